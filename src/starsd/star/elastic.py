"""Draft capacity that follows load: a controller that adds a draft server when the star's servers
are saturated and retires one when they idle, within bounds and after a cool-down.

It reads each draft server's counters every `interval_s`: over the interval, its utilisation (busy
time for requests, pre-drafting not counted) and the sessions it drafted for at once, on average
(a batch of 4 for half of it counts 2): utilisation alone does not tell 2 targets from 32, since
they draft as deep as their server keeps up with; how many share a batch does. The rule (`decide`):
- add: over the last `window` readings every server was busy at least `high` of the time and
  drafted for at least `high_sessions` sessions at once (drafts queue: the star past N_full), fewer
  than `max_servers` run, and `cooldown_s` passed since the last change;
- retire: over the last `retire_window` readings (longer: targets that pause after missed
  deadlines make dips) the load would keep one server fewer busy at most `low` of the time, or
  drafting for at most `low_sessions` at once (sums over K - 1), more than `min_servers` run, the
  cool-down passed; else hold.
Acting (`Controller`): a server is added by its `Servers` (RayStar: an actor), the targets are told
the servers (protocol.DraftServers, by the gateway) and sessions spread onto it. A server retired:
the targets are told the rest, and its sessions move with their whole prefixes (no token lost) at
their next drafts; it stops once it holds none, or has had no draft to make for QUIET_S (only idle
sessions), or after `drain_s`. Every decision is a log line and a counter.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from starsd.config import ClientKeys, ElasticConfig
from starsd.star.client import query_stats

log = logging.getLogger("starsd.elastic")

QUIET_S = 3.0  # a retired server that has had no draft request for this long holds only idle sessions


@dataclass(frozen=True)
class Decision:
    action: str  # "add", "retire" or "hold"
    why: str


@dataclass(frozen=True)
class Load:
    """One server's reading over an interval."""

    busy: float  # the share of it spent drafting for requests
    sessions: float  # the sessions drafted for at once, on average


def decide(readings: list[list[Load]], servers: int, bounds: ElasticConfig, since_change_s: float) -> Decision:
    """`readings`: the last readings, oldest first, each the load of every server running then (a
    reading of another number of servers than `servers` is not judged)."""
    recent = [r for r in readings[-bounds.window:] if len(r) == servers]
    if len(recent) < bounds.window:
        return Decision("hold", f"{len(recent)} of {bounds.window} readings of {servers} servers")
    longer = [r for r in readings[-bounds.retire_window:] if len(r) == servers]
    if since_change_s < bounds.cooldown_s:
        return Decision("hold", f"cooling down ({since_change_s:.0f} of {bounds.cooldown_s:.0f} s)")
    least = min(min(x.busy for x in r) for r in recent)
    fewest = min(min(x.sessions for x in r) for r in recent)
    if least >= bounds.high and fewest >= bounds.high_sessions:
        why = f"every server busy >= {least:.0%} of the time, drafting for >= {fewest:.1f} sessions at once"
        if servers >= bounds.max_servers:
            return Decision("hold", f"saturated ({why}), at the most servers ({servers})")
        return Decision("add", f"{why}, over {bounds.window} readings")
    if servers > bounds.min_servers and len(longer) == bounds.retire_window:
        busy = max(sum(x.busy for x in r) / (servers - 1) for r in longer)
        sessions = max(sum(x.sessions for x in r) / (servers - 1) for r in longer)
        if busy <= bounds.low or sessions <= bounds.low_sessions:
            return Decision("retire", f"{servers - 1} servers would be busy {busy:.0%} of the time at most, "
                                      f"drafting for {sessions:.1f} sessions at once")
    return Decision("hold", f"busy {least:.0%}, {fewest:.1f} sessions at once at least, within bounds")


class Servers(Protocol):
    """What the controller starts and stops draft servers with (RayStar, star/ray_cluster.py)."""

    def draft_servers(self) -> list[str]: ...

    def add_draft_server(self) -> str: ...

    def stop_draft_server(self, address: str) -> None: ...


@dataclass
class Counts:
    """The controller's figures, for /metrics."""

    decisions: collections.Counter = field(default_factory=collections.Counter)  # by action: add, retire,
    # add_failed (hold not counted)
    servers: int = 0
    last: str = ""  # the last decision's reason


