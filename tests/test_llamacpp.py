"""The llama.cpp target engine (models/llamacpp.py).

On a tiny Qwen2 GGUF (F32 weights, written in milliseconds) llama.cpp must compute what transformers
computes from the same file: the logits of a prompt and of draft trees, before and after commits
that keep a branch other than the first. That checks the engine's tree sequences and its rollback
against the reference implementation of tree attention (models/target.py). On the real pinned
target, greedy decoding with drafts must give llama.cpp's own target-only output, but where the
engine's batched and single-token kernels round a near-tie the other way (shown, with its margin).
Sampled decoding with drafts keeps the law of llama.cpp's own sampling (tests/lossless.py's check).
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import pytest
import torch

import numpy as np

import tiny
from gguf_tiny import EOS_TOKEN_IDS, VOCAB, write_tiny_qwen2_gguf
from lossless import assert_matches, expected_tv
from starsd.config import DraftConfig, SamplingConfig
from starsd.errors import StarsdError
from starsd.models.drafter import Drafter
from starsd.models.target import TargetModel
from starsd.spec_decode.audit import audit
from starsd.spec_decode.decode import speculative
from starsd.spec_decode.tree import DraftTree
from starsd.spec_decode.verify import Verdict, warp

if not os.environ.get("STARSD_REQUIRE_REAL"):  # make test builds it: missing is a failure there
    pytest.importorskip("llama_cpp")
from starsd.models.llamacpp import ContextFull, LlamaCppTarget  # noqa: E402

GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """The same tiny GGUF on llama.cpp and, loaded by transformers in float32, as the reference."""
    from transformers import AutoModelForCausalLM

    where = tmp_path_factory.mktemp("gguf")
    write_tiny_qwen2_gguf(where / "model.gguf", seed=3)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file="model.gguf", dtype=torch.float32).eval()
    return LlamaCppTarget(where / "model.gguf", threads=1), TargetModel(model), where / "model.gguf"


def tree_of(parents: list[int], seed: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    return DraftTree(torch.randint(0, len(VOCAB), (len(parents),), generator=g), torch.tensor(parents))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """llama.cpp keeps its KV cache in float16: its logits differ from float32 transformers' by that rounding."""
    assert a.shape == b.shape
    err = (a - b).abs().max().item()
    assert err < 2e-2 * max(1.0, b.abs().max().item()), f"logits differ by {err}"


