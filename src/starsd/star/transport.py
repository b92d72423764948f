"""The draft server's IO thread: the only owner of its ZeroMQ ROUTER socket.

It decodes and validates every message as it arrives and answers a malformed one with an Error at
once; it answers heartbeats (Ping) and StatsRequests itself, so they never wait behind drafting;
it refuses a Hello or a DraftRequest as `busy` when Q_in is full; everything else (a Bye too, which
frees a session's memory) goes on Q_in for the compute loop. Replies come back from the compute
loop through an inproc PUSH/PULL pair (the Outbox), which wakes the IO thread at once, and leave
through the ROUTER socket.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from starsd.config import ServerConfig
from starsd.errors import StarsdError, Unavailable
from starsd.star import protocol as P
from starsd.star import security
from starsd.star.hosts import on_this_host
from starsd.star.stats import ServerStats

log = logging.getLogger("starsd.transport")


@dataclass
class Request:
    """A message for the compute loop."""

    peer: bytes
    msg: object
    tensors: tuple
    received: float  # time.perf_counter() when the IO thread took it off the socket
    user: str = ""  # the peer's authenticated public key (star/security.py); "" without keys
    local: bool = False  # the peer runs on this host (shares its cores): hosts.on_this_host


class Transport:
    def __init__(self, cfg: ServerConfig, q_in: queue.Queue, stats: ServerStats,
                 on_ping: Callable[[int], bool], stats_json: Callable[[], str],
                 sessions: Callable[[], tuple[int, int]]):
        self.cfg = cfg
        self.bind = cfg.bind
        self.q_in = q_in
        self.stats = stats
        self.queue_limit = cfg.queue_limit
        self.backlog = 0  # requests the compute loop has taken off Q_in and not yet drafted (it sets this)
        self.on_ping = on_ping  # a live session's heartbeat
        self.stats_json = stats_json  # the answer to a StatsRequest
        self.sessions = sessions  # the sessions the server holds, and of them those on its host (every Pong says them)
        self.ctx = zmq.Context()
        self.stopping = threading.Event()
        self._ready = threading.Event()
        self._failure: StarsdError | None = None
        self._auth = None  # the CURVE authenticator's thread, when the server has keys
        self._outbox_addr = f"inproc://outbox-{id(self)}"
        self._thread = threading.Thread(target=self._run, name="starsd-io", daemon=True)
        self._local: dict[bytes, bool] = {}  # peer -> on_this_host, per connection

    def start(self) -> None:
        """Bind and start the IO thread; raises a StarsdError if the address cannot be bound."""
        self._thread.start()
        self._ready.wait()
        if self._failure:
            if self._auth:
                self._auth.stop()
            self.ctx.term()
            raise self._failure

    def outbox(self) -> Outbox:
        """A way for the calling thread (the compute loop) to send replies."""
        return Outbox(self.ctx, self._outbox_addr, self.stopping)

    def stop(self) -> None:
        """Stop the IO thread and close the context (after every Outbox is closed)."""
        self.stopping.set()
        self._thread.join(timeout=2)
        if self._auth:
            self._auth.stop()
        self.ctx.term()

    def _run(self) -> None:
        router = inbox = None
        try:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)  # larger frames drop the connection
            self._auth = security.guard_server(self.ctx, router, self.bind, self.cfg.curve_key,
                                               self.cfg.curve_clients, self.cfg.insecure)
            router.bind(self.bind)
            inbox = self.ctx.socket(zmq.PULL)
            inbox.bind(self._outbox_addr)
        except (zmq.ZMQError, security.SecurityError) as e:
            for sock in (router, inbox):  # an open socket would hang the context's term(), even from the GC
                if sock is not None:
                    sock.close(0)
            failure = e if isinstance(e, StarsdError) else Unavailable(f"cannot bind {self.bind}: {e}")
            self._failure = failure.with_traceback(None)  # this thread's frames are not kept alive by it
            self.stopping.set()
            self._ready.set()
            return
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(inbox, zmq.POLLIN)
        self._ready.set()
        try:
            while not self.stopping.is_set():
                for sock, _ in poller.poll(100):
                    if sock is inbox:  # [queued-at timestamp, peer, message frames...]
                        stamp, *frames = inbox.recv_multipart(copy=False)
                        router.send_multipart(frames, copy=False)
                        self.stats.hop(time.perf_counter() - struct.unpack("d", stamp.buffer)[0])
                    else:
                        self._receive(router, router.recv_multipart(copy=False))
        finally:
            router.close(0)
            inbox.close(0)

    def _receive(self, router, frames) -> None:
        peer = frames[0].bytes

        def answer(msg) -> None:
            router.send_multipart([peer, *P.encode(msg)])

        try:
            msg, tensors = P.decode(frames[1:])
        except P.ProtocolError as e:
            self.stats.error(e.code)
            return answer(P.Error(e.code, str(e)))
        except Exception as e:  # whatever a message does, the IO thread lives on
            log.exception("unexpected failure decoding a message")
            self.stats.error("internal")
            return answer(P.Error("internal", str(e)[:200]))
        if isinstance(msg, P.Ping):
            unknown = tuple(tag for tag in msg.tags if not self.on_ping(tag))
            return answer(P.Pong(msg.tag, msg.sent, self.on_ping(msg.tag), self.stats.level_ms(), *self.sessions(),
                                 self.stats.wait_ms(), unknown, self.stats.pace_ms()))
        if isinstance(msg, P.StatsRequest):
            return answer(P.Stats(self.stats_json()))
        if not isinstance(msg, (P.Hello, P.DraftRequest, P.Bye)):
            self.stats.error("unexpected")
            return answer(P.Error("unexpected", f"{type(msg).__name__} is not a request"))
        full = self.q_in.qsize() + self.backlog >= self.queue_limit
        if full and not isinstance(msg, P.Bye):  # not taken: the target goes on without this draft. A Bye is
            # always taken, beyond the limit: it is tiny, and it frees a session's draft KV
            self.stats.error("busy")
            tag = 0 if isinstance(msg, P.Hello) else msg.tag
            step = msg.step if isinstance(msg, P.DraftRequest) else -1
            stream = msg.stream if isinstance(msg, P.Hello) else 0
            return answer(P.Error("busy", "draft server queue is full; retry later", tag, step, stream))
        user = security.peer_key(frames[1]) if self._auth else ""
        self.q_in.put(Request(peer, msg, tensors, time.perf_counter(), user, self._on_this_host(peer, frames[1])))

    def _on_this_host(self, peer: bytes, frame: zmq.Frame) -> bool:
        if peer not in self._local:
            if len(self._local) >= 4096:  # connections come and go: forget them all now and then
                self._local.clear()
            try:
                address = frame.get("Peer-Address")
            except zmq.ZMQError:  # a transport without addresses (inproc)
                address = None
            self._local[peer] = on_this_host(address)
        return self._local[peer]


class Outbox:
    """The compute loop's end of the reply path: a PUSH socket into the IO thread."""

    def __init__(self, ctx: zmq.Context, address: str, stopping: threading.Event):
        self.stopping = stopping
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDTIMEO, 1000)  # never wait on an IO thread that is gone
        self.sock.connect(address)

    def send(self, peer: bytes, msg, tensors=()) -> None:
        """Hand a reply to the IO thread. Once stopping, the IO thread may be gone: a reply it
        cannot take is dropped (a PUSH without its peer would block the compute loop forever)."""
        stamp = struct.pack("d", time.perf_counter())
        flags = zmq.NOBLOCK if self.stopping.is_set() else 0
        try:
            self.sock.send_multipart([stamp, peer, *P.encode(msg, tensors)], flags=flags, copy=False)
        except zmq.Again:
            log.warning("reply to %s dropped: the server is stopping", peer.hex()[:8])

    def close(self) -> None:
        self.sock.close(0)
