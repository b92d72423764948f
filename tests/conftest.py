import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing comes from a hub

import pytest  # noqa: E402
import torch  # noqa: E402

import tiny  # noqa: E402
from starsd.models.drafter import Drafter  # noqa: E402
from starsd.models.target import TargetModel  # noqa: E402

torch.set_num_threads(1)  # tiny models gain nothing from threads; idle OpenMP spinners cost a lot

# `make test` runs the other modules two at a time, then these with nothing beside them: they time
# recoveries, deadlines or a service in seconds, make network namespaces, run a Ray cluster, or
# hold the real pair in memory on both cores. test_security: its allowed client's first send once
# blocked for good with another module beside it (a send now fails after 5 s: client.connect).
ALONE = {"test_bench_metrics", "test_bench_soak", "test_draft_host", "test_failover", "test_gateway_recovery",
         "test_netns", "test_placement", "test_ray", "test_real_pair", "test_security", "test_supervise"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ in ALONE:
            item.add_marker(pytest.mark.alone)


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
