"""Pre-drafting: the draft server's idle time put to work.

While no request is queued, the likeliest *outcomes* of each waiting session's last chain are
drafted ahead, each as the request it would bring:
- accepted whole, with the draft's own guess of the bonus token: a draft a level deeper, led by it;
- rejected at position j, the target's token being the draft's runner-up there (DraftJob.second).
They go one batch of ROWS at a time, the likeliest first over every idle session (ranked by
`observe`), OUTCOMES a session at most; sessions whose requests come together (`together`: an
engine's rows, DraftRequest.more) get each one's likeliest in one batch (COHORT_ROWS at most). Each
is as deep as the session's last request, plus one level. A request bringing exactly an outcome's
tokens is answered from it at once; any other is drafted as usual. Real requests come first: a
pre-draft stops at the next level when one arrives (its levels answer a request asking at most twice
as deep), and none starts while the server was busy more than MAX_BUSY of the last LOOKBACK_S
seconds. Each runs on a copy of the session's draft state (a miss costs only idle time); a whole
chain's bonus guess, not yet committed, is carried (`Session.carry`) before the next request's
tokens. Chains only (top_k 1, not sampled).
Figures and what was tried: docs/scheduler.md#pre-draftings-outcomes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from starsd.config import MAX_DRAFT_DEPTH
from starsd.models.drafter import DraftJob, Drafter, DraftSequence

ROWS = 1  # pre-drafts batched together, over all sessions
COHORT_ROWS = 4  # pre-drafts batched together, over sessions whose requests come together
OUTCOMES = 4  # pre-drafts per session at most
LOOKBACK_S = 2.0
MAX_BUSY = 0.8  # of the last LOOKBACK_S seconds spent drafting: beyond it, no pre-drafting
DECAY = 0.95  # of a session's tally of outcomes, per request


@dataclass
class Outcome:
    """A pre-drafted next request: the draft state as if its tokens had come (all but `carry`
    committed), and the chain drafted below them with each level's runner-up."""

    short: int  # tokens short of the whole chain it assumed
    cut: bool  # ended early for a request that came: its chain may be shallower than the session asks
    seq: DraftSequence
    carry: list[int]
    chain: list[int]
    second: list[int]


def observe(s, tokens: list[int]) -> None:
    """Tally how many tokens short of the session's last chain a request's accepted ones came (the
    request: the accepted tokens, then the target's own)."""
    accepted = len(tokens) - 1
    if not s.last_chain or accepted > len(s.last_chain) or tokens[:-1] != s.last_chain[:accepted]:
        return
    short = len(s.last_chain) - accepted
    s.shortfall = [w * DECAY for w in s.shortfall] + [0.0] * (short + 1 - len(s.shortfall))
    s.shortfall[short] += 1.0


def eligible(s) -> bool:
    """A session whose next request can be pre-drafted: a chain session with draft state, tokens to
    start from, and fewer than OUTCOMES pre-drafts."""
    return (s.seq is not None and len(s.ahead or ()) < OUTCOMES and s.draft is not None and s.draft.top_k == 1
            and not s.draft.sample and bool(s.carry or s.last_chain))


def plan(sessions: list, rows: int = ROWS) -> list[tuple]:
    """The outcomes to pre-draft next, (session, tokens short of its whole chain), `rows` at most,
    none drafted already: each session's likeliest by its tally (with none, the whole chain first
    and then ever shorter), every session's first before any session's second, and so on (the
    likelier first among those)."""
    options = []
    for s in sessions:
        total = sum(s.shortfall)
        done = {o.short for o in (s.ahead or {}).values()}
        mine = []
        for short in range(len(s.last_chain) + 1):
            if short in done or short and len(s.last_second) < len(s.last_chain) - short + 1:
                continue  # drafted, or no runner-up known where the chain would break
            seen = s.shortfall[short] / total if short < len(s.shortfall) and total else 0.0
            mine.append((-seen, short))
        options += [(rank, *o, id(s), s) for rank, o in enumerate(sorted(mine), start=len(done))]
    return [(s, short) for _, _, short, _, s in sorted(options, key=lambda o: o[:4])[:rows]]


def together(sessions: list, s) -> list:
    """The sessions whose last requests came in one batch of their sender's with s's (s among them)."""
    return [c for c in sessions if c.group == s.group]


def cohort_plan(sessions: list) -> list[tuple]:
    """The next batch of pre-drafts: the likeliest outcome over every session (plan), and the likeliest of
    each session whose requests came with its session's, COHORT_ROWS at most."""
    first = plan(sessions)
    if not first:
        return []
    s0 = first[0][0]
    others = [o for c in together(sessions, s0) if c is not s0 for o in plan([c])]
    return first + others[:COHORT_ROWS - 1]


def predraft(drafter: Drafter, todo: list[tuple], stop=None) -> bool:
    """Pre-draft these (session, short) outcomes in one batch, ending it at the level boundary where
    `stop()` says a request came; say whether it did. A session's pre-drafts wait on it, keyed by
    the tokens their request would bring, each as far as it got; one too short to answer with is
    kept too, so that it is not redone."""
    cut = []

    def halt() -> bool:
        if stop is not None and stop():
            cut.append(True)
            return True
        return False

    jobs, keys = [], []
    for s, short in todo:
        keep = len(s.last_chain) - short
        copy = s.seq.clone()
        if short == 0:  # the bonus guess, as if committed, is the first level
            jobs.append(DraftJob(copy, s.carry + s.last_chain,
                                 dataclasses.replace(s.draft, depth=min(s.draft.depth + 1, MAX_DRAFT_DEPTH)),
                                 s.sampling, max_depth=s.budget + 1, given=1))
        else:  # the runner-up where the chain breaks, ingested
            jobs.append(DraftJob(copy, s.carry + guess(s, keep), s.draft, s.sampling, max_depth=s.budget))
        keys.append((s, short, keep))
    trees = drafter.propose_batch(jobs, halt)
    for (s, short, keep), job, tree in zip(keys, jobs, trees):
        tokens = tree.tokens.tolist()
        s.ahead = s.ahead or {}
        if short == 0:
            s.ahead[tuple(s.last_chain + tokens[:1])] = Outcome(0, bool(cut), job.seq, tokens[:1], tokens[1:],
                                                                 job.second[1:])
        else:
            s.ahead[tuple(guess(s, keep))] = Outcome(short, bool(cut), job.seq, [], tokens, job.second)
    return bool(cut)


def guess(s, keep: int) -> list[int]:
    """The tokens a request brings if the target accepts the first `keep` of the session's last chain
    and its own token there is the draft's runner-up."""
    return s.last_chain[:keep] + [s.last_second[keep]]


def answer(s, tokens: list[int], budget: int, reset: bool) -> Outcome | None:
    """The pre-draft of this request's outcome if there is one with a chain (the session then takes
    its draft state), and, if it was cut short, at least half as deep as the request asks (`budget`
    less one): a request answered at once with a shallower chain than it asked can still pay, but
    not with a much shallower one. None otherwise. Either way the session's pre-drafts are used up."""
    outcomes, s.ahead = s.ahead, None
    o = None if reset or not outcomes else outcomes.get(tuple(tokens))
    if o is None or not o.chain or o.cut and 2 * len(o.chain) < budget - 1:
        return None
    s.seq = o.seq
    s.carry = o.carry
    return o
