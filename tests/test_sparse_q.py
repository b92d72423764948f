"""A sampled draft's q (spec_decode/sparse_q.py): a truncated support in 16 bits that the draft samples from
exactly, the same values on both sides of the wire, and a few hundred bytes a node on it."""

import numpy as np
import pytest
import torch

import tiny
from lossless import gof_pvalue
from starsd.config import DraftConfig, SamplingConfig, ServerConfig
from starsd.models.drafter import ROOT, Drafter, Expansion
from starsd.spec_decode.sparse_q import SparseQ, normalise
from starsd.spec_decode.verify import make_generator, warp
from starsd.star import protocol as P
from starsd.star.client import DraftClient
from starsd.star.processes import free_port
from starsd.star.server import DraftServer

QWEN_VOCAB = 151_936


def test_truncate_keeps_the_top_k_then_the_top_p_prefix_renormalised_in_float16():
    """p = [0.05, 0.4, 0.1, 0.3, 0.15]: its top 4 are 0.4, 0.3, 0.15 and 0.1 (mass 0.95), of which the
    first two reach 0.7 of that (0.665): q is 4/7 and 3/7 on tokens 1 and 3, the other two slots 0."""
    q = SparseQ.truncate(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]), top_k=4, top_p=0.7)
    assert q.ids.tolist() == [[1, 3, 4, 2]] and q.weights.dtype == torch.float16
    torch.testing.assert_close(q.probs, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))
    torch.testing.assert_close(q.dense(5), torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7, 0.0]]))
    assert SparseQ.truncate(torch.tensor([[0.2, 0.8]]), top_k=64, top_p=1e-9).probs.tolist() == [[1.0, 0.0]]
    whole = SparseQ.truncate(torch.tensor([[0.25, 0.75]]), top_k=64, top_p=1.0)
    assert whole.ids.tolist() == [[1, 0]] and whole.probs.tolist() == [[0.75, 0.25]]
    both = SparseQ.cat([q, SparseQ.truncate(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]), 4, 0.99)])
    assert both.ids.shape == (2, 4)  # the second row's support is all four
    assert SparseQ.cat([q, q]).ids.shape == (2, 2)  # trailing slots of weight 0 in every row are not sent


def test_normalise_gives_the_same_bits_in_any_order_and_on_any_device():
    """The draft samples from normalise(weights) and the target verifies with it, on other devices and
    summing in another order: a float64 sum of float16 values is exact, so the result is too."""
    g = make_generator(0, "cpu")
    weights = torch.rand(50, 64, generator=g).softmax(-1)
    weights[:, 40:] *= 1e-3  # subnormal in float16
    weights = weights.half()
    want = normalise(weights)
    perm = torch.randperm(64, generator=g)
    assert torch.equal(normalise(weights[:, perm]), want[:, perm])
    for got, row in zip(want, weights.double()):  # summed one by one, left to right
        total = 0.0
        for x in row.tolist():
            total += x
        assert torch.equal(got, (row / total).float())
    if torch.cuda.is_available():
        assert torch.equal(normalise(weights.cuda()).cpu(), want)


def test_a_sampled_draft_draws_from_its_truncated_q_and_nowhere_else():
    """Each sampled node comes from its q's support (top 3 here, cut further at 0.9 of their mass),
    with q's probabilities, never from the rest of the warped draft distribution."""
    logits = torch.randn(128, generator=make_generator(1, "cpu")) * 2
    s = SamplingConfig(temperature=0.7)
    cfg = DraftConfig(depth=1, sample=True, sample_top_k=3, sample_top_p=0.9)
    full = warp(logits, s)
    q = SparseQ.truncate(full[None], 3, 0.9)
    support = q.ids[0][q.weights[0] > 0].tolist()
    assert 1 < len(support) <= 3 and float(full[support].sum()) < 0.9  # truncation bites
    g = make_generator(2, "cpu")
    draws = []
    for _ in range(4000):
        e = Expansion(cfg, s, g, depth=1)
        e.grow_sampled(ROOT, logits)
        draws.append(e.nodes[0].token)
    assert set(draws) <= set(support)
    counts = np.bincount(draws, minlength=128)[q.ids[0]]
    assert gof_pvalue(counts, q.probs[0].double().numpy()) > 1e-4
    tree = e.tree()
    assert torch.equal(tree.q.ids, q.ids[:, :len(support)]) and torch.equal(tree.q.probs, q.probs[:, :len(support)])


def test_a_drafted_chain_comes_with_the_q_of_each_node(tiny_drafters):
    drafter = tiny_drafters["good"]
    cfg = DraftConfig(depth=6, sample=True, min_path_prob=0.0, sample_top_k=8, sample_top_p=0.95)
    s = SamplingConfig(temperature=1.0)
    for seed in range(5):
        tree = drafter.propose(drafter.start([5, 6, 7]), [], cfg, s, make_generator(seed, "cpu"))
        assert len(tree) == 6 and tree.q.ids.shape[1] <= 8
        assert bool((tree.q.prob_of(tree.tokens) > 0).all())


@pytest.fixture(scope="module")
def qwen_sized_drafter():
    """A tiny draft model with the real pair's vocabulary: what a node's q would cost on the wire."""
    return Drafter(tiny.tiny_model(seed=3, vocab=QWEN_VOCAB))


def test_a_sampled_draft_node_takes_at_most_2_kb_on_the_wire(qwen_sized_drafter):
    """A sampled chain 10 deep over a 151,936-token vocabulary, through a live server: its reply used
    to carry q as float32 [10, 151936], 608 KB a node; now each node's ids and 16-bit weights."""
    address = f"tcp://127.0.0.1:{free_port()}"
    server = DraftServer(qwen_sized_drafter, "f" * 64, QWEN_VOCAB, ServerConfig(bind=address, predraft=False))
    thread = server.start()
    client = DraftClient(address, "f" * 64, "t", timeout_s=30, heartbeat_s=0)
    try:
        client.hello()
        cfg = DraftConfig(depth=10, sample=True, min_path_prob=0.0, adaptive=False)
        reply, tensors = client.draft([11, 12, 13], 11, cfg, SamplingConfig(temperature=0.7, seed=1))
    finally:
        client.close()
        server.stop()
        thread.join(timeout=5)
    wire = sum(len(memoryview(f).cast("B")) for f in P.encode(reply, tensors))
    n = tensors[0].shape[0]
    assert n == 10 and tensors[2].dtype == torch.int32 and tensors[3].dtype == torch.float16
    assert 0 < tensors[2].shape[1] <= DraftConfig().sample_top_k
    assert wire / n <= 2048, f"{wire / n:.0f} bytes a node"
