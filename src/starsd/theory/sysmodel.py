"""The analytical system model of a star: one draft server, N targets (DESIGN.md).

Terms (times in ms)
- S(b): the draft server's measured service time for a batch of b draft requests (a serial server
  always has b = 1); S_eff = S(b) / b is the service time per request.
- R: a target's return time per iteration: from its draft being ready on the server to its next
  request being there (verify + network + serialisation).
- tau: tokens a target commits per iteration (accepted draft tokens + the bonus/correction token).
- T_gamma = N * S_eff + T_idle: one target's iteration time, T_idle being the time the server waits
  for verification results in one round of the N targets (> 0 under-loaded, 0 fully loaded).
The server's throughput X (iterations/s) has two bounds:
  X <= N / (R + S(1))           every target iterating as if alone with the server (linear growth)
  X <= C = max_b b / S(b)       the server's capacity, b <= max_batch (1 when serial)
N_full = C * (R + S(1)) is where they meet: past it, more targets add queueing but no capacity (the
knee of a closed system's asymptotic bounds). Between them, by Little's law (X*R targets verifying,
b drafted, b/2 waiting on average), a batching server's batch b at load N has throughput b / S(b),
where N = b * (1.5 + R / S(b)). Pure arithmetic on a Profile, tested without processes or sockets.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from starsd.errors import SettingError


def interpolate(points: dict[int, float], x: float) -> float:
    """y at x: linear between the measured points, flat before the first, extended by the last
    slope after the last (never below the last value)."""
    pts = sorted(points.items())
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2:]
    return max(y1, y1 + (y1 - y0) * (x - x1) / (x1 - x0))


@dataclass(frozen=True)
class Profile:
    """The measured parameters of one star (times in ms)."""

    service_ms: dict[int, float]  # S(b): draft server time for one batch of b requests, by b
    return_ms: float  # R: verify + network + serialisation, per iteration
    tokens_per_iteration: float  # tau
    target_only_ms_per_token: float = 0.0  # a target decoding alone, without speculation (0: unknown)
    max_batch: int = 32
    # Per-iteration samples, for the simulator's spread (empty: use the means above).
    return_samples_ms: tuple[float, ...] = field(default=(), repr=False)
    tokens_samples: tuple[int, ...] = field(default=(), repr=False)
    # The levels each of those iterations' drafts had (its chain's length before verification), paired
    # with tokens_samples: with them the simulator cuts a batch short as the server does (simulate.py)
    levels_samples: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self):
        if not self.service_ms or min(self.service_ms) < 1:
            raise SettingError("service_ms needs S(b) for batch sizes b >= 1, at least S(1)")
        if any(not (v > 0 and math.isfinite(v)) for v in self.service_ms.values()):
            raise SettingError("service times must be positive and finite")
        if not (self.return_ms >= 0 and math.isfinite(self.return_ms)):
            raise SettingError("return_ms must be >= 0")
        if not self.tokens_per_iteration >= 1:
            raise SettingError("tokens_per_iteration is at least 1 (the bonus token)")
        if self.max_batch < 1:
            raise SettingError("max_batch must be >= 1")
        if any(not (x >= 0 and math.isfinite(x)) for x in self.return_samples_ms):
            raise SettingError("return_samples_ms must be >= 0 and finite")
        if any(x < 1 for x in self.tokens_samples):
            raise SettingError("tokens_samples are at least 1 each (the bonus token)")
        if self.levels_samples and (len(self.levels_samples) != len(self.tokens_samples) or any(
                not (1 <= c and a <= c + 1) for a, c in zip(self.tokens_samples, self.levels_samples))):
            raise SettingError("levels_samples pair with tokens_samples: at least 1 level each, and no more "
                               "tokens than levels + 1")

    def service(self, b: float) -> float:
        """S(b), ms: piecewise-linear in the measured points, extended by the last slope."""
        if len(self.service_ms) == 1:  # batching never measured: assume it gains nothing
            (b0, s0), = self.service_ms.items()
            return s0 * max(1.0, b / b0)
        return interpolate(self.service_ms, b)

    def to_json(self) -> dict:
        d = asdict(self)
        d["service_ms"] = {str(k): v for k, v in sorted(self.service_ms.items())}
        d["return_samples_ms"], d["tokens_samples"] = list(self.return_samples_ms), list(self.tokens_samples)
        d["levels_samples"] = list(self.levels_samples)
        return d

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        d = dict(d.get("profile", d))  # a benchmark's JSON holds its profile under "profile"
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise SettingError(f"unknown profile fields: {', '.join(sorted(unknown))}")
        d["service_ms"] = {int(k): float(v) for k, v in d["service_ms"].items()}
        d["return_samples_ms"] = tuple(float(x) for x in d.get("return_samples_ms", ()))
        d["tokens_samples"] = tuple(int(x) for x in d.get("tokens_samples", ()))
        d["levels_samples"] = tuple(int(x) for x in d.get("levels_samples", ()))
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise SettingError(f"cannot read a profile from {path}: {e!r}") from None


@dataclass(frozen=True)
class Prediction:
    n: int
    regime: str  # "under-loaded" or "fully loaded"
    batch: float  # mean draft batch size
    t_gamma_ms: float  # one target's iteration time
    t_idle_ms: float  # draft server idle time per round of N requests
    utilization: float  # share of time the draft server drafts
    system_tokens_per_s: float
    per_target_tokens_per_s: float


def capacity(p: Profile, serial: bool) -> tuple[float, int]:
    """The server's peak throughput (iterations/s) and the batch size that reaches it."""
    if serial:
        return 1e3 / p.service(1), 1
    best = max(range(1, p.max_batch + 1), key=lambda b: b / p.service(b))
    return 1e3 * best / p.service(best), best


