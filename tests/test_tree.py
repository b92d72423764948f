"""Unit tests for starsd.spec_decode.tree: DraftTree, depths, ancestor_mask, children."""

from __future__ import annotations

import pytest
import torch

from starsd.spec_decode.sparse_q import SparseQ
from starsd.spec_decode.tree import DraftTree, ancestor_mask, children, depths


def t(xs):
    return torch.tensor(xs, dtype=torch.long)


def q_of(n: int, k: int = 4) -> SparseQ:
    """A q of n nodes, k slots each, every row its own (row i: ids 1000 i .. 1000 i + k - 1)."""
    ids = torch.arange(n)[:, None] * 1000 + torch.arange(k)
    return SparseQ(ids, (torch.arange(k) + 1.0).repeat(n, 1).half())


def same_q(a: SparseQ, b: SparseQ) -> bool:
    return torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights)


# A tree whose shallow nodes are interleaved with deep ones in node order, so truncation keeps a
# non-contiguous set of nodes and has to remap parents:
#
#   root ─ 0 ─ 1 ─ 2
#        │   └ 5
#        └ 3 ─ 4 ─ 6
PARENTS = [-1, 0, 1, -1, 3, 0, 4]
DEPTHS = [1, 2, 3, 1, 2, 2, 3]
TOKENS = [10, 11, 12, 13, 14, 15, 16]


def ancestors_brute(parents: list[int], i: int) -> set[int]:
    """Node indices on the path from node i up to (excluding) the root, i included."""
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


def random_tree(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(torch.randint(-1, i, (), generator=g)) for i in range(n)]


def token_path(tree: DraftTree, i: int) -> list[int]:
    """Tokens from the root down to node i."""
    out = []
    while i >= 0:
        out.append(int(tree.tokens[i]))
        i = int(tree.parents[i])
    return out[::-1]


# ---------------------------------------------------------------------------------------------
# DraftTree construction and validation
# ---------------------------------------------------------------------------------------------

def test_valid_tree_constructs():
    tree = DraftTree(t(TOKENS), t(PARENTS))
    assert len(tree) == 7
    assert tree.q is None


@pytest.mark.parametrize("parents", [
    [0],                 # a node cannot be its own parent
    [-1, 1],             # self-parent further down
    [-1, 2, 0],          # a parent after its child
    [-1, 0, 3, 1],       # a parent after its child, deeper
    [-2],                # below -1
    [-1, -1, -5],
])
def test_non_topological_parents_rejected(parents):
    n = len(parents)
    with pytest.raises(ValueError, match="topologically"):
        DraftTree(torch.arange(n), t(parents))


def test_parents_shape_mismatch_rejected():
    with pytest.raises(ValueError):
        DraftTree(t([1, 2, 3]), t([-1, 0]))


def test_two_dimensional_tokens_rejected():
    with pytest.raises(ValueError):
        DraftTree(torch.zeros(2, 2, dtype=torch.long), t([-1, 0]))


def test_q_row_count_must_match_nodes():
    with pytest.raises(ValueError, match="rows"):
        DraftTree(t([1, 2]), t([-1, 0]), q_of(3))


def test_q_with_matching_rows_accepted():
    q = q_of(2)
    tree = DraftTree(t([1, 2]), t([-1, 0]), q)
    assert tree.q is q


def test_empty_tree():
    tree = DraftTree.empty()
    assert len(tree) == 0
    assert tree.tokens.dtype == torch.long and tree.parents.dtype == torch.long
    assert tree.q is None
    assert children(tree.parents) == [[]]
    assert ancestor_mask(tree.parents).tolist() == [[True]]


# ---------------------------------------------------------------------------------------------
# chain()
# ---------------------------------------------------------------------------------------------

def test_chain_parents_and_tokens():
    tree = DraftTree.chain([5, 6, 7, 8])
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.tokens.tolist() == [5, 6, 7, 8]
    assert tree.tokens.dtype == torch.long
    assert depths(tree.parents).tolist() == [1, 2, 3, 4]
    assert tree.q is None


