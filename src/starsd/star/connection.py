"""A client's link to a draft server, and the heartbeat that tells a dead server from a busy one.

A target server's stream has a socket of its own (`Socket`): one session per connection. An engine
that makes each of its requests a session (a vLLM instance: starsd/vllm) shares one `Connection` per
draft server among them: one DEALER socket and one heartbeat, whatever the number of requests (256
requests held 512 sockets and 256 threads when each had its own). Each session is a `Channel` of
it, numbered by its Hello's `stream`; the server binds the session to the connection as it binds a
target's, and its messages come back routed by tag (a Welcome or a refused Hello by stream number).

A connection is read from one thread, the engine's (ZeroMQ sockets are not shared between threads):
whichever channel waits pumps the socket and files what comes for the others in their inboxes. A
channel that leaves says goodbye to its session (its client need not have read the Welcome); a
message for a session that has left is dropped, and a Welcome for a channel that left is answered
with a goodbye (a Hello queued while the server was down opens a session nobody would use).
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable

import zmq

from starsd.config import ClientKeys
from starsd.star import protocol as P
from starsd.star import security
from starsd.star.placement import Loads

log = logging.getLogger("starsd.client")


class Heartbeat(threading.Thread):
    """Pings the draft server on a socket of its own while the target computes, so the server can
    tell a busy target from a dead one, and the target a dead server from a busy one. One Ping
    carries every session tag `tags()` gives (a connection's sessions: one heartbeat for all), and
    its Pong names those the server does not hold (restarted, or it freed them): `lost(tag)`."""

    def __init__(self, address: str, tags: Callable[[], Iterable[int]], interval_s: float,
                 keys: ClientKeys = ClientKeys(), grace_s: float = 0.0):
        super().__init__(name="starsd-heartbeat", daemon=True)
        self.address = address
        self.keys = keys
        self.tags = tags
        self.interval_s = interval_s
        self._stop_event = threading.Event()
        self._last_pong = time.monotonic() + grace_s
        self.gone: frozenset[int] = frozenset()  # tags the server's last answers said it does not hold
        self.level_ms = 0.0  # the server's time per drafted level, as its last Pong said (0: none said it yet)
        self.local = -1  # the server's sessions of targets on its host, as its last Pong said (-1: none said it yet)
        self.wait_ms = -1.0  # the server's recent queue before a draft, as its last Pong said (-1: none said it yet)
        self.pace_ms = 0.0  # the server's recent time per level of a draft batch, as its last Pong said (0: not yet)

    def silent_s(self) -> float:
        """Seconds since the server last answered a ping (or since the heartbeat started, plus
        `grace_s`: the time its connection is allowed to take)."""
        return time.monotonic() - self._last_pong

    def lost(self, tag: int) -> bool:
        """Whether the server's answers say it no longer holds session `tag`."""
        return tag in self.gone

    def run(self) -> None:
        sock = security.connect(zmq.Context.instance(), self.address, self.keys, send_hwm=16)  # pings to a dead
        # server are dropped, not queued up for its successor
        try:
            while not self._stop_event.wait(self.interval_s):
                try:
                    self._beat(sock)
                except Exception:  # (a thread that died would leave every session unreachable for good)
                    log.exception("heartbeat to %s", self.address)
        finally:
            sock.close(0)

    def _beat(self, sock) -> None:
        """One round: a Ping of every tag, and the Pongs that came since the last."""
        held = tuple(self.tags())
        for start in range(0, max(1, len(held)), P.MAX_PING_TAGS):
            try:
                sock.send_multipart(P.encode(P.Ping(0, time.time(), held[start:start + P.MAX_PING_TAGS])), zmq.NOBLOCK)
            except zmq.Again:
                pass
        gone = set(self.gone)
        while sock.poll(0):
            pong = sock.recv_multipart()
            self._last_pong = time.monotonic()
            try:
                msg = P.decode(pong)[0]
            except P.ProtocolError:
                continue  # an answer all the same: the server is alive
            if not isinstance(msg, P.Pong):
                continue
            gone.update(msg.unknown)
            if msg.level_ms > 0:
                self.level_ms = msg.level_ms
            if msg.local >= 0:
                self.local = msg.local
            if msg.wait_ms >= 0:
                self.wait_ms = msg.wait_ms
            if msg.pace_ms > 0:
                self.pace_ms = msg.pace_ms
        self.gone = frozenset(gone.intersection(held))  # one rebinding: readers see either set

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2)


class Socket:
    """A session's own DEALER socket: the connection is the session's (stream number 0)."""

    stream = 0

    def __init__(self, address: str, keys: ClientKeys):
        self.sock = security.connect(zmq.Context.instance(), address, keys)

    def send(self, frames: list) -> None:
        self.sock.send_multipart(frames, copy=False)

    def receive(self, wait_ms: int) -> tuple | None:
        """The next message, decoded, if one comes within wait_ms; raises P.ProtocolError."""
        if not self.sock.poll(wait_ms):
            return None
        return P.decode(self.sock.recv_multipart(copy=False))

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger=linger_ms)


