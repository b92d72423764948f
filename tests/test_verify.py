"""Pure-tensor tests of starsd.spec_decode.verify: warp, greedy verification, residual, and -- the heart of it --
statistical losslessness of speculative sampling on chains and trees.

Losslessness setup: a small-vocabulary *Markov* target. The target's next-token distribution after
token a is the fixed row P[a], so the target distribution at every tree row is known exactly (row 0 is
P[root], row i+1 is P[tokens[i]]), and so is the exact law of the first two decoded tokens:
P(t1 = a, t2 = b) = P[root, a] * P[a, b]. A Markov draft Q plays the drafter. We decode two tokens the
way the engine does -- verify one draft, and if it emitted a single token, draft again from it and
verify again -- and compare the empirical law of (t1, t2) with the exact one. (The joint of
verdict.tokens[:2] restricted to verdicts that emit two tokens would be biased: whether a draft token
is accepted depends on its value.)
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math

import numpy as np
import pytest
import torch

from lossless import assert_matches
from starsd.spec_decode import verify as V_
from starsd.config import SamplingConfig
from starsd.spec_decode.sparse_q import SparseQ
from starsd.spec_decode.tree import DraftTree
from starsd.spec_decode.verify import (Verdict, make_generator, next_token, residual, verify, verify_greedy,
                           verify_stochastic, warp)

T1 = SamplingConfig(temperature=1.0)
GREEDY = SamplingConfig()


def t(xs):
    return torch.tensor(xs, dtype=torch.long)


# =============================================================================================
# warp()
# =============================================================================================

def test_warp_greedy_is_one_hot_argmax():
    logits = torch.randn(3, 5, 11, generator=make_generator(0, "cpu"))
    probs = warp(logits, GREEDY)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 11).float())


def test_warp_greedy_ignores_top_k_and_top_p():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0])
    probs = warp(logits, SamplingConfig(temperature=0.0, top_k=2, top_p=0.3))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 1.5, 4.0])
def test_warp_temperature_scales_logits(temperature):
    logits = torch.randn(4, 9, generator=make_generator(1, "cpu")) * 3
    probs = warp(logits, SamplingConfig(temperature=temperature))
    torch.testing.assert_close(probs, (logits / temperature).softmax(-1))
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_warp_temperature_orders_entropy():
    """Lower temperature sharpens, higher flattens."""
    logits = torch.randn(16, generator=make_generator(2, "cpu")) * 2

    def entropy(p):
        return float(-(p * p.clamp_min(1e-30).log()).sum())

    hs = [entropy(warp(logits, SamplingConfig(temperature=tt))) for tt in (0.3, 0.6, 1.0, 2.0, 5.0)]
    assert hs == sorted(hs) and hs[0] < hs[-1]


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-45, 1e-30])
def test_warp_tiny_temperatures_are_the_argmax_ties_not_nan(temperature):
    """A temperature float32 cannot hold divided by 0, and one it can sent the largest logit to +inf:
    NaN probabilities, a failed stream (found by the HTTP fuzz)."""
    probs = warp(torch.tensor([1.0, 3.0, 3.0, -2.0]), SamplingConfig(temperature=temperature))
    assert probs.tolist() == [0.0, 0.5, 0.5, 0.0]


def test_warp_top_p_below_float32_keeps_the_first_token():
    """top_p = 5e-324 rounds to 0 in a float32 comparison: every token was dropped, NaN after."""
    probs = warp(torch.tensor([1.0, 3.0, 2.0]), SamplingConfig(temperature=1.0, top_p=5e-324))
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_warp_accepts_half_precision_logits():
    logits = torch.randn(2, 7, generator=make_generator(3, "cpu")).to(torch.bfloat16)
    probs = warp(logits, T1)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, logits.float().softmax(-1))


@pytest.mark.parametrize("k", [1, 2, 3, 5, 9])
def test_warp_top_k_keeps_exactly_k(k):
    """With distinct logits, exactly the k largest survive, renormalised in proportion."""
    logits = torch.randn(6, 10, generator=make_generator(4, "cpu")) * 2
    probs = warp(logits, SamplingConfig(temperature=1.0, top_k=k))
    top = logits.topk(k, -1).indices
    kept = probs > 0
    assert (kept.sum(-1) == k).all()
    assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, top, True))
    expect = torch.full_like(logits, float("-inf")).scatter(-1, top, logits.gather(-1, top)).softmax(-1)
    torch.testing.assert_close(probs, expect)


@pytest.mark.parametrize("k", [0, 10, 50])
def test_warp_top_k_off_when_zero_or_at_least_vocab(k):
    logits = torch.randn(10, generator=make_generator(5, "cpu"))
    torch.testing.assert_close(warp(logits, SamplingConfig(temperature=1.0, top_k=k)), logits.softmax(-1))


def test_warp_top_k_after_temperature():
    logits = torch.tensor([4.0, 2.0, 1.0, 0.0])
    probs = warp(logits, SamplingConfig(temperature=2.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([2.0, 1.0, -math.inf, -math.inf]).softmax(-1))


# Hand example for top-p: p = [0.125, 0.5, 0.125, 0.25] (binary fractions, so every partial sum is
# exact in float32 and the boundary cases are really on the boundary). Sorted: 0.5, 0.25, 0.125, 0.125;
# cumulative 0.5, 0.75, 0.875, 1.0.
P_HAND = torch.tensor([0.125, 0.5, 0.125, 0.25])


@pytest.mark.parametrize("top_p, n_kept", [
    (0.01, 1),     # tiny top_p: the top token is always kept
    (0.3, 1),      # the top token alone already exceeds top_p
    (0.5, 1),      # boundary: the top token's mass equals top_p exactly -> it alone suffices
    (0.5001, 2),
    (0.75, 2),     # boundary: 0.5 + 0.25 == 0.75
    (0.7501, 3),   # just above: a third token is needed
    (0.875, 3),    # boundary
    (0.8751, 4),
    (1.0, 4),      # off
])
def test_warp_top_p_hand_example(top_p, n_kept):
    """Keeps the smallest set of most likely tokens whose mass reaches top_p, renormalised."""
    probs = warp(P_HAND.log(), SamplingConfig(temperature=1.0, top_p=top_p))
    kept = set((probs > 0).nonzero().squeeze(1).tolist())
    assert len(kept) == n_kept
    # Most likely first: token 1, then 3, then the tied 0 / 2 (either may come first).
    assert kept >= ({1} if n_kept == 1 else {1, 3})
    expect = torch.zeros(4)
    idx = t(sorted(kept))
    expect[idx] = P_HAND[idx] / P_HAND[idx].sum()
    torch.testing.assert_close(probs, expect)


@pytest.mark.parametrize("top_p, expect", [
    # p = [0.1, 0.4, 0.2, 0.3]; sorted 0.4, 0.3, 0.2, 0.1 with cumulative 0.4, 0.7, 0.9, 1.0
    (0.35, [0.0, 1.0, 0.0, 0.0]),
    (0.6, [0.0, 4 / 7, 0.0, 3 / 7]),
    (0.8, [0.0, 4 / 9, 2 / 9, 3 / 9]),
    (0.95, [0.1, 0.4, 0.2, 0.3]),
])
def test_warp_top_p_non_binary_example(top_p, expect):
    probs = warp(torch.tensor([0.1, 0.4, 0.2, 0.3]).log(), SamplingConfig(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor(expect))


def test_warp_top_p_batched_rows_independent():
    """Each row keeps its own nucleus (the inverse permutation is per row)."""
    p = torch.tensor([[0.1, 0.4, 0.2, 0.3],
                      [0.3, 0.2, 0.4, 0.1],
                      [0.7, 0.1, 0.1, 0.1]])
    probs = warp(p.log(), SamplingConfig(temperature=1.0, top_p=0.6))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7],
                                                    [3 / 7, 0.0, 4 / 7, 0.0],
                                                    [1.0, 0.0, 0.0, 0.0]]))


def test_warp_order_is_temperature_then_top_k_then_top_p():
    """Each step sees the distribution the previous one produced.

    p = [0.4, 0.3, 0.2, 0.1]. top_k=2 renormalises to [4/7, 3/7]; top_p=0.5 then keeps only the top
    token (4/7 >= 0.5). Applied to the raw p, top_p=0.5 would keep two tokens. Likewise temperature
    0.5 sharpens p to [16, 9, 4, 1]/30, whose top token (0.533) alone reaches top_p = 0.5."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert warp(logits, SamplingConfig(temperature=1.0, top_k=2, top_p=0.5)).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert warp(logits, SamplingConfig(temperature=0.5, top_p=0.5)).tolist() == [1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(warp(logits, SamplingConfig(temperature=1.0, top_p=0.5)),
                               torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


