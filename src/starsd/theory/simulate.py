"""A discrete-event simulation of K draft servers and N targets, on the parameters of a Profile.

The analytical model (sysmodel.py) gives steady-state means under approximations; this plays the
star out request by request, so it also gives queueing, per-token latency spread, and answers for
several draft servers. Terms (times in ms, as in sysmodel.py):
- target: one target model, one outstanding draft request at a time. An iteration runs from sending
  a request to sending the next: queue Q_in, drafting, then its return time R (verify + network).
- draft server: serves the targets assigned to it (target i -> server i % K). Serial: FIFO, one
  request at a time, S(1) each. Batched: when idle with requests pending, it drafts up to max_batch
  of them (arrival order) for S(b), all replies leaving at its end. With the profile's levels_samples
  it drafts as the server does (star/server.py): level by level, a row's reply leaving when its chain
  is whole, the batch ending at the first level after another target's request arrives (`_cut_batch`).
- idle: the share of time a server waits for verification results; utilisation is the rest.
- per-token latency: an iteration of duration T that commits a tokens gives a samples of T / a.
R and the tokens per iteration are drawn from the profile's samples (else its means). All targets
send their first request at t = 0; figures come from a window after a warm-up. Servers share
nothing: each is simulated alone, the results pooled.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import math
import random
from dataclasses import asdict, dataclass, field

from starsd.errors import SettingError
from starsd.results import write_json
from starsd.theory import sysmodel
from starsd.theory.sysmodel import Profile

WARMUP_ITERATIONS = 10  # iterations per target before the window opens (default horizon)
WINDOW_ITERATIONS = 40  # iterations per target inside the measured window (default horizon)
WINDOW_TOTAL = 4000  # ... and at least this many in all: sampled return times are heavy-tailed (prefills)


@dataclass(frozen=True)
class SimResult:
    """What one simulation measured in its window (times in ms)."""

    n: int  # targets
    servers: int  # draft servers K
    serial: bool  # one request at a time (else batched)
    window_ms: float  # length of the measured window
    warmup_ms: float  # simulated time before it
    system_tokens_per_s: float
    per_target_tokens_per_s: float  # system throughput / n
    min_per_target_tokens_per_s: float  # per-target throughput on the worst-off draft server
    utilization: float  # mean busy share of the draft servers
    server_utilizations: tuple[float, ...]
    t_gamma_ms: float  # mean iteration time of a target
    mean_batch: float  # mean draft batch size
    queue_ms: float  # mean wait in Q_in, from a request's arrival to the start of its batch
    latency_mean_ms: float  # per-token latency, see the module docstring
    latency_p50_ms: float
    latency_p99_ms: float
    latency_cv: float  # std / mean of the per-token latency
    iterations: int  # target iterations that ended inside the window

    def to_json(self) -> dict:
        d = asdict(self)
        d["server_utilizations"] = list(self.server_utilizations)
        return d


@dataclass
class _Window:
    """Sums one draft server accumulates over the measured window [start, end)."""

    start: float
    end: float
    tokens: float = 0.0  # credited by the share of each iteration inside the window
    busy_ms: float = 0.0
    batches: int = 0
    batched_requests: int = 0
    queue_ms: float = 0.0
    iteration_ms: list[float] = field(default_factory=list)  # iterations that ended in the window
    iteration_tokens: list[float] = field(default_factory=list)

    def overlap(self, t0: float, t1: float) -> float:
        return max(0.0, min(t1, self.end) - max(t0, self.start))

    def add_batch(self, start: float, end: float, arrivals: list[float]) -> None:
        self.busy_ms += self.overlap(start, end)
        if self.start <= start < self.end:
            self.batches += 1
            self.batched_requests += len(arrivals)
            self.queue_ms += sum(start - t for t in arrivals)

    def add_iteration(self, sent: float, committed: float, tokens: float) -> None:
        # Crediting tokens by the share of the iteration inside the window, rather than counting
        # whole iterations, removes an edge error of up to one iteration per target.
        if committed > sent:
            self.tokens += tokens * self.overlap(sent, committed) / (committed - sent)
        if self.start <= committed < self.end:
            self.iteration_ms.append(committed - sent)
            self.iteration_tokens.append(tokens)


def _draw(rng: random.Random, samples: tuple, mean: float) -> float:
    return rng.choice(samples) if samples else mean


def _run_server(p: Profile, targets: int, serial: bool, window: _Window, rng: random.Random) -> _Window:
    """One draft server and its targets, until every iteration that overlaps the window has ended."""
    cap = 1 if serial else p.max_batch
    q_in = [(0.0, i) for i in range(targets)]  # (arrival time, target): arrival order
    heapq.heapify(q_in)
    now = 0.0  # the time the draft server becomes idle
    level = _level_times(p)
    while q_in and q_in[0][0] < window.end:
        start = max(now, q_in[0][0])
        batch = []
        while q_in and q_in[0][0] <= start and len(batch) < cap:
            batch.append(heapq.heappop(q_in))
        if p.levels_samples and not serial:
            now = _cut_batch(p, batch, start, q_in, window, rng, level(len(batch)))
            continue
        now = start + p.service(len(batch))
        window.add_batch(start, now, [t for t, _ in batch])
        for sent, target in batch:
            committed = now + _draw(rng, p.return_samples_ms, p.return_ms)
            window.add_iteration(sent, committed, _draw(rng, p.tokens_samples, p.tokens_per_iteration))
            heapq.heappush(q_in, (committed, target))
    return window


def _cut_batch(p: Profile, batch: list[tuple[float, int]], start: float, q_in: list, window: _Window,
               rng: random.Random, level_ms: float) -> float:
    """One batch drafted level by level at `level_ms` a level: each row draws its draft (tokens it
    commits whole, its chain's levels) and its return time; a row's reply leaves when its chain is
    whole; the batch ends at the first level boundary after a request of a target outside it arrives
    (the first level always runs; its own rows' next requests cut nothing, as in the server's `_cut`),
    each row then as deep as it got and committing what its accepted prefix keeps. Its requests' next
    ones go to Q_in; returns its end."""
    rows = []
    for sent, target in batch:
        j = rng.randrange(len(p.tokens_samples))
        rows.append((sent, target, p.tokens_samples[j], p.levels_samples[j],
                     _draw(rng, p.return_samples_ms, p.return_ms)))
    deepest = max(c for *_, c, _ in rows)
    levels = deepest
    if q_in and q_in[0][0] < start + deepest * level_ms:  # Q_in holds no target of the batch
        levels = max(1, min(deepest, math.ceil((q_in[0][0] - start) / level_ms)))
    end = start + levels * level_ms
    window.add_batch(start, end, [sent for sent, *_ in rows])
    for sent, target, tokens, chain, r in rows:
        committed = start + min(chain, levels) * level_ms + r
        window.add_iteration(sent, committed, min(tokens, levels + 1))
        heapq.heappush(q_in, (committed, target))
    return end


def _level_times(p: Profile):
    """A level's time by batch size b: S(b) over the levels of a batch of b drafts (the deepest of b
    drawn from levels_samples, its expectation)."""
    counts = collections.Counter(p.levels_samples)
    memo: dict[int, float] = {}

    def level(b: int) -> float:
        if b not in memo:
            deepest, below = 0.0, 0
            for c in sorted(counts):  # E[max] = sum over c of c (F(c)^b - F(c-)^b)
                share = below / len(p.levels_samples)
                below += counts[c]
                deepest += c * ((below / len(p.levels_samples)) ** b - share ** b)
            memo[b] = p.service(b) / deepest
        return memo[b]

    return level


def _horizon(p: Profile, n: int, servers: int, serial: bool) -> tuple[float, float]:
    """(warm-up, window) in ms: enough for each target to iterate ~10 then ~40 times, and for the
    window to hold at least WINDOW_TOTAL iterations."""
    t_gamma = sysmodel.predict(p, math.ceil(n / servers), serial).t_gamma_ms
    return WARMUP_ITERATIONS * t_gamma, max(WINDOW_ITERATIONS, math.ceil(WINDOW_TOTAL / n)) * t_gamma


def _weighted_quantile(values: list[float], weights: list[float], q: float) -> float:
    pairs = sorted(zip(values, weights))
    total, cum = sum(weights), 0.0
    for v, w in pairs:
        cum += w
        if cum >= q * total:
            return v
    return pairs[-1][0]


def _latency(windows: list[_Window]) -> tuple[float, float, float, float]:
    """Per-token latency (mean, p50, p99, cv): an iteration of T ms with a tokens weighs a at T/a."""
    values, weights = [], []
    for w in windows:
        for t, a in zip(w.iteration_ms, w.iteration_tokens):
            if a > 0:
                values.append(t / a)
                weights.append(a)
    if not values:
        return math.nan, math.nan, math.nan, math.nan
    total = sum(weights)
    mean = sum(v * w for v, w in zip(values, weights)) / total
    var = sum(w * (v - mean) ** 2 for v, w in zip(values, weights)) / total
    cv = math.sqrt(var) / mean if mean > 0 else 0.0
    return mean, _weighted_quantile(values, weights, 0.5), _weighted_quantile(values, weights, 0.99), cv


def _check(n: int, servers: int, duration_s: float | None, warmup_s: float | None) -> None:
    if n < 1 or servers < 1:
        raise SettingError(f"need at least one target and one draft server (got n={n}, servers={servers})")
    if duration_s is not None and not (duration_s > 0 and math.isfinite(duration_s)):
        raise SettingError(f"duration_s must be positive (got {duration_s})")
    if warmup_s is not None and not (warmup_s >= 0 and math.isfinite(warmup_s)):
        raise SettingError(f"warmup_s must be >= 0 (got {warmup_s})")


def simulate(p: Profile, n: int, servers: int = 1, serial: bool = False, duration_s: float | None = None,
             warmup_s: float | None = None, seed: int = 0) -> SimResult:
    """Simulate n targets on `servers` draft servers; the window and warm-up default to ~40 and ~10
    iterations per target (from sysmodel.predict)."""
    _check(n, servers, duration_s, warmup_s)
    warmup_ms, window_ms = _horizon(p, n, servers, serial)
    warmup_ms = warmup_ms if warmup_s is None else 1e3 * warmup_s
    window_ms = window_ms if duration_s is None else 1e3 * duration_s
    counts = [len(range(k, n, servers)) for k in range(servers)]  # round-robin: target i -> server i % K
    windows = [_run_server(p, c, serial, _Window(warmup_ms, warmup_ms + window_ms), random.Random(seed * 7919 + k))
               for k, c in enumerate(counts)]
    system = 1e3 * sum(w.tokens for w in windows) / window_ms
    per_target = [1e3 * w.tokens / window_ms / c for w, c in zip(windows, counts) if c]
    utilizations = tuple(w.busy_ms / window_ms for w in windows)
    iteration_ms = [t for w in windows for t in w.iteration_ms]
    batches = sum(w.batches for w in windows)
    requests = sum(w.batched_requests for w in windows)
    mean, p50, p99, cv = _latency(windows)
    return SimResult(
        n=n, servers=servers, serial=serial, window_ms=window_ms, warmup_ms=warmup_ms,
        system_tokens_per_s=system, per_target_tokens_per_s=system / n, min_per_target_tokens_per_s=min(per_target),
        utilization=sum(utilizations) / servers, server_utilizations=utilizations,
        t_gamma_ms=sum(iteration_ms) / len(iteration_ms) if iteration_ms else math.nan,
        mean_batch=requests / batches if batches else math.nan,
        queue_ms=sum(w.queue_ms for w in windows) / requests if requests else math.nan,
        latency_mean_ms=mean, latency_p50_ms=p50, latency_p99_ms=p99, latency_cv=cv, iterations=len(iteration_ms))


# ---------------------------------------------------------------------------------------------
# How many draft servers for M targets
# ---------------------------------------------------------------------------------------------

def _first_guess(p: Profile, m: int, quality: float, serial: bool) -> int:
    """Servers by the analytical model: the most targets one server keeps at quality, spread over m."""
    goal = quality * sysmodel.predict(p, 1, serial).per_target_tokens_per_s
    lo, hi = 1, m  # per-target throughput falls with the load of a server
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sysmodel.predict(p, mid, serial).per_target_tokens_per_s >= goal else (lo, mid - 1)
    return math.ceil(m / lo)


def servers_needed(p: Profile, m: int, quality: float = 0.9, serial: bool = False, max_servers: int = 1024,
                   seed: int = 0) -> int:
    """The fewest draft servers K with which each of m targets keeps >= quality x the per-target
    throughput of a target alone with a draft server (simulated N = 1, K = 1).

    "Each" is judged on the worst-off server (round-robin leaves some servers one target more).
    With K >= m every target is alone with a server, so K = m always suffices. The search starts at
    the analytical guess, brackets the answer by doubling or halving, then bisects, keeping the
    invariant "K = lo falls short, K = hi meets the quality".
    """
    if m < 1:
        raise SettingError(f"m must be >= 1 (got {m})")
    if not 0 < quality <= 1:
        raise SettingError(f"quality must be in (0, 1] (got {quality})")
    goal = quality * simulate(p, 1, 1, serial, seed=seed).per_target_tokens_per_s

    def enough(k: int) -> bool:
        return k >= m or simulate(p, m, k, serial, seed=seed).min_per_target_tokens_per_s >= goal

    guess = min(max(1, _first_guess(p, m, quality, serial)), m)
    if enough(guess):
        lo, hi = guess // 2, guess
        while lo >= 1 and enough(lo):
            lo, hi = lo // 2, lo
    else:
        lo, hi = guess, min(2 * guess, m)
        while not enough(hi):
            lo, hi = hi, min(2 * hi, m)
    while hi - lo > 1:  # lo == 0 stands for "fewer than one server", which never suffices
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    if hi > max_servers:
        raise SettingError(f"{m} targets need {hi} draft servers, more than max_servers={max_servers}")
    return hi


# ---------------------------------------------------------------------------------------------
# Checking the simulator against measured points
# ---------------------------------------------------------------------------------------------

def compare(p: Profile, points: list[dict], seed: int = 0) -> list[dict]:
    """For measured points {"mode": "batched" | "serial", "n": int, "system_tokens_per_s": float,
    optionally "servers": int}, the simulated system throughput and its error relative to the
    measured one; points of other modes are skipped."""
    out = []
    for point in points:
        if point.get("mode") not in ("batched", "serial"):
            continue
        serial, n, servers = point["mode"] == "serial", int(point["n"]), int(point.get("servers", 1))
        measured = float(point["system_tokens_per_s"])
        simulated = simulate(p, n, servers, serial, seed=seed).system_tokens_per_s
        out.append({"mode": point["mode"], "n": n, "servers": servers, "measured_tokens_per_s": measured,
                    "simulated_tokens_per_s": simulated,
                    "relative_error": (simulated - measured) / measured if measured > 0 else math.nan})
    return out


# ---------------------------------------------------------------------------------------------
# `starsd simulate`
# ---------------------------------------------------------------------------------------------

def int_list(text: str, flag: str) -> list[int]:
    """A flag's comma-separated integers, each >= 1."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SettingError(f"{flag} takes comma-separated integers, e.g. 1,2,4 (got {text!r})") from None
    if not values or min(values) < 1:
        raise SettingError(f"{flag} takes integers >= 1 (got {text!r})")
    return values


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="profile", required=True, metavar="PROFILE.json",
                   help="a profile, or a benchmark JSON holding one under \"profile\"")
    p.add_argument("--targets", default="1,2,4,8,16,32,64,128", help="numbers of targets N, comma-separated")
    p.add_argument("--servers", default="1", help="numbers of draft servers K, comma-separated")
    p.add_argument("--serial", action="store_true", help="draft servers serve one request at a time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--for-targets", type=int, default=None, metavar="M",
                   help="also report how many draft servers M targets need")
    p.add_argument("--quality", type=float, default=0.9,
                   help="with --for-targets: per-target throughput to keep, as a share of a target alone")
    p.add_argument("--json-out", default=None, help="write the results as JSON here")


