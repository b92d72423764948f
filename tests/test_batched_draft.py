"""Drafting many sequences in one batch gives exactly the trees each would get alone (fp32), each given
as soon as it is whole."""

import random

import pytest
import torch

from starsd.config import DraftConfig, SamplingConfig
from starsd.models.drafter import DraftJob, Drafter
from starsd.spec_decode.verify import make_generator

GREEDY = SamplingConfig()


def _trees_equal(a, b):
    return torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


@pytest.mark.parametrize("cfgs", [
    [DraftConfig(depth=4)] * 4,
    [DraftConfig(depth=3, top_k=2, total_tokens=5), DraftConfig(depth=5), DraftConfig(depth=2, top_k=3),
     DraftConfig(depth=6, top_k=2, min_path_prob=0.05)],
    # three rows stop after one level: the batch drops their rows and carries on with the fourth
    [DraftConfig(depth=1), DraftConfig(depth=1), DraftConfig(depth=7, top_k=2, total_tokens=9), DraftConfig(depth=1)],
], ids=["same-chains", "mixed-shapes", "rows-stop-early"])
def test_batch_equals_one_at_a_time(tiny_drafters, cfgs):
    drafter: Drafter = tiny_drafters["good"]
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 128) for _ in range(n)] for n in (3, 40, 1, 12)]
    solo = [drafter.start(p) for p in prompts]
    batched = [drafter.start(p) for p in prompts]
    pending = [[] for _ in prompts]
    for step in range(6):
        jobs = [DraftJob(s, list(new), c, GREEDY) for s, new, c in zip(batched, pending, cfgs)]
        given = {}
        got = drafter.propose_batch(jobs, done=lambda i, tree: given.setdefault(i, tree))
        # each draft whole before the batch's last level was given as soon as it was, and is what comes back
        assert all(_trees_equal(tree, got[i]) and tree.depth() < max(t.depth() for t in got) for i, tree in given.items())
        if step == 0 and cfgs[2].depth == 7:
            assert set(given) == {0, 1, 3}
        for i, (seq, cfg) in enumerate(zip(solo, cfgs)):
            want = drafter.propose(seq, list(pending[i]), cfg, GREEDY)
            assert _trees_equal(got[i], want), (step, i)
            assert batched[i].cached == seq.cached == len(seq.tokens)
        # commit a varying number of tokens per sequence, as verification would
        pending = [[rng.randrange(1, 128) for _ in range(rng.randrange(1, 6))] for _ in prompts]


def test_batch_of_sampled_chains_is_seeded(tiny_drafters):
    drafter = tiny_drafters["good"]
    s = SamplingConfig(temperature=1.0, seed=3)
    cfg = DraftConfig(depth=3, sample=True)

    def run():
        seqs = [drafter.start([5, 6, 7]), drafter.start([9] * 20)]
        jobs = [DraftJob(q, [], cfg, s, make_generator(10 + i, "cpu")) for i, q in enumerate(seqs)]
        first = drafter.propose_batch(jobs)
        jobs = [DraftJob(q, [1, 2], cfg, s, j.generator) for q, j in zip(seqs, jobs)]
        return first + drafter.propose_batch(jobs)

    a, b = run(), run()
    assert all(torch.equal(x.tokens, y.tokens) and torch.equal(x.q.ids, y.q.ids) and torch.equal(x.q.weights, y.q.weights)
               for x, y in zip(a, b))
    solo = drafter.propose(drafter.start([5, 6, 7]), [], cfg, s, make_generator(10, "cpu"))
    assert torch.equal(solo.tokens, a[0].tokens)
    torch.testing.assert_close(solo.q.dense(128), a[0].q.dense(128))


def _accept(tree, rng) -> list[int]:
    """What verification commits: a path from the root (followed by chance) and one more token."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    path, node = [], -1
    while True:
        kids = [c for c, p in enumerate(parents) if p == node]
        if not kids or rng.random() < 0.25:
            return path + [rng.randrange(1, 128)]
        node = rng.choice(kids)
        path.append(tokens[node])


@pytest.mark.parametrize("cfg", [DraftConfig(depth=5, min_path_prob=0.0),
                                 DraftConfig(depth=4, top_k=3, total_tokens=8, min_path_prob=0.0)],
                         ids=["chain", "tree"])
def test_accepted_nodes_are_reused_not_recomputed(tiny_drafters, cfg):
    """The keys and values of accepted draft nodes are moved into place, not ingested again: the
    next draft is the one a fresh sequence holding the same tokens gets, and the batch path agrees."""
    drafter: Drafter = tiny_drafters["good"]
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 128) for _ in range(n)] for n in (5, 17, 9)]
    seqs = [drafter.start(p) for p in prompts]
    alone = [drafter.start(p) for p in prompts]
    pending = [[] for _ in prompts]
    reused = 0
    for step in range(6):
        trees = drafter.propose_batch([DraftJob(s, list(new), cfg, GREEDY) for s, new in zip(seqs, pending)])
        for i, tree in enumerate(trees):
            assert _trees_equal(tree, drafter.propose(alone[i], list(pending[i]), cfg, GREEDY)), (step, i)
            fresh = drafter.propose(drafter.start(list(seqs[i].tokens)), [], cfg, GREEDY)
            assert _trees_equal(tree, fresh), (step, i)
        pending = [_accept(t, rng) for t in trees]
        reused += sum(len(p) - 1 for p in pending)
        assert all(s.kept for s in seqs)
    assert reused > 10 and all(s.cached == len(s.tokens) for s in seqs)
