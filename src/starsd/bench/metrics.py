"""Figures of one measured point (a mode at N targets) from the targets' traces and the server's timeline.

Definitions
- iteration: one draft -> verify -> accept step of one target; its duration runs from the end of
  the target's previous step (or the prompt's start) to the end of this one.
- per-token latency: an iteration of duration T that commits a tokens gives each of them T / a.
- return time: the part of an iteration spent outside the draft server's queue and compute
  (verify + network + serialisation): duration - queue - service.
- overhead: the part of a draft request's round trip spent outside the server's queue and
  compute (serialisation, transport, the server's IO hop): wall - queue - service.
Only iterations that end inside the measuring window [w0, w1] count.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Iteration:
    target: str
    start: float  # unix s
    end: float
    tokens: int
    wall_ms: float = 0.0  # the draft request's round trip; 0 when the step asked for no draft
    queue_ms: float = 0.0
    service_ms: float = 0.0
    batch: int = 0  # sessions drafted together; 0: no draft (not asked, or refused as busy)

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1e3


def iterations(rows: list[dict]) -> list[Iteration]:
    """Every iteration in the JSON rows a replay host (or target worker) printed, one row per prompt.
    The draft requests (`requests`, in order) belong to the steps that asked for a draft (`asked`,
    the depth asked each step, 0: none); a row without `asked` asked at every step."""
    out = []
    for r in rows:
        req = r.get("requests") or {}
        asked = r.get("asked") or [1] * len(r["trace"])
        prev = r["started"]
        k = 0  # the next request
        for (end, tokens), depth in zip(r["trace"], asked):
            draft = [0, 0, 0, 0]
            if depth and req.get("wall"):
                draft = [req[key][k] for key in ("wall", "queue", "service", "batch")]
                k += 1
            out.append(Iteration(r["target"], prev, end, tokens, *draft))
            prev = end
    return out


def busy_fraction(timeline: list, start: float, end: float) -> float:
    """Share of [start, end] (unix s) during which the draft server was drafting."""
    busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b, *_ in timeline)
    return busy / (end - start) if end > start else 0.0


def busy_over_time(timeline: list, start: float, end: float, bin_s: float = 1.0) -> list[float]:
    """busy_fraction in consecutive bins of bin_s seconds over [start, end]."""
    n = max(1, int((end - start) / bin_s))
    return [busy_fraction(timeline, start + i * bin_s, start + (i + 1) * bin_s) for i in range(n)]


def batch_times(timeline: list, start: float, end: float) -> list[tuple[int, float]]:
    """(batch size, ms) of every draft batch that started inside [start, end]."""
    return [(size, round((b - a) * 1e3, 3)) for a, b, size in timeline if start <= a <= end]


def service_table(pairs: list[tuple[int, float]], min_count: int = 3) -> dict[int, float]:
    """Mean batch time by batch size: S(b) as the draft server timed it (sizes seen < min_count
    times are left to interpolation)."""
    by: dict[int, list[float]] = {}
    for size, ms in pairs:
        by.setdefault(size, []).append(ms)
    return {b: statistics.fmean(v) for b, v in sorted(by.items()) if len(v) >= min_count}


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))] if s else 0.0


def per_token_latencies(its: list[Iteration]) -> list[float]:
    return [it.ms / it.tokens for it in its if it.tokens for _ in range(it.tokens)]


def point(its: list[Iteration], n: int, w0: float, w1: float, timeline: list | None = None) -> dict:
    """The figures of one (mode, N) point over the window [w0, w1]."""
    inside = [it for it in its if w0 <= it.end <= w1]
    if not inside:
        raise RuntimeError(f"no iteration ended inside the {w1 - w0:.0f} s window: lengthen it")
    seconds = w1 - w0
    by_target: dict[str, int] = {}
    for it in inside:
        by_target[it.target] = by_target.get(it.target, 0) + it.tokens
    lat = per_token_latencies(inside)
    mean_lat = statistics.fmean(lat)
    drafted = [it for it in inside if it.batch]
    out = {
        "n": n, "window_s": seconds, "iterations": len(inside), "tokens": sum(by_target.values()),
        "system_tokens_per_s": sum(by_target.values()) / seconds,
        "per_target_tokens_per_s": sum(by_target.values()) / seconds / n,
        "per_target_min_tokens_per_s": min(by_target.get(t, 0) for t in _names(its, n)) / seconds,
        "jain_index": jain([by_target.get(t, 0) for t in _names(its, n)]),
        "tokens_per_iteration": statistics.fmean(it.tokens for it in inside),
        "drafted_share": len(drafted) / len(inside),  # steps that verified a draft
        "t_gamma_ms": statistics.fmean(it.ms for it in inside),
        "t_gamma_cv": statistics.pstdev(it.ms for it in inside) / statistics.fmean(it.ms for it in inside),
        "latency_mean_ms": mean_lat, "latency_p50_ms": percentile(lat, 50), "latency_p99_ms": percentile(lat, 99),
        "latency_cv": statistics.pstdev(lat) / mean_lat if mean_lat else 0.0,
    }
    if drafted:
        out.update({
            "queue_ms": statistics.fmean(it.queue_ms for it in drafted),
            "service_ms": statistics.fmean(it.service_ms for it in drafted),
            "mean_batch": statistics.fmean(it.batch for it in drafted),
            "return_ms": statistics.fmean(it.ms - it.queue_ms - it.service_ms for it in drafted),
            "overhead_ms": statistics.fmean(it.wall_ms - it.queue_ms - it.service_ms for it in drafted),
        })
    if timeline is not None:
        out["draft_utilization"] = busy_fraction(timeline, w0, w1)
        out["idle_ratio"] = 1.0 - out["draft_utilization"]
        out["utilization_over_time"] = busy_over_time(timeline, w0, w1)
        out["batch_times"] = batch_times(timeline, w0, w1)
    return out


def jain(xs: list[float]) -> float:
    """Jain's fairness index of the targets' throughputs: (sum x)^2 / (n sum x^2), 1 when all are
    equal, 1/n when one target gets everything."""
    squares = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * squares) if squares else 1.0


def _names(its: list[Iteration], n: int) -> list[str]:
    names = sorted({it.target for it in its})
    return names + [f"missing-{i}" for i in range(n - len(names))]  # a target that never finished counts as 0
