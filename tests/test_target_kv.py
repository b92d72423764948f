"""The transformers target on its preallocated KV: chunked causal prefill, tree scoring, commit by
moving columns, cutting a failed pass back; against a full forward of the plain model, in float32.

The target kept its cache in a DynamicCache that grew by concatenation on every pass, and prefilled a
prompt of m tokens with a dense [m, m] mask, turned into an [m, m] float bias: 4 GiB at 32k tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import tiny

from starsd.config import DraftConfig, SamplingConfig
from starsd.models.target import TargetModel
from starsd.spec_decode.decode import speculative, target_only
from starsd.spec_decode.tree import DraftTree
from starsd.spec_decode.verify import Verdict

TOL = dict(rtol=1e-5, atol=1e-5)


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """[V] the plain model's logits after the last of `tokens`, from one pass over all of them."""
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -1].float()


def path_to(parents: list[int], node: int) -> list[int]:
    """Node indices from the root's child down to `node`."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def random_tree(g: torch.Generator, n: int) -> DraftTree:
    """n nodes, each below a random earlier node or the root."""
    parents = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
    return DraftTree(torch.randint(1, tiny.VOCAB, (n,), generator=g), torch.tensor(parents))


# Each round: a draft and the node whose path is accepted (-1: none). The trees' last nodes lie on
# branches other than the first, so the accepted columns must move down behind the root.
ROUNDS = [("chain", 4, 1), ("tree", 7, 6), ("tree", 5, -1), ("chain", 3, 2), ("tree", 9, 8), ("chain", 1, 0)]


@pytest.mark.parametrize("chunk", [7, 512])
def test_prefill_and_rounds_equal_a_full_forward(tiny_target, chunk):
    model = tiny_target.model
    target = TargetModel(model, prefill_chunk=chunk)
    g = torch.Generator().manual_seed(chunk)
    context = torch.randint(1, tiny.VOCAB, (45,), generator=g).tolist()
    seq = target.start(context)
    for kind, n, accepted in ROUNDS:
        if kind == "chain":
            tree = DraftTree.chain(torch.randint(1, tiny.VOCAB, (n,), generator=g))
        else:
            tree = random_tree(g, n)
        got = target.score(seq, tree)  # [n+1, V]
        parents = tree.parents.tolist()
        tokens = tree.tokens.tolist()
        want = torch.stack([full_logits(model, context)] +
                           [full_logits(model, context + [tokens[j] for j in path_to(parents, i)]) for i in range(n)])
        torch.testing.assert_close(got, want, **TOL)
        path = path_to(parents, accepted)
        assert kind == "chain" or accepted < 0 or path != list(range(len(path)))  # moved, not in place
        emitted = [tokens[j] for j in path] + [int(got[0].argmax())]
        target.commit(seq, Verdict(path, emitted))
        context += emitted
        assert seq.tokens == context
        assert seq.cache.length == len(context) - 1
    torch.testing.assert_close(target.score(seq, DraftTree.empty())[0], full_logits(model, context), **TOL)


def test_chunked_prefill_features_equal_a_full_forward(tiny_target):
    """EAGLE taps: the features of a prefill fed in chunks are those of one pass over the prompt (to
    1e-5 of their scale: the residual stream reaches 60, where a float32 step is 4e-6)."""
    model = tiny_target.model
    prompt = list(range(3, 40))
    seq = TargetModel(model, prefill_chunk=5).start(prompt, taps=(1, 2))
    with torch.inference_mode():
        states = model.model(input_ids=torch.tensor([prompt[:-1]]), output_hidden_states=True).hidden_states
    want = torch.cat([states[1][0], states[2][0]], dim=-1)
    torch.testing.assert_close(seq.features, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    last = TargetModel(model, prefill_chunk=5).start(prompt, taps=())
    torch.testing.assert_close(last.features, states[-1][0], **TOL)


def test_greedy_is_lossless_with_a_chunked_prefill(tiny_target, tiny_drafters):
    chunked = TargetModel(tiny_target.model, prefill_chunk=8)
    greedy = SamplingConfig()
    prompt = list(range(20, 60))
    ref = target_only(tiny_target, prompt, 40, greedy)
    assert target_only(chunked, prompt, 40, greedy).token_ids == ref.token_ids
    for draft in (DraftConfig(depth=4, min_path_prob=0.0), DraftConfig(depth=3, top_k=2, min_path_prob=0.0)):
        assert speculative(chunked, tiny_drafters["good"], prompt, 40, draft, greedy).token_ids == ref.token_ids


def test_a_failed_score_is_cut_back(tiny_target, monkeypatch):
    """The earlier layers of a pass that fails part-way have written their columns: the KV's length
    goes back to the root's, and the retry scores as a fresh sequence does."""
    seq = tiny_target.start([5, 6, 7, 8])
    tree = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 0]))

    def fail(*args, **kwargs):
        raise RuntimeError("injected failure in the last layer")

    monkeypatch.setattr(tiny_target.model.model.layers[-1], "forward", fail)
    with pytest.raises(RuntimeError, match="injected"):
        tiny_target.score(seq, tree)
    monkeypatch.undo()
    assert [slab.length for slab in seq.cache.layers] == [3] * len(seq.cache.layers)
    assert torch.equal(tiny_target.score(seq, tree), tiny_target.score(tiny_target.start([5, 6, 7, 8]), tree))


