"""Child processes of a local star: `starsd` commands started as children that die with their
parent, their ready line awaited, free loopback ports for them."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time

from starsd.errors import Unavailable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies, however it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def spawn(args: list[str], prefix: list[str] = (), stderr=None, env: dict | None = None) -> subprocess.Popen:
    """`starsd ARGS` as a child; `prefix` runs it through a wrapper (e.g. `ip netns exec NS`).
    Its stderr is the launcher's unless given (a file); loading progress bars of several children
    would only garble it. `env`: its environment (default: this one's)."""
    env = {**(os.environ if env is None else env), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    return subprocess.Popen([*prefix, sys.executable, "-m", "starsd.cli", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=stderr, text=True, preexec_fn=_die_with_parent, env=env)


def stop_group(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """Stop a child started in a session of its own (`start_new_session`) and everything it started:
    SIGINT to its process group, as Ctrl-C would, then SIGKILL to what is left of the group after
    `timeout_s` or once the child is gone (vLLM's engine core and worker outlive a parent killed alone)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def read_json_line(proc: subprocess.Popen, key: str, timeout_s: float) -> dict:
    """Wait for the child's first stdout JSON line holding `key` (e.g. its ready signal)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise Unavailable(f"{describe(proc)} exited with status {proc.wait()} before it was ready "
                              "(its own error is above)")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if key in obj:
            return obj
    raise Unavailable(f"{describe(proc)} was not ready within {timeout_s:.0f} s")


def starsd_args(proc: subprocess.Popen) -> list[str]:
    """The `starsd` arguments a child was spawned with (without the wrapper and the interpreter)."""
    args = list(proc.args)
    return args[args.index("starsd.cli") + 1:] if "starsd.cli" in args else args


def describe(proc: subprocess.Popen) -> str:
    """`starsd target-server --bind ADDR` for a child started by spawn (its command and first flag)."""
    return "`starsd " + " ".join(map(str, starsd_args(proc)[:3])) + "`"