class Channel:
    """One session's share of a Connection: what comes for it (by its stream number, then its tag)."""

    def __init__(self, connection: Connection, stream: int):
        self.connection = connection
        self.stream = stream
        self.inbox: collections.deque = collections.deque()  # decoded messages, oldest first
        self.tag = 0  # its session's, once its Welcome came (0: none yet)
        self.closed = False

    @property
    def heartbeat(self) -> Heartbeat:
        return self.connection.heartbeat

    def send(self, frames: list) -> None:
        self.connection.sock.send_multipart(frames, copy=False)

    def receive(self, wait_ms: int) -> tuple | None:
        if not self.inbox:
            self.connection.pump(self, wait_ms)
        return self.inbox.popleft() if self.inbox else None

    def close(self, linger_ms: int = 0) -> None:
        if not self.closed:
            self.closed = True
            self.connection.drop(self, linger_ms)


class Connection:
    """One socket and one heartbeat to one draft server, shared by a process's sessions (Channels)."""

    def __init__(self, address: str, keys: ClientKeys, heartbeat_s: float, grace_s: float,
                 on_empty: Callable[[Connection], None]):
        self.address = address
        self.sock = security.connect(zmq.Context.instance(), address, keys)
        self._numbers = itertools.count(1)
        self._by_stream: dict[int, Channel] = {}
        self._by_tag: dict[int, Channel] = {}
        self._on_empty = on_empty
        self._linger_ms = 0  # the longest any leaving channel asked its goodbye to be waited for
        self.heartbeat = Heartbeat(address, lambda: list(self._by_tag), heartbeat_s, keys, grace_s)
        if heartbeat_s > 0:
            self.heartbeat.start()

    def __len__(self) -> int:
        return len(self._by_stream)

    def channel(self) -> Channel:
        ch = Channel(self, next(self._numbers))
        self._by_stream[ch.stream] = ch
        return ch

    def pump(self, waiting: Channel, wait_ms: int) -> None:
        """Read what the socket holds, each message into its channel's inbox, until `waiting`'s inbox
        has one or wait_ms pass. A malformed message raises P.ProtocolError to the reader."""
        until = time.monotonic() + wait_ms / 1e3
        while not waiting.inbox:
            left = max(0, math.ceil((until - time.monotonic()) * 1e3))
            if not self.sock.poll(left):
                return
            self._file(*P.decode(self.sock.recv_multipart(copy=False)))

    def _file(self, msg, tensors) -> None:
        tag = getattr(msg, "tag", 0)
        if isinstance(msg, P.Welcome):
            ch = self._by_stream.get(msg.stream)
            if ch is None:  # a Hello of a channel that left (sent before a restart, delivered after it):
                self._bye(msg.tag)  # the session it opened is nobody's
                return
            self._by_tag.pop(ch.tag, None)
            ch.tag = msg.tag
            self._by_tag[ch.tag] = ch
        elif isinstance(msg, P.Error) and not tag:  # a refused Hello, by its number; a server that names none
            # (another protocol version's, refusing this one) answers the oldest Hello waiting
            ch = self._by_stream.get(msg.stream) or next((c for c in self._by_stream.values() if not c.tag), None)
        else:
            ch = self._by_tag.get(tag)
        if ch is not None:
            ch.inbox.append((msg, tensors))

    def _bye(self, tag: int) -> None:
        try:
            self.sock.send_multipart(P.encode(P.Bye(tag)), zmq.NOBLOCK)
        except zmq.ZMQError:  # (no connection now: the server frees it after its timeout)
            pass

    def drop(self, ch: Channel, linger_ms: int) -> None:
        """A channel leaves: its session, if its Welcome came, is said goodbye to (read by its client
        or not), and the connection closes with its last channel."""
        self._by_stream.pop(ch.stream, None)
        if ch.tag and self._by_tag.get(ch.tag) is ch:
            del self._by_tag[ch.tag]
            self._bye(ch.tag)
        self._linger_ms = max(self._linger_ms, linger_ms)
        if not self._by_stream:
            if self.heartbeat.is_alive():
                self.heartbeat.stop()
            self.sock.close(linger=self._linger_ms)
            self._on_empty(self)


class Connections:
    """An engine process's connections: one per draft server address, opened with its first session
    and closed with its last."""

    def __init__(self, keys: ClientKeys = ClientKeys(), heartbeat_s: float = 0.25, dead_after_s: float = 1.0):
        self.keys = keys
        self.heartbeat_s = heartbeat_s
        self.grace_s = 4 * dead_after_s  # a first pong takes a connection and a handshake
        self._open: dict[str, Connection] = {}
        self._loads: dict[tuple[str, ...], Loads] = {}

    def __len__(self) -> int:
        return len(self._open)

    def channel(self, address: str) -> Channel:
        if address not in self._open:
            self._open[address] = Connection(address, self.keys, self.heartbeat_s, self.grace_s, self._closed)
        return self._open[address].channel()

    def _closed(self, connection: Connection) -> None:
        if self._open.get(connection.address) is connection:
            del self._open[connection.address]

    def loads(self, addresses: list[str]) -> Loads:
        """The loads of several servers, one thread for all the sessions that list them."""
        key = tuple(addresses)
        if key not in self._loads:
            self._loads[key] = Loads(addresses, self.keys)
            self._loads[key].start()
        return self._loads[key]

    def close(self) -> None:
        """Stop the loads' threads (each connection closes with its last session)."""
        for loads in self._loads.values():
            loads.stop()
        self._loads.clear()
