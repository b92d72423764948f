"""The draft distribution q of a sampled draft, held over a small support: what a sampled draft
carries to verification, over the wire or not.

Verification accepts a sampled draft token x with probability min(1, p(x) / q(x)) (verify.py),
which keeps the target distribution only if q is exactly the distribution x was drawn from. A draft
samples not from its model's whole warped distribution (V float32 values a node) but from a
truncation of it (`SparseQ.truncate`): its top_k likeliest tokens, cut to the smallest prefix of
them whose mass reaches top_p of theirs, renormalised and rounded to float16. Those token ids
(int32 on the wire) and 16-bit weights are a node's whole q; a token whose weight rounds to 0 is
outside the support.
Exactness: the draft samples from the float16 weights themselves, normalised by `normalise`, which
gives the same float32 values on every device and in any summation order (see there). So the q
that verification reads is, bit for bit, the q the draft sampled from; truncating costs acceptance
(the draft mass it drops), never losslessness. Sizes on the wire: docs/protocol.md; why float16:
docs/lossless.md#greedy-sampling-and-late-drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def normalise(weights: torch.Tensor) -> torch.Tensor:
    """[..., K] float16 weights -> [..., K] float32 probabilities, each row over its sum.

    Every float16 is a whole multiple of 2^-24 below 2^16, so up to 2^13 of them add up in float64
    with no rounding at all, whatever the order or the device; the quotient is then rounded once (IEEE
    division and the cast to float32 are correctly rounded everywhere). The draft samples from these
    values and verification reads them: the same bits on both sides of the wire."""
    w = weights.double()
    return (w / w.sum(-1, keepdim=True)).float()


@dataclass(eq=False)
class SparseQ:
    """q of n sampled draft nodes, row i over its own support: q_i(ids[i, k]) = probs[i, k] (slots
    that repeat a token add up; a slot of weight 0 is outside the support).

    ids:     [n, K] int64 token ids
    weights: [n, K] float16 >= 0, each row with a positive sum: the stored form, sent on the wire
    probs:   [n, K] float32, normalise(weights): the distribution itself
    """

    ids: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor = field(init=False)

    def __post_init__(self):
        if self.ids.ndim != 2 or self.weights.shape != self.ids.shape:
            raise ValueError(f"ids {tuple(self.ids.shape)} and weights {tuple(self.weights.shape)} must be [n, K]")
        if self.weights.dtype != torch.float16:
            raise ValueError(f"weights are float16, not {self.weights.dtype}")
        self.probs = normalise(self.weights)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, rows: torch.Tensor) -> SparseQ:
        """The rows `rows` ([m] indices), as a q of m nodes."""
        return SparseQ(self.ids[rows], self.weights[rows])

    def to(self, device: str | torch.device) -> SparseQ:
        if self.ids.device == torch.device(device):
            return self
        return SparseQ(self.ids.to(device), self.weights.to(device))

    def prob_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n] tokens -> [n] float32: q_i(tokens[i]), each node's probability of a token of its own."""
        hit = self.ids == tokens.to(self.ids.device)[:, None]
        return (self.probs * hit).sum(-1)

    def row(self, node: int, vocab: int) -> torch.Tensor:
        """q_node over the whole vocabulary: [vocab] float32 on q's device (one row, where a rejection needs it)."""
        return torch.zeros(vocab, device=self.ids.device).scatter_add_(0, self.ids[node], self.probs[node])

    def dense(self, vocab: int) -> torch.Tensor:
        """Every row over the whole vocabulary: [n, vocab] float32."""
        return torch.zeros(len(self), vocab, device=self.ids.device).scatter_add_(1, self.ids, self.probs)

    @classmethod
    def truncate(cls, probs: torch.Tensor, top_k: int, top_p: float) -> SparseQ:
        """[n, V] warped draft distributions -> the q a sampled draft draws from: each row's top_k
        likeliest tokens (likeliest first), those past the smallest prefix whose mass reaches top_p
        of theirs weighted 0, renormalised and rounded to float16. [n, min(top_k, V)]."""
        top = probs.float().topk(min(top_k, probs.shape[-1]), dim=-1)
        kept = top.values
        mass_before = kept.cumsum(-1) - kept
        kept = kept.masked_fill(mass_before >= top_p * kept.sum(-1, keepdim=True), 0.0)  # the first always stays
        return cls(top.indices, (kept / kept.sum(-1, keepdim=True)).half())

    @classmethod
    def cat(cls, parts: list[SparseQ]) -> SparseQ:
        """The rows of `parts` (one width) in order, less the trailing slots that every row leaves at
        weight 0 (a truncated row holds its support first: a top_p cut leaves fewer tokens to send)."""
        ids = torch.cat([q.ids for q in parts])
        weights = torch.cat([q.weights for q in parts])
        used = (weights > 0).any(0).nonzero()
        width = int(used[-1]) + 1 if len(used) else 0
        return cls(ids[:, :width], weights[:, :width])
