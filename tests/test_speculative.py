"""End to end on tiny random models: speculative decoding is lossless and handles the edges."""

import collections
import time

import pytest
import torch

import tiny

from starsd.config import DraftConfig, SamplingConfig
from starsd.spec_decode.decode import speculative, target_only
from starsd.spec_decode.drafting import LocalDrafting
from starsd.spec_decode.verify import warp

GREEDY = SamplingConfig()
FULL = dict(min_path_prob=0.0)  # draft the whole depth, however unlikely the path
DRAFTS = [
    DraftConfig(depth=1, **FULL),
    DraftConfig(depth=4, **FULL),
    DraftConfig(depth=7, **FULL),
    DraftConfig(depth=10, min_path_prob=0.3),  # stops early
    DraftConfig(depth=3, top_k=2, total_tokens=6, **FULL),
    DraftConfig(depth=5, top_k=4, total_tokens=12, **FULL),
    DraftConfig(depth=4, top_k=3, **FULL),  # keeps every candidate
]
PROMPTS = [[5], [17, 3, 99], list(range(20, 60)), [7, 7, 7, 7, 7, 7]]


@pytest.mark.parametrize("quality", ["perfect", "good", "random"])
@pytest.mark.parametrize("draft", DRAFTS, ids=lambda d: f"d{d.depth}k{d.top_k}n{d.max_nodes}p{d.min_path_prob}")
def test_greedy_equals_target_only(tiny_target, tiny_drafters, quality, draft):
    for prompt in PROMPTS:
        ref = target_only(tiny_target, prompt, 40, GREEDY)
        got = speculative(tiny_target, tiny_drafters[quality], prompt, 40, draft, GREEDY)
        assert got.token_ids == ref.token_ids, (quality, draft, prompt)
        assert len(got.accepted) == got.num_steps


def test_perfect_chain_accepts_everything(tiny_target, tiny_drafters):
    got = speculative(tiny_target, tiny_drafters["perfect"], [5, 6], 50, DraftConfig(depth=4, adaptive=False, **FULL),
                      GREEDY)
    assert got.accepted[:-1] == [4] * (len(got.accepted) - 1)
    assert got.num_steps == 10  # 50 tokens, 5 per step


def test_random_draft_still_progresses(tiny_target, tiny_drafters):
    got = speculative(tiny_target, tiny_drafters["random"], [5, 6], 30, DraftConfig(depth=4), GREEDY)
    assert len(got.token_ids) == 30 and got.num_steps <= 30


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 6, 9])
def test_budget_ends_inside_a_draft(tiny_target, tiny_drafters, max_new):
    ref = target_only(tiny_target, [9, 8], max_new, GREEDY)
    for draft in (DraftConfig(depth=4, **FULL), DraftConfig(depth=8, **FULL), DraftConfig(depth=4, top_k=3, **FULL)):
        got = speculative(tiny_target, tiny_drafters["perfect"], [9, 8], max_new, draft, GREEDY)
        assert got.token_ids == ref.token_ids and len(got.token_ids) == max_new


def test_a_generation_tells_when_its_prefill_ended(tiny_target, tiny_drafters):
    """Benchmarks time the decoding from there: the first step differs between modes (the default
    decodes it alone co-located, a fixed depth drafts and ingests the prompt)."""
    t0 = time.time()
    for gen in (target_only(tiny_target, list(range(20, 60)), 8, GREEDY),
                speculative(tiny_target, tiny_drafters["good"], list(range(20, 60)), 8, DraftConfig(depth=4), GREEDY)):
        assert t0 < gen.prefilled < gen.trace[0][0] <= gen.trace[-1][0] <= time.time()


def test_zero_budget(tiny_target, tiny_drafters):
    assert speculative(tiny_target, tiny_drafters["good"], [1], 0, DraftConfig(), GREEDY).token_ids == []
    assert target_only(tiny_target, [1], 0, GREEDY).token_ids == []


@pytest.mark.parametrize("position", [0, 2, 3, 6])
def test_eos_inside_a_draft(tiny_target, tiny_drafters, position):
    """Declare the token at `position` of the greedy output to be EOS: both decoders stop just after
    its first occurrence, even when a perfect draft proposes tokens beyond it."""
    full = target_only(tiny_target, [4, 2], 20, GREEDY).token_ids
    eos = frozenset({full[position]})
    ref = target_only(tiny_target, [4, 2], 20, GREEDY, eos)
    assert ref.token_ids == full[: full.index(full[position]) + 1]
    for draft in (DraftConfig(depth=5, **FULL), DraftConfig(depth=4, top_k=2, **FULL)):
        got = speculative(tiny_target, tiny_drafters["perfect"], [4, 2], 20, draft, GREEDY, eos)
        assert got.token_ids == ref.token_ids