def _model_tokens_per_s(p: Profile, n: int, servers: int, serial: bool) -> float:
    """sysmodel.predict per draft server, summed over the servers (K = 1: the model itself)."""
    return sum(sysmodel.predict(p, c, serial).system_tokens_per_s
               for c in (len(range(k, n, servers)) for k in range(servers)) if c)


def table(p: Profile, results: list[SimResult]) -> str:
    lines = [f"{'K':>3} {'N':>5} {'system tok/s':>13} {'model tok/s':>12} {'per target':>11} {'util':>5} "
             f"{'batch':>6} {'T_gamma ms':>11} {'queue ms':>9} {'lat CV':>7}"]
    for r in results:
        model = _model_tokens_per_s(p, r.n, r.servers, r.serial)
        lines.append(f"{r.servers:>3} {r.n:>5} {r.system_tokens_per_s:>13.2f} {model:>12.2f} "
                     f"{r.per_target_tokens_per_s:>11.3f} {r.utilization:>5.0%} {r.mean_batch:>6.1f} "
                     f"{r.t_gamma_ms:>11.1f} {r.queue_ms:>9.1f} {r.latency_cv:>7.3f}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    p = Profile.load(args.profile)
    ns, ks = int_list(args.targets, "--targets"), int_list(args.servers, "--servers")
    if args.for_targets is not None and args.for_targets < 1:
        raise SettingError(f"--for-targets must be >= 1 (got {args.for_targets})")
    name = "one-at-a-time" if args.serial else "batched"
    print(f"{name} draft servers: S(1) {p.service(1):.1f} ms, R {p.return_ms:.1f} ms, "
          f"tau {p.tokens_per_iteration:.2f}, N_full {sysmodel.n_full(p, args.serial):.1f} per server "
          f"(model tok/s: sysmodel.predict per server, summed)")
    results = [simulate(p, n, k, args.serial, seed=args.seed) for k in ks for n in ns]
    print(table(p, results))
    needed = None
    if args.for_targets is not None:
        needed = servers_needed(p, args.for_targets, args.quality, args.serial, seed=args.seed)
        print(f"{args.for_targets} targets need {needed} {name} draft server(s) to keep "
              f"{args.quality:.0%} of a lone target's throughput")
    if args.json_out:
        write_json(args.json_out, {
            "benchmark": "simulate", "profile": p.to_json(), "serial": args.serial, "seed": args.seed,
            "results": [r.to_json() for r in results],
            "servers_needed": None if needed is None else
            {"targets": args.for_targets, "quality": args.quality, "servers": needed}})
    return 0