@pytest.mark.parametrize("s", [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.3),
    SamplingConfig(temperature=2.0, top_k=5),
    SamplingConfig(temperature=0.8, top_p=0.7),
    SamplingConfig(temperature=1.3, top_k=20, top_p=0.9),
    SamplingConfig(temperature=1.0, top_k=1),
    SamplingConfig(temperature=1.0, top_p=1e-6),
])
def test_warp_sums_to_one_and_keeps_top_token(s):
    logits = torch.randn(8, 50, generator=make_generator(6, "cpu")) * 4
    probs = warp(logits, s)
    assert probs.shape == (8, 50)
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(8))
    top = logits.argmax(-1, keepdim=True)
    assert (probs.gather(-1, top) > 0).all()
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))


def test_warp_handles_minus_inf_logits():
    logits = torch.tensor([0.0, -math.inf, 1.0, -math.inf])
    probs = warp(logits, SamplingConfig(temperature=1.0, top_p=0.9))
    assert probs[1] == 0 and probs[3] == 0
    assert float(probs.sum()) == pytest.approx(1.0)


def test_next_token_greedy_and_sampled():
    logits = torch.tensor([0.0, 5.0, 1.0])
    assert next_token(logits, GREEDY, None) == 1
    one_hot = torch.tensor([-math.inf, -math.inf, 0.0])
    assert next_token(one_hot, T1, make_generator(0, "cpu")) == 2


