"""The draft server: one draft model serving many target workers (the hub of the star).

Threads and queues (design principles 1-3 of DESIGN.md):
- The IO thread owns the ZeroMQ ROUTER socket. It decodes and validates every message, answers
  malformed ones with an Error at once, and puts the rest on Q_in. It sends whatever the compute
  loop puts on Q_out (through an inproc socket, so it wakes at once).
- The compute loop owns the draft model and every session. Whenever Q_in holds a draft request it
  drafts ALL pending sessions together, one batched forward pass per tree level (or, with
  `serial`, one request at a time: the reference code's behaviour, kept as the baseline). Each
  reply goes out as soon as its batch is done, so a slow target never holds up the others.
- Sessions: a handshake binds a fresh random tag to the peer's connection; all draft state (KV
  cache, committed tokens, sampling generator) lives under it, and a request is honoured only
  from the connection that owns the tag. A session is freed on Bye, or once neither a request nor
  a heartbeat (Ping, sent by the target's heartbeat thread) has come for session_timeout_s: a
  killed, hung or unplugged target loses its session within that time.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import secrets
import struct
import threading
import time
from dataclasses import dataclass, field

import torch
import zmq

from starsd import protocol as P
from starsd.config import DraftConfig, SamplingConfig, setting
from starsd.models.drafter import DraftJob, Drafter, DraftSequence
from starsd.verify import make_generator

log = logging.getLogger("starsd.draft_server")


@dataclass(frozen=True)
class ServerConfig:
    bind: str = setting("tcp://127.0.0.1:5555", "ZeroMQ address to bind the ROUTER socket to")
    max_sessions: int = setting(64, "sessions held at once; a hello beyond it is refused")
    session_timeout_s: float = setting(120.0, "free a session whose target has been silent this long")
    serial: bool = setting(False, "draft one request at a time (the reference behaviour, a baseline) instead of batching")
    max_batch: int = setting(32, "sessions drafted together in one batch at most")
    queue_limit: int = setting(4096, "requests waiting in Q_in at most; beyond it requests are refused as busy")
    max_context: int = setting(32768, "tokens one session may hold (prompt + generated); beyond it drafts are refused")


@dataclass
class Session:
    tag: int
    peer: bytes  # the ZeroMQ routing id of the target's connection
    name: str
    seq: DraftSequence | None = None
    cfg: DraftConfig | None = None
    sampling: SamplingConfig | None = None
    generator: torch.Generator | None = None
    next_step: int = 0
    last_seen: float = field(default_factory=time.monotonic)


@dataclass
class Request:
    peer: bytes
    msg: object
    tensors: tuple
    received: float  # time.perf_counter() when the IO thread took it off the socket


class ServerStats:
    """Counters the server keeps; `snapshot()` is what a StatsRequest returns (JSON)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.errors: collections.Counter = collections.Counter()
        self.batch_sizes: collections.Counter = collections.Counter()
        self.requests = self.replies = self.sessions_opened = self.sessions_freed = 0
        self.busy_s = 0.0
        self.hops, self.hop_s = 0, 0.0
        self.timeline: collections.deque = collections.deque(maxlen=20000)  # (start, end: unix s, batch size)

    def batch(self, start: float, end: float, size: int) -> None:
        with self.lock:
            self.batch_sizes[size] += 1
            self.busy_s += end - start
            wall = time.time() - time.perf_counter()  # perf_counter -> wall clock, comparable across processes
            self.timeline.append((round(start + wall, 6), round(end + wall, 6), size))

    def hop(self, seconds: float) -> None:
        """A reply's trip from the compute loop through the IO thread onto the socket."""
        with self.lock:
            self.hops += 1
            self.hop_s += seconds

    def error(self, code: str) -> None:
        with self.lock:
            self.errors[code] += 1

    def snapshot(self, sessions: int) -> dict:
        with self.lock:
            elapsed = time.monotonic() - self.started
            return {
                "uptime_s": elapsed, "busy_s": self.busy_s, "utilization": self.busy_s / elapsed if elapsed else 0.0,
                "requests": self.requests, "replies": self.replies, "errors": dict(self.errors),
                "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "sessions_open": sessions, "sessions_opened": self.sessions_opened,
                "sessions_freed": self.sessions_freed, "timeline": list(self.timeline),
                "reply_hop_ms": 1e3 * self.hop_s / self.hops if self.hops else 0.0,
            }


