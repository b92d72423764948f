"""Choosing the draft depth per step: speculate only as deep as it pays, and not at all when
decoding alone is faster. Pure arithmetic on what a stream has measured.

Per step a target either decodes alone (one target pass over one token) or asks for a draft of
depth d: it waits draft_ms(d) for it (the draft server's queue and service and the network, or a
co-located draft model's passes), verifies the root and the draft in verify_ms(width) and commits
the accepted tokens and one more. The policy takes the depth with the most tokens per millisecond:

    rate(0) = 1 / verify_ms(1)
    rate(d) = (1 + accepted(d)) / (draft_ms(levels(d)) + verify_ms(levels(d) + 1))

where accepted(d) = sum over k <= d of P(the first k tokens drafted and accepted), and levels(d) the
levels a draft asked d deep is expected to have: a chain stops short of d where the draft is unsure
(min_path_prob), so that a deep ask costs what the drafts it gets cost (`expect`). How often a draft
goes on past each level is learnt too, apart for drafts accepted so far (confident drafts both run
long and are accepted: taken as independent, deep asks looked poor). Both costs and
acceptance are learnt from this stream's own steps, and robustly: a cost is the median of its size's
recent measurements (one pass slowed by another process or by a first call's warm-up must not steer
the stream for good); draft_ms is a line in d through them (a queueing wait plus a cost per level),
verify_ms a table by width, since a CPU's matrix kernels make it anything but a line. Acceptance is a
Beta posterior per position of the chain, shrunk towards the stream's rate over all positions, itself
shrunk towards a prior of 0.8: one rejected draft does not make a stream give up drafting, and a
position never tested is judged by what the others showed. Whether to draft is decided on the
posterior means; how deep, on one draw from each posterior (Thompson sampling): the less the stream
knows about a depth, the more often it is tried, and once it knows, it keeps to the depth with the
most tokens per millisecond. Unless each chain stops where one more level no longer pays (`stops`,
DraftConfig.auto_stop, the default: `stop` below): the draft is then asked as deep as the step
allows, and its own confidence at that step, which no position's past acceptance knows, sets how
deep it goes (replayed over recorded transformers answers, a depth drawn from the positions' figures
made 0.90-0.91x the best fixed depth with a fresh policy per answer and 0.96-0.98x carried over the
answers; asked as deep as allowed, 0.96-0.98x and 0.99x). An unmeasured width
costs what its nearest measured neighbour costs, so a stream starts at full depth and learns from
there. Every `explore` steps the policy also looks beside its choice: at decoding alone until that has
been measured a few times, and again once its figure is old (a stream that always drafts would
otherwise weigh every draft against passes slowed once, long ago), then one level shallower and one
deeper in turn (not where chains stop themselves: their widths vary anyway) (or, while decoding alone,
at the best draft, twice as rarely after each look that finds decoding alone still better, up to
16 x explore), so that a width measured slow once, and a draft server that slows down or frees up,
are noticed. A look at drafting is made only at a depth that could pay (every drafted token accepted
and no wait, a co-hosted server's compute aside: on one core, verifying one drafted token costs
more than two passes of one, and no look at one level can find it paying), and never while a
co-hosted server holds none of the stream: the look would have it ingest the whole prompt on the
targets' cores. A target process measures its verify costs by width before its first stream
(spec_decode/decode.py, `measure_verify`), so that the very first choice weighs a draft against them. A
stream that drafts in its own process (co-located, `inline`) takes the drafter's recent cost per
level as its prior for a draft, and counts that compute when it weighs a look, as it does a
co-hosted server's.

The same arithmetic bounds the wait: a draft d deep pays only while it arrives within

    deadline(d) = (1 + accepted(d)) * verify_ms(1) - verify_ms(d + 1)

(rate(d) >= rate(0) solved for draft_ms). A target gives each draft that long, and at least one
pass of decoding alone (so that a try of a depth that does not pay yet still measures the round
trip instead of its own deadline); a step whose draft misses it is decoded alone (`missed`), and
the policy then decodes alone for `explore` steps, twice as long after each further miss in a
row, before it waits for a draft again. So a draft server that is alive but slow or overloaded
costs a target at most one bounded wait per pause, and never its own decoding speed.

A step that decodes alone need not leave the draft server idle for its stream. With a remote
drafter it asks for a draft without waiting (`ahead`: the depth that would pay if the draft cost
no wait, plus the tokens the stream commits while it travels), and a later step takes what came back as far
as it still follows the tokens committed meanwhile, verifying it as deep as a draft that costs no
wait pays (`worth`). A slow server's drafts are then late but not lost, and a target that never
waits for one cannot fall below its own decoding speed because of it.

Unless the server is on this host (`cohosted`): its drafts are then computed on the cores the
targets verify on, and a draft nobody waits for still takes its compute from them. Each draft's
share of the server's time (its batch's service time over the streams in it) is learnt as a cost of
its own (`share_ms`), and a draft is asked ahead only where it pays at that cost (`asked_ahead`). A
local star on two cores, two targets and a draft server, would otherwise draft as if drafts were free
while every pass slowed. And that compute is taken from every other target on those cores
too (`neighbours`, as the server counts its sessions of targets on its host): a stream charges it
once for each (`taken`), so that no stream drafts for a gain of its own that slows the host more.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

MAX_STOP = 0.95  # the highest chain stopping threshold stop() gives: a chain always drafts its first level


def median(values) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@dataclass
class Costs:
    """Milliseconds by size (tokens verified, or levels drafted): at each size, the median of its last
    `keep` measurements, so that a pass slowed by another process, a page fault or a first call's
    warm-up does not stand for the size's cost. A size measured fewer than `trusted` times counts only
    for the next `window` measurements (a single slow pass at a width not tried again must not rule
    it out for good), and a size measured again after that long starts afresh; `prior` stands in
    before any. Between measured sizes a straight line. Beyond them,
    `extend`: "flat" (the nearest measured size's cost: a CPU's matrix kernels make a verify's cost
    anything but a line, measured here: 1 token 619 ms, 2 tokens 1214 ms, 4 tokens 1962 ms, 11
    tokens 2499 ms, so an unmeasured width is taken at its neighbour's cost until tried, which makes
    trying it look worth it) or "line" (a draft's queueing wait plus a cost per level: a line through
    the measured sizes, its slope the median of their pairwise slopes, never negative; with one size
    measured, `proportional` draws it through the origin, else flat)."""

    prior: float
    extend: str = "flat"
    proportional: bool = True
    keep: int = 9
    window: int = 64
    trusted: int = 3  # measurements that make a size's median count for good
    samples: dict[int, deque] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)  # size -> count of measurements when it was last measured
    count: int = 0
    _values: dict[int, float] | None = field(default=None, repr=False)  # values() until the next add()

    def add(self, x: int, y: float) -> None:
        if self.stale(x):  # its figures are from another time (another load on the host): the new one replaces them
            self.samples[x].clear()
        self.samples.setdefault(x, deque(maxlen=self.keep)).append(y)
        self.count += 1
        self.last[x] = self.count
        self._values = None

    def values(self) -> dict[int, float]:
        """The median cost at each size measured recently enough to count."""
        if self._values is None:
            kept = {x for x, n in self.last.items() if self.count - n < self.window or self.measured(x) >= self.trusted}
            self._values = {x: median(self.samples[x]) for x in sorted(kept or self.last)}
        return self._values

    def measured(self, x: int) -> int:
        return len(self.samples.get(x, ()))

    def stale(self, x: int) -> bool:
        """Whether size x was measured, but not for the last `window` measurements."""
        return x in self.last and self.count - self.last[x] >= self.window

    def __call__(self, x: float) -> float:
        values = self.values()
        if not values:
            return self.prior * x if self.extend == "line" and self.proportional else self.prior
        xs = list(values)
        if self.extend == "line" and (x < xs[0] or x > xs[-1] or len(xs) == 1):
            a, b = self.line()
            return max(0.0, a + b * x)
        if x <= xs[0]:
            return values[xs[0]]
        if x >= xs[-1]:
            return values[xs[-1]]
        hi = next(k for k in xs if k >= x)
        lo = max(k for k in xs if k <= x)
        if hi == lo:
            return values[lo]
        return values[lo] + (values[hi] - values[lo]) * (x - lo) / (hi - lo)

    def slope(self) -> float:
        """What one more unit of size costs: the slope of line() through the measured sizes (robust: the
        median of their pairwise slopes, so a noisy pair of neighbours does not make it negative or
        steep), or the prior's before any (a line through the origin: the prior; flat: none); flat with
        one size measured, none (a one-token pass measured first, taken through the origin, made a
        transformers target's next chain stop at its first level: its pass costs about the same for 1
        to 11 tokens)."""
        values = self.values()
        if not values:
            return self.prior if self.extend == "line" and self.proportional else 0.0
        if len(values) == 1 and self.extend == "flat":  # as __call__ takes the sizes beside it: at its cost
            return 0.0
        return self.line()[1]

    def line(self) -> tuple[float, float]:
        """(a, b) of y = a + b x through the sizes' medians."""
        values = self.values()
        xs = list(values)
        if len(xs) == 1:
            (x, y), = values.items()
            return (0.0, y / x) if self.proportional and x > 0 else (y, 0.0)
        b = max(0.0, median((values[j] - values[i]) / (j - i) for n, i in enumerate(xs) for j in xs[n + 1:]))
        return median(values[x] - b * x for x in xs), b


