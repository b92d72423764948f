"""A drafter that lives on a draft server: RemoteDrafter has the Drafter interface (start /
propose), so the target runs the very same draft -> verify -> accept loop (spec.decode.speculative)
whether its drafter is local or remote. It keeps each stream's place on the server (RemoteSequence),
what its drafts took (Timing), and the recovery from a server that is slow, full, gone or back.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from starsd.config import DraftConfig, SamplingConfig
from starsd.spec_decode.sparse_q import SparseQ
from starsd.spec_decode.tree import DraftTree
from starsd.star import protocol as P
from starsd.star.client import GO_ON_ALONE, MISCONFIGURED, DraftClient, DraftServerError
from starsd.star.hosts import server_on_this_host, shares_cores
from starsd.star.stats import WAIT_WINDOW_S

REPLY_FRESH_S = WAIT_WINDOW_S  # a drafter's own figure of its server's time counts this long after its reply

log = logging.getLogger("starsd.client")


@dataclass
class RemoteSequence:
    tokens: list[int]  # committed tokens, as the target sees them
    sent: int = 0  # how many of them the draft server holds; 0: the next request is a reset
    pending: int = 0  # a request is in flight (its reply not read yet): the server will hold this many
    # tokens once it is taken. Set by start()'s early reset and by a draft that missed its deadline.
    pending_since: float = 0.0  # when that request went out (monotonic s)
    alone_until: float = 0.0  # no drafts before this (monotonic s): the server refused this stream for want of room
    taps: tuple[int, ...] | None = None  # the target features this stream keeps for an EAGLE head (None: none)
    features: list[torch.Tensor] = field(default_factory=list)  # EAGLE: [rows, F] chunks, the features of
    # tokens[1:] in order (row j: the target's feature at position j); a reset sends them all again
    feature_count: int = 0  # rows in `features`
    behind: int = 0  # the last draft given was asked this many committed tokens ago (0: for the current prefix)
    share_ms: float = 0.0  # the server's time on the last draft given, over the streams of its batch
    arrived: tuple | DraftServerError | None = None  # the reply to the request in flight, read by keep_up() at a
    # step that asked no draft (or the refusal it was), for the next request to take
    lag: int | None = None  # the tokens committed when keep_up() found that reply (None: not found by it)

    def forget(self) -> None:
        """No reply to the request in flight will be read (its server or session is gone)."""
        self.pending = 0
        self.arrived = self.lag = None

    def add_features(self, chunk: torch.Tensor) -> None:
        self.features.append(chunk)
        self.feature_count += len(chunk)

    def feature_rows(self, start: int, bits: int) -> tuple[torch.Tensor, ...]:
        """The wire frames of the features of tokens[start:] (a first token's row: zeros)."""
        if self.feature_count != len(self.tokens) - 1:
            raise RuntimeError(f"{len(self.tokens)} tokens but {self.feature_count} feature rows")
        need = len(self.tokens) - max(start, 1)  # rows from the end; only a reset reads them all
        tail: list[torch.Tensor] = []
        for chunk in reversed(self.features):
            if need <= 0:
                break
            tail.insert(0, chunk[-need:])
            need -= len(tail[0])
        rows = torch.cat(tail) if tail else self.features[0][:0]
        if start == 0:
            rows = torch.cat([rows.new_zeros(1, rows.shape[1]), rows])
        return P.features_to_wire(rows, bits)


@dataclass
class Timing:
    """Per draft request, as the target saw it (ms), one entry per request in order. overhead = wall -
    queue - service: serialisation, transport and the server's IO hop. A request the server turned
    away as busy, or whose draft missed the target's deadline (that step decoded without a draft),
    has batch 0 and no queue or service time. A reply to a request asked at an earlier step, or
    before the prompt's prefill (`early`), counts its wall time from then: it took the target's own
    passes too, so its overhead is no protocol's, and `overheads()` leaves it out."""

    wall: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    service: list[float] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    early: list[bool] = field(default_factory=list)
    late: int = 0  # requests whose draft missed the deadline (their steps decoded alone)
    ahead: int = 0  # requests asked without waiting (deadline 0), for a later step to pick up
    taken_late: int = 0  # drafts picked up at a later step than asked, and still following the committed tokens

    def add(self, wall: float, queue: float = 0.0, service: float = 0.0, batch: int = 0, early: bool = False) -> None:
        self.wall.append(wall)
        self.queue.append(queue)
        self.service.append(service)
        self.batch.append(batch)
        self.early.append(early)

    def overheads(self) -> list[float]:
        """wall - queue - service of each answered request the target waited for from its asking."""
        return [w - q - s for w, q, s, b, e in zip(self.wall, self.queue, self.service, self.batch, self.early)
                if b and not e]

    @property
    def refused(self) -> int:
        return self.batch.count(0) - self.late - self.ahead

    def summary(self) -> dict:
        """Means over the answered requests."""
        answered = [i for i, b in enumerate(self.batch) if b]
        n = len(answered)
        if not n:
            return {"requests": 0, "refused": self.refused, "late": self.late, "ahead": self.ahead,
                    "taken_late": self.taken_late} if self.batch else {}

        def mean(xs):
            return sum(xs[i] for i in answered) / n

        overhead = self.overheads()
        return {"requests": n, "wall_ms": mean(self.wall), "queue_ms": mean(self.queue),
                "service_ms": mean(self.service), "overhead_ms": sum(overhead) / max(1, len(overhead)),
                "mean_batch": mean(self.batch), "refused": self.refused, "late": self.late,
                "ahead": self.ahead, "taken_late": self.taken_late}


class RemoteDrafter:
    """The Drafter interface, served by a draft server. A request refused as busy gives an empty
    draft (the target decodes that step alone) and its tokens go with the next request.

    A server that stops answering (`unreachable`, or no reply within the client's timeout) also
    gives empty drafts: the target decodes alone, losing nothing, since every committed token stays
    in the sequence. Once the heartbeat hears the server again (a restart at the same address), the
    drafter opens a new session, at most once per backoff (0.5 s, doubling to 30 s while hellos
    fail), and its next request is a reset carrying the whole accepted prefix. A client with no
    session yet (its hello was refused) starts that way.

    A server that is full (`kv_full`: its draft KV budget is taken) gives empty drafts for the
    backoff's first wait, then the stream asks again with a reset; a stream past the server's
    context limit (`context_full`) decodes alone to its end.

    Given several servers (DraftClient's `address`, comma-separated), a session that its server
    loses (silent, broken) or cannot hold (`kv_full`, or a hello refused) moves to the next server
    at once: a new hello there, and a reset with the whole accepted prefix, so no token is lost. A
    hello that no Welcome answers within a few heartbeats' silence moves on too; only after every
    server was tried in a row does the backoff apply. Where the servers' loads are uneven, a session
    moves to one holding fewer (star/placement.py), the same way."""

    device = torch.device("cpu")  # where the generator of a sampled draft would live: unused, see propose
    BACKOFF_S = (0.5, 30.0)  # first wait before a new hello, and the longest

    def __init__(self, client: DraftClient, cohosted: bool | None = None):
        """`cohosted`: whether the server computes on this host's cores (None: whether its address is
        on this host); False for a target that stands for one on a host of its own (a replay target)."""
        self.client = client
        self._cohosted = cohosted
        self._place()
        self.moves = 0  # sessions moved to another of several servers
        self.relocations: collections.deque = collections.deque(maxlen=64)  # the last moves: (time.time(),
        # from, to, why), for a benchmark's account of a takeover
        self.rebalanced = 0  # of them, moved to spread the sessions evenly (the rest: lost or refused)
        self._tried = 1  # servers tried in a row without a session (a full round: the backoff applies)
        self.timing = Timing()
        self.down = not client.tag  # no session (the server stopped answering, or never admitted one):
        # drafts are empty until a new session opens
        self.outages = 0
        self.misconfigured: DraftServerError | None = None  # the server refused this target for good (MISCONFIGURED)
        self._backoff_s = self.BACKOFF_S[0]
        self._retry_at = 0.0
        # when the Hello of a new session went out (None: none in flight; a start's try_hello may have left one)
        self._hello_at: float | None = client.hello_at if self.down and client.hello_pending else None
        self._down_at = time.monotonic()  # when the last session was lost
        # Running averages over this drafter's streams (a new prompt starts from what the last ones
        # saw: a saturated server is as slow for a stream's first draft as for its hundredth):
        self.lateness = 1.0  # tokens committed between a request and the reading of its reply, when that
        # came after the target had gone on (a draft asked ahead needs to be this much deeper)
        self.reply_ms = 0.0  # the draft server's queue before a request's draft, as this drafter's replies say
        self.reply_at = -math.inf  # when the last reply came (monotonic s)

    def _place(self) -> None:
        """What the server this client talks to now means for its drafts."""
        # A draft may be asked without waiting (deadline 0) and picked up at a later step, unless the
        # server drafts on the cores this target verifies on: a draft asked ahead would then be
        # computed during the target's own pass, each slowing the other (on 2 cores, a target and a
        # server at 2 threads each), and the two take turns instead, as a co-located pair does.
        self.asynchronous = not shares_cores(self.client.address, torch.get_num_threads())
        # A server on this host drafts on the cores its targets verify on, whatever the threads: what
        # it spends on a stream's draft is that stream's cost even where nobody waits for the draft
        # (spec_decode/depth.py, Source.cohosted). A local star on a small machine runs more threads than cores.
        self.cohosted = server_on_this_host(self.client.address) if self._cohosted is None else self._cohosted

    def _move(self, why: str, to: str | None = None) -> None:
        """To another of several servers (`to`, else DraftClient.move's choice), at once (a backoff
        only after a whole round of them)."""
        left = self.client.address
        self.client.move(to)
        self._place()
        self.moves += 1
        self.relocations.append((time.time(), left, self.client.address, why))
        self._hello_at = None
        self._tried += 1
        wrapped = self._tried > len(self.client.addresses)
        if wrapped:
            self._tried = 1
            self._backoff_s = min(2 * self._backoff_s, self.BACKOFF_S[1])
        self._retry_at = time.monotonic() + (self._backoff_s if wrapped else 0.0)
        log.warning("%s: %s at %s; the session moves to %s", self.client.name, why, left, self.client.address)

    def start(self, prompt_ids: list[int], cfg: DraftConfig | None = None, sampling: SamplingConfig | None = None,
              max_depth: int = 0) -> RemoteSequence:
        """With settings and max_depth > 0, the stream's reset goes out at once: the draft server
        prefills the prompt and drafts while the target prefills it, and the first propose() finds
        its draft waiting (the draft's prefill no longer adds to the time to the first token)."""
        seq = RemoteSequence(list(prompt_ids), taps=self.taps)
        if cfg is not None and max_depth > 0 and self._session(seq, wait=False) and seq.taps is None:
            self.client.send_draft(seq.tokens, max_depth + 1, cfg, sampling, stop=cfg.min_path_prob)
            seq.pending = len(seq.tokens)
            seq.pending_since = time.monotonic()
        return seq

    @property
    def server_ms(self) -> float:
        """The draft server's time on a request before its draft begins (its queue; what a draft asked ahead
        comes after, with its levels at pace_ms each): as this drafter's replies say, or as the server says
        of its recent requests, whichever is longer. A stream that joins a saturated server, or asks for no
        draft while it is, knows its wait from the server's word (on an AMX Xeon, 32 replay targets that
        joined one each waited for their first five drafts, 0.7 to 2.3 s each, and decoded at 0.79x alone).
        The drafter's own figure counts while it is recent (REPLY_FRESH_S): one from a load since gone would
        keep it from asking again."""
        own = self.reply_ms if time.monotonic() - self.reply_at < REPLY_FRESH_S else 0.0
        return max(own, self.client.wait_ms)

    @property
    def pace_ms(self) -> float:
        """The server's recent time per level of a draft batch, its whole time (DraftClient.pace_ms; 0: unknown)."""
        return self.client.pace_ms

    @property
    def level_ms(self) -> float:
        """The server's recent time per drafted level of a stream (DraftClient.level_ms; 0: unknown)."""
        return self.client.level_ms

    @property
    def ingest_ms(self) -> float:
        """The server's time to ingest one token of a stream it does not hold (0: unknown)."""
        return self.client.ingest_ms

    @property
    def neighbours(self) -> int:
        """Other targets whose cores this stream's drafts are computed on: a co-hosted server's sessions
        of targets on its host, this stream's own left out (0: none, or the server is not on this host)."""
        return max(0, self.client.local_sessions - 1) if self.cohosted else 0

    @property
    def taps(self) -> tuple[int, ...] | None:
        """The target features the server's drafter needs (None: tokens only), as its Welcome said."""
        return self.client.taps

    def propose(self, seq: RemoteSequence, new_tokens: list[int], cfg: DraftConfig, sampling: SamplingConfig,
                generator=None, max_depth: int = 1 << 30, deadline_ms: float | None = None,
                features: torch.Tensor | None = None, more: int = 0) -> DraftTree:
        """`generator` is unused: a sampled draft draws from the server's per-session generator,
        seeded as the co-located drafter's is, so seeded runs match. A draft that has not come
        within `deadline_ms` (spec_decode/depth.py; 0: ask without waiting) gives an empty draft; its
        request stays in flight, and a later call reads its reply first: if the tokens committed
        since it was asked spell a path of its tree, the subtree below that path is that call's
        draft (DraftTree.follow; `seq.behind` says how many tokens late it is), else it is dropped
        and the next request goes out. `features`: for an EAGLE head, the target's features of the
        new tokens (spec_decode/decode.py); a stream that began without them, or for another head,
        decodes alone. `more`: other streams' requests this process sends right after this one, at
        most (the server may wait for them and draft them in one batch: protocol.DraftRequest)."""
        seq.tokens.extend(new_tokens)
        seq.behind = 0  # until a late draft is taken below: whatever this call returns is not one
        if features is not None:
            seq.add_features(features)
        if seq.taps != self.taps:
            return DraftTree.empty()
        budget = max(1, min(max_depth + 1, 1 << 30))  # tokens the target may still emit
        t0 = time.perf_counter()
        earlier = seq.pending_since if seq.pending else None  # a request in flight before this call
        until = None if deadline_ms is None else time.monotonic() + deadline_ms / 1e3
        # a Welcome is waited for only by a draft waited for, and no longer than its deadline: a step that asks
        # ahead goes on (a rebalance's sessions each waited about 800 ms for a busy new server's Welcome)
        if not self._session(seq, wait=deadline_ms != 0, until=until) or time.monotonic() < seq.alone_until:
            self.timing.add((time.perf_counter() - t0) * 1e3)
            return DraftTree.empty()
        for attempt in range(2):
            try:
                reply, tree = self._request(seq, cfg, sampling, budget, until, more)
                break
            except Late:
                if deadline_ms == 0:
                    self.timing.ahead += 1
                else:
                    self.timing.late += 1
                self.timing.add((time.perf_counter() - t0) * 1e3)
                return DraftTree.empty()
            except DraftServerError as e:
                if e.code in ("unreachable", "timeout", "bad_reply", "unknown_session"):
                    self._lost(seq, e)
                if e.code == "kv_full" and len(self.client.addresses) > 1:
                    self._lost(seq, e)  # another server may have room: the session moves there
                elif e.code in ("kv_full", "context_full"):
                    seq.sent = 0  # refused with the server's state of it gone: the next request is a reset
                    seq.alone_until = time.monotonic() + (self.BACKOFF_S[0] if e.code == "kv_full" else math.inf)
                if e.code == "unknown_session" and not attempt and self._back(seq, deadline_ms != 0, until):
                    continue  # the server dropped the session (restart, timeout): this step's request is a
                    # reset on the new one
                if e.code in GO_ON_ALONE or e.code in ("context_full", "unknown_session"):
                    self.timing.add((time.perf_counter() - t0) * 1e3)
                    return DraftTree.empty()
                if attempt or e.code != "reset_required":
                    raise
                seq.sent = 0
        wall = (time.perf_counter() - t0) * 1e3
        seq.share_ms = reply.service_ms / max(1, reply.batch_size)
        early = earlier is not None and seq.pending_since == earlier  # the reply to a request asked before
        if early:  # this call (at an earlier step, or with the prompt): its round trip runs from then
            self.timing.taken_late += bool(seq.behind)
            wall = (time.monotonic() - earlier) * 1e3
        self.timing.add(wall, reply.queue_ms, reply.service_ms, reply.batch_size, early)
        queued = reply.queue_ms  # a server found faster is believed at once (it is asked again only now and
        # then while it seems too slow), a slower one over a few replies
        self.reply_ms = min(queued, self.reply_ms + 0.25 * (queued - self.reply_ms))
        self.reply_at = time.monotonic()
        return tree

    def keep_up(self, seq: RemoteSequence, unsent: int = 0) -> None:
        """On a step that asks no draft (spec_decode/decode.py): a new session's Welcome is read, or a new
        hello sent when one is due, as at any step. A target that stopped asking for a while (no
        draft pays, or it paused after missed deadlines) would otherwise leave the Welcome unread,
        and the server frees a session it hears nothing of. The reply to a draft asked ahead is read too, if it
        has come, with `unsent` (tokens the stream committed that seq does not hold yet) telling how late it
        came: read only at the next draft asked, a probe's reply 64 steps on would say 64 tokens late."""
        self._session(seq, wait=False)
        if seq.pending and seq.arrived is None and not self.down:
            try:
                seq.arrived = self.client.receive_draft(time.monotonic())
            except DraftServerError as e:
                seq.arrived = e
            if seq.arrived is not None:
                seq.lag = len(seq.tokens) + unsent - seq.pending

    def holds(self, seq: RemoteSequence) -> bool:
        """Whether the server holds the stream, or will once the request in flight is read. A request asked
        while the session was down (a move's hello not yet answered) went nowhere, and the next one is a
        reset with the whole prefix."""
        return bool(seq.sent or seq.pending)

    def _session(self, seq: RemoteSequence, wait: bool, until: float | None = None) -> bool:
        """Whether a session is open for a request now. A session the heartbeat's replies say is gone
        (the server restarted, or freed it) is dropped, and a new one asked for at once; so is one
        whose server moved to another address (DraftClient.readdress), there; while down, _back()
        (waiting for the Welcome only with `wait`, and not past `until`, monotonic s)."""
        if (to := self.client.moved_to()) is not None:
            self._follow(seq, to)
        if self.client.retired():  # the star no longer lists its server (star/elastic.py): it drains
            self._relocate(seq, "its server is retired", None, outage=False)
        if not self.down and self.client.session_gone():
            self._lost(seq, DraftServerError("unknown_session", "the heartbeat's replies say the session is gone"))
        if not self.down and not self.client.reachable(patience=3.0):  # noticed without a request (a target
            # decoding alone asks for none), so that its session moves to another server within seconds, not
            # at its next ask. A request in flight fails after dead_after_s of silence; between requests a
            # longer one is asked for: a heartbeat thread starved for a moment is no dead server
            self._lost(seq, DraftServerError("unreachable", f"{self.client.address} answers no heartbeat"))
        if not self.down and (to := self.client.better()):
            self._rebalance(seq, to)
        return not self.down or self._back(seq, wait, until)

    def _lost(self, seq: RemoteSequence, why: DraftServerError) -> None:
        """The session is gone: its server is silent or broken (a new hello waits for the backoff), or
        it answers but no longer holds the session (`unknown_session`: a new hello at once)."""
        log.warning("%s: draft session lost (%s); decoding alone until a new one opens", self.client.name, why)
        self.down = True
        self._down_at = time.monotonic()
        self.outages += 1
        seq.forget()  # that socket is closed before the next request: no reply of it will be read
        seq.sent = 0  # whatever session comes next starts from the whole accepted prefix
        self._backoff_s = self.BACKOFF_S[0]
        self._retry_at = time.monotonic() + (0.0 if why.code == "unknown_session" else self._backoff_s)
        if len(self.client.addresses) > 1 and why.code != "unknown_session":  # a server that answers keeps it
            self._tried = 1
            self._move(f"session lost ({why.code})")

    def _follow(self, seq: RemoteSequence, to: str) -> None:
        """The session's server runs at `to` now (the session it held was lost with its old process)."""
        self._relocate(seq, "its server moved", to, outage=True)

    def _rebalance(self, seq: RemoteSequence, to: str) -> None:
        """The session moves to a server that holds fewer (star/placement.py)."""
        self.rebalanced += 1
        self._relocate(seq, "the sessions are spread unevenly", to, outage=False)

    def _relocate(self, seq: RemoteSequence, why: str, to: str | None, outage: bool) -> None:
        """A hello at `to` (None: the least loaded other) at once (no round of servers tried: no backoff),
        then a reset with the whole accepted prefix, as after a loss. `outage`: counted as one, unless
        the session was down already (a loss to the old address's silence was counted then)."""
        if not self.down:
            self._down_at = time.monotonic()
            self.outages += outage
        self.down = True
        seq.forget()  # that socket is closed: no reply of it will be read
        seq.sent = 0
        self._tried = 0
        self._move(why, to)

    def _back(self, seq: RemoteSequence, wait: bool = True, until: float | None = None) -> bool:
        """While down: once the server answers pings again and the backoff has passed, send a Hello on
        a fresh socket and (with `wait`) wait up to dead_after_s for its Welcome; if it has not come,
        look for it at each later step without waiting (a server busy with a long batch answers
        late, and a client that gave up and said hello again would leave a session behind each
        time). True once the session is open."""
        if self._hello_at is None:
            if time.monotonic() < self._retry_at or not self.client.reachable():
                return False
            self.client.reopen()
            self._hello_at = time.monotonic()
            log.info("%s: hello for a new draft session, on a fresh connection", self.client.name)
        # a server at ease answers within dead_after_s of the hello: with `wait`, wait out what is left
        # of that, to draft this very step
        wait_s = max(0.0, self.client.dead_after_s - (time.monotonic() - self._hello_at)) if wait else 0.0
        if until is not None:
            wait_s = min(wait_s, max(0.0, until - time.monotonic()))
        several = len(self.client.addresses) > 1
        # another server may answer sooner; but one that answers pings is alive and only busy (a hello
        # is answered between its batches): leaving it would leave a session behind there
        patience_s = 4 * self.client.dead_after_s if several and not self.client.answers() else self.client.timeout_s
        try:
            welcome = self.client.receive_welcome(wait_s=wait_s)
            given_up = welcome is None and time.monotonic() - self._hello_at > patience_s
            why = "no Welcome"
        except DraftServerError as e:  # refused (full) or unreachable
            if e.code in MISCONFIGURED and len(self.client.addresses) == 1:  # no retry mends it: decoding alone
                # from now on, said once (with several servers it moves on, as from a hello refused)
                log.error("%s: %s; decoding alone", self.client.name, e)
                self.misconfigured = e
                self._retry_at = math.inf
                self._hello_at = None
                return False
            log.info("%s: no new draft session yet (%s)", self.client.name, e)
            welcome = None
            given_up = True
            why = f"hello refused ({e.code})"
        if welcome is None:
            if given_up and several:
                self._move(why)
            elif given_up:  # try again after the backoff
                log.warning("%s: no Welcome %.0f s after hello; trying again in %.1f s", self.client.name,
                            time.monotonic() - self._hello_at, 2 * self._backoff_s)
                self._hello_at = None
                self._backoff_s = min(2 * self._backoff_s, self.BACKOFF_S[1])
                self._retry_at = time.monotonic() + self._backoff_s
            return False
        log.info("%s: new draft session %x at %s, %.1f s after the last was lost", self.client.name, welcome.tag,
                 self.client.address, time.monotonic() - self._down_at)
        self._hello_at = None
        self._tried = 1
        self.down = False
        seq.sent = 0
        seq.forget()
        return True

    def _request(self, seq: RemoteSequence, cfg: DraftConfig, sampling: SamplingConfig, budget: int,
                 until: float | None, more: int = 0) -> tuple[P.DraftReply, DraftTree]:
        if seq.pending:  # a request is in flight (start()'s reset, or a draft that came late): its reply first
            lag = seq.lag
            reply, tensors = self._settle(seq, until)
            lag = len(seq.tokens) - seq.sent if lag is None else lag
            if lag > 0:
                self.lateness += 0.25 * (lag - self.lateness)
            tree = _tree(tensors).follow(seq.tokens[seq.sent:])  # still a draft of what was committed since?
            if seq.sent == len(seq.tokens) or len(tree):
                seq.behind = len(seq.tokens) - seq.sent
                return reply, tree
        features = () if seq.taps is None else seq.feature_rows(seq.sent, cfg.feature_bits)
        if seq.sent == 0:  # the step's cfg says where its chain stops (the policy's choice, spec_decode/decode.py)
            self.client.send_draft(seq.tokens, budget, cfg, sampling, features, cfg.min_path_prob, more)
        else:
            self.client.send_draft(seq.tokens[seq.sent:], budget, features=features, stop=cfg.min_path_prob, more=more)
        seq.pending = len(seq.tokens)
        seq.pending_since = time.monotonic()
        reply, tensors = self._settle(seq, until)
        return reply, _tree(tensors)

    def _settle(self, seq: RemoteSequence, until: float | None):
        """The in-flight request's reply; the server then holds seq.pending tokens. Raises Late if it
        has not come by `until` (monotonic s), DraftServerError if it was refused (and not taken)."""
        held = seq.pending
        arrived, seq.arrived, seq.lag = seq.arrived, None, None
        try:
            if isinstance(arrived, DraftServerError):
                raise arrived
            reply = arrived or self.client.receive_draft(until)
        except DraftServerError:
            seq.pending = 0
            raise
        if reply is None:  # a server that died with the request would leave it in flight for good
            if not self.client.reachable():
                raise DraftServerError("unreachable", "the draft server answers no heartbeat")
            if time.monotonic() - seq.pending_since > self.client.timeout_s:
                raise DraftServerError("timeout", f"no answer within {self.client.timeout_s:.0f} s")
            raise Late()
        seq.pending = 0
        seq.sent = held
        return reply


def _tree(tensors: tuple) -> DraftTree:
    """A DraftReply's frames as a draft: tokens, parents and, for a sampled draft, q's ids and weights."""
    q = SparseQ(tensors[2].long(), tensors[3].clone()) if len(tensors) == 4 else None
    return DraftTree(tensors[0].long(), tensors[1].long(), q)


class Late(Exception):
    """A draft did not come within the target's deadline; its request is still in flight."""
