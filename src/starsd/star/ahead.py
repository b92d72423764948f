"""Pre-drafting: the draft server's idle time put to work.

Below N_full the draft server waits while its targets verify. While no request is queued, each
waiting session's most likely next request is drafted ahead: its last draft accepted whole, and
the target's next token (the bonus) equal to the draft model's own best guess after it. One batched
draft one level deeper than the session's does both: its first level is the bonus guess, the
levels below it the next draft. The result waits on the session with the outcome it assumed. A
request carrying exactly those tokens is answered at once from it; any other is drafted as usual
and the pre-draft is dropped. Real requests come first: a pre-draft yields at the next level
boundary when a request arrives, and runs on a few sessions at a time (ROWS), so that a level, and
the delay it can add to a request, stays short. It does not start while the server has been busy
more than MAX_BUSY of the last LOOKBACK_S seconds: past N_full the gaps between batches are too
short to use, and a pre-draft would only delay the next batch.

The pre-draft runs on a copy of the session's draft state, so a miss costs nothing but the idle
time it used. After a hit the bonus guess is a drafted node, not yet committed: it is carried
(`Session.carry`) in front of the tokens of the next request. Chains only (top_k 1, not sampled):
their likeliest outcome is one path. Losslessness is untouched: the target verifies every token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from starsd.config import MAX_DRAFT_DEPTH
from starsd.models.drafter import DraftJob, Drafter, DraftSequence

ROWS = 2  # sessions pre-drafted together
LOOKBACK_S = 2.0
MAX_BUSY = 0.8  # of the last LOOKBACK_S seconds spent drafting: beyond it, no pre-drafting


@dataclass
class Ahead:
    """A session's pre-draft: the request tokens it assumed, the draft state as if they had come
    (all but the bonus guess committed), and the chain drafted below the bonus guess."""

    expect: list[int]
    seq: DraftSequence
    chain: list[int]


def eligible(s) -> bool:
    """A session whose next request can be pre-drafted: a chain session with draft state, no
    pre-draft yet, and tokens to start from."""
    return (s.seq is not None and s.ahead is None and s.draft is not None and s.draft.top_k == 1
            and not s.draft.sample and bool(s.carry or s.last_chain))


def predraft(drafter: Drafter, sessions: list, stop=None) -> None:
    """Pre-draft these sessions in one batch (Interrupted propagates from `stop`, leaving them as
    they were). A pre-draft too short to answer with is kept too, so that it is not redone."""
    copies = [s.seq.clone() for s in sessions]
    jobs = [DraftJob(c, s.carry + s.last_chain, dataclasses.replace(s.draft, depth=min(s.draft.depth + 1, MAX_DRAFT_DEPTH)),
                     s.sampling, given=1) for s, c in zip(sessions, copies)]  # the bonus guess: as if committed
    trees = drafter.propose_batch(jobs, stop)
    for s, c, tree in zip(sessions, copies, trees):
        tokens = tree.tokens.tolist()
        s.ahead = Ahead(s.last_chain + tokens[:1], c, tokens[1:])


def answer(s, tokens: list[int], reset: bool) -> list[int] | None:
    """The pre-drafted chain if this request brings the tokens the session's pre-draft assumed (the
    session then takes that draft state); None otherwise. Either way the pre-draft is used up."""
    a, s.ahead = s.ahead, None
    if a is None or reset or not a.chain or tokens != a.expect:
        return None
    s.seq = a.seq
    s.carry = a.expect[-1:]
    return a.chain
