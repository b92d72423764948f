"""The target backend: the model whose distribution the output must follow.

A TargetSequence holds one generation stream. Its KV cache covers every token but the last, the
*pending* token, which is the root of the next draft tree: one forward pass over
[pending] + tree nodes scores the whole draft (tree attention), and `commit` keeps only the
accepted path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from starsd.models import forward as fw
from starsd.spec.tree import DraftTree, ancestor_mask, depths
from starsd.spec.verify import Verdict


@dataclass
class TargetSequence:
    tokens: list[int]  # prompt + generated; the cache covers tokens[:-1]
    cache: object
    scored: int = 0  # nodes of the last scored tree, still in the cache until commit
    hidden: torch.Tensor | None = field(default=None, repr=False)  # [n+1, H] of the last score, if asked


class TargetModel:
    def __init__(self, model: torch.nn.Module):
        self.model = model

    @property
    def device(self) -> torch.device:
        return fw.device_of(self.model)

    def start(self, prompt_ids: list[int]) -> TargetSequence:
        """Prefill the prompt (all but its last token, which becomes the pending root)."""
        seq = TargetSequence(list(prompt_ids), fw.new_cache(self.model))
        body = torch.tensor(prompt_ids[:-1], dtype=torch.long)
        if body.numel():
            m = body.shape[0]
            fw.forward(self.model, seq.cache, body, torch.arange(m), torch.ones(m, m).tril().bool())
        return seq

    def score(self, seq: TargetSequence, tree: DraftTree, want_hidden: bool = False) -> torch.Tensor:
        """Target logits after the root and after each node: [n+1, V] float32, in one forward pass."""
        if seq.scored:
            raise RuntimeError("score() called twice without commit()")
        past = fw.cache_len(seq.cache)
        n = len(tree)
        tokens = torch.cat([torch.tensor([seq.tokens[-1]]), tree.tokens])
        positions = past + torch.cat([torch.zeros(1, dtype=torch.long), depths(tree.parents)])
        attend = torch.cat([torch.ones(n + 1, past, dtype=torch.bool), ancestor_mask(tree.parents)], dim=1)
        try:
            hidden = fw.forward(self.model, seq.cache, tokens, positions, attend)
        except BaseException:  # a pass that fails part-way leaves some layers longer: cut them back
            fw.truncate(seq.cache, past)
            raise
        seq.scored = n
        seq.hidden = hidden if want_hidden else None
        return fw.lm_head(self.model, hidden)

    def commit(self, seq: TargetSequence, verdict: Verdict) -> None:
        """Keep the root and the accepted path in the cache; the last emitted token becomes pending."""
        root = fw.cache_len(seq.cache) - seq.scored - 1
        kept = root + 1 + torch.tensor(verdict.path, dtype=torch.long)
        fw.keep_positions(seq.cache, root + 1, kept)
        seq.tokens.extend(verdict.tokens)
        seq.scored = 0
