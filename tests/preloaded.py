"""Draft servers that start in about a second: `starsd draft-server` run in a process forked from
one that imported torch, transformers and starsd once (multiprocessing's forkserver), instead of a
fresh interpreter that imports them again (~4 s of a 2-core host's CPU). The child runs the real
command line (`starsd.cli.main`), in a process of its own: SIGKILL kills it as it kills any server.
For tests that start and kill many servers (tests/test_failover.py, for one)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import subprocess
import time

from starsd.config import PairConfig, ServerConfig
from starsd.star.client import DraftClient, DraftServerError
from starsd.star.launch import Star, server_command
from starsd.star.processes import free_port

PRELOAD = ["torch", "transformers", "transformers.models.qwen2.modeling_qwen2", "starsd.cli",
           "starsd.models.pair", "starsd.star.server"]
_context = None


def context():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _run(argv: list[str], log: str) -> None:
    """In the child: the command's stdout and stderr go to `log`, and it dies with the forkserver."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import ctypes

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlives the tests
    from starsd import cli

    os._exit(cli.main(argv))


class Forked:
    """A forked process, with the Popen calls Star.close() and the tests make."""

    def __init__(self, process):
        self.process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"draft server {self.pid}", timeout)
        return self.process.exitcode


def answers(address: str) -> bool:
    """Whether a server at `address` answers a Ping within 0.5 s (a Ping, not a StatsRequest: the
    server keeps its counters for 0.2 s, and a test's first query would get this one's copy)."""
    client = DraftClient(address, "", "ready?", timeout_s=0.5, heartbeat_s=0)
    try:
        client.ping()
        return True
    except DraftServerError:
        return False
    finally:
        client.close()


def start_server(pair: PairConfig, server: ServerConfig = ServerConfig(), port: int = 0, log: str = os.devnull,
                 timeout_s: float = 120.0) -> Star:
    """One draft server on tcp://127.0.0.1:port (0: a free one), once it answers; as
    starsd.star.launch.start_server, but forked."""
    address = f"tcp://127.0.0.1:{port or free_port()}"
    cfg = dataclasses.replace(server, bind=address, metrics_port=0)
    process = context().Process(target=_run, args=(server_command(pair, cfg), log), daemon=True)
    process.start()
    proc = Forked(process)
    deadline = time.monotonic() + timeout_s
    while not answers(address):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the forked draft server on {address} did not start (exit {proc.poll()}; log {log})")
        time.sleep(0.05)
    return Star([proc], [address])