# =============================================================================================
# residual()
# =============================================================================================

@pytest.mark.parametrize("seed", range(5))
def test_residual_sums_to_one_and_zero_where_p_le_q(seed):
    g = make_generator(seed, "cpu")
    p = torch.rand(12, generator=g).softmax(-1)
    q = (torch.rand(12, generator=g) * 2).softmax(-1)
    r = residual(p, 3, q)
    assert float(r.sum()) == pytest.approx(1.0, abs=1e-6)
    assert (r >= 0).all()
    assert (r[p <= q] == 0).all()
    assert (r[p > q] > 0).all()
    torch.testing.assert_close(r, (p - q).clamp_min(0) / (p - q).clamp_min(0).sum())


def test_residual_hand_example():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.4, 0.1, 0.3])
    torch.testing.assert_close(residual(p, 1, q), torch.tensor([0.75, 0.0, 0.25, 0.0]))


def test_residual_one_hot_zeroes_x():
    p = torch.tensor([0.1, 0.4, 0.2, 0.3])
    r = residual(p, 1, None)
    torch.testing.assert_close(r, torch.tensor([1 / 6, 0.0, 2 / 6, 3 / 6]))
    # q None is the same as an explicit one-hot q.
    torch.testing.assert_close(r, residual(p, 1, torch.nn.functional.one_hot(t(1), 4).float()))
    assert p.tolist() == pytest.approx([0.1, 0.4, 0.2, 0.3])  # input untouched


def test_residual_degenerate_returns_p():
    """When p <= q everywhere (rejection impossible) there is no residual mass; p comes back."""
    p = torch.tensor([0.25, 0.25, 0.5])
    assert torch.equal(residual(p, 0, p.clone()), p)
    assert torch.equal(residual(torch.tensor([0.0, 1.0, 0.0]), 1, None), torch.tensor([0.0, 1.0, 0.0]))


# =============================================================================================
# verify_greedy()
# =============================================================================================

def rows_with_argmax(best: list[int], vocab: int = 10) -> torch.Tensor:
    """[len(best), vocab] random logits whose row i has its argmax at best[i]."""
    logits = torch.randn(len(best), vocab, generator=make_generator(len(best), "cpu"))
    logits[torch.arange(len(best)), t(best)] = 10.0
    return logits


def test_greedy_perfect_chain_accepts_all_plus_bonus():
    draft = [3, 1, 4, 1]
    logits = rows_with_argmax(draft + [5])
    v = verify_greedy(DraftTree.chain(draft), logits)
    assert v.path == [0, 1, 2, 3]
    assert v.tokens == [3, 1, 4, 1, 5]
    assert v.num_accepted == 4


@pytest.mark.parametrize("j", [0, 1, 2, 3])
def test_greedy_chain_wrong_at_j(j):
    """The draft is wrong at position j: j tokens accepted, then the target's argmax."""
    target = [3, 1, 4, 1, 5]
    draft = list(target[:4])
    draft[j] = (draft[j] + 1) % 10
    # Rows after the wrong token must not matter: give them arbitrary argmaxes.
    best = target[: j + 1] + [7] * (4 - j)
    v = verify_greedy(DraftTree.chain(draft), rows_with_argmax(best))
    assert v.path == list(range(j))
    assert v.tokens == target[:j] + [target[j]]


@pytest.mark.parametrize("match", [0, 1, 2])
def test_greedy_tree_matching_sibling(match):
    """root has 3 children (tokens 7, 8, 9); the target's argmax is sibling `match`, whose own two
    children are then checked against the row of that sibling."""
    #          0:7  1:8  2:9  3:1(0) 4:2(0) 5:1(1) 6:2(1) 7:1(2) 8:2(2)
    parents = [-1, -1, -1, 0, 0, 1, 1, 2, 2]
    tokens = [7, 8, 9, 1, 2, 1, 2, 1, 2]
    tree = DraftTree(t(tokens), t(parents))
    # Row 0: argmax = 7 + match. Row of each sibling s (= s + 1): argmax 2 for the matched sibling,
    # 1 for others -- so picking the wrong row changes the answer. Row of node 4/6/8 (token 2): 5.
    best = [7 + match] + [2 if s == match else 1 for s in range(3)] + [0, 5, 0, 5, 0, 5]
    v = verify_greedy(tree, rows_with_argmax(best))
    second = 4 + 2 * match  # the child with token 2 under the matched sibling
    assert v.path == [match, second]
    assert v.tokens == [7 + match, 2, 5]


def test_greedy_tree_no_match_at_root():
    tree = DraftTree(t([7, 8, 9]), t([-1, -1, -1]))
    v = verify_greedy(tree, rows_with_argmax([4, 0, 0, 0]))
    assert v.path == [] and v.tokens == [4]


