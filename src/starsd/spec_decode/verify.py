"""Speculative sampling: the math that makes speculative decoding lossless. Pure tensor code.

Vocabulary (one verify step of one sequence):
- draft tree: the nodes the drafter proposed below the root (see `tree.py`); a chain is a tree.
- target distribution p: the target's warped next-token distribution after the root and after
  every node, from ONE forward pass over root + tree.
- accepted tokens: the path of draft nodes that verification keeps, from the root downwards.
- recovered token: on a rejection, a token sampled from the residual norm(max(0, p - q)), in the
  rejected draft token's place.
- bonus token: when the path ends at a leaf (or the draft is empty), a token sampled from p there.
Every step therefore emits len(accepted) + 1 tokens.
The rule (Leviathan et al. 2023, Chen et al. 2023) accepts a draft token x drawn from q with
probability min(1, p(x) / q(x)), so the output is distributed exactly as p. A node's children are
tried in turn, the residual replacing p after each rejection (SpecInfer). A deterministically
chosen candidate (top-k, argmax) has q = one-hot: it is accepted with probability p(x), and the
residual is p with x removed, which keeps p for any set of distinct siblings. A sampled token's q
is the draft's own truncated distribution, in the 16-bit values it was drawn from (sparse_q.py).
Greedy decoding (temperature 0) is exact argmax matching, so it equals target-only greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from starsd.config import SamplingConfig
from starsd.spec_decode.tree import DraftTree, children


def warp(logits: torch.Tensor, s: SamplingConfig) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities of the sampling distribution s.

    Temperature first, then top-k, then top-p (the order of target-only sampling in every
    engine). Greedy (temperature 0) gives the one-hot of the argmax."""
    logits = logits.float()
    if s.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # The largest logit at 0 first: a tiny temperature sends the others to -inf, not the largest to
    # +inf (a NaN softmax). A temperature under 1e-20 counts as 1e-20 (float32 has no number below
    # 1.4e-45, so 1e-300 would divide by 0): the same distribution, but for logits that lie within
    # about 1e-18 of the largest, which then stay ties.
    logits = (logits - logits.amax(-1, keepdim=True)) / max(s.temperature, 1e-20)
    if 0 < s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if s.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = mass_before >= s.top_p
        drop_sorted[..., 0] = False  # the first token is always kept, even where top_p rounds to 0 in float32
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from [V] probabilities (need not be normalised); `generator` on probs' device."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def next_token(logits: torch.Tensor, s: SamplingConfig, generator: torch.Generator | None) -> int:
    """Target-only decoding: the next token from [V] logits."""
    if s.greedy:
        return int(logits.argmax(-1).item())
    return sample(warp(logits, s), generator)


def make_generator(seed: int, device: str | torch.device) -> torch.Generator:
    """A seeded generator on `device`: it must live where the tensors it draws for live."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass
class Verdict:
    """The outcome of verifying one draft tree.

    path:   accepted node indices from the root downwards (len = number of accepted draft tokens)
    tokens: the accepted draft tokens followed by the recovered or bonus token (len(path) + 1)
    """

    path: list[int]
    tokens: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def verify(tree: DraftTree, target_logits: torch.Tensor, s: SamplingConfig,
           generator: torch.Generator | None) -> Verdict:
    """target_logits: [n+1, V], row 0 after the root, row i+1 after node i."""
    if s.greedy:
        return verify_greedy(tree, target_logits)
    return verify_stochastic(tree, warp(target_logits, s), generator)


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Verdict:
    """Follow the argmax of the target through the tree for as long as a child matches it."""
    best = target_logits.argmax(-1).tolist()  # [n+1]
    tokens = tree.tokens.tolist()
    kids = children(tree.parents)
    path: list[int] = []
    row = 0
    while True:
        match = next((c for c in kids[row] if tokens[c] == best[row]), None)
        if match is None:
            return Verdict(path, [tokens[c] for c in path] + [best[row]])
        path.append(match)
        row = match + 1


def verify_stochastic(tree: DraftTree, target_probs: torch.Tensor,
                      generator: torch.Generator | None) -> Verdict:
    """target_probs: [n+1, V] warped target distributions. Multi-round speculative sampling.
    `generator` must be on target_probs' device; tree.q is moved there, and a node's q is spread over
    the vocabulary only where a rejection needs its residual."""
    device = target_probs.device  # the generator lives here too; q may arrive from elsewhere (the wire)
    q = None if tree.q is None else tree.q.to(device)
    tokens = tree.tokens.tolist()
    q_own = [1.0] * len(tokens) if q is None else q.prob_of(tree.tokens).tolist()  # q of each node's token
    kids = children(tree.parents)
    path: list[int] = []
    row = 0
    while True:
        p = target_probs[row]
        accepted = None
        for c in kids[row]:
            x = tokens[c]
            u = float(torch.rand((), generator=generator, device=device))
            if u * q_own[c] < float(p[x]):  # accept with probability min(1, p(x) / q(x))
                accepted = c
                break
            p = residual(p, x, None if q is None else q.row(c, p.shape[-1]))
        if accepted is None:
            return Verdict(path, [tokens[c] for c in path] + [sample(p, generator)])
        path.append(accepted)
        row = accepted + 1


def residual(p: torch.Tensor, x: int, q: torch.Tensor | None) -> torch.Tensor:
    """norm(max(0, p - q)) after rejecting x; q None means one-hot on x. [V] -> [V]."""
    if q is None:
        r = p.clone()
        r[x] = 0.0
    else:
        r = (p - q).clamp_min(0.0)
    total = r.sum()
    if total <= 0:  # p <= q everywhere: rejection had probability 0, only rounding gets here
        return p
    return r / total
