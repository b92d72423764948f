"""What a stream learns of its own steps, for the depth decision (spec_decode/depth.py).

- Costs: milliseconds by size (tokens verified, or levels drafted), each size's cost the median of
  its recent measurements, so that a pass slowed once by another process or a warm-up does not
  stand for its size for good.
- Acceptance: whether each drafted position is accepted, a Beta posterior per position shrunk
  towards the stream's rate over all positions, itself shrunk towards a prior, so that one
  rejected draft does not end drafting and a position never tested is judged by the others.

Why these estimators, with the runs behind them: docs/scheduler.md#how-deep-to-draft-the-defaults.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field


def median(values) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@dataclass
class Costs:
    """Milliseconds by size: at each size, the median of its last `keep` measurements. A size measured
    fewer than `trusted` times counts only for the next `window` measurements, and a size measured
    again after that long starts afresh; `prior` stands in before any. Between measured sizes a
    straight line. Beyond them, `extend`: "flat" (the nearest measured size's cost: a CPU's matrix
    kernels make a verify's cost anything but a line, so an unmeasured width costs its neighbour's
    until tried) or "line" (a draft's queueing wait plus a cost per level: its slope the median of the
    measured sizes' pairwise slopes, never negative; with one size measured, `proportional` draws it
    through the origin, else flat)."""

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
        """What one more unit of size costs: the slope of line(), the prior's before any measurement (a
        line through the origin: the prior; flat: none), and none with one size measured of a flat
        table (a transformers target's pass costs about the same for 1 to 11 tokens)."""
        values = self.values()
        if not values:
            return self.prior if self.extend == "line" and self.proportional else 0.0
        if len(values) == 1 and self.extend == "flat":  # as __call__ takes the sizes beside it: at its cost
            return 0.0
        return self.line()[1]

    def line(self) -> tuple[float, float]:
        """(a, b) of y = a + b x through the sizes' medians (b: the median of their pairwise slopes, so a
        noisy pair of neighbours makes it neither negative nor steep)."""
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
    `prior`), `strength` tests' worth. Old tests weigh less (`decay`)."""

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
        better than its mean, in proportion to what the stream does not know)."""
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