def test_greedy_first_matching_duplicate_wins():
    tree = DraftTree(t([7, 7]), t([-1, -1]))
    v = verify_greedy(tree, rows_with_argmax([7, 1, 2]))
    assert v.path == [0] and v.tokens == [7, 1]


def test_greedy_empty_tree_is_argmax_of_row_zero():
    logits = rows_with_argmax([6])
    v = verify_greedy(DraftTree.empty(), logits)
    assert v == Verdict([], [6])


def test_verify_dispatches_greedy_at_temperature_zero():
    draft = [3, 1, 4]
    logits = rows_with_argmax([3, 1, 2, 9])
    assert verify(DraftTree.chain(draft), logits, GREEDY, None) == Verdict([0, 1], [3, 1, 2])
    # top_k / top_p do not matter at temperature 0.
    s = SamplingConfig(temperature=0.0, top_k=1, top_p=0.1)
    assert verify(DraftTree.chain(draft), logits, s, None) == Verdict([0, 1], [3, 1, 2])


# =============================================================================================
# A Markov target and drafters for end-to-end decoding
# =============================================================================================

VOCAB = 8
ROOT = 0


def markov_pair(seed: int, vocab: int = VOCAB, sharp: float = 1.0, noise: float = 1.0):
    """Target P [V, V] and a correlated but different draft Q [V, V] (rows are distributions)."""
    g = make_generator(seed, "cpu")
    base = torch.randn(vocab, vocab, generator=g) * sharp
    P = base.softmax(-1)
    Q = (base + noise * torch.randn(vocab, vocab, generator=g)).softmax(-1)
    return P, Q


def markov_pair_with_zeros(seed: int, vocab: int = VOCAB):
    """P has zeros (tokens a+1, a+2 after token a); Q puts a lot of mass exactly there and has its
    own zeros (tokens a+3, a+4) where P has mass."""
    P, Q = markov_pair(seed, vocab)
    P, Q = P.clone(), Q.clone()
    for a in range(vocab):
        P[a, [(a + 1) % vocab, (a + 2) % vocab]] = 0.0
        Q[a, [(a + 3) % vocab, (a + 4) % vocab]] = 0.0
        Q[a, [(a + 1) % vocab, (a + 2) % vocab]] += 0.3
    return P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True)


def cumulative(Q: torch.Tensor) -> list[list[float]]:
    """Per row of Q [V, V], its running sums (float64): draw(cum[a], u) samples a token from Q[a]."""
    return [list(itertools.accumulate(row)) for row in Q.double().tolist()]


def draw(cum: list[float], u: float) -> int:
    """The token x with cum[x - 1] <= u * total < cum[x], for u uniform in [0, 1): x ~ the row.
    Exact inversion of the row's CDF; a token of zero mass has an empty interval, so never comes.
    (torch.multinomial costs ~60 us a call here, and the drafts make ~100k draws per test.)"""
    return bisect.bisect_right(cum, u * cum[-1])


def whole(Q: torch.Tensor) -> SparseQ:
    """A Markov draft Q [V, V] as a SparseQ over the whole vocabulary: row a is the draft after token a."""
    return SparseQ(torch.arange(Q.shape[-1]).repeat(Q.shape[0], 1), Q.half())


def sampled_chain(Q: SparseQ, depth, told=None):
    """Chain whose tokens are sampled from the draft Q (row a: the draft after token a, over its own
    support), with the q rows they were drawn from given, or told(rows, contexts) of them: a broken
    drafter's (`contexts`: each node's parent token). A chain seen before (same root, same tokens) is
    the same DraftTree, built once."""
    cum = cumulative(Q.probs)
    ids = Q.ids.tolist()
    trees = {}

    def draft(root, g):
        toks, last = [], root
        for u in torch.rand(depth, generator=g, dtype=torch.float64).tolist():
            last = ids[last][draw(cum[last], u)]
            toks.append(last)
        key = (root, *toks)
        if key not in trees:
            contexts = t([root, *toks[:-1]])
            q = Q[contexts]  # node i was sampled from Q[parent]
            trees[key] = DraftTree.chain(toks, q if told is None else told(q, contexts))
        return trees[key]
    return draft


def argmax_chain(Q, depth):
    """Chain of the draft's argmax tokens, q None (one DraftTree per root, built once)."""
    @functools.cache
    def chain(last):
        toks = []
        for _ in range(depth):
            last = int(Q[last].argmax())
            toks.append(last)
        return DraftTree.chain(toks)
    return lambda last, g: chain(last)


def fixed_chain(tokens):
    """The same chain whatever the context, q None."""
    tree = DraftTree.chain(tokens)
    return lambda last, g: tree


def fixed_tree(tokens, parents):
    """The same tree whatever the context, q None."""
    tree = DraftTree(t(tokens), t(parents))
    return lambda last, g: tree


