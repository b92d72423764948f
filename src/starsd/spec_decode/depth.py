"""The draft depth of each step: speculate only as deep as it pays, and not at all when decoding alone
is faster. Per step a target decodes alone (one pass over one token) or waits draft_ms for a draft
asked d deep, verifies it in verify_ms and commits the accepted tokens and one more. The depth with
the most tokens per millisecond wins:

    rate(0) = 1 / verify_ms(1)
    rate(d) = (1 + accepted(d)) / (wait(levels(d)) + verify_ms(levels(d) + 1) + taken(levels(d)))

accepted(d) is the expected run of accepted tokens, levels(d) the levels such a draft is expected to
have (a chain may stop short by its own confidence), wait what the stream waits for it, taken a
co-hosted server's compute charged to the other targets on its cores. A draft pays only within

    deadline(d) = (1 + accepted(d)) * verify_ms(1) - verify_ms(levels(d) + 1)

`decide` is the rule, a pure function of a Situation: what the stream measured (estimates.py), where
its drafts come from (Source), the look schedule's turn. DepthPolicy learns and keeps the schedule.
The cases, with the runs behind each: docs/scheduler.md#the-depth-decision-as-one-rule.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

from starsd.spec_decode.estimates import Acceptance, Costs, server_costs

MAX_STOP = 0.95  # the highest chain stopping threshold stop() gives: a chain always drafts its first level
# A draft asked ahead that comes k tokens late is taken only if its first k levels are what the stream committed
# meanwhile: it is asked only where that is likelier than not (Situation.followed). Each one takes its server's
# time from the other streams' drafts: on an AMX Xeon, 32 replay targets on two servers asked 10 levels ahead at
# 1,932 steps of a run, several tokens late by the servers' own figures, with 14 taken; the servers, busy 96% of the
# time, answered late what was waited for
FOLLOWED = 0.5
# A draft waited for may miss its deadline: the step waits it out and verifies one token. The chance of that is
# the misses among the stream's drafts waited for over its last MISS_STEPS steps not paused (two hits assumed), and
# rate() weighs it: on an AMD EPYC, 32 replay targets on two servers waited for 1,248 drafts, 20% missed, and
# the misses' waits (750 ms each beyond the pass) cost more than the hits won (150 ms each)
MISS_STEPS = 128


@dataclass(frozen=True)
class Source:
    """Where a stream's drafts come from, as it stands at this step (the caller says it each step)."""

    inline: bool = False  # computed when asked and waited for, never ahead: in this process, or a server on its cores
    cohosted: bool = False  # the server computes on this host's cores: a draft asked ahead is not free
    neighbours: int = 0  # cohosted: the other targets on those cores, each slowed by a draft's compute too
    server_ms: float = 0.0  # a remote server's queue now, before a request's draft begins, as its replies say
    pace_ms: float = 0.0  # and its time per level of a draft (0: not known): d levels wait server_ms + d * pace_ms
    lateness: float = 1.0  # tokens the stream commits before a draft asked now can be used
    unsent: int = 0  # tokens of the stream the drafter does not hold: its next draft ingests them first
    ingest_ms: float = 0.0  # the drafter's time to ingest one such token (0: not known)
    holds: bool = False  # the drafter holds the stream's prompt (a draft of it was asked)
    stops: bool = False  # each chain stops where stop() says (DraftConfig.auto_stop): asked as deep as allowed


@dataclass(frozen=True)
class Decision:
    """One step's decision (decide), and what the look schedule must note of it."""

    depth: int = 0  # wait for a draft this deep (0: decode alone)
    deadline_ms: float = 0.0  # and at most this long
    ahead: int = 0  # ask a draft this deep without waiting for it (0: none)
    stop: float = 0.0  # the chain's min_path_prob, for a chain that stops where one more level no longer pays
    drafts: bool = False  # drafting pays this step by the stream's means, before any look
    look: str = ""  # the look beside the choice made this step: "", "none", "drafting", "probe", "catch-up", "alone",
    # "beside" (a catch-up leaves the look due: it is made at the next step, the drafter no longer lacking)
    late: str = ""  # asked ahead: "held" (the server is too slow: none), "probe" (one all the same), "timely"


