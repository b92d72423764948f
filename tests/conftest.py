import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing comes from a hub

import pytest  # noqa: E402
import torch  # noqa: E402

import tiny  # noqa: E402
from starsd.models.drafter import Drafter  # noqa: E402
from starsd.models.target import TargetModel  # noqa: E402

torch.set_num_threads(1)  # tiny models gain nothing from threads; idle OpenMP spinners cost a lot


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Every test module starts at one torch thread, whatever an earlier one set (test_real_pair
    loads the real pair at two): a RemoteDrafter's choice to ask drafts ahead, for one, depends on
    it (star/hosts.py, shares_cores)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


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