@dataclass
class Acceptance:
    """Whether each drafted position is accepted, k = 1..max_depth, as a Beta-Bernoulli estimate per
    position: a position is tested when it was drafted and every position before it was accepted.
    Each position's rate is shrunk towards the rate of all positions together (itself shrunk towards
    `prior`), `strength` tests' worth, so that a position tested a few times, or never, is judged by
    what the stream has shown elsewhere rather than by one draft. Old tests weigh less (`decay`)."""

    max_depth: int
    decay: float = 0.97
    prior: float = 0.8
    strength: float = 2.0
    tests: list[float] = field(default_factory=list)  # weight of drafts that tested position k
    hits: list[float] = field(default_factory=list)  # weight of those whose position k was accepted

    def __post_init__(self):
        self.tests = [0.0] * self.max_depth
        self.hits = [0.0] * self.max_depth

    def add(self, depth: int, accepted: int) -> None:
        """A draft `depth` deep of which the first `accepted` tokens were accepted."""
        for k in range(self.max_depth):
            self.tests[k] *= self.decay
            self.hits[k] *= self.decay
            if k < depth and k <= accepted:
                self.tests[k] += 1.0
                self.hits[k] += 1.0 if k < accepted else 0.0

    def rates(self, rng: random.Random | None = None) -> list[float]:
        """P(position k accepted | every one before accepted): the posterior means, or with `rng` one
        draw from each posterior (Thompson sampling: a position little tested is now and then judged
        better than its mean, so the depth choice looks deeper or shallower in proportion to what it
        does not know)."""
        pooled = (sum(self.hits) + self.strength * self.prior) / max(sum(self.tests) + self.strength, 1e-9)
        out = []
        for tests, hits in zip(self.tests, self.hits):
            a = hits + self.strength * pooled
            b = tests - hits + self.strength * (1.0 - pooled)
            if a + b <= 1e-9:  # never tested, and no prior to go by
                out.append(pooled)
            else:
                out.append(rng.betavariate(max(a, 1e-3), max(b, 1e-3)) if rng else a / (a + b))
        return out

    def expected(self, d: int, rates: list[float] | None = None) -> float:
        """E[accepted tokens] of a draft d deep (by the posterior means, or by `rates`)."""
        total = 0.0
        reach = 1.0  # P(the first k accepted)
        for rate in (rates or self.rates())[:d]:
            reach *= rate
            total += reach
        return total


