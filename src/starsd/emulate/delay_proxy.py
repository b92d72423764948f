"""A user-space TCP proxy that delays each direction of every connection by a fixed one-way delay.

This kernel has no netem, so network latency between the emulated hosts (see `starsd.emulate.netns`) is
added here. Each accepted connection gets its own connection to the upstream; the two directions
of a pair are *pipes*. A chunk of bytes read from a pipe's source is written to its destination
`delay_ms` after it was read, in order, without holding up other connections.

Design: one thread, non-blocking sockets, `select.select` and a heap of due writes. `select` takes
its timeout in microseconds, where epoll (and so asyncio) rounds timers up to whole milliseconds,
which would turn a 0.1 ms delay into 1 ms or more. The thread also asks the kernel for a 1 us timer
slack (the default 50 us would be a quarter of a 0.1 ms delay). Because of `select`, descriptors
must stay below FD_SETSIZE (1024): fine for the ~100 connections of a star.

Run as a process:

    python -m starsd.emulate.delay_proxy --listen 127.0.0.1:0 --upstream 10.231.0.1:5555 --delay-ms 0.1

prints `{"ready": "HOST:PORT"}` once listening and runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import heapq
import itertools
import json
import select
import signal
import socket
import sys
import threading
import time
from collections import deque

Address = tuple[str, int]

_READ_SIZE = 256 * 1024
_MAX_BACKLOG = 8 * 1024 * 1024  # bytes a pipe may hold before it stops reading its source
_EOF = b""  # queued in a pipe when its source has shut down its sending side
_PR_SET_TIMERSLACK = 29


def _set_timer_slack_ns(ns: int) -> None:
    """Ask Linux to wake this thread within `ns` of its timeouts (per thread; ignored elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class _Pipe:
    """One direction of a proxied connection: bytes read from `src` are written to `dst` later.

    `queue` holds (due time, chunk) in arrival order, `_EOF` marking the source's shutdown; `out`
    holds due bytes the kernel has not accepted yet (the destination is slow)."""

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src = src
        self.dst = dst
        self.queue: deque[tuple[float, bytes]] = deque()
        self.out = bytearray()
        self.backlog = 0  # bytes in queue + out
        self.reading = True  # the source has not reached EOF
        self.eof_due = False  # the EOF is due: shut down dst's sending side once `out` drains
        self.done = False  # EOF forwarded: nothing more will pass this way

    def wants_read(self) -> bool:
        return self.reading and self.backlog < _MAX_BACKLOG

    def move_due(self, now: float) -> None:
        """Move the chunks due by `now` from the delay queue to the send buffer."""
        while self.queue and self.queue[0][0] <= now:
            chunk = self.queue.popleft()[1]
            if chunk is _EOF:
                self.eof_due = True
            else:
                self.out += chunk

    def send(self) -> None:
        """Send what the kernel accepts of `out`; forward the EOF once it is all sent.

        Raises OSError when the destination has gone away."""
        if self.out:
            try:
                sent = self.dst.send(self.out)
            except (BlockingIOError, InterruptedError):
                return
            del self.out[:sent]
            self.backlog -= sent
        if not self.out and self.eof_due and not self.done:
            self.dst.shutdown(socket.SHUT_WR)
            self.done = True


class _Pair:
    """An accepted client connection and its upstream connection."""

    def __init__(self, client: socket.socket, upstream: socket.socket, connecting: bool) -> None:
        self.client = client
        self.upstream = upstream
        self.connecting = connecting  # upstream's non-blocking connect has not completed yet
        self.up = _Pipe(client, upstream)
        self.down = _Pipe(upstream, client)
        self.closed = False

    def pipes(self) -> tuple[_Pipe, _Pipe]:
        return self.up, self.down

    def finished(self) -> bool:
        return self.up.done and self.down.done


class DelayProxy:
    """Forward TCP connections from `listen` to `upstream`, delaying each direction by `delay_ms`.

    Addresses are IPv4 (host, port). `start()` binds (port 0 picks a free port, then exposed as
    `.port`) and serves from a background thread; `stop()` closes every connection and joins the
    thread. Also a context manager."""

    def __init__(self, listen: Address, upstream: Address, delay_ms: float) -> None:
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        self.listen = listen
        self.upstream = upstream
        self.delay_s = delay_ms / 1000.0
        self.port: int | None = None
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._pairs: dict[socket.socket, _Pair] = {}  # both sockets of every open pair
        self._heap: list[tuple[float, int, _Pair, _Pipe]] = []
        self._seq = itertools.count()  # heap tie-breaker: pairs and pipes do not compare

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> DelayProxy:
        """Bind, listen and serve from a background thread (once per proxy)."""
        if self._listener is not None or self._stopping:
            raise RuntimeError("a DelayProxy starts only once")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(self.listen)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="delay-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close every connection and the listener; join the thread. Idempotent."""
        self._stopping = True
        if self._thread is not None:
            self._wake_w.send(b"x")
            self._thread.join()
            self._thread = None
        for pair in list(self._pairs.values()):
            self._close(pair)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the loop ----------------------------------------------------------------------------

    def _serve(self) -> None:
        _set_timer_slack_ns(1000)
        while not self._stopping:
            self._run_due(time.monotonic())
            readers, writers = self._interest()
            timeout = max(0.0, self._heap[0][0] - time.monotonic()) if self._heap else None
            readable, writable, _ = select.select(readers, writers, [], timeout)
            for sock in writable:
                self._on_writable(sock)
            for sock in readable:
                self._on_readable(sock)

    def _interest(self) -> tuple[list[socket.socket], list[socket.socket]]:
        """The sockets to watch: sources with room to read, destinations with bytes waiting."""
        readers: list[socket.socket] = [self._wake_r, self._listener]
        writers: list[socket.socket] = []
        for pair in dict.fromkeys(self._pairs.values()):  # each pair once, in order
            if pair.connecting:  # read the client ahead; the upstream is not readable yet
                writers.append(pair.upstream)
                if pair.up.wants_read():
                    readers.append(pair.client)
                continue
            for pipe in pair.pipes():
                if pipe.wants_read():
                    readers.append(pipe.src)
                if pipe.out:
                    writers.append(pipe.dst)
        return readers, writers

    def _run_due(self, now: float) -> None:
        """Send everything that has come due; the heap holds one entry per queued chunk."""
        while self._heap and self._heap[0][0] <= now:
            _, _, pair, pipe = heapq.heappop(self._heap)
            if not pair.closed:
                pipe.move_due(now)
                self._send(pair, pipe)

    def _send(self, pair: _Pair, pipe: _Pipe) -> None:
        if pair.connecting or pair.closed:
            return
        try:
            pipe.send()
        except OSError:
            self._close(pair)
            return
        if pair.finished():
            self._close(pair)

    # -- events ------------------------------------------------------------------------------

    def _on_readable(self, sock: socket.socket) -> None:
        if sock is self._wake_r:
            sock.recv(64)
        elif sock is self._listener:
            self._accept()
        elif sock in self._pairs:  # not closed earlier in this round
            pair = self._pairs[sock]
            self._read(pair, pair.up if sock is pair.client else pair.down)

    def _on_writable(self, sock: socket.socket) -> None:
        pair = self._pairs.get(sock)
        if pair is None:
            return
        if pair.connecting:
            self._connected(pair)
        else:
            self._send(pair, pair.up if sock is pair.upstream else pair.down)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        for sock in (client, upstream):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        err = upstream.connect_ex(self.upstream)
        if err not in (0, errno.EINPROGRESS):
            client.close()
            upstream.close()
            return
        pair = _Pair(client, upstream, connecting=err != 0)
        self._pairs[client] = self._pairs[upstream] = pair

    def _connected(self, pair: _Pair) -> None:
        """The upstream connect finished: fail the pair, or start forwarding what waited."""
        if pair.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self._close(pair)
            return
        pair.connecting = False
        pair.up.move_due(time.monotonic())
        self._send(pair, pair.up)

    def _read(self, pair: _Pair, pipe: _Pipe) -> None:
        try:
            chunk = pipe.src.recv(_READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by the peer
            self._close(pair)
            return
        now = time.monotonic()
        if not chunk:
            pipe.reading = False
        pipe.queue.append((now + self.delay_s, chunk))
        pipe.backlog += len(chunk)
        if self.delay_s == 0:
            pipe.move_due(now)
            self._send(pair, pipe)
        else:
            heapq.heappush(self._heap, (now + self.delay_s, next(self._seq), pair, pipe))

    def _close(self, pair: _Pair) -> None:
        if pair.closed:
            return
        pair.closed = True
        del self._pairs[pair.client], self._pairs[pair.upstream]
        pair.client.close()
        pair.upstream.close()


# -- command line ----------------------------------------------------------------------------

def _address(text: str) -> Address:
    host, _, port = text.rpartition(":")
    if not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m starsd.emulate.delay_proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", type=_address, required=True, help="HOST:PORT (port 0: any free port)")
    parser.add_argument("--upstream", type=_address, required=True, help="HOST:PORT to forward to")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay in each direction")
    args = parser.parse_args(argv)
    # Blocked before the proxy thread starts, so that only sigwait below ever sees them.
    signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    proxy = DelayProxy(args.listen, args.upstream, args.delay_ms).start()
    print(json.dumps({"ready": f"{args.listen[0]}:{proxy.port}"}), flush=True)
    signal.sigwait(signals)
    proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