@dataclass(frozen=True)
class Situation:
    """All the depth decision reads, frozen for one step. The estimates are read, never changed."""

    limit: int  # the deepest draft this step could use: the tokens the stream may still emit, less one
    source: Source
    max_depth: int
    verify_ms: Costs
    draft_ms: Costs
    share_ms: Costs  # a co-hosted server's compute on one draft, by levels
    acceptance: Acceptance
    reach: Acceptance  # whether a draft went on past each level where it was asked to
    onward: Acceptance  # the same, of drafts whose levels up to there were all accepted
    prefill_ms: float = 0.0  # the last prompt's prefill
    miss: float = 0.0  # the chance that a draft waited for misses its deadline (DepthPolicy.miss_chance)
    drawn: tuple[float, ...] | None = None  # one Thompson draw of each position's acceptance (how deep, and
    # whether a draft asked ahead is likely taken: a stream that measured little asks one now and then, and learns)
    paused: bool = False  # the schedule's turn: decode alone, a pause after missed deadlines
    second: bool = False  # the stream's second step
    due: bool = False  # a look beside a choice that drafts is due
    due_alone: bool = False  # a look at drafting, while decoding alone, is due
    turn: int = 0  # a look beside: 0 one level shallower, 1 one deeper
    late_due: bool = False  # a probe of a server too slow to ask ahead is due
    before_prefill: bool = False  # the step is a prompt's first, chosen before its prefill

    def expect(self, d: int, rates=None) -> tuple[float, float]:
        """(levels drafted, tokens accepted) expected of a draft asked d deep: it stops short of d at each
        level as often as the stream's drafts have, apart for drafts accepted so far (confident ones
        both run long and are accepted)."""
        go, on = self.means[1:]
        acc = rates or self.means[0]
        reached = run = 1.0  # P(level k drafted), P(levels 1..k drafted and accepted)
        levels = accepted = 0.0
        for k in range(min(d, self.max_depth)):
            if k:
                reached *= go[k - 1]
                run *= on[k - 1]
            run *= acc[k]
            levels += reached
            accepted += run
        return levels, accepted

    def followed(self, k: int, rates=None) -> float:
        """The chance that a draft asked now is still one of the stream once it has committed k tokens more
        (a draft k tokens late is used only then): its first k levels drafted, and each what it committed."""
        on = self.means[2]
        acc = rates or self.means[0]
        run = 1.0
        for j in range(k):
            if j >= self.max_depth:
                return 0.0
            run *= (on[j - 1] if j else 1.0) * acc[j]
        return run

    @cached_property
    def means(self) -> tuple[list[float], list[float], list[float]]:  # acceptance, reach, onward, by position
        return self.acceptance.rates(), self.reach.rates(), self.onward.rates()

    @cached_property
    def by_means(self) -> list[float]:  # rate(d) by the means, d = 0..max_depth: several rules weigh it
        return [self.rate(d) for d in range(self.max_depth + 1)]

    def rate(self, d: int, rates=None) -> float:
        """Expected tokens per millisecond of a draft asked d deep and waited for."""
        if d == 0:
            return 1.0 / max(self.verify_ms(1), 1e-6)
        levels, accepted = self.expect(d, rates)
        wait = self.draft_ms(levels) if self.source.inline else max(self.draft_ms(levels), self.server_wait(levels))
        hit = 1.0 - self.miss  # a miss waits out the deadline and verifies one token
        tokens = hit * (1.0 + accepted) + self.miss
        ms = hit * (wait + self.verify_ms(levels + 1) + self.taken(levels))
        if self.miss:
            ms += self.miss * (self.deadline_ms(d) + self.verify_ms(1))
        return tokens / max(ms, 1e-6)

    def server_wait(self, levels: float) -> float:
        """What a remote server's own word says a draft this deep waits now: its queue and its levels."""
        return self.source.server_ms + levels * self.source.pace_ms

    @cached_property
    def look_at(self) -> int:
        """The depth a look at drafting, while decoding alone, asks: the best by the means (0: none allowed)."""
        limit = min(self.limit, self.max_depth)
        return max(range(1, limit + 1), key=self.by_means.__getitem__) if limit >= 1 else 0

    def freed(self) -> bool:
        """Whether, by a remote server's own word, a look at the best draft could pay now, waited for."""
        d = self.look_at
        return not self.source.inline and d > 0 and self.could_pay(d) and self.could_pay(d, self.server_wait(d))

    def lacking(self) -> int:
        """Tokens the drafter lacks beyond a step's own (what was decoded alone since its last draft): its
        next draft ingests them first."""
        return self.source.unsent if self.source.unsent > self.max_depth + 1 else 0

    def taken(self, levels: float) -> float:
        """A co-hosted server's compute on a draft, as it slows each other target on its cores."""
        return self.source.neighbours * self.share_ms(levels) if self.source.cohosted else 0.0

    def here(self, d: int) -> float:
        """Expected tokens per millisecond of verifying a draft d deep that is already here."""
        if d == 0:
            return self.rate(0)
        return (1.0 + self.acceptance.expected(d, self.means[0])) / max(self.verify_ms(d + 1), 1e-6)

    def asked_ahead(self, d: int) -> float:
        """Expected tokens per millisecond of a draft asked ahead: no wait, but a co-hosted server's compute."""
        if d == 0 or not self.source.cohosted:
            return self.here(d)
        levels, accepted = self.expect(d)
        return (1.0 + accepted) / max(self.share_ms(levels) + self.verify_ms(levels + 1) + self.taken(levels), 1e-6)

    def deepest(self, value, limit: int | None = None) -> int:
        """The depth up to `limit` (this step's), 0 included, with the most tokens per millisecond by `value`."""
        limit = self.limit if limit is None else limit
        return max(range(max(0, min(limit, self.max_depth)) + 1), key=value)

    def could_pay(self, d: int, wait_ms: float = 0.0) -> bool:
        """Whether a draft d deep could beat decoding alone, all accepted, waiting `wait_ms` (and its compute here)."""
        src = self.source
        compute = self.share_ms(d) + self.taken(d) if src.cohosted else self.draft_ms(d) if src.inline else 0.0
        return (1.0 + d) / max(compute + wait_ms + self.verify_ms(d + 1), 1e-6) > self.rate(0)

    def catch_up_pays(self, d: int) -> bool:
        """Whether drafting d deep over the tokens the stream may still emit saves more than the
        drafter's ingest of the tokens it lacks beyond a step's own, where that compute is taken from
        this host's targets (each neighbour's too, of a co-hosted server's)."""
        src = self.source
        lacking = self.lacking()
        if not lacking or src.ingest_ms <= 0 or not (src.cohosted or src.inline):
            return True
        tokens = max(0, self.limit) + 1
        cost = lacking * src.ingest_ms * (1 + (src.neighbours if src.cohosted else 0))
        return tokens / self.rate(0) - tokens / self.rate(d) > cost

    def stop(self) -> float:
        """The path probability below which this step's chain stops: one more level pays while its chance
        of being accepted beats its cost (the slopes of the costs) in tokens at the stream's best rate."""
        more = self.draft_ms.slope() + self.verify_ms.slope() + (
            self.source.neighbours * self.share_ms.slope() if self.source.cohosted else 0.0)
        best = max(self.by_means)
        return min(MAX_STOP, max(0.0, more * best))

    def deadline_ms(self, d: int) -> float:
        """How long a draft d deep may take and still beat decoding alone (at least a pass), or twice its own
        expected time, though never more than twice the first: a draft that missed its deadline counts as
        taking it, and without the cap each miss in a row doubled the next wait (32 replay targets on two
        servers waited 1.6 s, then 3.2 s, for drafts that never came, at 230 ms a token alone)."""
        levels, accepted = self.expect(d)
        gain = (1.0 + accepted) * self.verify_ms(1) - self.verify_ms(levels + 1)
        pays = max(gain, self.verify_ms(1), 1.0)
        return max(pays, min(2.0 * self.draft_ms(d), 2.0 * pays))