class DraftServer:
    def __init__(self, drafter: Drafter, fingerprint: str, vocab_size: int, cfg: ServerConfig,
                 name: str = "starsd-draft"):
        self.drafter, self.fingerprint, self.vocab_size, self.cfg, self.name = drafter, fingerprint, vocab_size, cfg, name
        self.q_in: queue.Queue[Request] = queue.Queue()
        self.sessions: dict[int, Session] = {}
        self.by_peer: dict[bytes, int] = {}
        self.stats = ServerStats()
        self.ctx = zmq.Context()
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self.failure: str | None = None
        self.last_ping: dict[int, float] = {}  # written by the IO thread, read by the reaper
        self._stats_json, self._stats_at = "{}", -1.0
        self._deferred: list[Request] = []  # a session's later requests wait for its earlier one
        self._outbox_addr = f"inproc://outbox-{id(self)}"
        self._io_thread = threading.Thread(target=self._io_loop, name="starsd-io", daemon=True)

    # ------------------------------------------------------------------ IO thread
    def _io_loop(self) -> None:
        try:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)  # larger frames drop the connection
            router.bind(self.cfg.bind)
            outbox = self.ctx.socket(zmq.PULL)
            outbox.bind(self._outbox_addr)
        except zmq.ZMQError as e:
            self.failure = f"cannot bind {self.cfg.bind}: {e}"
            self.stopping.set()
            self.ready.set()
            return
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(outbox, zmq.POLLIN)
        self.ready.set()
        try:
            while not self.stopping.is_set():
                for sock, _ in poller.poll(100):
                    if sock is outbox:  # [queued-at timestamp, peer, message frames...]
                        stamp, *frames = outbox.recv_multipart(copy=False)
                        router.send_multipart(frames, copy=False)
                        self.stats.hop(time.perf_counter() - struct.unpack("d", stamp.buffer)[0])
                    else:
                        frames = router.recv_multipart(copy=False)
                        try:
                            self._on_frames(router, frames)
                        except Exception as e:  # whatever a message does, the IO thread lives on
                            log.exception("unexpected failure on a message")
                            self.stats.error("internal")
                            router.send_multipart([frames[0], *P.encode(P.Error("internal", str(e)[:200]))])
        finally:
            router.close(0)
            outbox.close(0)

    def _on_frames(self, router, frames) -> None:
        peer = frames[0].bytes
        body = frames[1:]
        try:
            msg, tensors = P.decode(body)
        except P.ProtocolError as e:
            self.stats.error(e.code)
            router.send_multipart([peer, *P.encode(P.Error(e.code, str(e)))])
            return
        if isinstance(msg, P.Ping):
            router.send_multipart([peer, *P.encode(P.Pong(msg.tag, msg.sent))])
            if msg.tag in self.sessions:  # liveness (read by the reaper); the tag is the proof
                self.last_ping[msg.tag] = time.monotonic()
            return
        if isinstance(msg, P.StatsRequest):  # served from a copy at most 0.2 s old: floods stay cheap
            now = time.monotonic()
            if now - self._stats_at > 0.2:
                self._stats_json, self._stats_at = json.dumps(self.stats.snapshot(len(self.sessions))), now
            router.send_multipart([peer, *P.encode(P.Stats(self._stats_json))])
            return
        if isinstance(msg, (P.Hello, P.DraftRequest, P.Bye)):
            if self.q_in.qsize() >= self.cfg.queue_limit:
                self.stats.error("busy")
                router.send_multipart([peer, *P.encode(P.Error("busy", "draft server queue is full; retry later",
                                                               getattr(msg, "tag", 0), getattr(msg, "step", -1)))])
                return
            self.q_in.put(Request(peer, msg, tensors, time.perf_counter()))
            return
        self.stats.error("unexpected")
        router.send_multipart([peer, *P.encode(P.Error("unexpected", f"{type(msg).__name__} is not a request"))])

    # ------------------------------------------------------------------ compute loop
    def serve(self, on_ready=None) -> None:
        """Run until stop(): the IO thread in the background, the compute loop here. Call this from
        the main thread in production: torch's OpenMP kernels ran ~40% slower from another thread here."""
        self._io_thread.start()
        self.ready.wait()
        if self.failure:
            raise RuntimeError(self.failure)
        if on_ready:
            on_ready()
        self._outbox = self.ctx.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.SNDTIMEO, 1000)  # never wait on an IO thread that is gone
        self._outbox.connect(self._outbox_addr)
        log.info("draft server %s listening on %s (%s)", self.name, self.cfg.bind,
                 "serial" if self.cfg.serial else "batched")
        last_reap = time.monotonic()
        try:
            while not self.stopping.is_set():
                try:
                    first = self.q_in.get(timeout=0 if self._deferred else 0.2)
                except queue.Empty:
                    first = None
                pending, self._deferred = self._deferred + ([first] if first else []), []
                while True:
                    try:
                        pending.append(self.q_in.get_nowait())
                    except queue.Empty:
                        break
                self._handle(pending)
                if time.monotonic() - last_reap > 1.0:
                    self._reap()
                    last_reap = time.monotonic()
        finally:
            self.stopping.set()
            self._outbox.close(0)
            self._io_thread.join(timeout=2)
            self.ctx.term()

    def start(self) -> threading.Thread:
        """serve() on a thread of its own (tests, embedding); returns once the socket is bound."""
        t = threading.Thread(target=self.serve, name="starsd-compute", daemon=True)
        t.start()
        self.ready.wait()
        if self.failure:
            raise RuntimeError(self.failure)
        return t

    def stop(self) -> None:
        self.stopping.set()

    def _send(self, peer: bytes, msg, tensors=()) -> None:
        """Hand a reply to the IO thread. Once stopping, the IO thread may be gone: a reply it
        cannot take is dropped (a PUSH without its peer would block the compute loop forever)."""
        stamp = struct.pack("d", time.perf_counter())
        flags = zmq.NOBLOCK if self.stopping.is_set() else 0
        try:
            self._outbox.send_multipart([stamp, peer, *P.encode(msg, tensors)], flags=flags, copy=False)
        except zmq.Again:
            log.warning("reply to %s dropped: the server is stopping", peer.hex()[:8])

    def _fail(self, peer: bytes, code: str, message: str, tag: int = 0, step: int = -1) -> None:
        self.stats.error(code)
        log.warning("refused a request of session %x: %s [%s]", tag, message, code)
        self._send(peer, P.Error(code, message, tag, step))

    def _handle(self, pending: list[Request]) -> None:
        drafts: list[tuple[Session, Request]] = []
        in_round: set[int] = set()
        for req in pending:
            msg = req.msg
            if isinstance(msg, P.DraftRequest) and msg.tag in in_round:
                self._deferred.append(req)  # one request per session per batch, in order
                continue
            try:
                s = self._take(req)
            except Exception as e:  # a request that breaks its handling costs only itself
                log.exception("request failed")
                self._fail(req.peer, "internal", str(e)[:200], getattr(msg, "tag", 0), getattr(msg, "step", -1))
                continue
            if s is not None:
                in_round.add(s.tag)
                drafts.append((s, req))
        if not drafts:
            return
        size = 1 if self.cfg.serial else self.cfg.max_batch
        for i in range(0, len(drafts), size):
            if self.stopping.is_set():  # stop within one batch, however long the queue
                return
            self._draft(drafts[i:i + size])

    def _take(self, req: Request) -> Session | None:
        """Handle one message; return its session when it is a draft request to serve."""
        msg = req.msg
        if isinstance(msg, P.Hello):
            self._on_hello(req)
        elif isinstance(msg, P.Bye):
            s = self._session(req, msg.tag)
            if s:
                self._free(s, "bye")
        else:
            self.stats.requests += 1
            return self._admit(req)
        return None

    def _on_hello(self, req: Request) -> None:
        msg: P.Hello = req.msg
        if msg.version != P.PROTOCOL_VERSION:
            return self._fail(req.peer, "version", f"protocol version {msg.version} is not supported; "
                              f"this server speaks version {P.PROTOCOL_VERSION}")
        if msg.fingerprint != self.fingerprint:
            return self._fail(req.peer, "vocab_mismatch",
                              f"vocabulary fingerprint {msg.fingerprint[:12]} differs from the draft model's "
                              f"{self.fingerprint[:12]}: target and draft need one shared tokenizer")
        old = self.by_peer.get(req.peer)
        if old is not None:  # one session per connection: a second hello replaces the first
            self._free(self.sessions[old], "replaced")
        if len(self.sessions) >= self.cfg.max_sessions:
            return self._fail(req.peer, "too_many_sessions", f"the draft server holds its maximum of "
                              f"{self.cfg.max_sessions} sessions; retry later or use another draft server")
        tag = secrets.randbits(62) + 1
        self.sessions[tag] = Session(tag, req.peer, msg.name)
        self.by_peer[req.peer] = tag
        self.stats.sessions_opened += 1
        log.info("session %x opened for %s", tag, msg.name)
        self._send(req.peer, P.Welcome(tag, self.name, P.MAX_DRAFT_NODES))

    def _session(self, req: Request, tag: int) -> Session | None:
        s = self.sessions.get(tag)
        if s is None or s.peer != req.peer:
            self._fail(req.peer, "unknown_session", f"no session {tag:x} on this connection; say hello first",
                       tag, getattr(req.msg, "step", -1))
            return None
        s.last_seen = time.monotonic()
        return s

    def _admit(self, req: Request) -> Session | None:
        """Check a draft request against its session; apply a reset. None if refused."""
        msg: P.DraftRequest = req.msg
        s = self._session(req, msg.tag)
        if s is None:
            return None
        tokens = req.tensors[0]
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            self._fail(req.peer, "bad_tokens", f"token ids must lie in [0, {self.vocab_size})", s.tag, msg.step)
            return None
        if msg.reset:
            st = msg.settings
            s.cfg = DraftConfig(depth=st.depth, top_k=st.top_k, total_tokens=st.total_tokens, sample=st.sample,
                                min_path_prob=st.min_path_prob)
            s.sampling = SamplingConfig(temperature=st.temperature, top_k=st.sampling_top_k, top_p=st.top_p,
                                        seed=st.seed)
            s.generator = make_generator(st.seed + 1)
            s.seq = self.drafter.start(tokens.tolist())
            s.next_step = msg.step
        elif s.seq is None:
            self._fail(req.peer, "reset_required", "this session has no draft state: send a reset request",
                       s.tag, msg.step)
            return None
        if len(s.seq.tokens) + (0 if msg.reset else tokens.shape[0]) > self.cfg.max_context:
            s.seq = None
            self._fail(req.peer, "context_full", f"the session would exceed {self.cfg.max_context} tokens",
                       s.tag, msg.step)
            return None
        if msg.step != s.next_step:
            self._fail(req.peer, "bad_step", f"expected step {s.next_step}, got {msg.step}", s.tag, msg.step)
            return None
        s.next_step += 1
        return s

    def _draft(self, items: list[tuple[Session, Request]]) -> None:
        start = time.perf_counter()
        jobs = [DraftJob(s.seq, [] if r.msg.reset else r.tensors[0].tolist(), s.cfg, s.sampling, s.generator,
                         max_depth=r.msg.budget - 1) for s, r in items]
        states = [None if s.generator is None else s.generator.get_state() for s, _ in items]
        try:
            trees = self.drafter.propose_batch(jobs)
        except Exception:  # never let one batch take the server down; isolate the culprit
            log.exception("batch of %d failed; retrying one by one", len(items))
            if len(items) > 1:
                for (s, _), state in zip(items, states):
                    if state is not None:  # the failed pass may have drawn from them
                        s.generator.set_state(state)
                for item in items:
                    self._draft([item])
                return
            s, r = items[0]
            s.seq = None  # its draft state may be half-updated: require a reset
            return self._fail(r.peer, "reset_required", "drafting failed; resend the whole sequence with reset",
                              s.tag, r.msg.step)
        end = time.perf_counter()
        self.stats.batch(start, end, len(items))
        for (s, r), tree in zip(items, trees):
            tensors = [tree.tokens.to(torch.int32), tree.parents.to(torch.int32)]
            if tree.q is not None:
                tensors.append(tree.q.float())
            reply = P.DraftReply(s.tag, r.msg.step, (start - r.received) * 1e3, (end - start) * 1e3, len(items),
                                 P.specs(*tensors))
            self._send(s.peer, reply, tuple(tensors))
            self.stats.replies += 1

    def _free(self, s: Session, why: str) -> None:
        self.sessions.pop(s.tag, None)
        self.last_ping.pop(s.tag, None)
        if self.by_peer.get(s.peer) == s.tag:
            del self.by_peer[s.peer]
        self.stats.sessions_freed += 1
        log.info("session %x of %s freed (%s)", s.tag, s.name, why)

    def _reap(self) -> None:
        now = time.monotonic()
        for s in list(self.sessions.values()):
            if now - max(s.last_seen, self.last_ping.get(s.tag, 0.0)) > self.cfg.session_timeout_s:
                self._free(s, "timed out")
