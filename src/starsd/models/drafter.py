"""The drafter backend: a small LM that proposes a chain or a top-k token tree.

A DraftSequence's KV cache covers exactly its *committed* tokens, the sequence the target has
accepted so far. `propose` first ingests the tokens committed since the last draft (the accepted
path and the recovered/bonus token: this is how rejected draft tokens are rolled back), then
expands a tree on top of the cache and finally drops the tree's entries again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from starsd.config import DraftConfig, SamplingConfig
from starsd.models import forward as fw
from starsd.tree import DraftTree
from starsd.verify import sample, warp


@dataclass
class DraftSequence:
    tokens: list[int]  # committed tokens; the cache covers tokens[:cached]
    cache: object
    cached: int = 0


@dataclass
class _Node:
    token: int
    parent: int  # index into the candidate list, -1 for the root
    score: float  # cumulative draft log-probability of the path
    depth: int
    slot: int = -1  # cache position once the node has been fed to the model


class Drafter:
    def __init__(self, model: torch.nn.Module):
        self.model = model

    def start(self, prompt_ids: list[int]) -> DraftSequence:
        if not prompt_ids:
            raise ValueError("empty prompt: at least one token is needed to condition on")
        return DraftSequence(list(prompt_ids), fw.new_cache(self.model))

    def propose(self, seq: DraftSequence, new_tokens: list[int], cfg: DraftConfig,
                sampling: SamplingConfig, generator: torch.Generator | None = None) -> DraftTree:
        """Append `new_tokens` to the committed sequence and draft a tree below its last token."""
        seq.tokens.extend(new_tokens)
        root_logits = self._ingest(seq)
        if cfg.sample:
            tree = self._sampled_chain(seq, root_logits, cfg.depth, sampling, generator)
        else:
            tree = self._top_k_tree(seq, root_logits, cfg)
        fw.truncate(seq.cache, seq.cached)
        return tree

    def _ingest(self, seq: DraftSequence) -> torch.Tensor:
        """Feed the committed tokens the cache lacks; return the logits after the last one: [V]."""
        past, total = seq.cached, len(seq.tokens)
        fresh = torch.tensor(seq.tokens[past:total], dtype=torch.long)
        m = fresh.shape[0]
        attend = torch.cat([torch.ones(m, past, dtype=torch.bool), torch.ones(m, m).tril().bool()], dim=1)
        logits, _ = fw.forward(self.model, seq.cache, fresh, past + torch.arange(m), attend)
        seq.cached = total
        return logits[-1]

    def _feed(self, seq: DraftSequence, nodes: list[_Node], batch: list[int]) -> torch.Tensor:
        """Feed tree nodes `batch` (indices into nodes) in one pass: [len(batch), V] logits."""
        past = fw.cache_len(seq.cache)
        m = len(batch)
        attend = torch.zeros(m, past + m, dtype=torch.bool)
        attend[:, :seq.cached] = True
        for row, i in enumerate(batch):
            nodes[i].slot = past + row
            attend[row, past + row] = True
            a = nodes[i].parent
            while a >= 0:
                attend[row, nodes[a].slot] = True
                a = nodes[a].parent
        tokens = torch.tensor([nodes[i].token for i in batch])
        positions = torch.tensor([seq.cached - 1 + nodes[i].depth for i in batch])
        logits, _ = fw.forward(self.model, seq.cache, tokens, positions, attend)
        return logits

    def _top_k_tree(self, seq: DraftSequence, root_logits: torch.Tensor, cfg: DraftConfig) -> DraftTree:
        """EAGLE-2 style: expand the top_k best frontier nodes per level, keep the best total."""
        nodes: list[_Node] = []
        frontier = self._expand(nodes, [-1], root_logits[None], cfg.top_k)
        for _ in range(cfg.depth - 1):
            logits = self._feed(seq, nodes, frontier)
            frontier = self._expand(nodes, frontier, logits, cfg.top_k)
        # Re-rank every candidate by its path score. A child never outscores its parent and a stable
        # sort keeps parents (created first) ahead of children on ties, so the kept set is a tree.
        order = sorted(range(len(nodes)), key=lambda i: -nodes[i].score)[: cfg.max_nodes]
        kept = sorted(order)
        index = {old: new for new, old in enumerate(kept)}
        tokens = torch.tensor([nodes[i].token for i in kept], dtype=torch.long)
        parents = torch.tensor([index[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in kept],
                               dtype=torch.long)
        return DraftTree(tokens, parents)

    @staticmethod
    def _expand(nodes: list[_Node], parents: list[int], logits: torch.Tensor, k: int) -> list[int]:
        """Add the top-k children of each parent as candidates; return the k best new ones to expand."""
        logp = logits.float().log_softmax(-1)
        top = logp.topk(k, dim=-1)
        first = len(nodes)
        for row, p in enumerate(parents):
            base = 0.0 if p < 0 else nodes[p].score
            depth = 1 if p < 0 else nodes[p].depth + 1
            for lp, tok in zip(top.values[row].tolist(), top.indices[row].tolist()):
                nodes.append(_Node(tok, p, base + lp, depth))
        new = range(first, len(nodes))
        return sorted(new, key=lambda i: -nodes[i].score)[:k]

    def _sampled_chain(self, seq: DraftSequence, root_logits: torch.Tensor, depth: int,
                       sampling: SamplingConfig, generator: torch.Generator | None) -> DraftTree:
        """A chain whose tokens are sampled from q = warp(draft logits); q travels with the draft."""
        nodes: list[_Node] = []
        qs, logits = [], root_logits
        for d in range(depth):
            q = warp(logits, sampling)
            qs.append(q)
            nodes.append(_Node(sample(q, generator), d - 1, 0.0, d + 1))
            if d + 1 < depth:
                logits = self._feed(seq, nodes, [d])[0]
        return DraftTree.chain([n.token for n in nodes], torch.stack(qs))
