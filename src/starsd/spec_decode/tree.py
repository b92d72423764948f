"""Token trees: the shape of a draft.

A draft tree hangs below a *root*: the last token the target has committed (its "pending" token).
Nodes are numbered 0..n-1 in topological order (a parent always comes before its children);
`parents[i]` is the index of node i's parent, or -1 when the parent is the root. A chain of length n
is the tree with parents [-1, 0, 1, ..., n-2].

Where a tensor covers the root as well, row/column 0 is the root and node i is row i + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from starsd.spec_decode.sparse_q import SparseQ


@dataclass
class DraftTree:
    """A draft: tokens, their tree shape and, for sampled drafts, the distributions they came from.

    tokens:  [n] int64, the drafted token of each node
    parents: [n] int64, parent node index, -1 for children of the root
    q:       SparseQ of n rows, or None. Row i is the draft distribution node i was *sampled* from,
             over its own small support (sparse_q.py). None means every node was chosen
             deterministically (top-k / argmax): verification then treats each node's q as one-hot on
             its token, which keeps the target distribution for any choice of distinct siblings.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    q: SparseQ | None = None

    def __post_init__(self):
        n = self.tokens.shape[0]
        if self.tokens.ndim != 1 or self.parents.shape != (n,):
            raise ValueError(f"tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} must be [n]")
        if n and not bool((self.parents < torch.arange(n)).all() and (self.parents >= -1).all()):
            raise ValueError("parents must be topologically ordered: -1 <= parents[i] < i")
        if self.q is not None and len(self.q) != n:
            raise ValueError(f"q has {len(self.q)} rows for {n} nodes")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def chain(cls, tokens: list[int] | torch.Tensor, q: SparseQ | None = None) -> "DraftTree":
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        return cls(tokens, torch.arange(tokens.shape[0]) - 1, q)

    @classmethod
    def empty(cls) -> "DraftTree":
        return cls(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))

    def depth(self) -> int:
        """Levels below the root (0 for an empty draft)."""
        return int(depths(self.parents).max()) if len(self) else 0

    def truncate(self, max_depth: int) -> "DraftTree":
        """Keep only the nodes at depth <= max_depth (used when the token budget ends inside a draft)."""
        return self._keep((depths(self.parents) <= max_depth).nonzero().squeeze(1))

    def follow(self, path: list[int]) -> "DraftTree":
        """The subtree below the node reached by spelling `path` down from the root (the first such
        node where siblings repeat a token), as a draft of its own below the path's last token;
        empty if the tree does not hold the path. A draft asked for a prefix is still a draft for
        the prefix plus `path` when the target committed `path` without it: each node was drawn
        given its ancestors only, so the nodes below a fixed path are a draft of that longer
        prefix, with their q rows unchanged."""
        node = -1
        kids = children(self.parents)
        for token in path:
            node = next((c for c in kids[node + 1] if int(self.tokens[c]) == token), None)
            if node is None:
                return DraftTree.empty()
        below = [node]  # the nodes under `node`, in topological order
        inside = torch.zeros(len(self) + 1, dtype=torch.bool)
        inside[node + 1] = True
        for i, p in enumerate(self.parents.tolist()):
            if inside[p + 1] and i != node:
                inside[i + 1] = True
                below.append(i)
        return self._keep(torch.tensor(below[1:], dtype=torch.long)) if len(below) > 1 else DraftTree.empty()

    def _keep(self, keep: torch.Tensor) -> "DraftTree":
        """The nodes `keep` (ascending), renumbered; a node whose parent is not kept hangs below the root."""
        remap = torch.full((len(self) + 1,), -1, dtype=torch.long)
        remap[keep + 1] = torch.arange(keep.shape[0])
        q = None if self.q is None else self.q[keep]
        return DraftTree(self.tokens[keep], remap[self.parents[keep] + 1], q)


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[n] depth of each node; children of the root have depth 1."""
    out = torch.zeros(parents.shape[0], dtype=torch.long)
    for i, p in enumerate(parents.tolist()):
        out[i] = 1 if p < 0 else out[p] + 1
    return out


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[n+1, n+1] bool, root included as row/col 0: mask[i, j] is True when j is i or an ancestor of i.

    This is the tree attention mask: each node attends to the root, its ancestors and itself."""
    n = parents.shape[0]
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents.tolist()):
        row = i + 1
        mask[row] = mask[p + 1]
        mask[row, row] = True
    return mask


def children(parents: torch.Tensor) -> list[list[int]]:
    """children[j + 1] lists the nodes whose parent is j (children[0]: the root's), in node order."""
    out: list[list[int]] = [[] for _ in range(parents.shape[0] + 1)]
    for i, p in enumerate(parents.tolist()):
        out[p + 1].append(i)
    return out