def test_the_kv_grows_geometrically(tiny_target):
    """Two tokens a round for 600 rounds: the KV grows by a quarter at a time (kv.py), so from 258
    columns to 1202 it is reallocated 7 times, not every pass, and never holds twice what it needs."""
    seq = tiny_target.start([5, 6, 7])
    first = seq.cache.capacity
    capacities = {first}
    for _ in range(600):
        tiny_target.score(seq, DraftTree.chain([9]))
        tiny_target.commit(seq, Verdict([0], [9, 4]))
        capacities.add(seq.cache.capacity)
        assert seq.cache.capacity <= max(first, 1.25 * (seq.cache.length + 2) + 64)
    assert seq.cache.length == 2 + 2 * 600
    assert len(capacities) <= 8, sorted(capacities)


def test_prefill_masks_span_a_chunk_at_most(tiny_target, monkeypatch):
    """No attention mask of a prefill is larger than [chunk, prompt]; the first chunk has none."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    masks: list[int] = []

    def spy(*args, attn_mask=None, **kwargs):
        masks.append(0 if attn_mask is None else attn_mask[0, 0].numel())
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    m = 300
    TargetModel(tiny_target.model, prefill_chunk=64).start([1 + i % (tiny.VOCAB - 1) for i in range(m + 1)])
    assert masks and masks[0] == 0
    assert max(masks) <= 64 * m


def peak_allocated(fn) -> int:
    """The most bytes that the tensors `fn` allocates hold at once: torch's own CPU allocations, each
    with its time, as its profiler records them. Not the process's RSS, which also counts kernels and
    buffers that the CPU's kind loads on first use (more on an AMX host) and moves with whatever
    runs beside the test."""
    from torch._C._profiler import _EventType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes: list[tuple[int, int]] = []  # (ns, bytes: + allocated, - freed)

    def walk(node):
        if node.tag == _EventType.Allocation:
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live = peak = 0
    for _, size in sorted(sizes):
        live += size
        peak = max(peak, live)
    return peak


def test_peak_allocated_follows_tensors_as_they_live_and_die():
    def work():
        a = torch.ones(1024, 1024)  # 4 MiB
        b = a * 2  # 4 more
        del a
        c = torch.zeros(2048, 1024)  # 8 more, with a gone: 12 at most
        return b, c

    assert 12 * 2**20 <= peak_allocated(work) < 13 * 2**20


def test_prefill_memory_does_not_grow_as_m_squared():
    """At m = 4096 a dense float mask is 64 MiB; the old path's prefill allocated 128 MiB of them at
    once (a float tril, its bool copy, the float bias). Now the prefill's tensors, KV and [chunk, m]
    masks included, hold below half of one such mask at their peak."""
    m = 4096
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * m)
    torch.manual_seed(0)
    target = TargetModel(Qwen2ForCausalLM(config).eval())
    prompt = torch.randint(1, 128, (m + 1,)).tolist()
    peak = peak_allocated(lambda: target.start(prompt))
    assert peak < m * m * 4 / 2, f"prefill of {m} tokens allocated {peak / 2**20:.1f} MiB at its peak"


def test_a_gather_past_a_kvs_capacity_is_refused(tiny_target):
    """Copying more columns than a KV holds raises, where a slice would copy fewer without a word."""
    from starsd.models.kv import KV

    model = tiny_target.model
    small, big = KV.allocate(model, 1, 64), KV.allocate(model, 1, 160)
    big.cut(100)
    with pytest.raises(RuntimeError, match="96 columns into 64"):
        small.gather([big], [96])
    with pytest.raises(RuntimeError, match="into 160"):
        big.gather([small], [96])
    room = KV.allocate(model, 1, 164)
    room.gather([big], [96])
    assert room.length == 96
