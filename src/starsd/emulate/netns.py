"""Two emulated hosts on one machine: a pair of network namespaces joined by a veth cable.

A `Link` is the cable between the draft host and one target host: namespaces
`starsd-<pid>-<k>-d` (draft) and `starsd-<pid>-<k>-t` (target), a veth pair between them on a
private /30 (draft 10.231.<k>.1, target 10.231.<k>.2), optionally shaped to `rate_mbit` with a
token bucket (`tc tbf`) on both ends. Run a process on either host with
`link.exec_argv(link.draft_ns) + [...]`.

Delay is not added here: this kernel has no netem; use `starsd.emulate.delay_proxy` inside a namespace.
The addresses live only inside the namespaces, so Links never clash with each other or with the
machine's own network; <k> still differs per Link so that logs tell them apart.

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2; `available()` says whether it works.
Namespaces outlive a killed process: `cleanup_stale()` removes those whose process is gone.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import subprocess
import threading
import time
import weakref

PREFIX = "starsd-"
_STALE = re.compile(rf"^{PREFIX}(\d+)-")
_DRAFT_DEV, _TARGET_DEV = "veth-d", "veth-t"
_MIN_BURST = 64 * 1024  # tbf below one maximal (GSO) packet stalls large messages
_TBF_LATENCY_MS = 200  # queueing a packet may wait before tbf drops it; generous, to avoid drops
_COMMAND_TIMEOUT_S = 10.0
_LINK_UP_TIMEOUT_S = 5.0

_counter = itertools.count()
_counter_lock = threading.Lock()


def _run(argv: list[str]) -> str:
    """Run an `ip` / `tc` command; raise RuntimeError naming it and its stderr when it fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {e}") from e
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _delete_namespaces(names: tuple[str, ...]) -> None:
    """Delete those of `names` that exist (their veth ends go with them)."""
    existing = set(list_namespaces())
    for name in names:
        if name in existing:
            _run(["ip", "netns", "delete", name])


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None when namespaces joined by veth can be made here, else a one-line reason (cached)."""
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
        try:
            _run(["ip", "-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"])
        finally:
            _delete_namespaces((probe,))
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def list_namespaces() -> list[str]:
    """Names of all network namespaces (`ip netns list` prints `name (id: N)` or `name`)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete `starsd-<pid>-...` namespaces whose process no longer exists; return their names."""
    stale = [name for name in list_namespaces()
             if (m := _STALE.match(name)) and not _pid_alive(int(m.group(1)))]
    _delete_namespaces(tuple(stale))
    return stale


def _wait_up(ns: str, dev: str) -> None:
    """Wait until `dev` is operationally up. The kernel's link watcher turns carrier on (and
    attaches the qdisc; until then packets are dropped) up to a second after `link set up`."""
    deadline = time.monotonic() + _LINK_UP_TIMEOUT_S
    while "state UP" not in _run(["ip", "-n", ns, "link", "show", "dev", dev]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{dev} in {ns} not up after {_LINK_UP_TIMEOUT_S} s")
        time.sleep(0.01)


def tbf_burst_bytes(rate_mbit: float) -> int:
    """Token bucket size: 10 ms at `rate_mbit`, at least 64 KiB (one maximal GSO packet)."""
    return max(_MIN_BURST, int(rate_mbit * 1e6 / 8 * 0.010))


class Link:
    """Two namespaces, draft host and target host, joined by a veth pair; a context manager.

    Attributes: `draft_ns`, `target_ns` (namespace names), `draft_ip`, `target_ip`, `rate_mbit`
    (None: unshaped). `close()` deletes both namespaces; it is idempotent and also runs when the
    interpreter exits."""

    def __init__(self, rate_mbit: float | None = None) -> None:
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        with _counter_lock:
            k = next(_counter)
        base = f"{PREFIX}{os.getpid()}-{k}"
        self.draft_ns = f"{base}-d"
        self.target_ns = f"{base}-t"
        self.draft_ip = f"10.231.{k % 256}.1"
        self.target_ip = f"10.231.{k % 256}.2"
        self.rate_mbit = rate_mbit
        self._finalizer = weakref.finalize(self, _delete_namespaces, (self.draft_ns, self.target_ns))
        try:
            self._create()
        except BaseException:
            self._close_quietly()
            raise

    def _create(self) -> None:
        _run(["ip", "netns", "add", self.draft_ns])
        _run(["ip", "netns", "add", self.target_ns])
        _run(["ip", "-n", self.draft_ns, "link", "add", _DRAFT_DEV, "type", "veth",
              "peer", "name", _TARGET_DEV, "netns", self.target_ns])
        for ns, dev, ip in ((self.draft_ns, _DRAFT_DEV, self.draft_ip),
                            (self.target_ns, _TARGET_DEV, self.target_ip)):
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.rate_mbit is not None:
                self._shape(ns, dev)
        for ns, dev in ((self.draft_ns, _DRAFT_DEV), (self.target_ns, _TARGET_DEV)):
            _wait_up(ns, dev)

    def _shape(self, ns: str, dev: str) -> None:
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
              "rate", f"{self.rate_mbit}mbit", "burst", str(tbf_burst_bytes(self.rate_mbit)),
              "latency", f"{_TBF_LATENCY_MS}ms"])

    def exec_argv(self, ns: str) -> list[str]:
        """The argv prefix that runs a command inside namespace `ns` (draft_ns or target_ns)."""
        if ns not in (self.draft_ns, self.target_ns):
            raise ValueError(f"{ns!r} is not a namespace of this link")
        return ["ip", "netns", "exec", ns]

    def close(self) -> None:
        """Delete both namespaces and the veth pair with them. Idempotent."""
        self._finalizer()

    def _close_quietly(self) -> None:
        """Close after a failed setup, keeping the setup error the one that is raised."""
        try:
            self.close()
        except RuntimeError:
            pass

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Link(draft={self.draft_ns}@{self.draft_ip}, target={self.target_ns}@{self.target_ip}, "
                f"rate_mbit={self.rate_mbit})")
