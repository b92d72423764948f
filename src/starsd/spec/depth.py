"""Choosing the draft depth per step: speculate only as deep as it pays, and not at all when
decoding alone is faster. Pure arithmetic on what a stream has measured.

Per step a target either decodes alone (one target pass over one token) or asks for a draft of
depth d: it waits draft_ms(d) for it (the draft server's queue and service and the network, or a
co-located draft model's passes), verifies the root and the draft in verify_ms(width) and commits
the accepted tokens and one more. The policy takes the depth with the most tokens per millisecond:

    rate(0) = 1 / verify_ms(1)
    rate(d) = (1 + accepted(d)) / (draft_ms(d) + verify_ms(d + 1))

where accepted(d) = sum over k <= d of P(the first k drafted tokens are accepted). Acceptance by
position and both costs are learnt from this stream's own steps, recent ones weighing more:
draft_ms as a straight line in d (a queueing wait plus a cost per level), verify_ms as a table by
width, since a CPU's matrix kernels make it anything but a line (measured here: 1 token 619 ms,
2 tokens 1214 ms, 4 tokens 1962 ms, 11 tokens 2499 ms). Unmeasured, a depth is assumed as good as
the configured one: a stream starts speculating at full depth and learns from there. Every
`explore` steps the policy looks beside its choice, in turn: decoding alone, one level shallower,
one deeper (or, while decoding alone, the best draft, twice as rarely after each look that finds
decoding alone still better, up to 16 x explore), so that costs it has not measured, and a draft
server that slows down or frees up, are noticed.

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
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Line:
    """y = a + b x fitted by least squares to the last `window` points; `prior` (a, b) when it has
    none. With one x seen, the line goes through the origin (`proportional`: a cost that grows with
    size, like a draft's levels) or is flat (a cost measured at one size only)."""

    prior: tuple[float, float]
    proportional: bool
    window: int = 48
    points: deque = field(default_factory=deque)
    _fitted: tuple[float, float] | None = field(default=None, repr=False)  # fit() until the next add()

    def add(self, x: float, y: float) -> None:
        self.points.append((x, y))
        if len(self.points) > self.window:
            self.points.popleft()
        self._fitted = None

    def __call__(self, x: float) -> float:
        a, b = self.fit()
        return max(0.0, a + b * x)

    def fit(self) -> tuple[float, float]:
        if self._fitted is None:
            self._fitted = self._least_squares()
        return self._fitted

    def _least_squares(self) -> tuple[float, float]:
        if not self.points:
            return self.prior
        n = len(self.points)
        mx = sum(p[0] for p in self.points) / n
        my = sum(p[1] for p in self.points) / n
        sxx = sum((p[0] - mx) ** 2 for p in self.points)
        if sxx == 0:
            return (0.0, my / mx) if self.proportional and mx > 0 else (my, 0.0)
        b = max(0.0, sum((p[0] - mx) * (p[1] - my) for p in self.points) / sxx)  # costs never fall with size
        return my - b * mx, b


@dataclass
class Table:
    """y by integer x: an exponential average of the measurements at each x (`weight` for the new
    one); between measured xs a straight line, beyond them the nearest; `prior` before any."""

    prior: float
    weight: float = 0.25
    values: dict[int, float] = field(default_factory=dict)

    def add(self, x: int, y: float) -> None:
        old = self.values.get(x)
        self.values[x] = y if old is None else old + self.weight * (y - old)

    def __call__(self, x: float) -> float:
        if not self.values:
            return self.prior
        xs = sorted(self.values)
        if x <= xs[0]:
            return self.values[xs[0]]
        if x >= xs[-1]:
            return self.values[xs[-1]]
        hi = next(k for k in xs if k >= x)
        lo = max(k for k in xs if k <= x)
        if hi == lo:
            return self.values[lo]
        return self.values[lo] + (self.values[hi] - self.values[lo]) * (x - lo) / (hi - lo)


@dataclass
class Acceptance:
    """P(the first k drafted tokens are all accepted), k = 1..max_depth, with exponential forgetting."""

    max_depth: int
    decay: float = 0.97
    tried: list[float] = field(default_factory=list)  # weight of drafts that reached position k
    taken: list[float] = field(default_factory=list)  # weight of those whose first k tokens were accepted

    def __post_init__(self):
        self.tried = [0.0] * self.max_depth
        self.taken = [0.0] * self.max_depth

    def add(self, depth: int, accepted: int) -> None:
        """A draft `depth` deep of which the first `accepted` tokens were accepted."""
        for k in range(self.max_depth):
            self.tried[k] *= self.decay
            self.taken[k] *= self.decay
            if k < depth:
                self.tried[k] += 1.0
                self.taken[k] += 1.0 if k < accepted else 0.0

    def expected(self, d: int) -> float:
        """E[accepted tokens] of a draft d deep. A position never tried is assumed to keep the last
        measured conditional rate (or 0.8 with none at all)."""
        total = 0.0
        reach = 1.0  # P(the first k - 1 accepted)
        rate = 0.8
        for k in range(d):
            if self.tried[k] > 0.5 and (k == 0 or self.taken[k - 1] > 0.5):
                p_k = self.taken[k] / self.tried[k]  # P(first k accepted | drafted k deep)
                p_prev = 1.0 if k == 0 else self.taken[k - 1] / self.tried[k - 1]
                rate = min(1.0, p_k / p_prev) if p_prev > 0 else 0.0
            reach *= rate
            total += reach
        return total


@dataclass
class DepthPolicy:
    """The depth of each step of one stream: 0 (decode alone) .. max_depth."""

    max_depth: int
    explore: int = 16  # steps between tries of another depth
    acceptance: Acceptance = None
    draft_ms: Line = None
    verify_ms: Table = None
    steps: int = 0
    chosen: int = 0
    since: int = 0  # steps since the last look beside the choice
    looks: int = 0  # looks beside a chosen depth so far (they take turns: alone, shallower, deeper)
    idle_looks: int = 0  # looks in a row at drafting while decoding alone (each doubles the interval)
    paused: int = 0  # steps left to decode alone after a missed deadline
    misses: int = 0  # deadlines missed in a row (each doubles the next pause)
    late_asks: int = 0  # steps since the last draft asked ahead while the server was too slow for one
    late_probes: int = 0  # such asks in a row (each doubles the interval to the next)
    prefill_ms: float = 0.0  # the last prompt's prefill (a first draft asked ahead has that long to come)

    def __post_init__(self):
        self.acceptance = self.acceptance or Acceptance(self.max_depth)
        # Priors that make speculating look worth it until measured: drafts cheap, verify flat.
        self.draft_ms = self.draft_ms or Line((0.0, 1.0), proportional=True)
        self.verify_ms = self.verify_ms or Table(100.0)
        self.chosen = self.max_depth

    def rate(self, d: int) -> float:
        """Expected tokens per millisecond at depth d."""
        if d == 0:
            return 1.0 / max(self.verify_ms(1), 1e-6)
        return (1.0 + self.acceptance.expected(d)) / max(self.draft_ms(d) + self.verify_ms(d + 1), 1e-6)

    def here(self, d: int) -> float:
        """Expected tokens per millisecond of verifying a draft d deep that is already here (no wait)."""
        if d == 0:
            return self.rate(0)
        return (1.0 + self.acceptance.expected(d)) / max(self.verify_ms(d + 1), 1e-6)

    def worth(self, limit: int) -> int:
        """How deep to verify a draft already here, at most `limit` deep (0: decode alone after all)."""
        return max(range(max(0, min(limit, self.max_depth)) + 1), key=self.here)

    def ahead(self, limit: int, behind: float = 1.0, server_ms: float = 0.0) -> int:
        """The depth to ask of a remote drafter, without waiting, on a step that decodes alone: the
        depth that would pay if it were here, plus the tokens committed before it can be used
        (`behind`: this step's and any more while it travels; 0: no draft would pay even free, so
        none is asked). A draft that would come too late to be of use is not asked: where the
        server's own time on a request (`server_ms`: its queue and draft, as its replies say) lets
        this stream commit so many tokens alone that no part of the deepest draft would still pay,
        asking only loads a saturated server with drafts nobody takes. Such steps ask only now and
        then (`explore` steps apart, twice as far after each such ask, up to 8 x explore), so that a
        server that catches up is noticed."""
        best = self.worth(limit)
        if not best:
            return 0
        cap = min(limit, self.max_depth)
        behind = max(1, math.ceil(behind))
        if not self.worth(cap - max(behind, math.ceil(server_ms / max(self.verify_ms(1), 1e-6)))):
            self.late_asks += 1
            if self.late_asks < self.explore << min(self.late_probes, 3):
                return 0
            self.late_asks = 0
            self.late_probes += 1
            return cap  # a probe: its reply tells how long the server takes now
        self.late_asks = self.late_probes = 0
        return min(best + behind, cap)

    def first(self, limit: int, behind: float = 1.0, server_ms: float = 0.0) -> int:
        """The depth to ask of a remote drafter before a prompt's prefill: a draft asked ahead, with
        the prefill's time (the last prompt's) to come before the first step. None where the server
        would answer too late even so (but now and then a probe, as `ahead` sends): a saturated
        server would otherwise spend its time ingesting every new prompt for drafts nobody takes."""
        head = self.prefill_ms / max(self.verify_ms(1), 1e-6)  # tokens a step decoding alone commits meanwhile
        return self.ahead(limit, behind - head, server_ms - self.prefill_ms)

    def choose(self, limit: int) -> int:
        """The depth for the next step, at most `limit` (the tokens left allow no deeper)."""
        limit = max(0, min(limit, self.max_depth))
        if self.paused > 0:
            self.paused -= 1
            self.chosen = 0
            return 0
        rates = [self.rate(d) for d in range(limit + 1)]
        best = max(range(limit + 1), key=rates.__getitem__)
        self.steps += 1
        self.since += 1
        if best > 0:
            self.idle_looks = 0
        interval = self.explore << min(self.idle_looks, 4)
        if self.since >= interval and limit > 0:  # look beside the choice now and then
            self.since = 0
            if best == 0:  # is the best draft worth asking for again? Each look that finds it is not
                # waits twice as long for the next (up to 16 x explore): a look can cost several
                # passes where verifying a draft is dear, and must not add up to a loss
                self.idle_looks += 1
                best = max(range(1, limit + 1), key=rates.__getitem__)
            else:
                best = [0, best - 1, min(limit, best + 1)][self.looks % 3]
                self.looks += 1
        self.chosen = best
        return best

    def deadline_ms(self, d: int) -> float:
        """How long a draft d deep may take and still beat decoding alone, and never less than one pass
        of decoding alone: a depth tried to explore may not pay at all, and its try must last long
        enough to measure a round trip (a shorter wait would only ever measure itself)."""
        gain = (1.0 + self.acceptance.expected(d)) * self.verify_ms(1) - self.verify_ms(d + 1)
        return max(gain, self.verify_ms(1), 1.0)

    def prefill(self, ms: float) -> None:
        """The target's prefill took `ms`: until a one-token pass is measured, its cost is taken to
        be that, or the prior if more (a first deadline that trusts the draft server at least as
        long as the prefill took)."""
        self.prefill_ms = ms
        if not self.verify_ms.values:
            self.verify_ms.prior = max(self.verify_ms.prior, ms)

    def missed(self, depth: int, waited_ms: float) -> None:
        """A draft `depth` deep did not come within its deadline: the step decoded alone. The wait
        counts as a draft time (at least that long), and the policy decodes alone for a while."""
        self.draft_ms.add(depth, waited_ms)
        self.paused = self.explore << min(self.misses, 4)
        self.misses += 1

    def observe(self, depth: int, accepted: int, draft_ms: float | None, width: int, verify_ms: float) -> None:
        """One step: a draft `depth` deep (0: none) waited for draft_ms (None: it was asked at an
        earlier step and waited for by none), verified `width` tokens (root and draft) in verify_ms
        and had `accepted` tokens accepted."""
        if depth > 0:
            self.acceptance.add(depth, accepted)
            if draft_ms is not None and math.isfinite(draft_ms):
                self.misses = 0
                self.draft_ms.add(depth, draft_ms)
        self.verify_ms.add(width, verify_ms)
