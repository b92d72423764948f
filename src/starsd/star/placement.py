"""Which of several draft servers a target's session goes to: the one holding the fewest sessions.

A target given several servers (DraftClient's `address`, comma-separated) pings each of them once
a second on a socket of its own (Loads); every draft server's Pong says how many sessions it holds.
- A new session opens at the server that holds the fewest, the first in the target's own order on
  a tie (client.for_target: target i lists server i mod K first, so K servers started together
  each take a K-th of the targets, as the simulator assigns them: theory/simulate.py).
- A session that its server loses or cannot hold moves to the least loaded of the others that
  answer (any next one where none does).
- Sessions rebalance: a target whose server holds at least two sessions more than another, in two
  rounds of figures in a row (one round may be taken while hellos are in flight), moves there with
  a probability chosen so that, of all the targets that see the same figures, about a
  quarter of the difference moves each second, and one at least (`should_move`): a large
  difference halves each second, so a server that joins or comes back (a restart) takes its share
  within a few seconds, and few targets overshoot (each move costs the new server a reset: the
  whole accepted prefix to ingest).
"""

from __future__ import annotations

import random
import threading
import time

import zmq

from starsd.config import ClientKeys
from starsd.star import protocol as P
from starsd.star import security


class Loads(threading.Thread):
    """The sessions each of several draft servers holds, as their Pongs said (refreshed every
    interval_s; a server silent for fresh_s counts as absent)."""

    def __init__(self, addresses: list[str], keys: ClientKeys = ClientKeys(), interval_s: float = 1.0,
                 fresh_s: float = 3.0):
        super().__init__(name="starsd-loads", daemon=True)
        self.addresses = list(addresses)
        self.keys = keys
        self.interval_s = interval_s
        self.fresh_s = fresh_s
        self.rounds = 0  # rounds of pings whose answers have been read
        self.answered: frozenset[str] = frozenset()  # the servers that answered in the last round
        self._seen: dict[str, tuple[int, float]] = {}  # address -> (sessions, monotonic time of the answer)
        self._first = threading.Event()
        self._stop_event = threading.Event()
        self._moves: list[tuple[str, str]] = []  # (old, new) not yet applied by the thread (readdress)
        self._relists: list[list[str]] = []  # lists of the servers to ping from now on, not yet applied (relist)

    def held(self) -> dict[str, int]:
        """Sessions held by each server that answered within fresh_s."""
        now = time.monotonic()
        return {a: n for a, (n, at) in list(self._seen.items()) if now - at <= self.fresh_s and n >= 0}

    def readdress(self, old: str, new: str) -> None:
        """From any thread: the server at `old` is pinged at `new` from the next round on."""
        self._moves.append((old, new))

    def relist(self, addresses: list[str]) -> None:
        """From any thread: these servers are pinged from the next round on (one added, or one retired)."""
        self._relists.append(list(addresses))

    def wait_first(self, timeout_s: float) -> None:
        """Until the first round's answers are in (or timeout_s)."""
        self._first.wait(timeout_s)

    def run(self) -> None:
        ctx = zmq.Context.instance()
        socks = {a: security.connect(ctx, a, self.keys, send_hwm=4) for a in self.addresses}  # pings to a dead
        # server are dropped, not queued up for its successor
        poller = zmq.Poller()
        for sock in socks.values():
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop_event.is_set():
                while self._moves:
                    old, new = self._moves.pop(0)
                    if old in socks:
                        poller.unregister(socks[old])
                        socks.pop(old).close(0)
                        self._seen.pop(old, None)
                        if new not in socks:
                            socks[new] = security.connect(ctx, new, self.keys, send_hwm=4)
                            poller.register(socks[new], zmq.POLLIN)
                        self.addresses = [new if a == old else a for a in self.addresses]
                relisted = None
                while self._relists:  # (appended from other threads: popped, never reassigned)
                    relisted = self._relists.pop(0)
                if relisted is not None:
                    for gone in set(socks) - set(relisted):
                        poller.unregister(socks[gone])
                        socks.pop(gone).close(0)
                        self._seen.pop(gone, None)
                    for new in set(relisted) - set(socks):
                        socks[new] = security.connect(ctx, new, self.keys, send_hwm=4)
                        poller.register(socks[new], zmq.POLLIN)
                    self.addresses = relisted
                by_sock = {sock: a for a, sock in socks.items()}
                for sock in socks.values():
                    try:
                        sock.send_multipart(P.encode(P.Ping(0, time.time())), zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                until = time.monotonic() + self.interval_s
                answered: set[str] = set()
                while not self._stop_event.is_set() and (left := until - time.monotonic()) > 0:
                    for sock, _ in poller.poll(max(1, min(100, int(left * 1e3)))):  # stop() waits 0.1 s at most
                        address = by_sock[sock]
                        try:
                            msg = P.decode(sock.recv_multipart())[0]
                        except P.ProtocolError:
                            continue
                        if isinstance(msg, P.Pong):
                            self._seen[address] = (msg.sessions, time.monotonic())
                            answered.add(address)
                    if len(answered) == len(socks) and not self._first.is_set():
                        break  # the first round ends as soon as every server has answered
                self.answered = frozenset(answered)
                self.rounds += 1
                self._first.set()
        finally:
            for sock in socks.values():
                sock.close(0)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2)


def least_loaded(order: list[str], held: dict[str, int], skip: str | None = None) -> str | None:
    """The server holding the fewest sessions among those that answered (the first in `order` on a
    tie), `skip` left out; None if none answered."""
    candidates = [a for a in order if a in held and a != skip]
    return min(candidates, key=lambda a: held[a]) if candidates else None


def should_move(mine: int, fewest: int, rng: random.Random) -> bool:
    """Whether a target whose server holds `mine` sessions (its own among them) moves to one holding
    `fewest`. Each of the `mine` targets that see these figures moves with probability
    max(1, (mine - fewest) / 4) / mine, so about a quarter of the difference moves, which halves
    it, and one target at least, so that the last steps to even do not drag. Half the difference at
    once would even the two out on average, but with a binomial's spread about it: many targets
    moving back and forth. A difference of one moves nobody.

    >>> rng = random.Random(0)
    >>> should_move(3, 2, rng), should_move(1, 0, rng)
    (False, False)
    >>> round(sum(should_move(8, 0, rng) for _ in range(8000)) / 1000)  # of 8 on one server, 0 on another
    2
    """
    diff = mine - fewest
    return diff >= 2 and rng.random() < max(1.0, diff / 4) / mine