def test_llamacpp_scores_trees_and_keeps_a_branch_as_transformers_does(tiny_pair):
    llama, reference, _ = tiny_pair
    assert llama.width == len(VOCAB)
    prompt = torch.randint(0, len(VOCAB), (17,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b = llama.start(prompt), reference.start(prompt)
    #                  root -> 0 -> 1 -> 2;  0 -> 3;  root -> 4 -> 5;  4 -> 6 -> 7
    steps = [([-1, 0, 1, 0, -1, 4, 4, 6], Verdict([4, 6, 7], None)),  # a path through the second branch
             ([-1, 0, 1, 2], Verdict([0, 1], None)),  # a chain, cut inside
             ([-1, -1, -1, 2, 2], Verdict([], None)),  # nothing accepted
             ([], Verdict([], None)),  # a step alone
             ([-1, 0, 0, 1, 1, 2, 2], Verdict([0, 2, 5], None))]  # the third branch of a wider tree
    for i, (parents, verdict) in enumerate(steps):
        tree = tree_of(parents, seed=i)
        close(llama.score(a, tree), reference.score(b, tree))
        bonus = int(torch.randint(0, len(VOCAB), (1,), generator=torch.Generator().manual_seed(100 + i)))
        verdict = Verdict(verdict.path, [int(tree.tokens[j]) for j in verdict.path] + [bonus])
        llama.commit(a, verdict)
        reference.commit(b, verdict)
        assert a.tokens == b.tokens
    last = reference.score(b, DraftTree.empty())
    close(llama.score(a, DraftTree.empty()), last)
    fresh = llama.start(a.tokens)  # the same tokens in one prefill: the commits left exactly them
    close(llama.score(fresh, DraftTree.empty()), last)


def check_lossless(target: LlamaCppTarget, drafter, prompts: list[list[int]], n: int, draft: DraftConfig) -> list:
    """Greedy speculative output, every token audited against llama.cpp's own one-token pass at its
    context (spec_decode/audit.py): its argmax, or a near-tie within the measured batched-vs-single allowance."""
    accepted = []
    for prompt in prompts:
        spec = speculative(target, drafter, prompt, n, draft, GREEDY, frozenset(EOS_TOKEN_IDS))
        accepted.append(spec.mean_accepted)
        found = audit(target, prompt, spec.token_ids, draft.max_nodes + 1, n, frozenset(EOS_TOKEN_IDS))
        assert found["ok"], found
    return accepted


def test_greedy_with_drafts_is_llamacpp_target_only_on_a_tiny_model(tiny_pair):
    llama, reference, _ = tiny_pair
    drafters = {"perfect": Drafter(reference.model), "noisy": Drafter(tiny.perturbed(reference.model, seed=5, scale=0.1))}
    prompts = [torch.randint(0, len(VOCAB), (m,), generator=torch.Generator().manual_seed(m)).tolist() for m in (3, 9, 20)]
    for name, drafter in drafters.items():
        for draft in (DraftConfig(depth=4, adaptive=False, min_path_prob=0.0),
                      DraftConfig(depth=3, top_k=2, adaptive=False, min_path_prob=0.0)):
            accepted = check_lossless(llama, drafter, prompts, 24, draft)
            if name == "perfect":
                assert min(accepted) > 1.0, (draft, accepted)


SAMPLED = SamplingConfig(temperature=1.0, top_k=3)
SAMPLED_DRAFT = DraftConfig(depth=2, sample=True, min_path_prob=0.0, adaptive=False)


def law_of_two(score, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """The law of the first two tokens sampled after `prompt`, from `score(ids)`: the logits there."""
    law = {(): 1.0}
    for _ in range(2):
        longer = {}
        for prefix, mass in law.items():
            p = warp(score(prompt + list(prefix)), SAMPLED)
            for t in p.nonzero().squeeze(1).tolist():
                longer[prefix + (t,)] = mass * float(p[t])
        law = longer
    return law


class OtherQ:
    """A drafter whose drafts travel with their q rows in reverse order (each token with another
    position's q) instead of those their tokens were drawn from: a verification that must not keep
    the target's law."""

    def __init__(self, drafter):
        self.drafter = drafter

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, *args, **kwargs):
        tree = self.drafter.propose(*args, **kwargs)
        return DraftTree(tree.tokens, tree.parents, tree.q[torch.arange(len(tree)).flip(0)])


def test_sampling_with_drafts_keeps_llamacpps_law_on_a_tiny_model(tiny_pair):
    """Sampled chains of a noisy draft, verified (spec_decode/verify.py) on llama.cpp's logits: the first two
    tokens of many seeded generations follow the law of llama.cpp's own sampling (from its
    single-token logits; its batched ones differ by rounding only), closer to it by far than to the
    draft's law; and the check has power: verifying with other positions' q fails it."""
    llama, reference, _ = tiny_pair
    drafter = Drafter(tiny.perturbed(reference.model, seed=5, scale=0.5))
    prompt = [10, 11, 12]
    law = law_of_two(lambda ids: llama.score(llama.start(ids), DraftTree.empty())[0], prompt)
    with torch.inference_mode():
        draft_law = law_of_two(lambda ids: drafter.model(torch.tensor([ids])).logits[0, -1], prompt)

    def sample(source, trials: int) -> np.ndarray:
        counts = Counter(tuple(speculative(llama, source, prompt, 3, SAMPLED_DRAFT, dataclasses.replace(SAMPLED, seed=i))
                               .token_ids[:2]) for i in range(trials))  # 3 tokens: the first draft is 2 deep
        return np.array([counts[o] for o in outcomes])

    outcomes = sorted(set(law) | set(draft_law))
    target = np.array([law.get(o, 0.0) for o in outcomes])
    drafted = np.array([draft_law.get(o, 0.0) for o in outcomes])
    trials = 1500
    max_tv = 2.2 * expected_tv(target, trials)  # what an exact sampler exceeds about once in 10^4 runs here
    assert 0.5 * np.abs(target - drafted).sum() > 6 * max_tv  # the draft's own law is told apart
    assert_matches("llama.cpp, sampled drafts", sample(drafter, trials), target, {"draft law": drafted}, max_tv=max_tv)
    with pytest.raises(AssertionError, match="TV to target|chi-square"):
        assert_matches("other q", sample(OtherQ(drafter), trials), target, {"draft law": drafted}, max_tv=max_tv)


def test_llamacpp_refuses_what_it_cannot_hold(tiny_pair):
    llama, _, file = tiny_pair
    small = LlamaCppTarget(file, context=16, threads=1)
    with pytest.raises(ContextFull, match="context of 16"):
        small.start(list(range(17)))
    seq = small.start(list(range(10)))
    with pytest.raises(ContextFull):
        small.score(seq, tree_of([-1, 0, 1, 2, 3, 4, 5, 6], seed=0))
    small.score(seq, tree_of([-1, 0, 1, 2, 3], seed=0))  # the stream is still whole after a refusal
    with pytest.raises(StarsdError, match="transformers"):
        llama.start([1, 2, 3], taps=())
    old = llama.start([1, 2, 3])
    llama.start([4, 5])
    with pytest.raises(RuntimeError, match="another stream"):
        llama.score(old, DraftTree.empty())


@pytest.mark.real
def test_real_target_on_llamacpp_with_the_real_draft_is_its_own_target_only():
    """The pinned 1.5B target's own GGUF on llama.cpp, drafted for by the pinned 0.5B draft (int8,
    co-located), greedy, a chain and a tree: llama.cpp's target-only output, or a near-tie."""
    from starsd.config import DEFAULT_DRAFT, DEFAULT_TARGET, PairConfig
    from starsd.models import pinned
    from starsd.models.pair import Pair
    from starsd.prompts import Prompt

    if not (pinned.is_cached(DEFAULT_TARGET) and pinned.is_cached(DEFAULT_DRAFT)):
        if os.environ.get("STARSD_REQUIRE_REAL"):
            pytest.fail("the real pair is not cached: run `starsd models fetch` (make test does)")
        pytest.skip("the real pair is not cached")
    cfg = PairConfig(target_engine="llamacpp", threads=2)
    pair = Pair.load(cfg.target_model(), cfg.draft_model(), cfg.cache, 2)
    assert pair.target.width == 151936 and pair.eos_ids == {151643, 151645}
    prompts = [Prompt("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", chat=False),
               Prompt("chat", "Write a Python function that checks whether a string is a palindrome.", chat=True)]
    ids = [p.encode(pair.tokenizer) for p in prompts]
    chain = DraftConfig(depth=4, min_path_prob=0.0, adaptive=False)
    tree = DraftConfig(depth=3, top_k=2, total_tokens=6, adaptive=False)
    accepted = check_lossless(pair.target, pair.drafter, ids[:1], 32, chain) + check_lossless(
        pair.target, pair.drafter, ids[1:], 32, tree)
    assert min(accepted) > 0.5  # the real draft does help


def test_auto_runs_the_target_on_llamacpp_where_it_can(tmp_path):
    """`--target-engine auto` (the default) means llama.cpp for a GGUF target on a CPU with the dtype
    left to auto; a dtype asked for, a GPU, an EAGLE head or a target without a GGUF mean transformers."""
    from starsd.config import PairConfig

    assert PairConfig().engine == "llamacpp" and PairConfig().target_model().engine == "llamacpp"
    assert PairConfig(dtype="float32").engine == "transformers"
    assert PairConfig(device="cuda").engine == "transformers"
    assert PairConfig(eagle=str(tmp_path)).engine == "transformers"
    assert PairConfig(target=str(tmp_path)).engine == "transformers"
    (tmp_path / "model.gguf").write_bytes(b"")
    assert PairConfig(target=str(tmp_path)).engine == "llamacpp"
    assert PairConfig(target_engine="transformers").target_model().engine == "transformers"