def test_empty_prompt_is_refused(tiny_target, tiny_drafters):
    with pytest.raises(ValueError, match="empty prompt"):
        target_only(tiny_target, [], 5, GREEDY)
    with pytest.raises(ValueError, match="empty prompt"):
        speculative(tiny_target, tiny_drafters["good"], [], 5, DraftConfig(), GREEDY)


@pytest.mark.parametrize("draft", [DraftConfig(depth=3, adaptive=False), DraftConfig(depth=3, sample=True, adaptive=False),
                                   DraftConfig(depth=3, top_k=2, total_tokens=5, adaptive=False)],
                         ids=["greedy-chain", "sampled-chain", "tree"])
def test_seeded_sampling_is_reproducible(tiny_target, tiny_drafters, draft):
    s = SamplingConfig(temperature=0.9, top_p=0.95, seed=11)
    a = speculative(tiny_target, tiny_drafters["good"], [3, 4], 30, draft, s)
    b = speculative(tiny_target, tiny_drafters["good"], [3, 4], 30, draft, s)
    c = speculative(tiny_target, tiny_drafters["good"], [3, 4], 30, draft, SamplingConfig(temperature=0.9, top_p=0.95, seed=12))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def _exact_two_token_distribution(target, prompt, s):
    """p(t1) and p(t2 | t1) of target-only sampling, from the target's own logits."""
    seq = target.start(prompt)
    from starsd.spec_decode.tree import DraftTree

    p1 = warp(target.score(seq, DraftTree.empty())[0], s)
    cond = {}
    for t1 in p1.nonzero().squeeze(1).tolist():
        s2 = target.start(prompt + [t1])
        cond[t1] = warp(target.score(s2, DraftTree.empty())[0], s)
    return p1, cond


@pytest.mark.parametrize("draft", [DraftConfig(depth=2, sample=True), DraftConfig(depth=2),
                                   DraftConfig(depth=2, top_k=3, total_tokens=6)],
                         ids=["sampled-chain", "greedy-chain", "tree"])
def test_sampled_output_follows_target_distribution(tiny_target, tiny_drafters, draft):
    """The joint law of the first two sampled tokens matches target-only sampling: total variation
    to the exact target law is small, and several times smaller than to the draft's own law."""
    s = SamplingConfig(temperature=1.0, top_k=6)
    prompt = [10, 11, 12]
    p1, cond = _exact_two_token_distribution(tiny_target, prompt, s)
    exact = {(a, b): float(p1[a] * cond[a][b]) for a in cond for b in cond[a].nonzero().squeeze(1).tolist()}
    drafter = tiny_drafters["good"]
    d1, dcond = _exact_two_token_distribution(type(tiny_target)(drafter.model), prompt, s)
    draft_law = {(a, b): float(d1[a] * dcond[a][b]) for a in dcond for b in dcond[a].nonzero().squeeze(1).tolist()}

    trials = 2000
    counts = collections.Counter()
    for seed in range(trials):
        g = speculative(tiny_target, drafter, prompt, 2, draft, SamplingConfig(temperature=1.0, top_k=6, seed=seed))
        counts[tuple(g.token_ids)] += 1
    emp = {k: v / trials for k, v in counts.items()}

    def tv(a, b):
        keys = set(a) | set(b)
        return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys)

    to_target, to_draft = tv(emp, exact), tv(emp, draft_law)
    assert to_target < 0.06, (to_target, to_draft)
    assert to_draft > 3 * to_target, (to_target, to_draft)