def decide(s: Situation) -> Decision:
    """The rule: whether to draft, how deep, how long to wait, what to ask ahead."""
    src = s.source
    limit = max(0, min(s.limit, s.max_depth))
    pays = s.deepest(s.by_means.__getitem__)  # the best depth by the means (0: decoding alone)
    best = 0
    if not s.paused and pays:  # whether to draft: on the means, never gambled on
        # how deep: as deep as the chain's own stop lets it run, else by one draw of each position
        best = limit if src.stops else max(range(1, limit + 1), key=lambda d: s.rate(d, s.drawn))
        if (s.second or src.inline) and not s.verify_ms.measured(1):
            best = 0  # a one-token pass is what every draft is weighed against: measured first
        elif not s.catch_up_pays(best):
            best = 0
    drafts = best > 0
    look, probe = "", 0
    if not s.paused and limit > 0 and (s.due if drafts else s.due_alone):  # a look beside the choice
        look = "none"
        if not drafts:  # at the best draft, where it could pay and the drafter need not ingest for it
            d = s.look_at
            if s.could_pay(d) and (src.holds or not src.cohosted) and s.catch_up_pays(d):
                if src.inline or s.freed():
                    best, look = d, "drafting"
                else:  # no wait at this server could pay: a level asked ahead, its reply tells the server's queue
                    probe, look = 1, "probe"
        elif s.verify_ms.measured(1) < 3 or s.verify_ms.stale(1):
            best, look = 0, "alone"  # decoding alone, to compare with: measured little, or long ago
        elif not src.stops:  # the widths beside: one pass slowed once must not rule a width out
            best, look = (best - 1, min(limit, best + 1))[s.turn], "beside"
    ahead = 0  # a draft asked without waiting
    late = ""
    behind = None  # the tokens the stream commits before such a draft can be used (None: none is asked)
    # the server's own time on a draft asked ahead, the tokens it lacks ingested first (a prompt, at its first draft)
    wait = s.server_wait(min(s.limit, s.max_depth)) + (0.0 if src.inline else s.lacking() * src.ingest_ms)
    if s.before_prefill and not src.inline:  # a prompt's first draft: the prefill's time to come, and the
        if not (src.cohosted and not pays):  # prompt to ingest on a co-hosted server's cores
            behind = src.lateness - s.prefill_ms / max(s.verify_ms(1), 1e-6)
            wait -= s.prefill_ms
    elif not best and not src.inline:
        behind = src.lateness
    if behind is not None:  # as deep as pays with no wait, plus the tokens committed before it can be used
        cap = min(s.limit, s.max_depth)
        behind = max(1, math.ceil(behind))
        useful = 0 if probe else s.deepest(s.asked_ahead)
        late_by = max(behind, math.ceil(wait / max(s.verify_ms(1), 1e-6)))  # tokens committed before it comes
        if probe:
            ahead = min(probe, cap)
        elif useful and (not s.deepest(s.asked_ahead, cap - late_by) or s.followed(late_by, s.drawn) < FOLLOWED):
            ahead, late = (1, "probe") if s.late_due else (0, "held")  # too late to pay: a level now and then,
            # whose reply tells the server's queue (a deeper one costs the server more and tells no more)
        elif useful:
            ahead, late = min(useful + behind, cap), "timely"
    if s.before_prefill and best and not src.inline and not ahead:  # a stream that drafts needs the prompt
        ahead = 1  # ingested: asked now, the prefill hides it, and the first step takes its level if it has come
    if best and not src.inline and s.lacking() and not s.before_prefill:  # a remote drafter lacks what the
        # stream decoded alone since its last draft (or its prompt, where no first draft was asked): it ingests that
        # asked ahead, a level, and the draft waited for at the next step measures a draft, not an ingest; a look
        # stays due till then (a prompt's first draft, which ingests the prompt, is waited for and not counted as
        # a draft's cost: spec_decode/decode.py)
        return Decision(0, 0.0, 1, s.stop(), drafts, "catch-up" if look == "drafting" else look, "")
    return Decision(best, s.deadline_ms(best) if best else 0.0, ahead, s.stop(), drafts, look, late)


