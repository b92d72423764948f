import pytest
import torch

import tiny
from starsd.models.drafter import Drafter
from starsd.models.target import TargetModel

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_target():
    return TargetModel(tiny.tiny_model(seed=1))


@pytest.fixture(scope="session")
def tiny_drafters(tiny_target):
    """Drafts of every quality: perfect (the target itself), good (a perturbed copy), random."""
    base = tiny_target.model
    return {
        "perfect": Drafter(base),
        "good": Drafter(tiny.perturbed(base, seed=7, scale=0.3)),
        "random": Drafter(tiny.tiny_model(seed=2)),
    }