def test_chain_from_tensor_and_q_passed_through():
    q = q_of(3)
    tree = DraftTree.chain(torch.tensor([1, 2, 3]), q)
    assert tree.parents.tolist() == [-1, 0, 1]
    assert tree.q is q


def test_chain_single_and_empty():
    assert DraftTree.chain([4]).parents.tolist() == [-1]
    empty = DraftTree.chain([])
    assert len(empty) == 0 and empty.parents.tolist() == []


def test_chain_q_rows_checked():
    with pytest.raises(ValueError):
        DraftTree.chain([1, 2, 3], q_of(2))


# ---------------------------------------------------------------------------------------------
# truncate()
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_depth", [0, 1, 2, 3, 4, 10])
def test_truncate_keeps_depth_and_remaps_parents(max_depth):
    q = q_of(7)
    tree = DraftTree(t(TOKENS), t(PARENTS), q)
    cut = tree.truncate(max_depth)
    kept = [i for i, d in enumerate(DEPTHS) if d <= max_depth]

    assert len(cut) == len(kept)
    # Node order is preserved, tokens and q rows follow their nodes.
    assert cut.tokens.tolist() == [TOKENS[i] for i in kept]
    assert same_q(cut.q, q[t(kept)])
    # Depths are the original depths, all <= max_depth.
    assert depths(cut.parents).tolist() == [DEPTHS[i] for i in kept]
    # Parents are remapped: every kept node still hangs under the same token path.
    for new, old in enumerate(kept):
        assert token_path(cut, new) == token_path(tree, old)
    # And the result is itself valid (the constructor validated topological order).
    assert cut.parents.dtype == torch.long


def test_truncate_explicit_remap():
    tree = DraftTree(t(TOKENS), t(PARENTS))
    cut = tree.truncate(2)
    # kept old nodes 0, 1, 3, 4, 5 -> new 0, 1, 2, 3, 4
    assert cut.tokens.tolist() == [10, 11, 13, 14, 15]
    assert cut.parents.tolist() == [-1, 0, -1, 2, 0]
    assert cut.truncate(1).parents.tolist() == [-1, -1]


def test_truncate_zero_gives_empty_tree():
    tree = DraftTree(t(TOKENS), t(PARENTS), q_of(7, 3))
    cut = tree.truncate(0)
    assert len(cut) == 0
    assert cut.q is not None and cut.q.ids.shape == (0, 3)


def test_truncate_deep_enough_is_identity():
    q = q_of(7, 3)
    tree = DraftTree(t(TOKENS), t(PARENTS), q)
    cut = tree.truncate(3)
    assert torch.equal(cut.tokens, tree.tokens)
    assert torch.equal(cut.parents, tree.parents)
    assert same_q(cut.q, q)


def test_truncate_without_q_keeps_q_none():
    assert DraftTree(t(TOKENS), t(PARENTS)).truncate(2).q is None


def test_truncate_chain_is_prefix():
    q = q_of(5)
    cut = DraftTree.chain([9, 8, 7, 6, 5], q).truncate(3)
    assert cut.tokens.tolist() == [9, 8, 7]
    assert cut.parents.tolist() == [-1, 0, 1]
    assert same_q(cut.q, q[t([0, 1, 2])])


def test_truncate_empty_tree():
    assert len(DraftTree.empty().truncate(3)) == 0


@pytest.mark.parametrize("seed", range(5))
def test_truncate_random_trees(seed):
    parents = random_tree(12, seed)
    tree = DraftTree(torch.arange(100, 112), t(parents), q_of(12, 2))
    d = depths(tree.parents).tolist()
    for max_depth in range(0, max(d) + 1):
        cut = tree.truncate(max_depth)
        kept = [i for i in range(12) if d[i] <= max_depth]
        assert cut.tokens.tolist() == [100 + i for i in kept]
        assert same_q(cut.q, tree.q[t(kept)])
        for new, old in enumerate(kept):
            assert token_path(cut, new) == token_path(tree, old)