@dataclass
class DepthPolicy:
    """One stream's depth decisions: learns from its steps and keeps the look schedule; `decide` decides."""

    max_depth: int
    explore: int = 16  # steps between looks beside the choice
    acceptance: Acceptance = None
    reach: Acceptance = None  # whether a draft went on past each level where it was asked to
    onward: Acceptance = None  # the same, of drafts whose levels up to there were all accepted
    draft_ms: Costs = None
    verify_ms: Costs = None
    share_ms: Costs = None  # a co-hosted server's compute on one stream's draft, by levels
    rng: random.Random = field(default_factory=lambda: random.Random(0))  # the Thompson draws
    steps: int = 0
    since: int = 0  # steps since the last look beside the choice
    looks: int = 0  # looks beside a chosen depth so far (they take turns: shallower, deeper)
    idle_looks: int = 0  # looks in a row at drafting while decoding alone (each doubles the interval)
    probed: bool = False  # the last such look found the server too slow to wait for (a probe, asked ahead)
    paused: int = 0  # steps left to decode alone after a missed deadline
    misses: int = 0  # deadlines missed in a row (each doubles the next pause)
    late_asks: int = 0  # steps since the last draft asked ahead while the server was too slow for one
    late_probes: int = 0  # such asks in a row (each doubles the interval to the next)
    prefill_ms: float = 0.0  # the last prompt's prefill
    moves: int = 0  # the drafter's moves to another server, as of the last one followed
    looking: bool = False  # this step is a look at drafting while decoding alone (its draft waited for)
    waited: deque = field(default_factory=lambda: deque(maxlen=16))  # (step, missed) of the last drafts waited for

    def __post_init__(self):
        self.acceptance = self.acceptance or Acceptance(self.max_depth)
        self.reach = self.reach or Acceptance(self.max_depth, prior=1.0)  # until seen: every draft as deep as asked
        self.onward = self.onward or Acceptance(self.max_depth, prior=1.0)
        # Priors that make speculating look worth it until measured: drafts cheap, verify flat.
        draft_ms, share_ms = server_costs()
        self.draft_ms = self.draft_ms or draft_ms
        self.verify_ms = self.verify_ms or Costs(100.0)
        self.share_ms = self.share_ms or share_ms

    def situation(self, limit: int, source: Source = Source(), **turn) -> Situation:
        return Situation(limit, source, self.max_depth, self.verify_ms, self.draft_ms, self.share_ms,
                         self.acceptance, self.reach, self.onward, self.prefill_ms, self.miss_chance(), **turn)

    def miss_chance(self) -> float:
        """The chance that a draft waited for misses its deadline: the misses among those of the last
        MISS_STEPS steps, over their count plus two."""
        recent = [missed for step, missed in self.waited if self.steps - step < MISS_STEPS]
        return sum(recent) / (len(recent) + 2)

    def choose(self, limit: int, source: Source = Source(), before_prefill: bool = False) -> Decision:
        """This step's decision, at most `limit` deep; `before_prefill`: a prompt's first step, before its
        prefill (the draft asked ahead then is its first)."""
        paused = self.paused > 0
        if paused:
            self.paused -= 1
        else:
            self.steps += 1
            self.since += 1
        turn = dict(paused=paused, second=not paused and self.steps == 2, due=self.since >= self.explore,
                    due_alone=self.since >= self.explore << min(self.idle_looks, 4), turn=self.looks % 2,
                    late_due=self.late_asks + 1 >= self.explore << min(self.late_probes, 3),
                    before_prefill=before_prefill)
        if self.probed and not paused and not turn["due_alone"] and self.situation(limit, source).freed():
            turn["due_alone"] = True  # the server too slow at the last look says it could serve a look now: one
            # now, not up to 256 steps on (of two targets left by 30, one decoded alone for about 90 s after they went)
        drawn = tuple(self.acceptance.rates(self.rng))
        decision = decide(self.situation(limit, source, drawn=drawn, **turn))
        self.looking = decision.look == "drafting"
        if decision.drafts:
            self.idle_looks = 0
        if decision.look and decision.look != "catch-up":
            self.since = 0
        self.idle_looks += decision.look in ("drafting", "probe")
        if decision.look in ("drafting", "probe"):
            self.probed = decision.look == "probe"
        self.looks += decision.look == "beside"
        if decision.late == "held":
            self.late_asks += 1
        elif decision.late:
            self.late_asks = 0
            self.late_probes = self.late_probes + 1 if decision.late == "probe" else 0
        return decision

    def worth(self, limit: int) -> int:
        """How deep to verify a draft already here, at most `limit` deep (0: decode alone after all)."""
        s = self.situation(limit)
        return s.deepest(s.here)

    def server_prior(self, level_ms: float) -> None:
        """The draft server's own recent time per drafted level (its Welcome, or a drafter in this
        process's figure; 0: unknown): until this stream has measured its drafts, a draft is taken to
        cost at least that a level to wait for, and a co-hosted server's that a level in compute."""
        if level_ms <= 0:
            return
        if not self.draft_ms.samples:
            self.draft_ms.prior = max(self.draft_ms.prior, level_ms)
        if not self.share_ms.samples:
            self.share_ms.prior = level_ms

    def follow(self, moves: int, level_ms: float) -> bool:
        """The drafter's count of moves to another server (its last one died or had no room): at a new
        count, what was learnt of the last server's costs, and any pause after its missed deadlines,
        are void; the new server's figure per level (0: unknown) stands in until measured. Returns
        whether the count was new (the new server holds none of the stream)."""
        if moves == self.moves:
            return False
        self.moves = moves
        self.draft_ms, self.share_ms = server_costs()
        self.waited.clear()
        self.paused = self.misses = self.late_asks = self.late_probes = 0
        self.server_prior(level_ms)
        return True

    def prefill(self, ms: float) -> None:
        """The target's prefill took `ms`: until a one-token pass is measured, a pass is taken to cost
        that (a first deadline trusts the server at least as long as the prefill took)."""
        self.prefill_ms = ms
        if not self.verify_ms.samples:
            self.verify_ms.prior = max(self.verify_ms.prior, ms)

    def missed(self, depth: int, waited_ms: float) -> None:
        """A draft `depth` deep did not come within its deadline: the step decoded alone. The wait is a
        draft time (at least), and the policy decodes alone for a while, twice as long after each miss
        in a row; but not after a first miss at a depth whose draft time was hardly measured yet."""
        known = self.draft_ms.measured(depth) >= self.draft_ms.trusted
        self.draft_ms.add(depth, waited_ms)
        if known or self.misses:
            self.paused = self.explore << min(self.misses, 4)
        self.misses += 1
        self.waited.append((self.steps, True))

    def observe(self, depth: int, accepted: int, draft_ms: float | None, width: int, verify_ms: float,
                share: tuple[int, float] | None = None, asked: int | None = None) -> None:
        """One step: a draft `depth` deep (0: none) waited for draft_ms (None: asked at an earlier step,
        or its wait held a prompt's ingest), verified `width` tokens in verify_ms and had `accepted`
        tokens accepted. `share`: (levels drafted, ms), a co-hosted server's compute on this step's
        draft. `asked`: the depth it was asked for at this step (a shorter draft stopped by itself)."""
        if share is not None and share[0] > 0:
            self.share_ms.add(*share)
        if depth > 0 and asked:
            self.reach.add(asked - 1, depth - 1)
            self.onward.add(min(accepted, asked - 1), depth - 1)
        if depth > 0:
            self.acceptance.add(depth, accepted)
            if draft_ms is not None and math.isfinite(draft_ms):
                self.misses = 0
                if self.looking and draft_ms < 0.5 * self.draft_ms(depth):  # a look from decoding alone, its draft
                    # in under half what the figures say: they are of a server loaded then (many targets, since
                    # gone) and would keep the stream alone for hundreds of steps, a faster draft at each rarer
                    # look moving a median of slow ones hardly at all. They start afresh from this one
                    self.draft_ms = server_costs()[0]
                    self.waited.clear()
                self.draft_ms.add(depth, draft_ms)
                self.waited.append((self.steps, False))
        self.verify_ms.add(width, verify_ms)
