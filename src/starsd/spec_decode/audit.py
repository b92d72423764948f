"""Greedy output audited token by token against the engine's own target-only decoding.

An engine whose batched and single-token kernels round differently (llama.cpp) may verify a draft to
a token that target-only decoding, one token a pass, would not pick: where the top two logits are
closer than that rounding. The audit walks the emitted tokens with one-token passes, as target-only
decoding does, and at every position compares the emitted token with the pass's argmax. A
divergence is excused only at a *near-tie*: the emitted token's logit within the *allowance* of the
argmax's. The allowance is measured on these same tokens: the most that the engine's batched passes
(of `nodes` tokens, a verification's size) moved the margin between a position's argmax and any of
its runners-up (its top CANDIDATES) from what the one-token pass gave. After a near-tie the walk
goes on from the emitted token, so nothing after it goes unexamined. An engine whose kernels agree
gets an allowance of 0: any divergence fails.
"""

from __future__ import annotations

from typing import Callable

import torch

from starsd.spec_decode.tree import DraftTree
from starsd.spec_decode.verify import Verdict

CANDIDATES = 8  # the tokens a position's margins are measured between: its top ones, one-token pass

# the token emitted at a position, from that position, the tokens before it and the pass's logits
Chooser = Callable[[int, list[int], torch.Tensor], "int | None"]


def batched_logits(target, prompt_ids: list[int], tokens: list[int], nodes: int) -> list[torch.Tensor]:
    """The engine's logits at each position of `tokens` (row i: after prompt + tokens[:i]), scored in
    passes of `nodes` tokens: the root and a chain of the next nodes - 1, all accepted."""
    seq = target.start(prompt_ids)
    rows: list[torch.Tensor] = []
    while len(rows) < len(tokens):
        at = len(rows)
        chain = tokens[at:at + nodes - 1][:len(tokens) - at - 1]
        logits = target.score(seq, DraftTree.chain(chain))
        rows.extend(logits[i] for i in range(len(chain) + 1))
        target.commit(seq, Verdict(list(range(len(chain))), tokens[at:at + len(chain) + 1]))
    return rows[:len(tokens)]


def walk(target, prompt_ids: list[int], choose: Chooser, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Up to n tokens, each `choose`n after a one-token pass, as target-only decoding makes them;
    with the pass's logits. Stops where `choose` gives None."""
    seq = target.start(prompt_ids)
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    while len(tokens) < n:
        logits = target.score(seq, DraftTree.empty())[0]
        token = choose(len(tokens), tokens, logits)
        if token is None:
            break
        rows.append(logits)
        tokens.append(token)
        target.commit(seq, Verdict([], [token]))
    return tokens, rows


def audit(target, prompt_ids: list[int], emitted: list[int], nodes: int, n: int,
          eos_ids: frozenset[int] = frozenset(), choose: Chooser | None = None) -> dict:
    """Every emitted token against the argmax of the engine's one-token pass at its context.

    emitted: the greedy output to audit (or, with `choose`, the tokens that choice follows, found by
             the walk itself); nodes: tokens scored in one verification pass; n: the token budget.
    Returns {"allowance", "divergences": [{"position", "margin", "near_tie"}], "ok"}: ok when every
    divergence is a near-tie and the output ends at an EOS or at n tokens.
    """
    if choose is None:
        def choose(i: int, before: list[int], logits: torch.Tensor) -> int | None:
            return emitted[i] if i < len(emitted) else None
    tokens, single = walk(target, prompt_ids, choose, n)
    batched = batched_logits(target, prompt_ids, tokens, max(2, nodes)) if tokens else []
    allowance = max((moved(s, b) for b, s in zip(batched, single)), default=0.0)
    divergences = []
    for i, (token, logits) in enumerate(zip(tokens, single)):
        best = int(logits.argmax())
        if token != best:
            margin = float(logits[best] - logits[token])
            divergences.append({"position": i, "margin": round(margin, 4), "near_tie": margin <= allowance})
    ended = len(tokens) == n or bool(tokens) and tokens[-1] in eos_ids
    return {"allowance": round(allowance, 4), "divergences": divergences, "tokens": tokens,
            "ok": ended and all(d["near_tie"] for d in divergences)}


def moved(single: torch.Tensor, batched: torch.Tensor) -> float:
    """How far a batched pass moved the margins between the one-token pass's argmax and its runners-up."""
    top = single.topk(CANDIDATES).indices
    margins = single[top[0]] - single[top[1:]], batched[top[0]] - batched[top[1:]]
    return float((margins[0] - margins[1]).abs().max())


def following(text: str, decode: Callable[[list[int]], str], width: int = 8) -> Chooser:
    """A chooser that follows a served text: the highest-logit token (of the top `width`) whose
    decoding keeps the tokens so far a prefix of `text` and adds to it (or, the argmax only, adds
    nothing: a special token the text leaves out); None where no token does."""
    def choose(i: int, before: list[int], logits: torch.Tensor) -> int | None:
        done = len(decode(before).rstrip("\ufffd"))
        top = logits.topk(width).indices.tolist()
        for token in top:
            piece = decode(before + [token]).rstrip("\ufffd")  # a token may end inside a character
            if text.startswith(piece) and (len(piece) > done or token == top[0] and len(piece) == done):
                return token
        return None
    return choose


def in_words(found: dict) -> str:
    """An audit in words, labelled with its "mode" and "prompt": where the output parts from one-token
    decoding, each margin, and the allowance."""
    parts = ", ".join(f"at {d['position']} margin {d['margin']}" for d in found["parts"])
    verdict = "near-ties" if found["ok"] else "NOT LOSSLESS"
    return f"{found['mode']} {found['prompt']}: {parts or 'ends early'} (allowance {found['allowance']}, {verdict})"
