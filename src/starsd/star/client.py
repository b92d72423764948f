"""A target's session on a draft server: hello, draft requests and their replies, refusals as
DraftServerError, over a socket of its own or a channel of its engine's shared connection, with the
heartbeat that tells a dead server from a busy one (star/connection.py). The drafter that a
target's decode loop drafts with over it is star/remote_drafter.py.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time

import torch
import zmq

from starsd.config import ClientKeys, DraftConfig, SamplingConfig
from starsd.errors import StarsdError
from starsd.star import protocol as P
from starsd.star import security
from starsd.star.connection import Channel, Connections, Heartbeat, Socket
from starsd.star.placement import Loads, least_loaded, should_move


log = logging.getLogger("starsd.client")

# Refusals after which a target decodes alone and asks again later: the server is absent, or full.
GO_ON_ALONE = ("busy", "unreachable", "timeout", "too_many_sessions", "kv_full", "bad_reply")
# Refused hellos that no retry mends: the target and the server do not belong together.
MISCONFIGURED = ("version", "vocab_mismatch")


class DraftServerError(StarsdError, RuntimeError):
    """The draft server refused a request (code says why) or did not answer in time."""

    def __init__(self, code: str, message: str):
        super().__init__(f"draft server: {message} [{code}]")
        self.code = code


def query_stats(address: str, name: str = "stats", timeout_s: float = 10.0,
                keys: ClientKeys = ClientKeys()) -> dict | None:
    """A draft server's counters (a StatsRequest on a connection of its own); None if it does not
    answer within timeout_s."""
    client = DraftClient(address, "", name, timeout_s=timeout_s, heartbeat_s=0, keys=keys)
    try:
        return client.stats()
    except DraftServerError:
        return None
    finally:
        client.close()


def for_target(addresses: str, i: int) -> str:
    """Several draft servers' addresses (comma-separated) as target i takes them: starting at the
    (i mod K)th, so that K servers each open with a K-th of the targets, and each target has the
    others to move to (DraftClient.move)."""
    listed = [a for a in addresses.split(",") if a]
    k = i % max(1, len(listed))
    return ",".join(listed[k:] + listed[:k])


class DraftClient:
    """One session on a draft server. Not thread-safe: one request in flight at a time.

    Its link is a DEALER socket of its own, or, given an engine's `connections`, a channel of the one
    connection that all the engine's sessions share with that server (star/connection.py): one socket
    and one heartbeat for them all.

    `step` numbers the session's requests as the server counts them: it advances when a reply
    comes and stays put on an Error, since a refused request is not taken (protocol.Error).

    After the handshake a Heartbeat pings the server every heartbeat_s on a socket of its own; the
    server's IO thread answers at once, even while it drafts. A request whose server has not
    answered a ping for dead_after_s fails as `unreachable` within about that long, instead of
    waiting out timeout_s (which is for a server that is alive but slow).

    `address` may name several draft servers, comma-separated: the client talks to one at a time,
    to begin with the one holding the fewest sessions (the first listed on a tie), and `move()`
    makes another its own: star/remote_drafter.py moves a stream's session when its server dies or
    has no room for it, or when `better()` finds the sessions unevenly spread (star/placement.py)."""

    def __init__(self, address: str, fingerprint: str, name: str = "target", timeout_s: float = 60.0,
                 heartbeat_s: float = 0.25, dead_after_s: float = 1.0, keys: ClientKeys = ClientKeys(),
                 connections: Connections | None = None):
        self.addresses = [a.strip() for a in address.split(",") if a.strip()] or [address]
        self.address = self.addresses[0]  # the server this client talks to now
        self.connections = connections  # the engine's shared connections (None: a socket of its own)
        self.loads: Loads | None = None  # the sessions each of several servers holds
        if len(self.addresses) > 1:
            if connections is None:
                self.loads = Loads(self.addresses, keys)
                self.loads.start()
            else:
                self.loads = connections.loads(self.addresses)
            self.loads.wait_first(dead_after_s)
            self.address = least_loaded(self.addresses, self.loads.held()) or self.address
        self._judged = 0  # the last round of loads that better() judged (or, after a Welcome, the round
        # before which it judges none: the figures do not count this session's own move yet)
        self._rng = random.Random()
        self._uneven: str | None = None  # the server that better()'s last round judged holding 2+ fewer
        self._moved: dict[str, str] = {}  # old -> new address of each listed server that moved (readdress)
        self.keys = keys  # for a server that requires authentication (star/security.py)
        self.fingerprint = fingerprint
        self.name = name
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self._heartbeat: Heartbeat | None = None
        self.link = self._link()
        self.tag = 0
        self.step = 0
        self.taps: tuple[int, ...] | None = None  # the target features the server's drafter needs (its Welcome)
        self._welcome_level_ms = 0.0  # the server's time per drafted level, as its Welcome said (0: unknown)
        self._welcome_wait_ms = -1.0  # the server's recent queue before a draft, as its Welcome said (-1: unknown)
        self._welcome_pace_ms = 0.0  # the server's recent time per level of a draft batch, as its Welcome said
        self.ingest_ms = 0.0  # the server's time to ingest a token of a stream it does not hold, as its Welcome said
        self._welcome_local = -1  # the server's sessions of targets on its host, as its Welcome said (-1: not said)
        self.hello_at = time.monotonic()  # when the last Hello went out
        self.hello_pending = False  # a Hello went out on this socket and no Welcome or refusal was read since

    def _link(self) -> Socket | Channel:
        if self.connections is not None:
            return self.connections.channel(self.address)
        return Socket(self.address, self.keys)

    @property
    def beat(self) -> Heartbeat | None:
        """The heartbeat of this client's server (its own, or its connection's; None: none yet)."""
        if isinstance(self.link, Channel):
            return self.link.heartbeat if self.connections.heartbeat_s > 0 else None
        return self._heartbeat

    def hello(self, timeout_s: float | None = None) -> P.Welcome:
        self.send_hello()
        return self.receive_welcome(timeout_s=timeout_s)

    def send_hello(self) -> None:
        """The first half of hello(): receive_welcome() must come before any other request."""
        self.hello_at = time.monotonic()
        self._send(P.Hello(P.PROTOCOL_VERSION, self.fingerprint, self.name, self.link.stream))
        self.hello_pending = True  # (not if it could not go out)

    def receive_welcome(self, timeout_s: float | None = None, wait_s: float | None = None) -> P.Welcome | None:
        """The second half of hello(): the session is open once its Welcome comes. With `wait_s`,
        None if it has not come within that long (the Hello is still in flight)."""
        try:
            got = self._receive(P.Welcome, timeout_s=timeout_s,
                                until=None if wait_s is None else time.monotonic() + wait_s)
        except DraftServerError:
            self.hello_pending = False
            raise
        if got is None:
            return None
        self.hello_pending = False
        welcome = got[0]
        self.tag = welcome.tag
        self.taps = None if welcome.taps is None else tuple(welcome.taps)
        if self.loads is not None:
            self._judged = self.loads.rounds + 2
            self._uneven = None
        self._welcome_level_ms = welcome.level_ms
        self._welcome_wait_ms = welcome.wait_ms
        self._welcome_pace_ms = welcome.pace_ms
        self.ingest_ms = welcome.ingest_ms
        self._welcome_local = welcome.local
        if self.heartbeat_s > 0 and isinstance(self.link, Socket):
            if self._heartbeat:
                self._heartbeat.stop()
            # its socket's first pong takes a connection and a handshake, as long as the Hello took
            # (several round trips on a slow link): silence counts from then. A Welcome read late
            # (looked for between steps) took less than it seems: at most a few dead_after_s.
            grace_s = min(time.monotonic() - self.hello_at, 4 * self.dead_after_s)
            tag = self.tag
            self._heartbeat = Heartbeat(self.address, lambda: (tag,), self.heartbeat_s, self.keys, grace_s)
            self._heartbeat.start()
        return welcome

    def try_hello(self, wait_s: float = 5.0) -> bool:
        """hello(), except that a draft server that is absent, full or busy is no failure: the target
        starts decoding alone, and its RemoteDrafter opens the session later (with backoff). One that
        has not answered within wait_s (down, or not started yet) leaves its Hello in flight, and the
        RemoteDrafter takes the Welcome when it comes: a target does not wait out `timeout_s` before it
        serves. A misconfiguration (another protocol version or vocabulary) still raises."""
        try:
            self.send_hello()
            if self.receive_welcome(wait_s=min(wait_s, self.timeout_s)) is None:
                log.warning("no answer from the draft server at %s within %.0f s: decoding alone until it answers",
                            self.address, min(wait_s, self.timeout_s))
                return False
            return True
        except DraftServerError as e:
            if e.code not in GO_ON_ALONE:
                raise
            log.warning("no draft session yet (%s): decoding alone until the draft server admits one", e)
            return False

    @property
    def level_ms(self) -> float:
        """The server's recent time per drafted level of a stream: as the heartbeat's last Pong said,
        else as the Welcome did (0: unknown)."""
        beat = self.beat
        return beat.level_ms if beat is not None and beat.level_ms > 0 else self._welcome_level_ms

    @property
    def wait_ms(self) -> float:
        """The server's recent time on a request from its arrival to the start of its draft, as the
        heartbeat's last Pong said, else as the Welcome did (0: unknown)."""
        beat = self.beat
        return max(0.0, beat.wait_ms if beat is not None and beat.wait_ms >= 0 else self._welcome_wait_ms)

    @property
    def pace_ms(self) -> float:
        """The server's recent time per level of a draft batch (its whole time), as the heartbeat's last Pong
        said, else as the Welcome did (0: unknown)."""
        beat = self.beat
        return beat.pace_ms if beat is not None and beat.pace_ms > 0 else self._welcome_pace_ms

    @property
    def local_sessions(self) -> int:
        """The server's sessions of targets on its own host, as its last Pong said, else its Welcome
        (-1: not said)."""
        beat = self.beat
        return beat.local if beat is not None and beat.local >= 0 else self._welcome_local

    def reachable(self, patience: float = 1.0) -> bool:
        """Whether the server answered a ping within patience x dead_after_s (True without a heartbeat)."""
        beat = self.beat
        return beat is None or beat.silent_s() <= patience * self.dead_after_s

    def session_gone(self) -> bool:
        """Whether the heartbeat's replies say the server no longer holds this client's session: it
        was restarted, or it freed the session after a silence. No request needs to be refused first
        (a target that decodes alone for a while sends none)."""
        beat = self.beat
        return bool(self.tag) and beat is not None and beat.lost(self.tag)

    def move(self, to: str | None = None) -> str:
        """Make another of several servers this client's: `to`, else the least loaded of the others
        that answer, else the next listed. A Bye frees the session on the one it leaves (if it still
        listens), its heartbeat stops, and the next reopen() says hello at the new one. Returns its
        address."""
        self._leave()
        self._heartbeat = None
        listed = self.addresses  # read once: readdress() may rebind it from another thread
        here = listed.index(self.address) if self.address in listed else -1
        following = listed[(here + 1) % len(listed)]
        held = self.loads.held() if self.loads is not None else {}
        self.address = to or least_loaded(listed, held, skip=self.address) or following
        self.link = self._link()
        self.tag = 0
        self.hello_pending = False
        return self.address

    def readdress(self, old: str, new: str) -> bool:
        """From any thread: the server listed at `old` runs at `new` now (a gateway said so: a Ray
        actor started again on another node). Whether this client lists `old`. The thread that uses
        the client follows at its next request (`moved_to`; star/remote_drafter.py)."""
        if old not in self.addresses:
            return False
        self._moved[old] = new
        self.addresses = [new if a == old else a for a in self.addresses]  # one rebinding: readers see either list
        if self.loads is not None:
            self.loads.readdress(old, new)
        return True

    def relist(self, addresses: list[str]) -> None:
        """From any thread: the star's draft servers are `addresses` now (one added, or one retired:
        star/elastic.py). The thread that uses the client follows at its next request: a session on a
        server no longer listed moves (`retired`), and the loads spread the sessions onto one added."""
        listed = [a for a in addresses if a]
        if not listed:
            return
        if self.loads is None and len(listed) > 1:
            self.loads = self.connections.loads(listed) if self.connections is not None else Loads(listed, self.keys)
            if self.connections is None:
                self.loads.start()
        elif self.loads is not None:
            self.loads.relist(listed)
        self.addresses = listed  # one rebinding: readers see either list

    def retired(self) -> bool:
        """Whether the server this client talks to is no longer one of the star's (relist)."""
        return self.address not in self.addresses and self.address not in self._moved

    def moved_to(self) -> str | None:
        """Where the server this client talks to runs now, if it moved (readdress); else None."""
        address = self.address
        while address not in self.addresses and address in self._moved:  # a chain of moves
            address = self._moved[address]
        return None if address == self.address else address

    def answers(self) -> bool:
        """Whether this client's server answered the loads' pings lately (several servers only)."""
        return self.loads is not None and self.address in self.loads.held()

    def better(self) -> str | None:
        """Another server that this client's session should move to, to spread the sessions evenly
        (placement.should_move), judged once for each new round of the servers' figures; None: stay."""
        if self.loads is None or not self.tag or self.loads.rounds <= self._judged:
            return None
        self._judged = self.loads.rounds
        held = self.loads.held()
        # only to a server that answered the last round: the figures of one that stopped answering stay
        # fresh for seconds, and a server just killed, holding no session, looked the best place
        recent = {a: n for a, n in held.items() if a in self.loads.answered}
        other = least_loaded(self.addresses, recent, skip=self.address)
        uneven = other if other is not None and self.address in held and held[self.address] - held[other] >= 2 else None
        # and only where the last round judged showed the same: one round may be taken while other
        # targets' hellos are in flight (targets started together, half of them not yet counted by
        # their server), and a spread on it moves sessions that then move back
        seen_before, self._uneven = self._uneven, uneven
        if uneven is None or uneven != seen_before:
            return None
        return other if should_move(held[self.address], held[other], self._rng) else None

    def reopen(self) -> None:
        """A fresh socket, and a Hello on it for a new session (the old socket's queued messages are
        dropped, so no stale request reaches a restarted server; a channel of a shared connection says
        goodbye to whatever session its Hello opened); receive_welcome() says when it is open."""
        self.link.close(0)
        self.link = self._link()
        self.tag = 0
        self.send_hello()

    def draft(self, tokens: list[int], budget: int, draft: DraftConfig | None = None,
              sampling: SamplingConfig | None = None) -> tuple[P.DraftReply, tuple]:
        """Send one draft request and wait for its reply. With settings it is a reset: `tokens` is
        then the whole sequence, and it gets a fresh step number, so that no late reply to an
        earlier request can pass for its answer. Raises DraftServerError on a refusal."""
        self.send_draft(tokens, budget, draft, sampling)
        return self.receive_draft()

    def send_draft(self, tokens: list[int], budget: int, draft: DraftConfig | None = None,
                   sampling: SamplingConfig | None = None, features: tuple[torch.Tensor, ...] = (),
                   stop: float = -1.0, more: int = 0) -> None:
        """The first half of draft(): the request goes out; receive_draft() must come before the next.
        `features`: the tokens' target features as protocol.features_to_wire gives them; `stop`: where
        the draft's chain stops (-1: the session's min_path_prob); `more`: requests of this process's
        that follow it at once, at most (protocol.DraftRequest)."""
        if draft is not None:  # a reset
            self.step += 1
        self._send(*P.draft_request(self.tag, self.step, torch.tensor(tokens, dtype=torch.int32), budget, draft,
                                    sampling, features, stop, more))

    def receive_draft(self, until: float | None = None) -> tuple[P.DraftReply, tuple] | None:
        """The second half of draft(): the reply to the request sent last. With `until` (monotonic
        s), None if it has not come by then; the request is then still in flight, and this is to be
        called again before another request goes out."""
        while True:
            got = self._receive(P.DraftReply, step=self.step, until=until)
            if got is None:
                return None
            if got[0].step == self.step:
                self.step += 1
                return got

    def stats(self) -> dict:
        self._send(P.StatsRequest())
        msg, _ = self._receive(P.Stats)
        return json.loads(msg.json)

    def ping(self) -> float:
        """Round trip of a Ping answered by the server's IO thread (ms): the network's share."""
        t0 = time.perf_counter()
        self._send(P.Ping(self.tag, time.time()))
        self._receive(P.Pong)
        return (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        self._leave()
        if self.loads is not None and self.connections is None:  # (shared ones: the connections' to stop)
            self.loads.stop()

    def _leave(self) -> None:
        """The session ends (a Bye, if the server still listens), and with it the heartbeat and the socket
        (a channel says its Bye itself, its Welcome read or not: star/connection.py)."""
        if self._heartbeat:
            self._heartbeat.stop()
        if self.tag and isinstance(self.link, Socket):
            try:
                self._send(P.Bye(self.tag))
            except (zmq.ZMQError, DraftServerError):
                pass
        self.link.close(100)

    def _send(self, msg, tensors=()) -> None:
        try:
            self.link.send(P.encode(msg, tensors))
        except zmq.Again:
            raise DraftServerError("unreachable", f"{self.address} takes no message: no connection to it "
                                                  f"takes one within {security.SEND_TIMEOUT_MS / 1e3:.0f} s") from None

    def _receive(self, want: type, step: int = -1, timeout_s: float | None = None, until: float | None = None):
        """The next message, which must be a `want`; None if `until` (monotonic s) passes first. An
        Error is raised as DraftServerError unless it answers another step than `step` (a late
        answer to an earlier request: skipped)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            wait_ms = 100 if until is None else max(0, min(100, math.ceil((until - time.monotonic()) * 1e3)))
            try:
                got = self.link.receive(wait_ms)
            except P.ProtocolError as e:  # a server that speaks nonsense is no server
                raise DraftServerError("bad_reply", f"malformed message from {self.address}: {e}") from None
            if got is None:
                if until is not None and time.monotonic() >= until:
                    return None
                if time.monotonic() > deadline:
                    raise DraftServerError("timeout", f"no answer from {self.address} within {timeout_s:.0f} s")
                if not self.reachable():
                    raise DraftServerError("unreachable", f"{self.address} answered no heartbeat for "
                                                          f"{self.beat.silent_s():.1f} s")
                if self.session_gone():
                    raise DraftServerError("unknown_session", f"{self.address} no longer holds session {self.tag:x}")
                continue
            msg, tensors = got
            if isinstance(msg, P.Error):
                if step >= 0 and msg.step not in (-1, step):
                    continue
                raise DraftServerError(msg.code, msg.message)
            if not isinstance(msg, want):
                raise DraftServerError("unexpected", f"expected {want.__name__}, got {type(msg).__name__}")
            return msg, tensors
