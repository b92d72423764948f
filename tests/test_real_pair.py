"""The bundled real pair (fetched by `make test`): fp32 greedy speculative equals target-only."""

import os

import pytest

from starsd.models import pinned
from starsd.models.pair import Pair
from starsd.config import DEFAULT_DRAFT, DEFAULT_TARGET, DraftConfig, PairConfig, SamplingConfig
from starsd.prompts import Prompt

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def pair():
    if not (pinned.is_cached(DEFAULT_TARGET) and pinned.is_cached(DEFAULT_DRAFT)):
        message = "the real pair is not cached: run `starsd models fetch` (make test does)"
        if os.environ.get("STARSD_REQUIRE_REAL"):  # make test fetched it: missing is a failure, not a skip
            pytest.fail(message)
        pytest.skip(message)
    cfg = PairConfig(dtype="float32", draft_quantize="none")
    return Pair.load(cfg.target_model(), cfg.draft_model(), threads=2)


@pytest.mark.parametrize("prompt, draft", [
    (Prompt("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", chat=False),
     DraftConfig(depth=5, min_path_prob=0.0, adaptive=False)),
    (Prompt("chat", "Write a Python function that checks whether a string is a palindrome.", chat=True),
     DraftConfig(depth=4, top_k=2, total_tokens=6, adaptive=False)),
], ids=["code-chain", "chat-tree"])
def test_real_pair_greedy_is_lossless(pair, prompt, draft):
    """One draft shape per prompt: fp32 on this CPU costs minutes per generation of the 1.5B."""
    ref = pair.generate(prompt, 32, SamplingConfig(), None)
    got = pair.generate(prompt, 32, SamplingConfig(), draft)
    assert got.token_ids == ref.token_ids
    assert got.mean_accepted > 0.5  # the real draft does help
