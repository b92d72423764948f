"""What a draft server counts, and how its timeline of batches is read.

The timeline holds one (start, end, batch size) entry per draft batch, in unix seconds, so that
it can be compared with the targets' own clocks (another process, the same machine or NTP).
"""

from __future__ import annotations

import collections
import statistics
import threading
import time


WAIT_WINDOW_S = 10.0  # the requests whose waits say what a new request waits now


class ServerStats:
    """Counters of one draft server; `snapshot()` is what a StatsRequest returns (as JSON).
    Written by the compute loop and the IO thread, read by either: every access holds the lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.errors: collections.Counter = collections.Counter()
        self.batch_sizes: collections.Counter = collections.Counter()
        self.requests = 0
        self.replies = 0
        self.sessions_opened = 0
        self.sessions_freed = 0
        self.sessions_evicted = 0  # sessions whose draft KV was freed for another's (star/sessions.py)
        self.sessions_restored = 0  # evicted sessions whose next request ingested their tokens again
        self.prefix_hits = 0  # new streams started from a prefix another's draft KV held (star/prefixes.py)
        self.prefix_tokens = 0  # the tokens those streams did not ingest
        self.kv_bytes = 0  # draft KV the sessions and their pre-drafts hold, as last counted (about once a second)
        self.connections = 0  # connections holding sessions (an engine's requests share one), counted with kv_bytes
        # and at each read of the counters
        self.kv_budget_bytes = 0
        self.busy_s = 0.0
        self.sessions_s = 0.0  # session-seconds drafted: each batch's time times its sessions (over uptime: the
        # sessions drafted at once, on average)
        self._running: tuple[float, int] | None = None  # the batch drafting now: when it began (perf_counter s)
        # and its sessions; its time so far counts in a snapshot, so that readings a second apart see a long batch
        self.hops = 0
        self.hop_s = 0.0
        self.predrafts = 0  # outcomes pre-drafted (ahead.py)
        self.predraft_hits = 0  # requests answered from a pre-draft
        self.predraft_misses = 0  # requests that came with other tokens than their pre-draft assumed
        self.predraft_yields = 0  # pre-draft batches cut short for a request that arrived
        self.predraft_s = 0.0  # compute spent pre-drafting (not in busy_s)
        self.predraft_timeline: collections.deque = collections.deque(maxlen=20000)  # (start, end: unix s) of
        # each pre-draft run (not in `timeline`, which holds the batches that answer requests)
        # The drafted rows by kind, and the tokens each kind had the draft model ingest: "reset" (a
        # stream's whole sequence: a new prompt, or a stream back from decoding alone without its
        # draft state) and "step" (the tokens a stream committed since its last draft)
        self.work: collections.Counter = collections.Counter()
        self.timeline: collections.deque = collections.deque(maxlen=20000)  # (start, end: unix s, batch size)
        self.levels: collections.deque = collections.deque(maxlen=33)  # ms per drafted level of recent step batches
        self.stepped: dict[int, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0])  # batch size ->
        # [step batches, their levels, their ms] since the start: what a level costs by batch size, over a run
        self.paces: collections.deque = collections.deque(maxlen=33)  # ms per drafted level of recent step
        # batches, the batch's own time (not shared out among its sessions): what each of its requests waited a level
        self.waits: collections.deque = collections.deque(maxlen=33)  # (monotonic s, ms from arrival to the start
        # of its draft) of recent requests
        self._ingest_ms = 0.0  # ms to ingest one token of a new stream, as the warm-up measured (0: not yet)

    def count(self, name: str, n: int = 1) -> None:
        """Add n to a plain counter: requests, replies, sessions_opened, _freed, _evicted, _restored,
        prefix_hits, _tokens, predrafts and predraft_hits, _misses, _yields."""
        with self.lock:
            setattr(self, name, getattr(self, name) + n)

    def begin(self, start: float, size: int) -> None:
        """A draft batch of `size` sessions begins (time.perf_counter()); batch() or abandon() ends it."""
        with self.lock:
            self._running = (start, size)

    def abandon(self) -> None:
        """The batch begun failed (its sessions are drafted apart, each a batch of its own)."""
        with self.lock:
            self._running = None

    def batch(self, start: float, end: float, size: int) -> None:
        """A draft batch of `size` sessions ran from `start` to `end` (time.perf_counter())."""
        with self.lock:
            self._running = None
            self.batch_sizes[size] += 1
            self.busy_s += end - start
            self.sessions_s += size * (end - start)
            self.timeline.append((*_wall(start, end), size))

    def predrafted(self, start: float, end: float) -> None:
        """A pre-draft ran from `start` to `end` (time.perf_counter())."""
        with self.lock:
            self.predraft_s += end - start
            self.predraft_timeline.append(_wall(start, end))

    def drafted(self, kind: str, tokens: int) -> None:
        """One row of a draft batch, of `kind` ("reset" or "step"), that ingested `tokens` first."""
        with self.lock:
            self.work[f"{kind}_rows"] += 1
            self.work[f"{kind}_tokens"] += tokens

    def level(self, ms: float, levels: int, size: int) -> None:
        """A batch of `size` streams' steps (no prompt ingested) drafted `levels` levels in `ms`."""
        if levels > 0:
            with self.lock:
                totals = self.stepped[size]
                totals[0] += 1
                totals[1] += levels
                totals[2] += ms
                self.levels.append(ms / levels / size)
                self.paces.append(ms / levels)

    def pace_ms(self) -> float:
        """The median time per level of recent step batches, each batch's whole time (0: none measured):
        with wait_ms, what a request asked d levels deep waits now, wait_ms + d * pace_ms."""
        with self.lock:
            return statistics.median_high(self.paces) if self.paces else 0.0

    def replied(self, queue_ms: float) -> None:
        """A request was answered; it had waited `queue_ms` from its arrival to the start of its draft."""
        with self.lock:
            self.waits.append((time.monotonic(), queue_ms))

    def wait_ms(self) -> float:
        """The median of recent requests' time from arrival to the start of their drafts, of the last
        WAIT_WINDOW_S: what a new request waits before its draft begins, whoever asks it (-1: none answered
        yet; 0: none of late, nothing queues). Not the draft's own time: a request's levels are its own
        (pace_ms), and a figure that held the others' (10 deep, beside a target drafting on) weighed a stream's
        2-level draft as if it were theirs. The waits of a load
        that has gone are not kept: 30 targets left a server whose last requests had waited 2-3 s, and the
        two that stayed, told so, asked for no draft for minutes."""
        with self.lock:
            if not self.waits:
                return -1.0
            since = time.monotonic() - WAIT_WINDOW_S
            recent = [ms for at, ms in self.waits if at >= since]
            return statistics.median_high(recent) if recent else 0.0

    def ingested(self, ms_per_token: float) -> None:
        """What one prompt token took to ingest, as the warm-up measured it."""
        with self.lock:
            self._ingest_ms = max(0.0, ms_per_token)

    def ingest_ms(self) -> float:
        """What ingesting one token of a stream it does not hold costs the server (0: not measured)."""
        with self.lock:
            return self._ingest_ms

    def level_ms(self) -> float:
        """The median of recent step batches' time per drafted level per stream (0: none yet): what a
        stream's draft costs the server, a level at a time, whatever the batch (a new stream's prior)."""
        with self.lock:
            return statistics.median_high(self.levels) if self.levels else 0.0

    def recent_busy(self, seconds: float) -> float:
        """Share of the last `seconds` spent drafting."""
        since = time.time() - seconds
        busy = 0.0
        with self.lock:
            for a, b, _ in reversed(self.timeline):  # newest first: stop at the first batch before `since`
                if b <= since:
                    break
                busy += b - max(a, since)
        return busy / seconds

    def hop(self, seconds: float) -> None:
        """A reply's trip from the compute loop through the IO thread onto the socket."""
        with self.lock:
            self.hops += 1
            self.hop_s += seconds

    def error(self, code: str) -> None:
        with self.lock:
            self.errors[code] += 1

    def snapshot(self, sessions_open: int, queue_depth: int = 0) -> dict:
        with self.lock:
            elapsed = time.monotonic() - self.started
            running, size = (0.0, 0) if self._running is None else (time.perf_counter() - self._running[0],
                                                                     self._running[1])
            busy = self.busy_s + running
            return {
                "uptime_s": elapsed, "busy_s": busy, "utilization": busy / elapsed if elapsed else 0.0,
                "sessions_s": self.sessions_s + size * running,
                "requests": self.requests, "replies": self.replies, "errors": dict(self.errors),
                "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "step_batches": {str(k): {"batches": v[0], "levels": v[1], "ms": v[2]}
                                 for k, v in sorted(self.stepped.items())},
                "queue_depth": queue_depth, "sessions_open": sessions_open, "sessions_opened": self.sessions_opened,
                "sessions_freed": self.sessions_freed, "sessions_evicted": self.sessions_evicted,
                "sessions_restored": self.sessions_restored, "kv_bytes": self.kv_bytes,
                "connections": self.connections,
                "kv_budget_bytes": self.kv_budget_bytes, "timeline": list(self.timeline),
                "reply_hop_ms": 1e3 * self.hop_s / self.hops if self.hops else 0.0, "work": dict(self.work),
                "predraft": {"outcomes": self.predrafts, "hits": self.predraft_hits, "misses": self.predraft_misses,
                             "yields": self.predraft_yields, "seconds": self.predraft_s},
                "predraft_timeline": list(self.predraft_timeline),
                "prefix": {"hits": self.prefix_hits, "tokens": self.prefix_tokens},
            }


def _wall(start: float, end: float) -> tuple[float, float]:
    """time.perf_counter() instants as unix seconds: comparable across processes (the targets' clocks)."""
    offset = time.time() - time.perf_counter()
    return round(start + offset, 6), round(end + offset, 6)


def busy_fraction(timeline: list, start: float, end: float) -> float:
    """Share of [start, end] (unix s) during which the draft server was drafting."""
    busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b, *_ in timeline)
    return busy / (end - start) if end > start else 0.0
