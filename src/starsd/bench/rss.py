"""A process's resident memory, read from /proc/PID/status: once, or sampled on a thread while it runs."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


def parse_status(text: str) -> dict[str, int]:
    """The memory lines of /proc/PID/status, in bytes: {"VmRSS": ..., "VmHWM": ...}. A zombie has none."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            number, unit = value.split()
            assert unit == "kB", line
            out[key] = int(number) * 1024
    return out


def read_status(pid: int) -> dict[str, int]:
    try:
        return parse_status(Path(f"/proc/{pid}/status").read_text())
    except (FileNotFoundError, ProcessLookupError):
        return {}


@dataclass
class Watch:
    """Samples a process's VmRSS and VmHWM every `every` seconds on a thread, until it exits."""

    pid: int
    every: float
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (monotonic s, VmRSS, VmHWM)

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            status = read_status(self.pid)
            if not status:  # gone, or a zombie: its memory is released
                return
            self.samples.append((time.monotonic(), status["VmRSS"], status["VmHWM"]))
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return max(s[2] for s in self.samples)

    def resident_before(self, t: float, window_s: float = 1.0) -> int:
        """The largest VmRSS sampled in the window_s seconds before t (while the models are held)."""
        recent = [s[1] for s in self.samples if t - window_s <= s[0] < t]
        return max(recent) if recent else self.samples[-1][1]


def group_peak(pgid: int) -> int:
    """The summed VmHWM (bytes) of every process in process group `pgid`: what a server of several
    processes (vLLM's API server, engine core and worker) has held at most."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == pgid:  # state, ppid, pgrp
            total += read_status(int(stat.parent.name)).get("VmHWM", 0)
    return total


def available() -> int:
    """The host's MemAvailable (bytes)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")