class Controller(threading.Thread):
    """Reads the servers, decides, acts (module docstring). `listed(addresses)`: tells the targets the
    star's servers (the gateway, from any thread)."""

    def __init__(self, servers: Servers, bounds: ElasticConfig, listed: Callable[[list[str]], None],
                 keys: ClientKeys = ClientKeys()):
        super().__init__(name="starsd-elastic", daemon=True)
        self.servers = servers
        self.bounds = bounds
        self.listed = listed
        self.keys = keys
        self.counts = Counts(servers=len(servers.draft_servers()))
        self.readings: collections.deque = collections.deque(maxlen=max(bounds.window, bounds.retire_window))
        self._last: dict[str, tuple[float, float, float]] = {}  # address -> (busy_s, sessions_s, uptime_s) at
        # the last reading
        self._changed_at = time.monotonic()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.bounds.interval_s):
            try:
                self.step()
            except Exception:  # a reading or an action that failed: the next interval tries again
                log.exception("the elastic controller's step failed")

    def step(self) -> Decision:
        addresses = self.servers.draft_servers()
        reading = self._read(addresses)
        if reading is None:  # a server silent, or just (re)started: what was read before judges nothing now
            self.readings.clear()
        else:
            self.readings.append(reading)
        decision = decide(list(self.readings), len(addresses), self.bounds, time.monotonic() - self._changed_at)
        self.counts.last = decision.why
        if decision.action == "add":
            self._add(decision)
        elif decision.action == "retire":
            self._retire(len(addresses) - 1, decision)
        return decision

    def _read(self, addresses: list[str]) -> list[Load] | None:
        """Each server's load since the last reading; None where a server has no reading before this one
        (just started, restarted) or does not answer."""
        out: list[Load] = []
        complete = True
        for address in addresses:
            snap = query_stats(address, timeout_s=self.bounds.interval_s, keys=self.keys)
            if snap is None:
                return None
            now = (snap["busy_s"], snap["sessions_s"], snap["uptime_s"])
            before = self._last.get(address)
            self._last[address] = now
            if before is None or now[2] <= before[2]:
                complete = False
                continue
            span = now[2] - before[2]
            out.append(Load((now[0] - before[0]) / span, (now[1] - before[1]) / span))
        return out if complete else None

    def _add(self, decision: Decision) -> None:
        log.warning("adding a draft server: %s", decision.why)
        try:
            address = self.servers.add_draft_server()
        except Exception as e:  # (no node with its resources, say): tried again after the cool-down
            log.error("no draft server added: %s", e)
            self.counts.decisions["add_failed"] += 1
            self.readings.clear()
            self._changed_at = time.monotonic()
            return
        self._changed(decision, self.servers.draft_servers())
        log.warning("draft server added at %s: %d now", address, self.counts.servers)

    def _retire(self, index: int, decision: Decision) -> None:
        """The `index`th server (the last added) goes. Named by its place: Ray may start its actor again
        elsewhere (its node lost) while it drains, at another address."""
        address = self.servers.draft_servers()[index]
        log.warning("retiring the draft server at %s: %s", address, decision.why)
        remaining = [a for i, a in enumerate(self.servers.draft_servers()) if i != index]
        self.listed(remaining)  # its sessions move first, each with its whole prefix
        deadline = time.monotonic() + self.bounds.drain_s
        requests, quiet_since = None, time.monotonic()
        while time.monotonic() < deadline and not self._stop_event.is_set():
            snap = query_stats(address, timeout_s=2.0, keys=self.keys)
            if snap is None or snap["sessions_open"] == 0:
                break
            if snap["requests"] != requests:
                requests, quiet_since = snap["requests"], time.monotonic()
            elif time.monotonic() - quiet_since >= QUIET_S:
                break  # what it still holds is idle: each moves when its target next drafts, as any would
            time.sleep(0.2)
        address = self.servers.draft_servers()[index]  # (where it runs now)
        self.servers.stop_draft_server(address)
        self._last.pop(address, None)
        self._changed(decision, self.servers.draft_servers())
        log.warning("draft server at %s retired: %d now", address, self.counts.servers)

    def _changed(self, decision: Decision, addresses: list[str]) -> None:
        self.listed(addresses)
        self.counts.decisions[decision.action] += 1
        self.counts.servers = len(addresses)
        self.readings.clear()  # readings of the old number of servers judge nothing now
        self._changed_at = time.monotonic()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=self.bounds.drain_s + 10)
