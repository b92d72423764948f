import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing comes from a hub

import pytest  # noqa: E402
import torch  # noqa: E402

import tiny  # noqa: E402
from starsd.models.drafter import Drafter  # noqa: E402
from starsd.models.target import TargetModel  # noqa: E402

torch.set_num_threads(1)  # tiny models gain nothing from threads; idle OpenMP spinners cost a lot


@pytest.fixture(scope="session")
def tiny_target():
    return TargetModel(tiny.tiny_model(seed=1))


@pytest.fixture(scope="session")
def tiny_drafters(tiny_target):
    """Drafts of every quality: perfect (the target itself), good (a perturbed copy), random."""
    base = tiny_target.model
    return {
        "perfect": Drafter(base),
        "good": Drafter(tiny.perturbed(base, seed=7, scale=0.1)),
        "random": Drafter(tiny.tiny_model(seed=2)),
    }