def topk_tree(Q, k1, k2):
    """Deterministic tree: the top-k1 draft tokens below the root, each with its top-k2 children, q None
    (one DraftTree per root, built once)."""
    @functools.cache
    def tree(last):
        toks, parents = [], []
        for a in Q[last].topk(k1).indices.tolist():
            toks.append(a)
            parents.append(-1)
            me = len(toks) - 1
            for b in Q[a].topk(k2).indices.tolist():
                toks.append(b)
                parents.append(me)
        return DraftTree(t(toks), t(parents))
    return lambda last, g: tree(last)


def sampled_tree(Q, k1, k2):
    """SpecInfer tree: k1 siblings sampled i.i.d. from Q[root], each with k2 children sampled i.i.d.
    from Q[sibling]; q given per node. Duplicated siblings are allowed."""
    Qs = whole(Q)
    cum = cumulative(Qs.probs)

    def draft(last, g):
        us = iter(torch.rand(k1 * (1 + k2), generator=g, dtype=torch.float64).tolist())
        toks, parents, rows = [], [], []  # rows: the Q row each node was sampled from
        for _ in range(k1):
            a = draw(cum[last], next(us))
            toks.append(a)
            parents.append(-1)
            rows.append(last)
            me = len(toks) - 1
            for _ in range(k2):
                toks.append(draw(cum[a], next(us)))
                parents.append(me)
                rows.append(a)
        return DraftTree(t(toks), t(parents), Qs[t(rows)])
    return draft


def check_verdict(tree: DraftTree, v: Verdict):
    """Structural invariants of any verdict."""
    assert len(v.tokens) == len(v.path) + 1
    prev = -1
    for node in v.path:
        assert int(tree.parents[node]) == prev
        prev = node
    assert v.tokens[:-1] == [int(tree.tokens[c]) for c in v.path]


def target_rows(Pw: torch.Tensor, last: int, tree: DraftTree) -> torch.Tensor:
    """[n+1, V] target distributions of one verify step: row 0 after `last`, row i+1 after node i."""
    return Pw[torch.cat([t([last]), tree.tokens])]


def decode_pairs(Pw, drafter, trials, seed, root=ROOT):
    """Decode the first two tokens after `root` `trials` times against the (already warped) Markov
    target Pw. Returns a [trials, 2] int array and the total number of accepted draft tokens.

    Calls verify_stochastic on rows of Pw rather than verify() on logits: on the 2-core test machine
    torch's softmax of a multi-row tensor with 2 threads costs ~8 ms (OpenMP), which would make 25k
    trials take minutes. That verify() == verify_stochastic(warp(...)) is checked separately."""
    g = make_generator(seed, "cpu")
    out = np.empty((trials, 2), dtype=np.int64)
    accepted = 0
    rows = {}  # (last, draft tokens) -> their target rows: a pure function of the two, built once
    for i in range(trials):
        got: list[int] = []
        last = root
        while len(got) < 2:
            tree = drafter(last, g)
            key = (last, *tree.tokens.tolist())
            if key not in rows:
                rows[key] = target_rows(Pw, last, tree)
            v = verify_stochastic(tree, rows[key], g)
            if i < 200:
                check_verdict(tree, v)
            accepted += v.num_accepted
            got += v.tokens
            last = got[-1]
        out[i] = got[:2]
    return out, accepted


def check_lossless(P, Q, drafter, trials, seed, s=T1, root=ROOT, min_accept_rate=0.2):
    """Decode with `drafter`; the first token must follow Pw[root] and the first two tokens the
    Markov joint Pw[root, a] * Pw[a, b], where Pw is the warped target."""
    Pw_t = warp(P.log(), s)
    pairs, accepted = decode_pairs(Pw_t, drafter, trials, seed, root)
    Pw = Pw_t.double().numpy()
    Qn = Q.double().numpy()
    # The drafts must actually get accepted, otherwise this only tests the bonus/recovery sampling.
    assert accepted / trials > min_accept_rate, f"drafts hardly accepted: {accepted / trials:.2f} per step"

    first = np.bincount(pairs[:, 0], minlength=VOCAB)
    p1 = Pw[root]
    refs1 = {"q": Qn[root], "uniform": np.full(VOCAB, 1 / VOCAB), "shifted p": np.roll(p1, 1)}
    d1 = assert_matches("first token", first, p1, refs1, max_tv=0.02)

    joint = np.zeros((VOCAB, VOCAB))
    np.add.at(joint, (pairs[:, 0], pairs[:, 1]), 1)
    p2 = p1[:, None] * Pw
    refs2 = {
        "q joint": Qn[root][:, None] * Qn,
        "uniform": np.full((VOCAB, VOCAB), 1 / VOCAB**2),
        "row 0 reused for token 2": p1[:, None] * p1[None, :],
        "shifted p": np.roll(p2, 1, axis=1),
    }
    d2 = assert_matches("first two tokens", joint, p2, refs2, max_tv=0.035)
    return d1, d2


# =============================================================================================
# Losslessness
# =============================================================================================

TRIALS = 25_000


def test_lossless_chain_sampled_draft():
    """(a) Chain of depth 3 sampled from a different draft Q, q given."""
    P, Q = markov_pair(11)
    check_lossless(P, Q, sampled_chain(whole(Q), 3), TRIALS, seed=100)


