"""Keep a local star's processes up: a draft server or target server that exits while the star runs
(a crash, an out-of-memory kill, kill -9) is started again with the same command line, so at the
same address, where its peers find it again (targets reconnect to their draft server, the gateway
asks its targets until they answer).

A child is started again after a backoff that doubles while it keeps dying soon after each start
(1 s up to 30 s); one that died `cap` times within `window_s` is given up and stays down, logged.
Each restart is logged and counted by kind of process (`restarts`), for /metrics.
"""

from __future__ import annotations

import collections
import logging
import subprocess
import threading
import time
from dataclasses import dataclass, field

from starsd.errors import StarsdError
from starsd.star.processes import read_json_line, spawn, starsd_args

log = logging.getLogger("starsd.supervise")


@dataclass
class Child:
    name: str  # "draft-server", "target-0", ...
    kind: str  # "draft-server" or "target-server": the label of its restarts
    proc: subprocess.Popen
    args: list[str]  # its `starsd ...` arguments, to start it again
    deaths: collections.deque = field(default_factory=collections.deque)  # monotonic s, within the window
    backoff_s: float = 0.0
    given_up: bool = False


class Supervisor:
    """A thread that watches children (`watch`) and starts again those that exit, until `halt()`."""

    def __init__(self, first_backoff_s: float = 1.0, max_backoff_s: float = 30.0, cap: int = 5,
                 window_s: float = 600.0, ready_timeout_s: float = 600.0, poll_s: float = 0.2):
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.cap = cap
        self.window_s = window_s
        self.ready_timeout_s = ready_timeout_s
        self.poll_s = poll_s
        self.children: list[Child] = []
        self.restarts: collections.Counter[str] = collections.Counter()  # by kind (counts() reads it)
        self.restart_s: list[tuple[str, float]] = []  # (child, seconds from its death to ready again)
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # children's Popen handles change under the star's close()
        self._thread = threading.Thread(target=self._run, name="starsd-supervise", daemon=True)

    def watch(self, name: str, kind: str, proc: subprocess.Popen) -> None:
        with self._lock:
            self.children.append(Child(name, kind, proc, starsd_args(proc)))

    def start(self) -> None:
        self._thread.start()

    def halt(self) -> None:
        """No process is started again from now on (the star is closing); procs() then holds every
        handle there will be."""
        with self._lock:
            self._stopping.set()

    def join(self) -> None:
        """After halt() and the children's end (a restart waiting for its child's ready line ends with it)."""
        if self._thread.is_alive():
            self._thread.join()

    def procs(self) -> list[subprocess.Popen]:
        with self._lock:
            return [c.proc for c in self.children]

    def counts(self) -> dict[str, int]:
        """Restarts by kind of process, from any thread (/metrics)."""
        with self._lock:
            return dict(self.restarts)

    def _run(self) -> None:
        while not self._stopping.wait(self.poll_s):
            for child in list(self.children):
                if not child.given_up and child.proc.poll() is not None and not self._stopping.is_set():
                    self._restart(child)

    def _restart(self, child: Child) -> None:
        died = time.monotonic()
        child.deaths.append(died)
        while child.deaths and died - child.deaths[0] > self.window_s:
            child.deaths.popleft()
        if len(child.deaths) > self.cap:
            child.given_up = True
            log.error("%s exited (status %s) %d times within %.0f s: not started again", child.name,
                      child.proc.returncode, len(child.deaths), self.window_s)
            return
        child.backoff_s = self.first_backoff_s if len(child.deaths) == 1 else \
            min(max(child.backoff_s, self.first_backoff_s) * 2, self.max_backoff_s)
        log.warning("%s exited (status %s): starting it again in %.0f s", child.name, child.proc.returncode,
                    child.backoff_s)
        if self._stopping.wait(child.backoff_s):
            return
        with self._lock:
            if self._stopping.is_set():
                return
            child.proc = spawn(child.args)
        try:
            read_json_line(child.proc, "ready", self.ready_timeout_s)
        except StarsdError as e:  # it died again while starting: the next turn of the loop sees it
            log.error("%s did not start again: %s", child.name, e)
            return
        with self._lock:
            self.restarts[child.kind] += 1
            self.restart_s.append((child.name, time.monotonic() - died))
        log.warning("%s is running again (restart %d, %.1f s after it exited)", child.name,
                    self.restarts[child.kind], time.monotonic() - died)