def n_full(p: Profile, serial: bool) -> float:
    """Targets at which the linear-growth bound meets the server's capacity."""
    return capacity(p, serial)[0] * (p.return_ms + p.service(1)) / 1e3


def loaded_batch(p: Profile, n: int, serial: bool) -> float:
    """Mean batch size of a fully loaded server at load n: solves n = b * (1.5 + R / S(b))."""
    if serial:
        return 1.0
    lo, hi = 1.0, float(p.max_batch)
    if lo * (1.5 + p.return_ms / p.service(lo)) >= n:
        return lo
    if hi * (1.5 + p.return_ms / p.service(hi)) <= n:
        return hi
    for _ in range(60):  # b * (1.5 + R / S(b)) grows with b while S grows slower than b
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid * (1.5 + p.return_ms / p.service(mid)) < n else (lo, mid)
    return (lo + hi) / 2


def predict(p: Profile, n: int, serial: bool = False) -> Prediction:
    """Steady-state figures for n targets on one draft server."""
    if n < 1:
        raise SettingError("n must be >= 1")
    linear = 1e3 * n / (p.return_ms + p.service(1))
    b = loaded_batch(p, n, serial)
    loaded = 1e3 * b / p.service(b)
    if linear <= loaded:
        x, b, regime = linear, 1.0, "under-loaded"
    else:
        x, regime = loaded, "fully loaded"
    per_request = p.service(b) / b
    t_gamma = 1e3 * n / x
    return Prediction(
        n=n, regime=regime, batch=b, t_gamma_ms=t_gamma, t_idle_ms=max(0.0, t_gamma - n * per_request),
        utilization=min(1.0, x * per_request / 1e3), system_tokens_per_s=x * p.tokens_per_iteration,
        per_target_tokens_per_s=x * p.tokens_per_iteration / n)


def break_even(p: Profile, serial: bool, n_max: int = 100_000) -> int | None:
    """The largest N whose per-target throughput still beats target-only decoding (None: unknown)."""
    if p.target_only_ms_per_token <= 0:
        return None
    alone = 1e3 / p.target_only_ms_per_token
    if predict(p, 1, serial).per_target_tokens_per_s < alone:
        return 0
    lo, hi = 1, n_max  # per-target throughput falls with N
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if predict(p, mid, serial).per_target_tokens_per_s >= alone else (lo, mid - 1)
    return lo


def report(p: Profile, ns: list[int]) -> str:
    """A table of predictions for both server disciplines, for `starsd model`."""
    lines = [f"profile: S(1) {p.service(1):.1f} ms, R {p.return_ms:.1f} ms, tau {p.tokens_per_iteration:.2f} "
             f"tokens/iteration, max batch {p.max_batch}"]
    for serial in (True, False):
        name = "one-at-a-time" if serial else "batched"
        cap, b = capacity(p, serial)
        lines.append(f"\n{name} server: capacity {cap:.2f} iterations/s (batch {b}), "
                     f"N_full {n_full(p, serial):.1f}, per-target above target-only up to N = {break_even(p, serial)}")
        lines.append(f"{'N':>5} {'regime':>13} {'batch':>6} {'T_gamma ms':>11} {'T_idle ms':>10} "
                     f"{'util':>5} {'system tok/s':>13} {'per target':>11}")
        for n in ns:
            r = predict(p, n, serial)
            lines.append(f"{n:>5} {r.regime:>13} {r.batch:>6.1f} {r.t_gamma_ms:>11.1f} {r.t_idle_ms:>10.1f} "
                         f"{r.utilization:>5.0%} {r.system_tokens_per_s:>13.2f} {r.per_target_tokens_per_s:>11.2f}")
    return "\n".join(lines)