# ---------------------------------------------------------------------------------------------
# depths(), ancestor_mask(), children()
# ---------------------------------------------------------------------------------------------

def test_depths_example():
    assert depths(t(PARENTS)).tolist() == DEPTHS
    assert depths(t([-1, -1, -1])).tolist() == [1, 1, 1]
    assert depths(t([])).tolist() == []
    assert depths(t(PARENTS)).dtype == torch.long


def test_ancestor_mask_example():
    m = ancestor_mask(t([-1, 0, -1, 2, 0]))
    expect = [
        # root n0 n1 n2 n3 n4
        [1, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0],  # n0
        [1, 1, 1, 0, 0, 0],  # n1 <- n0
        [1, 0, 0, 1, 0, 0],  # n2
        [1, 0, 0, 1, 1, 0],  # n3 <- n2
        [1, 1, 0, 0, 0, 1],  # n4 <- n0
    ]
    assert m.dtype == torch.bool
    assert m.tolist() == [[bool(x) for x in row] for row in expect]


def test_ancestor_mask_chain_is_lower_triangular():
    m = ancestor_mask(DraftTree.chain([1, 2, 3, 4]).parents)
    assert torch.equal(m, torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("seed", range(5))
def test_ancestor_mask_random_trees(seed):
    """Root column all True; a node attends to itself and its ancestors only; the root to itself only."""
    parents = random_tree(15, seed)
    m = ancestor_mask(t(parents))
    assert m.shape == (16, 16)
    assert m[:, 0].all()
    assert m[0].tolist() == [True] + [False] * 15
    assert m.diagonal().all()
    for i in range(15):
        anc = ancestors_brute(parents, i)
        assert m[i + 1, 1:].tolist() == [j in anc for j in range(15)]


def test_children_example():
    assert children(t(PARENTS)) == [[0, 3], [1, 5], [2], [], [4], [6], [], []]
    assert children(t([-1, -1, -1])) == [[0, 1, 2], [], [], []]
    assert children(t([-1, 0, 1])) == [[0], [1], [2], []]


@pytest.mark.parametrize("seed", range(3))
def test_children_inverts_parents(seed):
    parents = random_tree(15, seed)
    kids = children(t(parents))
    assert len(kids) == 16
    for j, ks in enumerate(kids):
        assert ks == sorted(ks)  # node order
        assert all(parents[k] == j - 1 for k in ks)
    assert sorted(k for ks in kids for k in ks) == list(range(15))


# ---------------------------------------------------------------------------------------------
# follow()
# ---------------------------------------------------------------------------------------------

def test_follow_gives_the_subtree_below_a_path_as_a_draft_of_its_own():
    q = q_of(7)
    tree = DraftTree(t(TOKENS), t(PARENTS), q)
    assert torch.equal(tree.follow([]).tokens, tree.tokens) and torch.equal(tree.follow([]).parents, tree.parents)
    below = tree.follow([10])  # node 0: its children 1 (with 2 below) and 5
    assert below.tokens.tolist() == [11, 12, 15] and below.parents.tolist() == [-1, 0, -1]
    assert same_q(below.q, q[t([1, 2, 5])])
    assert tree.follow([13, 14]).tokens.tolist() == [16] and tree.follow([13, 14]).parents.tolist() == [-1]
    assert len(tree.follow([10, 11, 12])) == 0  # a leaf: nothing below
    assert len(tree.follow([11])) == 0 and len(tree.follow([10, 16])) == 0  # not a path from the root


def test_follow_takes_the_first_of_repeated_siblings():
    tree = DraftTree(t([5, 5, 7, 8]), t([-1, -1, 0, 1]))
    assert tree.follow([5]).tokens.tolist() == [7]