def server_costs() -> tuple[Costs, Costs]:
    """A stream's figures of its draft server before it measures any: a draft's wait (nearly free) and
    a co-hosted server's compute on it (none), both lines in the depth."""
    return Costs(1.0, extend="line"), Costs(0.0, extend="line")


@dataclass
class DepthPolicy:
    """The depth of each step of one stream: 0 (decode alone) .. max_depth."""

    max_depth: int
    explore: int = 16  # steps between looks beside the choice
    acceptance: Acceptance = None
    reach: Acceptance = None  # whether a draft went on past each level where it was asked to (a chain stops
    # short where its path probability falls below min_path_prob): position k, from level k + 1 to k + 2
    onward: Acceptance = None  # the same, of drafts whose levels up to there were all accepted
    draft_ms: Costs = None
    verify_ms: Costs = None
    rng: random.Random = field(default_factory=lambda: random.Random(0))  # the Thompson draws
    steps: int = 0
    chosen: int = 0
    since: int = 0  # steps since the last look beside the choice
    looks: int = 0  # looks beside a chosen depth so far (they take turns: shallower, deeper)
    idle_looks: int = 0  # looks in a row at drafting while decoding alone (each doubles the interval)
    paused: int = 0  # steps left to decode alone after a missed deadline
    misses: int = 0  # deadlines missed in a row (each doubles the next pause)
    late_asks: int = 0  # steps since the last draft asked ahead while the server was too slow for one
    late_probes: int = 0  # such asks in a row (each doubles the interval to the next)
    prefill_ms: float = 0.0  # the last prompt's prefill (a first draft asked ahead has that long to come)
    cohosted: bool = False  # the draft server computes on this host's cores: a draft asked ahead is not free
    neighbours: int = 0  # cohosted: the other targets on this host's cores; a draft's compute is taken from
    # each of them too (the server said how many: its sessions of targets on its host)
    inline: bool = False  # drafts are computed when asked and waited for (a drafter in this process, or a
    # server sharing its cores: never asked ahead): a draft's wait is its compute, the same at every look
    holds: bool = False  # the drafter was asked a draft of this stream: it holds its prompt (spec_decode/decode.py sets it)
    moves: int = 0  # the drafter's moves to another server, as of the last new_server (spec_decode/decode.py)
    share_ms: Costs = None  # a co-hosted server's compute on one stream's draft, by depth
    stops: bool = False  # each step's chain stops where stop() says (DraftConfig.auto_stop): a draft is
    # asked as deep as the step allows, and its chain runs as deep as it pays (spec_decode/decode.py sets it)
    unsent: int = 0  # tokens of the stream the drafter does not hold: the prompt until its first draft, then
    # those decoded alone since the last one (spec_decode/decode.py sets it before each choice)
    ingest_ms: float = 0.0  # the drafter's time to ingest one such token (0: not known; the drafter says it)
    server_ms: float = 0.0  # a remote server's own time on a request (queue and draft), as its replies say
    # (spec_decode/decode.py sets it before each choice)
    probe: int = 0  # a look at drafting to ask ahead at this step instead of waiting for it (choose, ahead)

    def __post_init__(self):
        self.acceptance = self.acceptance or Acceptance(self.max_depth)
        self.reach = self.reach or Acceptance(self.max_depth, prior=1.0)  # until seen: every draft as deep as asked
        self.onward = self.onward or Acceptance(self.max_depth, prior=1.0)
        # Priors that make speculating look worth it until measured: drafts cheap, verify flat.
        draft_ms, share_ms = server_costs()
        self.draft_ms = self.draft_ms or draft_ms
        self.verify_ms = self.verify_ms or Costs(100.0)
        self.share_ms = self.share_ms or share_ms
        self.chosen = self.max_depth

    def expect(self, d: int, rates: list[float] | None = None) -> tuple[float, float]:
        """(levels drafted, tokens accepted) expected of a draft asked d deep, by the acceptance `rates`
        (else their means): a draft may stop short of d by its own confidence (min_path_prob), at each
        level as often as the stream's drafts have. A confident draft then runs deep where an unsure
        one stops at a level or two: a deep ask costs what the drafts it gets cost, not d levels each
        (co-located on transformers, asks weighed at d levels kept a stream 2-3 deep where the drafts
        ran 6-10 when let, 0.85x transformers' assisted generation)."""
        go, on = self.reach.rates(), self.onward.rates()
        acc = rates or self.acceptance.rates()
        reached = run = 1.0  # P(level k drafted), P(levels 1..k drafted and accepted)
        levels = accepted = 0.0
        for k in range(min(d, self.max_depth)):
            if k:  # a draft whose levels were accepted goes on more often than one that was not: both
                reached *= go[k - 1]  # are confident; so what it costs and what it yields are
                run *= on[k - 1]  # estimated apart
            run *= acc[k]
            levels += reached
            accepted += run
        return levels, accepted

    def rate(self, d: int, rates: list[float] | None = None) -> float:
        """Expected tokens per millisecond of a draft asked d deep (by the acceptance `rates`, else their means)."""
        if d == 0:
            return 1.0 / max(self.verify_ms(1), 1e-6)
        levels, accepted = self.expect(d, rates)
        return (1.0 + accepted) / max(self.wait_ms(levels) + self.verify_ms(levels + 1) + self.taken(levels), 1e-6)

    def wait_ms(self, levels: float) -> float:
        """What a draft of `levels` levels is expected to keep the stream waiting: as its drafts have, and
        from a remote server never less than the server's own time on a request now (`server_ms`, its
        queue and draft): the stream's measured drafts may date from before a queue formed, and a stream
        that decodes alone measures none. At a saturated server (32 replay targets on an AMX Xeon, 1.5 s
        a request), streams went on waiting for drafts by figures from earlier, 0.7 to 2.3 s a step, and
        decoded at 0.79x alone."""
        return self.draft_ms(levels) if self.inline else max(self.draft_ms(levels), self.server_ms)

    def taken(self, levels: float) -> float:
        """What a co-hosted server's compute on a draft of `levels` levels takes from the other targets on
        its cores (`neighbours`), in this stream's time: each of them is slowed by about that compute, so
        a draft that wins this stream a little can lose the host more. On an AMX Xeon here, a local
        star of two llama.cpp targets drafted one token a step for one of them, which looked worth 1.16x
        to it, and both ran at 0.65-0.78x decoding alone."""
        return self.neighbours * self.share_ms(levels) if self.cohosted else 0.0

    def stop(self) -> float:
        """The path probability below which this step's chain stops deepening (the drafter's
        min_path_prob; a chain drafts the level whose path probability falls below it, then stops):
        one more level pays while the chance that all its tokens are accepted, which the draft's
        path probability stands for, beats what the level costs in tokens at the stream's best rate:
        a drafted level's wait (and a co-hosted server's compute on it, charged to its neighbours
        too) and one more token in the verify pass, each the slope of its costs' line (robust: the
        verify table's neighbours differ by noise, and their local slope swung the threshold from
        0.14 to 0.51 on a transformers target). So a chain runs deep where levels are cheap against
        a target pass (a GPU, or a transformers target on a CPU, whose pass costs about the same for
        1 to 11 tokens) and stops early where each costs a good part of a target token (llama.cpp on
        a CPU). Replayed over recorded drafts (bench depth-replay, 16 and 8 HumanEval answers, a policy
        carried over them): on a llama.cpp target (AMX Xeon) it chose 0.77 (median) and made 11.54
        tokens/s against 11.00 with a fixed 0.3; on a transformers target (AMD EPYC) 0.45, where
        the best fixed threshold is, 17.25 against 17.18 (0.3) and 17.40 (0.45)."""
        more = self.draft_ms.slope() + self.verify_ms.slope() + (
            self.neighbours * self.share_ms.slope() if self.cohosted else 0.0)
        best = max(self.rate(d) for d in range(self.max_depth + 1))
        return min(MAX_STOP, max(0.0, more * best))

    def here(self, d: int) -> float:
        """Expected tokens per millisecond of verifying a draft d deep that is already here (no wait)."""
        if d == 0:
            return self.rate(0)
        return (1.0 + self.acceptance.expected(d)) / max(self.verify_ms(d + 1), 1e-6)

    def asked_ahead(self, d: int) -> float:
        """Expected tokens per millisecond of a draft d deep asked ahead: no wait, but a co-hosted
        server's compute on it counted."""
        if d == 0 or not self.cohosted:
            return self.here(d)
        levels, accepted = self.expect(d)
        return (1.0 + accepted) / max(self.share_ms(levels) + self.verify_ms(levels + 1) + self.taken(levels), 1e-6)

    def deepest(self, limit: int, value) -> int:
        """The depth, at most `limit` (and max_depth) deep, 0 included, with the most tokens per
        millisecond by `value` (rate, here or asked_ahead)."""
        return max(range(max(0, min(limit, self.max_depth)) + 1), key=value)

    def worth(self, limit: int) -> int:
        """How deep to verify a draft already here, at most `limit` deep (0: decode alone after all)."""
        return self.deepest(limit, self.here)

    def ahead(self, limit: int, behind: float = 1.0, server_ms: float = 0.0) -> int:
        """The depth to ask of a remote drafter, without waiting, on a step that decodes alone: the
        depth that would pay if it were here, plus the tokens committed before it can be used
        (`behind`: this step's and any more while it travels; 0: no draft would pay even free, so
        none is asked). A draft that would come too late to be of use is not asked: where the
        server's own time on a request (`server_ms`: its queue and draft, as its replies say) lets
        this stream commit so many tokens alone that no part of the deepest draft would still pay,
        asking only loads a saturated server with drafts nobody takes. Such steps ask only now and
        then (`explore` steps apart, twice as far after each such ask, up to 8 x explore), so that a
        server that catches up is noticed; and so does a look at drafting (choose) that the server's
        wait would not let pay (`probe`)."""
        cap = min(limit, self.max_depth)
        behind = max(1, math.ceil(behind))
        if self.probe:  # a look that a wait at this server could not pay for (choose): asked ahead
            look, self.probe = self.probe, 0
            return min(look + behind, cap)
        best = self.deepest(limit, self.asked_ahead)
        if not best:
            return 0
        if not self.deepest(cap - max(behind, math.ceil(server_ms / max(self.verify_ms(1), 1e-6))), self.asked_ahead):
            self.late_asks += 1
            if self.late_asks < self.explore << min(self.late_probes, 3):
                return 0
            self.late_asks = 0
            self.late_probes += 1
            return cap  # a probe: its reply tells how long the server takes now
        self.late_asks = self.late_probes = 0
        return min(best + behind, cap)

    def could_pay(self, d: int, wait_ms: float = 0.0) -> bool:
        """Whether a draft d deep could beat decoding alone at all: every drafted token accepted and
        no wait for it but `wait_ms`, only a co-hosted server's compute. A look at a depth that could not only
        measures a loss (on one core of this CPU, a llama.cpp target scored 2 tokens in 119 ms
        against 51 for one: no draft of one token pays there, whatever its acceptance). A drafter
        in this process (`inline`) has no wait but its compute, the same at every
        look: it counts (co-located with a llama.cpp target on 2 cores here, the 0.5B draft costs
        about 40 ms a level against 45 for the target's token; each look, with the drafter's catch-up
        of the tokens decoded alone, cost a 64-token answer some 4% of its time, by a trace's figures)."""
        compute = self.share_ms(d) + self.taken(d) if self.cohosted else self.draft_ms(d) if self.inline else 0.0
        return (1.0 + d) / max(compute + wait_ms + self.verify_ms(d + 1), 1e-6) > self.rate(0)

    def catch_up_pays(self, d: int, tokens: int) -> bool:
        """Whether a draft d deep pays back the drafter's catching up on the tokens it does not hold,
        where that compute is taken from this host's targets (a co-hosted server's, or a drafter in
        this process: `inline`). A stream that drafts every step sends only the last step's tokens
        (at most max_depth + 1), which its drafts' measured costs already hold; beyond those, each
        token costs ingest_ms, and a co-hosted server's is taken from each neighbour too. Drafting
        at rate(d) over the `tokens` the stream may still emit must save more than that. Seen on an AMX Xeon:
        a local star of two llama.cpp targets whose verify costs, measured on a loaded host, made a
        first draft look worth it had the server ingest a HumanEval prompt (about a second of its time on
        the shared cores) for one drafted step of 122, and ran at 0.87x decoding alone."""
        lacking = self.unsent if self.unsent > self.max_depth + 1 else 0
        if not lacking or self.ingest_ms <= 0 or not (self.cohosted or self.inline):
            return True
        cost = lacking * self.ingest_ms * (1 + (self.neighbours if self.cohosted else 0))
        return tokens / self.rate(0) - tokens / self.rate(d) > cost

    def first(self, limit: int, behind: float = 1.0, server_ms: float = 0.0) -> int:
        """The depth to ask of a remote drafter before a prompt's prefill: a draft asked ahead, with
        the prefill's time (the last prompt's) to come before the first step. None where the server
        would answer too late even so (but now and then a probe, as `ahead` sends): a saturated
        server would otherwise spend its time ingesting every new prompt for drafts nobody takes.
        None either from a co-hosted server while drafting does not pay by the stream's means: its
        ingest of the prompt is compute taken from the targets' cores (a 130-token prompt on the
        0.5B draft: about a second of a core here, more than a 64-token answer's drafts), for a
        draft the stream would not verify."""
        if self.cohosted and not self.deepest(limit, self.rate):
            return 0
        head = self.prefill_ms / max(self.verify_ms(1), 1e-6)  # tokens a step decoding alone commits meanwhile
        return self.ahead(limit, behind - head, server_ms - self.prefill_ms)

    def choose(self, limit: int) -> int:
        """The depth for the next step, at most `limit` (the tokens left allow no deeper). Whether to
        draft at all is judged on the posterior means (decoding alone is what protects a stream from
        a draft that does not pay, so it is not gambled on); how deep, on one draw of each
        position's acceptance, so that a depth the stream knows little about is tried in proportion
        to how likely it is to pay."""
        tokens = max(0, limit) + 1  # the stream may still emit (its budget)
        limit = max(0, min(limit, self.max_depth))
        if self.paused > 0:
            self.paused -= 1
            self.chosen = 0
            return 0
        best = max(range(limit + 1), key=self.rate)
        if best > 0 and self.stops:  # how deep: as deep as the chain's own stop lets it run
            best = limit
        elif best > 0:  # how deep: by one draw of each position's acceptance
            rates = self.acceptance.rates(self.rng)
            best = max(range(1, limit + 1), key=lambda d: self.rate(d, rates))
        self.steps += 1
        self.since += 1
        if best > 0 and (self.steps == 2 or self.inline) and not self.verify_ms.measured(1):
            best = 0  # a stream's second step decodes alone unless one already has: a one-token pass is
            # what every draft is weighed against, and no wider pass tells its cost (on a CPU a pass of
            # 11 tokens costs several of one, and taken as its cost it made a dear draft look worth it).
            # A drafter in this process has no prefill to draft beside: its stream's first step does
            # (a llama.cpp target here took the prefill's 660 ms for a pass's, drafted 10 levels at its
            # first step, about 480 ms with the prompt's ingest against 32 for a token, and 0.93x
            # decoding alone over 8 HumanEval answers in replay)
        if best > 0 and not self.catch_up_pays(best, tokens):
            best = 0
        if best > 0:
            self.idle_looks = 0
        interval = self.explore << min(self.idle_looks, 4)
        if self.since >= interval and limit > 0:  # look beside the choice now and then
            self.since = 0
            if best == 0:  # is the best draft worth asking for again? Each look that finds it is not
                # waits twice as long for the next (up to 16 x explore): a look can cost several
                # passes where verifying a draft is dear, and must not add up to a loss
                look = max(range(1, limit + 1), key=self.rate)
                if self.could_pay(look) and (self.holds or not self.cohosted) and self.catch_up_pays(look, tokens):
                    self.idle_looks += 1
                    if self.inline or self.could_pay(look, self.server_ms):
                        best = look  # where chains stop themselves too: a look costs less the shallower it is
                    else:  # a server whose own time on a request (its queue) loses even a perfect draft:
                        self.probe = look  # the look is asked ahead (ahead), and its reply tells whether the
                        # server has freed up. Waited for, such looks had a saturated server's streams wait up
                        # to deadline_ms: 32 replay targets on an AMX Xeon decoded at 0.79x alone, a step's
                        # p50 198 ms but its p99 2.3 s (a queue of 1.2 s and 1.7 s of service)
            elif self.verify_ms.measured(1) < 3 or self.verify_ms.stale(1):  # decoding alone, to compare
                best = 0  # with: measured little yet, or long ago (one-token passes slowed by a draft computed
                # beside them, then never measured again while drafting, could keep a stream drafting at a loss)
            elif not self.stops:  # the costs of the widths beside: a pass slowed once must not rule a width
                # out for good (a chain that stops itself varies its width step by step)
                best = [best - 1, min(limit, best + 1)][self.looks % 2]
                self.looks += 1
        self.chosen = best
        return best

    def deadline_ms(self, d: int) -> float:
        """How long a draft d deep may take and still beat decoding alone, and never less than one pass
        of decoding alone, nor than twice what such a draft is expected to take: a depth tried to
        explore may not pay at all (its chance of paying came from a draw, not from the means this
        gain is computed on), and its try must last long enough to measure a round trip (a shorter
        wait would only ever measure itself). A draft that is late beyond all of these is one that
        came much slower than its server has been."""
        levels, accepted = self.expect(d)
        gain = (1.0 + accepted) * self.verify_ms(1) - self.verify_ms(levels + 1)
        return max(gain, self.verify_ms(1), 2.0 * self.draft_ms(d), 1.0)

    def server_prior(self, level_ms: float) -> None:
        """The draft server's own recent time per drafted level (its Welcome, or a drafter in this
        process's own figure: Drafter.level_ms; 0: unknown): until this
        stream has measured its drafts, a draft is taken to cost at least that a level to wait for,
        and a co-hosted server's that a level in compute, so a new stream does not open with the
        deepest draft of a server that cannot pay for it."""
        if level_ms <= 0:
            return
        if not self.draft_ms.samples:
            self.draft_ms.prior = max(self.draft_ms.prior, level_ms)
        if not self.share_ms.samples:
            self.share_ms.prior = level_ms

    def new_server(self, level_ms: float) -> None:
        """The stream's drafts now come from another server (its last one died or had no room): what
        was learnt of the last one's costs, and any pause after its missed deadlines, are void (a
        draft lost with a dead server is no sign of a slow one); the new server's figure per level
        (0: unknown) stands in until its drafts are measured."""
        self.draft_ms, self.share_ms = server_costs()
        self.paused = self.misses = self.late_asks = self.late_probes = self.probe = 0
        self.holds = False
        self.server_prior(level_ms)

    def prefill(self, ms: float) -> None:
        """The target's prefill took `ms`: until a one-token pass is measured, its cost is taken to
        be that, or the prior if more (a first deadline that trusts the draft server at least as
        long as the prefill took)."""
        self.prefill_ms = ms
        if not self.verify_ms.samples:
            self.verify_ms.prior = max(self.verify_ms.prior, ms)

    def missed(self, depth: int, waited_ms: float) -> None:
        """A draft `depth` deep did not come within its deadline: the step decoded alone. The wait
        counts as a draft time (at least that long), and the policy decodes alone for a while: unless
        this is a first miss at a depth whose draft time was hardly measured yet (a stream's first
        drafts, judged by a deadline from next to no figures: the wait is a figure now, and the
        choice takes it in), since a pause then costs a stream the drafts it has not yet tried."""
        known = self.draft_ms.measured(depth) >= self.draft_ms.trusted
        self.draft_ms.add(depth, waited_ms)
        if known or self.misses:
            self.paused = self.explore << min(self.misses, 4)
        self.misses += 1

    def observe(self, depth: int, accepted: int, draft_ms: float | None, width: int, verify_ms: float,
                share: tuple[int, float] | None = None, asked: int | None = None) -> None:
        """One step: a draft `depth` deep (0: none) waited for draft_ms (None: it was asked at an
        earlier step and waited for by none), verified `width` tokens (root and draft) in verify_ms
        and had `accepted` tokens accepted. `share`: (levels drafted, ms), a co-hosted server's
        compute on this step's draft. `asked`: the depth this draft was asked for, where it was
        asked for this step (a draft shorter than that stopped by its own confidence)."""
        if share is not None and share[0] > 0:
            self.share_ms.add(*share)
        if depth > 0 and asked:
            self.reach.add(asked - 1, depth - 1)
            self.onward.add(min(accepted, asked - 1), depth - 1)
        if depth > 0:
            self.acceptance.add(depth, accepted)
            if draft_ms is not None and math.isfinite(draft_ms):
                self.misses = 0
                self.draft_ms.add(depth, draft_ms)
        self.verify_ms.add(width, verify_ms)