def test_features_come_with_scores(tiny_target):
    """The last hidden states (EAGLE-1's features) are what the LM head reads; tapped ones are
    transformers' hidden_states of those layers, side by side (EAGLE-3's)."""
    from starsd.spec_decode.tree import DraftTree

    seq = tiny_target.start([1, 2, 3], taps=())
    assert seq.features.shape == (2, tiny_target.model.config.hidden_size)  # the prefill's rows
    logits = tiny_target.score(seq, DraftTree.chain([4, 5]), taps=())
    assert logits.shape == (3, 128)
    assert seq.features.shape == (3, tiny_target.model.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(tiny_target.model.lm_head(seq.features).float(), logits)
        seq = tiny_target.start([1, 2, 3, 4], taps=(1, 2))
        states = tiny_target.model.model(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(seq.features, torch.cat([states[1][0], states[2][0]], dim=-1))


def test_int8_quantised_draft_is_lossless(tiny_target):
    """A dynamically quantised draft proposes different tokens, never different output."""
    from starsd.models.drafter import Drafter
    from starsd.models.loading import quantize_int8

    quantised = Drafter(quantize_int8(tiny.perturbed(tiny_target.model, 7, 0.1)))
    for prompt in PROMPTS:
        ref = target_only(tiny_target, prompt, 30, GREEDY)
        for draft in (DraftConfig(depth=4, **FULL), DraftConfig(depth=3, top_k=2, **FULL)):
            assert speculative(tiny_target, quantised, prompt, 30, draft, GREEDY).token_ids == ref.token_ids


def test_int8_draft_weights_keep_a_scale_per_output_channel(tiny_target):
    """One scale for a whole layer rounds its small rows away beside a large one (the 0.5B draft lost a
    tenth of its accepted tokens so); each output channel has its own scale."""
    import copy

    from starsd.models.loading import quantize_int8

    model = copy.deepcopy(tiny_target.model).float()
    layer = model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        layer.weight[0] *= 100.0  # one row far larger than the rest
    small = layer.weight[1:].detach().clone()
    quantize_int8(model)
    weight = model.model.layers[0].mlp.down_proj.weight()
    assert weight.qscheme() == torch.per_channel_affine
    error = (weight.dequantize()[1:] - small).abs().max() / small.abs().max()
    assert error < 0.01  # one scale per layer: a step of 100/127 of the small rows' largest weight


def test_a_failed_score_leaves_the_cache_as_it_was(tiny_target, monkeypatch):
    """A forward pass that fails part-way used to leave the layers before the failure with extra
    cache entries; the sequence then scored its next draft against a corrupted cache."""
    from starsd.spec_decode.tree import DraftTree

    seq = tiny_target.start([5, 6, 7, 8])
    lengths = [layer.length for layer in seq.cache.layers]  # columns written, not the allocation
    tree = DraftTree.chain([1, 2, 3])

    def fail(*args, **kwargs):
        raise RuntimeError("injected failure in the last layer")

    monkeypatch.setattr(tiny_target.model.model.layers[-1], "forward", fail)
    with pytest.raises(RuntimeError, match="injected"):
        tiny_target.score(seq, tree)
    monkeypatch.undo()
    assert [layer.length for layer in seq.cache.layers] == lengths
    assert torch.equal(tiny_target.score(seq, tree), tiny_target.score(tiny_target.start([5, 6, 7, 8]), tree))


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_runs_on_the_models_device(device):
    """Every random generator lives on the device of the tensors it draws for (the drafter's for
    sampled drafts, the target's for verification), and a draft's q is moved to the target's device.
    Generators were made on the CPU, so sampling with --device cuda could not run. Here only the
    CPU is tested unless CUDA is present."""
    from starsd.models.drafter import Drafter
    from starsd.models.target import TargetModel

    base = tiny.tiny_model(seed=1)
    target = TargetModel(base.to(device))
    drafter = Drafter(tiny.perturbed(base, seed=7, scale=0.1).to(device))
    s = SamplingConfig(temperature=0.8, top_p=0.95, seed=3)
    for draft in (DraftConfig(depth=4, sample=True, adaptive=False), DraftConfig(depth=3, top_k=2, total_tokens=5,
                                                                                 adaptive=False)):
        runs = [speculative(target, drafter, [5, 6], 30, draft, s).token_ids for _ in range(2)]
        assert runs[0] == runs[1] and len(runs[0]) == 30
    assert speculative(target, drafter, [5, 6], 30, DraftConfig(depth=4), GREEDY).token_ids == \
        target_only(target, [5, 6], 30, GREEDY).token_ids


def test_a_draft_outside_the_targets_vocabulary_is_refused(tiny_target, tiny_drafters):
    """A drafter (a draft server with a bug, or a hostile one) that sends token ids the target does
    not have: those drafts are dropped, each such step decodes alone, and the output is the target's."""
    from starsd.config import DraftConfig, SamplingConfig
    from starsd.spec_decode.decode import speculative, target_only
    from starsd.spec_decode.tree import DraftTree

    good = tiny_drafters["perfect"]
    width = tiny_target.width

    class OutOfRange(LocalDrafting):
        device, taps = good.device, None

        def __init__(self):
            self.calls = 0

        def start(self, *args):
            return good.start(*args)

        def propose(self, *args, **kw):
            tree = good.propose(*args, **kw)
            self.calls += 1
            if self.calls % 2 and len(tree):  # every other draft: its last token past the vocabulary
                tokens = tree.tokens.clone()
                tokens[-1] = width + 5
                return DraftTree(tokens, tree.parents, tree.q)
            return tree

    prompt, greedy = [5, 17, 33, 2], SamplingConfig(temperature=0.0)
    draft = DraftConfig(depth=4, adaptive=False, min_path_prob=0.0)
    gen = speculative(tiny_target, OutOfRange(), prompt, 24, draft, greedy)
    assert gen.token_ids == target_only(tiny_target, prompt, 24, greedy).token_ids
    assert 0 in gen.depths and max(gen.accepted) > 0  # the bad steps decoded alone, the good ones drafted