def test_lossless_chain_argmax_draft():
    """(b) Deterministic chain: the draft's argmax at each step, q None."""
    P, Q = markov_pair(12)
    check_lossless(P, Q, argmax_chain(Q, 3), TRIALS, seed=101)


def test_lossless_chain_fixed_tokens():
    """(b') A fixed chain regardless of context (q None); the second fixed token repeats the first."""
    P, Q = markov_pair(13)
    top = int(P[ROOT].argmax())
    check_lossless(P, Q, fixed_chain([top, top, 2]), TRIALS, seed=102, min_accept_rate=0.1)


def test_lossless_tree_topk_siblings():
    """(c) Deterministic tree: top-3 distinct siblings at the root, each with its top-2 children, q None."""
    P, Q = markov_pair(14)
    check_lossless(P, Q, topk_tree(Q, 3, 2), TRIALS, seed=103)


def test_lossless_tree_duplicate_deterministic_siblings():
    """(c') q None with a repeated sibling: once x is rejected the residual gives it probability 0,
    so the duplicate can never be accepted and the output law is unchanged."""
    P, Q = markov_pair(16)
    a, b = P[ROOT].topk(2).indices.tolist()
    #        0:a 1:a 2:b 3:b(0) 4:a(1) 5:a(2)
    draft = fixed_tree([a, a, b, b, a, a], [-1, -1, -1, 0, 1, 2])
    check_lossless(P, Q, draft, TRIALS, seed=108)


def test_lossless_tree_sampled_siblings_specinfer():
    """(d) SpecInfer multi-round rule: 3 siblings sampled i.i.d. from q, each with 2 i.i.d. children,
    q given per node (the module docstring claims the multi-round rule)."""
    P, Q = markov_pair(15)
    check_lossless(P, Q, sampled_tree(Q, 3, 2), TRIALS, seed=104)


def test_lossless_sampled_chain_with_disjoint_support():
    """(e) p has zeros that q puts mass on, q has zeros where p has mass; sampled chain with q given."""
    P, Q = markov_pair_with_zeros(15)
    assert (P == 0).any() and ((Q > 0) & (P == 0)).any() and ((Q == 0) & (P > 0)).any()
    check_lossless(P, Q, sampled_chain(whole(Q), 3), TRIALS, seed=105, min_accept_rate=0.1)


def test_lossless_deterministic_tree_with_zero_probability_candidates():
    """(e') Deterministic tree whose top-k candidates include tokens the target never emits."""
    P, Q = markov_pair_with_zeros(16)
    # Q's top-3 after every token includes at least one of P's zeros.
    for a in range(VOCAB):
        assert (P[a, Q[a].topk(3).indices] == 0).any()
    check_lossless(P, Q, topk_tree(Q, 3, 2), TRIALS, seed=106, min_accept_rate=0.1)


def test_lossless_against_warped_target():
    """The target law is warp(logits, s): temperature, top-k and top-p included (deterministic tree)."""
    P, Q = markov_pair(17, sharp=1.0)
    s = SamplingConfig(temperature=0.8, top_k=6, top_p=0.9)
    Pw = warp(P.log(), s)
    assert (Pw == 0).sum() >= VOCAB * 2  # the warp really removed tokens
    check_lossless(P, Q, topk_tree(Q, 2, 2), TRIALS, seed=107, s=s)


def test_lossless_check_has_power(monkeypatch):
    """Sanity check of the check itself: a classic bug -- resampling from p instead of from the
    residual after a rejection -- is caught."""
    P, Q = markov_pair(11)
    monkeypatch.setattr(V_, "residual", lambda p, x, q: p)
    with pytest.raises(AssertionError, match="TV to target|chi-square") as err:
        check_lossless(P, Q, sampled_chain(whole(Q), 3), 15_000, seed=100)
    assert "setup" not in str(err.value)


def truncated_pair(seed: int) -> tuple[torch.Tensor, torch.Tensor, SparseQ]:
    """P, Q and the draft's truncation of Q (sparse_q.py): each row's top 3 tokens, cut to those
    reaching 90% of their mass. It drops a fifth of Q's mass: a q that is not the truncated one shows."""
    P, Q = markov_pair(seed)
    Qt = SparseQ.truncate(Q, top_k=3, top_p=0.9)
    kept = (Q.gather(1, Qt.ids) * (Qt.weights > 0)).sum(1)  # Q's mass on each row's support
    assert (Qt.weights > 0).sum(1).min() < 3 and float(kept.mean()) < 0.85  # top_p cut some rows too
    return P, Q, Qt


def test_lossless_chain_sampled_from_a_truncated_draft():
    """(g) A sampled chain drawn from the draft's truncated q (its top-k, top-p support, in 16 bits),
    verified with that q: the target law is kept whatever the truncation."""
    P, _, Qt = truncated_pair(11)
    check_lossless(P, Qt.dense(VOCAB), sampled_chain(Qt, 3), TRIALS, seed=110)


@pytest.mark.parametrize("told", ["untruncated q", "q of another position"])
def test_lossless_check_catches_a_q_other_than_the_one_drawn_from(told):
    """The check has power against a drafter that sends a q other than the one each token was drawn
    from: the draft's distribution before truncation (what the wire carried before it was truncated),
    or the next node's q."""
    P, Q, Qt = truncated_pair(11)
    wrong = {"untruncated q": lambda q, contexts: whole(Q)[contexts],
             "q of another position": lambda q, contexts: q[torch.arange(len(q)).roll(-1)]}[told]
    with pytest.raises(AssertionError, match="TV to target|chi-square") as err:
        check_lossless(P, Qt.dense(VOCAB), sampled_chain(Qt, 3, wrong), 15_000, seed=110)
    assert "setup" not in str(err.value)


def acceptance_rate(trees: list[DraftTree], p: torch.Tensor, seed: int) -> float:
    """Fraction of verifications of one-level trees, one per trial, that accept a draft token."""
    g = make_generator(seed, "cpu")
    rows = torch.cat([p[None], torch.full((8, p.shape[0]), 1 / p.shape[0])])
    hits = 0
    for tr in trees:
        hits += verify_stochastic(tr, rows[: len(tr) + 1], g).num_accepted
    return hits / len(trees)


def test_acceptance_rate_is_optimal_for_sampled_draft():
    """x ~ q with q given is accepted with probability sum_x min(p(x), q(x)) (the optimal rate, not the
    one-hot rate sum_x q(x) p(x), which is also lossless but wastes drafts)."""
    P, Q = markov_pair(11)
    q = whole(Q[ROOT][None])
    p = P[ROOT]
    optimal = float(torch.minimum(p, q.probs[0]).sum())
    one_hot = float((p * q.probs[0]).sum())
    assert optimal - one_hot > 0.1
    drafts = [DraftTree.chain([x], q) for x in range(VOCAB)]  # x ~ q, drawn below all at once
    xs = torch.multinomial(q.probs[0], 20_000, replacement=True, generator=make_generator(0, "cpu")).tolist()
    rate = acceptance_rate([drafts[x] for x in xs], p, 1)
    assert rate == pytest.approx(optimal, abs=0.015)


def test_acceptance_rate_of_deterministic_siblings():
    """q None: one candidate x is accepted with probability p(x); distinct siblings with sum p(x_i)."""
    P, _ = markov_pair(11)
    p = P[ROOT]
    order = p.argsort(descending=True).tolist()
    x = order[1]
    assert acceptance_rate([DraftTree.chain([x])] * 10_000, p, 1) == pytest.approx(float(p[x]), abs=0.02)
    sib = order[:3]
    rate = acceptance_rate([DraftTree(t(sib), t([-1, -1, -1]))] * 10_000, p, 2)
    assert rate == pytest.approx(float(p[sib].sum()), abs=0.02)


def test_stochastic_empty_tree_samples_row_zero():
    P, _ = markov_pair(18)
    g = make_generator(5, "cpu")
    n = 20_000
    counts = np.bincount([verify_stochastic(DraftTree.empty(), P[:1], g).tokens[0] for _ in range(n)],
                         minlength=VOCAB)
    assert_matches("empty tree", counts, P[0].double().numpy(), {"uniform": np.full(VOCAB, 1 / VOCAB)},
                   max_tv=0.02)


def test_stochastic_certain_acceptance_and_rejection():
    """p(x) = 1 accepts x always (and the bonus comes from the next row); p(x) = 0 never accepts it."""
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    g = make_generator(0, "cpu")
    q = whole(torch.full((2, 3), 1 / 3))
    for tree in (DraftTree.chain([1, 2]), DraftTree.chain([1, 2], q)):
        for _ in range(50):
            assert verify_stochastic(tree, p, g) == Verdict([0, 1], [1, 2, 0])
    for tree in (DraftTree.chain([0, 2]), DraftTree.chain([0, 2], q)):
        for _ in range(50):
            assert verify_stochastic(tree, p, g) == Verdict([], [1])


def test_stochastic_tree_walks_into_accepted_childs_row():
    """Row selection in trees: after accepting node c the next row is c + 1, not the sibling's."""
    #         0:1  1:2  2:0(0) 3:0(1)
    tree = DraftTree(t([1, 2, 0, 0]), t([-1, -1, 0, 1]))
    p = torch.tensor([
        [0.0, 0.0, 1.0],  # root: only token 2 -> node 0 rejected, node 1 accepted
        [1.0, 0.0, 0.0],  # after node 0: would accept node 2
        [0.0, 1.0, 0.0],  # after node 1: rejects node 3 (token 0), recovers token 1
        [1.0, 0.0, 0.0],
        [1.0, 0.0, 0.0],
    ])
    g = make_generator(0, "cpu")
    for _ in range(50):
        assert verify_stochastic(tree, p, g) == Verdict([1], [2, 1])


# =============================================================================================
# Reproducibility
# =============================================================================================

def run_verdicts(seed: int, n: int = 300):
    """Verdicts of n steps over mixed drafts (sampled trees, top-k trees, sampled chains), with the
    draft sampling and verification sharing one seeded generator."""
    P, Q = markov_pair(20)
    g = make_generator(seed, "cpu")
    drafts = [sampled_tree(Q, 3, 2), topk_tree(Q, 3, 2), sampled_chain(whole(Q), 4)]
    out = []
    for i in range(n):
        tree = drafts[i % 3](i % VOCAB, g)
        out.append(verify_stochastic(tree, target_rows(P, i % VOCAB, tree), g))
    return out


def test_same_seed_same_verdicts():
    a, b = run_verdicts(1), run_verdicts(1)
    assert a == b


def test_different_seed_different_verdicts():
    a, b = run_verdicts(1), run_verdicts(2)
    assert a != b
    assert sum(x != y for x, y in zip(a, b)) > 30


def test_seeded_verify_independent_of_global_rng():
    """A seeded generator fully determines the verdicts; torch's global RNG state does not matter."""
    P, Q = markov_pair(21)
    tree = sampled_chain(whole(Q), 3)(0, make_generator(9, "cpu"))
    rows = target_rows(P, 0, tree)

    def run():
        g = make_generator(3, "cpu")
        return [verify_stochastic(tree, rows, g) for _ in range(200)]

    torch.manual_seed(0)
    a = run()
    torch.manual_seed(12345)
    torch.rand(100)
    assert run() == a
    assert len(set(map(str, a))) > 1  # the verdicts really are random


@pytest.mark.parametrize("s", [T1, SamplingConfig(temperature=0.7, top_k=5, top_p=0.8)])
def test_verify_dispatches_to_stochastic_on_warped_logits(s):
    """verify(logits) == verify_stochastic(warp(logits)) draw for draw, with the same seed."""
    P, Q = markov_pair(23)
    for i in range(10):
        tree = sampled_tree(Q, 2, 2)(i % VOCAB, make_generator(i, "cpu"))
        logits = target_rows(P, i % VOCAB, tree).log() * 1.7
        g1, g2 = make_generator(i, "cpu"), make_generator(i, "cpu")
        for _ in range(3):
            assert verify(tree, logits, s, g1) == verify_stochastic(tree, warp(logits, s), g2)


def test_greedy_decoding_matches_target_only_greedy():
    """Speculative greedy decoding reproduces target-only greedy decoding token for token."""
    P, Q = markov_pair(22)
    logP = P.log()
    expect, last = [], ROOT
    for _ in range(12):
        last = next_token(logP[last], GREEDY, None)
        expect.append(last)
    for drafter in (argmax_chain(Q, 3), topk_tree(Q, 3, 2), fixed_chain([1, 2, 3]), argmax_chain(P, 4)):
        got, last = [], ROOT
        while len(got) < 12:
            tree = drafter(last, None)
            v = verify(tree, torch.cat([logP[last][None], logP[tree.tokens]]), GREEDY, None)
            check_verdict(tree, v)
            got += v.tokens
            last = got[-1]
        assert got[:12] == expect


def test_lossless_late_draft_taken_below_the_token_decoded_without_it():
    """(f) A draft asked for a prefix that came one step late: the target decoded t1 alone meanwhile,
    and verifies what the draft holds below t1 (DraftTree.follow) as its next step's draft. The tree
    is SpecInfer's (3 sampled siblings, 2 sampled children each, duplicates allowed): below the first
    sibling equal to t1 lie two i.i.d. draws from Q[t1]. The law of (t1, t2) must stay the target's."""
    P, Q = markov_pair(17)
    Pw = warp(P.log(), T1)
    cum_p = cumulative(Pw)
    draft = sampled_tree(Q, 3, 2)
    g = make_generator(109, "cpu")
    pairs = np.empty((TRIALS, 2), dtype=np.int64)
    accepted = 0
    for i in range(TRIALS):
        tree = draft(ROOT, g)  # asked for the prefix ending at ROOT
        t1 = draw(cum_p[ROOT], float(torch.rand(1, generator=g, dtype=torch.float64)))  # decoded alone
        late = tree.follow([t1])
        v = verify_stochastic(late, target_rows(Pw, t1, late), g)
        accepted += v.num_accepted
        pairs[i] = (t1, v.tokens[0])
    assert accepted / TRIALS > 0.2, f"late drafts hardly accepted: {accepted / TRIALS:.2f} per step"
    Pn, Qn = Pw.double().numpy(), Q.double().numpy()
    joint = np.zeros((VOCAB, VOCAB))
    np.add.at(joint, (pairs[:, 0], pairs[:, 1]), 1)
    p2 = Pn[ROOT][:, None] * Pn
    refs = {"q for token 2": Pn[ROOT][:, None] * Qn, "row 0 reused for token 2": Pn[ROOT][:, None] * Pn[ROOT][None, :]}
    assert_matches("first two tokens", joint, p2, refs, max_tv=0.035)
