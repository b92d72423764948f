"""The draft server: one draft model serving many target workers (the hub of the star).

Its parts (DESIGN.md, principles 1-3):
- transport.py: the IO thread. Decodes and validates messages, answers heartbeats and stats, and
  puts requests on Q_in; sends what the compute loop hands it.
- sessions.py: per-target state under a session tag, and the rules a request must pass.
- ahead.py: pre-drafting, the compute loop's work while no request waits.
- this module: the compute loop. It owns the draft model. It takes every message waiting in Q_in
  (hellos and byes at once, draft requests into the waiting list), drafts one batch of the
  waiting requests, one batched forward pass per tree level (or, with `serial`, one request at a
  time: the reference code's behaviour, kept as the baseline), and goes round again. A batch
  holds the oldest request and then streams' next steps before new prompts, within `max_batch`
  and `batch_tokens` (tokens to ingest), so a batch is short whatever waits behind it: hellos,
  byes and timed-out sessions wait one batch at most, and a cheap step is not queued behind a
  round of new prompts. Each reply goes out as soon as its batch is done, so a slow target never
  holds up the others, and a batch that fails is retried one request at a time, so a bad request
  costs only itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time

import torch

from starsd.config import MAX_DRAFT_NODES, DraftConfig, SamplingConfig, ServerConfig
from starsd.models.drafter import DraftJob, Drafter
from starsd.spec_decode.tree import DraftTree
from starsd.star import ahead
from starsd.star import protocol as P
from starsd.star.sessions import Refused, Session, Sessions, Wait
from starsd.star.stats import ServerStats
from starsd.star.transport import Outbox, Request, Transport

GATHER_S = 0.005  # a request that announces more (DraftRequest.more): the next is waited for this long at most
GATHER_CAP_S = 0.02  # and the whole group this long after its first
GATHER_MAX = 8  # waiting requests beyond which a batch waits for no more

log = logging.getLogger("starsd.server")


class DraftServer:
    WARM_PROMPT = 64  # tokens of the longer of the warm-up's two prompts that measure a prompt token's cost

    def __init__(self, drafter: Drafter, fingerprint: str, vocab_size: int, cfg: ServerConfig,
                 name: str = "starsd-draft"):
        self.drafter = drafter
        self.cfg = cfg
        self.name = name
        self.stats = ServerStats()
        self.sessions = Sessions(cfg, drafter, fingerprint, vocab_size, self.stats)
        self.stats.kv_budget_bytes = self.sessions.kv_budget
        self.q_in: queue.Queue[Request] = queue.Queue()
        self.transport = Transport(cfg, self.q_in, self.stats, self.sessions.heartbeat, self._stats_json,
                                   lambda: (len(self.sessions), self.sessions.local()))
        self.stopping = self.transport.stopping
        self._waiting: list[tuple[Session, Request]] = []  # taken draft requests, oldest first, not yet drafted
        self._deferred: list[Request] = []  # a session's later request waits for its earlier one's batch
        self._stats_cache = "{}"
        self._stats_at = -1.0
        self._outbox: Outbox | None = None
        self._reaped_at = time.monotonic()
        self._group = 0  # the last group of requests begun (_join)
        self._group_start = 0.0  # when its first came (perf_counter s)
        self._open_until = 0.0  # while its sender announces more: when to stop waiting for them (0: not open)

    def serve(self, on_ready=None) -> None:
        """Run until stop(): the IO thread in the background, the compute loop here. Call this from
        the main thread in production: torch's OpenMP kernels ran ~40% slower from another thread here."""
        self._warm_up()
        self.transport.start()
        if on_ready:
            on_ready()
        self._outbox = self.transport.outbox()
        log.info("draft server %s listening on %s (%s)", self.name, self.cfg.bind,
                 "serial" if self.cfg.serial else "batched")
        try:
            while not self.stopping.is_set():
                todo = [] if self._waiting else self._predraft_todo()
                pending = self._next_round(wait=not todo and not self._waiting)
                self._handle(pending)
                if self._waiting:
                    self._gather()
                    batch = self._next_batch()
                    if batch:
                        self._draft(batch)
                elif todo and not self._deferred and self.q_in.empty():
                    self._predraft(self._predraft_todo() if pending else todo)  # planned again if a message
                    # came meanwhile (a request answered from a pre-draft changes its session's outcomes)
                self.transport.backlog = len(self._waiting) + len(self._deferred)
                self._reap()
        finally:
            self.stopping.set()
            self._outbox.close()
            self.transport.stop()

    def _warm_up(self, steps: int = 4, depth: int = 4) -> None:
        """Draft a throwaway stream before any target can come: a model's first passes cost more than
        its later ones (its buffers, the first touch of its weights), and what a step's level costs
        is what each Welcome tells a new stream to expect (ServerStats.level_ms), from the first
        target on: a target that shares this host weighs a draft's compute against its own passes
        before it asks one (spec_decode/depth.py). A drafter that drafts from a target's features (an EAGLE
        head) has none to draft from, and starts cold."""
        if self.drafter.taps is not None:
            return
        ids = [(100 + i) % self.sessions.vocab_size for i in range(32 + steps)]
        seq = self.drafter.start(ids[:32])
        cfg = DraftConfig(depth=depth, min_path_prob=0.0)
        for step in range(steps):
            start = time.perf_counter()
            tree = self.drafter.propose_batch([DraftJob(seq, ids[32 + step:33 + step] if step else [], cfg,
                                                        SamplingConfig())])[0]
            if step:  # the first ingested the prompt: not what a level costs
                self.stats.level((time.perf_counter() - start) * 1e3, tree.depth(), 1)
        # then two prompts of a warm model, a short and a long one, each drafted one level: what the long
        # one took more, per token more, is what each token of a new stream's prompt costs (a co-hosted
        # target weighs its first draft with it: spec_decode/depth.py, Source.unsent); the long one's time per token
        # where a tiny model's noise hides the difference
        short, long = (self._first_draft_ms(n) for n in (self.WARM_PROMPT // 8, self.WARM_PROMPT))
        extra = (long - short) / (self.WARM_PROMPT - self.WARM_PROMPT // 8)
        self.stats.ingested(extra if extra > 0 else long / self.WARM_PROMPT)
        log.info("draft server %s: %.1f ms a drafted level, %.2f ms a prompt token, warmed up", self.name,
                 self.stats.level_ms(), self.stats.ingest_ms())

    def _first_draft_ms(self, tokens: int) -> float:
        """A throwaway stream's first draft, one level deep, after a prompt of `tokens` tokens (ms)."""
        prompt = [(7 + 3 * i) % self.sessions.vocab_size for i in range(tokens)]
        start = time.perf_counter()
        self.drafter.propose_batch([DraftJob(self.drafter.start(prompt), [], DraftConfig(depth=1), SamplingConfig())])
        return (time.perf_counter() - start) * 1e3

    def start(self) -> threading.Thread:
        """serve() on a thread of its own (tests, embedding); returns once the socket is bound."""
        bound = threading.Event()
        failure: list[BaseException] = []

        def run():
            try:
                self.serve(on_ready=bound.set)
            except BaseException as e:
                failure.append(e)
                bound.set()

        t = threading.Thread(target=run, name="starsd-compute", daemon=True)
        t.start()
        bound.wait()
        if failure:
            raise failure[0]
        return t

    def stop(self) -> None:
        self.stopping.set()

    def _stats_json(self) -> str:
        """The counters as JSON, from a copy at most 0.2 s old: a flood of StatsRequests stays cheap."""
        now = time.monotonic()
        if now - self._stats_at > 0.2:
            self.stats.connections = self.sessions.connections()  # as of now, as sessions_open is (the reaped
            # figure is up to a second old: requests that all opened and drafted within it showed none)
            self._stats_cache = json.dumps(self.stats.snapshot(len(self.sessions),
                                                               self.q_in.qsize() + self.transport.backlog))
            self._stats_at = now
        return self._stats_cache

    def _next_round(self, wait: bool = True) -> list[Request]:
        """The requests deferred from the last round, then everything in Q_in (waiting a little
        for the first one when there is nothing else to do)."""
        pending = self._deferred
        self._deferred = []
        try:
            pending.append(self.q_in.get(timeout=0.2 if wait and not pending else 0))
        except queue.Empty:
            return pending
        while True:
            try:
                pending.append(self.q_in.get_nowait())
            except queue.Empty:
                return pending

    def _handle(self, pending: list[Request]) -> None:
        """Take each message: hellos and byes are answered, draft requests join the waiting list (a
        pre-draft may answer one at once). A session has one request waiting at most: a later one
        waits for its earlier one's batch, in order."""
        waiting = {s.tag for s, _ in self._waiting}
        for req in pending:
            if isinstance(req.msg, P.DraftRequest) and req.msg.tag in waiting:
                self._deferred.append(req)
                continue
            try:
                s = self._take(req, frozenset(waiting))
            except Wait:  # the batch being formed holds the room it needs: after that batch
                self._deferred.append(req)
                continue
            if s is None:
                continue
            self._join(s, req)
            if not req.msg.reset:
                ahead.observe(s, req.tensors[0].tolist())
            if s.ahead is not None and self._answer_ahead(s, req):
                continue
            waiting.add(s.tag)
            self._waiting.append((s, req))

    def _join(self, s: Session, req: Request) -> None:
        """A draft request joins the group its sender announced (an earlier request's `more`, GATHER_S
        before it at most), or begins one: `Session.group`. While the group's last request announces
        more, the group is open: until GATHER_S after it, and GATHER_CAP_S after the group's first."""
        if not (self._open_until and req.received <= self._open_until):
            self._group += 1
            self._group_start = req.received
        s.group = self._group
        self._open_until = (min(req.received + GATHER_S, self._group_start + GATHER_CAP_S)
                            if req.msg.more else 0.0)

    def _gather(self) -> None:
        """Before a batch is drafted for a few waiting requests: while their sender has said that more
        of its requests follow (an open group, `_join`), wait for them, so that they are drafted in
        one batch. Drafted as they came, vLLM's 3 rows' requests went in a batch of one and then one of
        two, the step waiting for both."""
        while self._open_until and len(self._waiting) <= GATHER_MAX:
            due = self._open_until - time.perf_counter()
            if due <= 0:
                return
            try:
                self._deferred.append(self.q_in.get(timeout=due))  # (after those deferred before it)
            except queue.Empty:
                return
            self._handle(self._next_round(wait=False))

    def _next_batch(self) -> list[tuple[Session, Request]]:
        """The next batch, taken off the waiting list: the oldest request, then the cheapest kind
        first (streams' next steps before new prompts, each kind oldest first), at most max_batch
        requests (1 when serial) and batch_tokens tokens to ingest (the oldest goes whatever its
        size). A prompt costs the draft model ~6 ms a token here (0.5B, int8, 2 cores): a batch of 64 new
        prompts kept a server from its hellos, its byes and its reaping for two minutes. Requests
        of sessions freed meanwhile (bye, timeout) are dropped."""
        self._waiting = [(s, r) for s, r in self._waiting if s.tag in self.sessions]
        if not self._waiting:
            return []
        size = 1 if self.cfg.serial else self.cfg.max_batch
        oldest, *rest = self._waiting
        batch = [oldest]
        tokens = _to_ingest(*oldest)
        for item in sorted(rest, key=lambda item: item[1].msg.reset):  # stable: oldest first within a kind
            if len(batch) == size:
                break
            cost = _to_ingest(*item)
            if tokens + cost <= self.cfg.batch_tokens:
                batch.append(item)
                tokens += cost
        chosen = {s.tag for s, _ in batch}
        self._waiting = [(s, r) for s, r in self._waiting if s.tag not in chosen]
        return batch

    def _reap(self) -> None:
        """Free the sessions of silent targets and count the draft KV held, at most once a second (four times per timeout where
        that is shorter, so that a session outlives its timeout by a quarter of it at most)."""
        if time.monotonic() - self._reaped_at > min(1.0, self.cfg.session_timeout_s / 4):
            self.sessions.reap()
            self.stats.kv_bytes = self.sessions.held_bytes()  # an int: one write
            self.stats.connections = self.sessions.connections()
            self._reaped_at = time.monotonic()

    def _take(self, req: Request, busy: frozenset[int] = frozenset()) -> Session | None:
        """Handle one message; return its session when it is a draft request to serve. `busy`: the
        sessions whose requests wait to be drafted (their draft state is not evicted for another's).
        Raises Wait for a request that needs room they hold: it is taken after their batch."""
        msg = req.msg
        try:
            if isinstance(msg, P.Hello):
                s = self.sessions.open(req.peer, msg, req.user, req.local)
                self._outbox.send(req.peer, P.Welcome(s.tag, self.name, MAX_DRAFT_NODES, self.drafter.taps,
                                                      self.stats.level_ms(), self.sessions.local(),
                                                      self.stats.ingest_ms(), self.stats.wait_ms(), msg.stream,
                                                      self.stats.pace_ms()))
            elif isinstance(msg, P.Bye):
                self.sessions.free(self.sessions.owned(req.peer, req.user, msg.tag), "bye")
            else:
                s = self.sessions.admit(req.peer, req.user, msg, req.tensors, busy)
                self.stats.count("requests")
                return s
        except Wait:
            raise
        except Refused as r:
            self.stats.count("requests", isinstance(msg, P.DraftRequest))
            self._refuse(req, r.code, str(r))
        except Exception as e:  # a request that breaks its handling costs only itself
            self.stats.count("requests", isinstance(msg, P.DraftRequest))
            log.exception("request failed")
            self._refuse(req, "internal", str(e)[:200])
        return None

    def _refuse(self, req: Request, code: str, message: str) -> None:
        tag = getattr(req.msg, "tag", 0)
        self.stats.error(code)
        log.warning("refused a message of session %x: %s [%s]", tag, message, code)
        self._outbox.send(req.peer, P.Error(code, message, tag, getattr(req.msg, "step", -1),
                                            getattr(req.msg, "stream", 0)))

    def _answer_ahead(self, s: Session, req: Request) -> bool:
        """Answer a request from its session's pre-draft if it brings what the pre-draft assumed."""
        o = ahead.answer(s, req.tensors[0].tolist(), req.msg.budget, req.msg.reset)
        if o is None:
            self.stats.count("predraft_misses")
            return False
        self.stats.count("predraft_hits")
        s.last_chain = o.chain[:max(1, req.msg.budget - 1)]
        s.last_second = o.second[:len(s.last_chain)]
        s.budget = req.msg.budget
        now = time.perf_counter()
        self._reply(s, req, DraftTree.chain(s.last_chain), now, now, 1)
        return True

    def _predraft_todo(self) -> list[tuple[Session, int]]:
        """The outcomes to pre-draft now, (session, tokens short of its last chain): none while the
        server has been nearly saturated (past N_full the gaps between batches are too short to
        use), else the likeliest of the idle chain sessions' not drafted yet (ahead.plan), as far
        as their copies of the sessions' state fit in the draft KV budget the sessions leave free."""
        if (not self.cfg.predraft or self.drafter.taps is not None  # a head cannot guess the target's features
                or self.stats.recent_busy(ahead.LOOKBACK_S) > ahead.MAX_BUSY or self.cohosted()):
            return []
        room = self.sessions.kv_budget - self.sessions.kv_bytes() - self.sessions.predraft_bytes()
        todo = []
        for s, short in ahead.cohort_plan([s for s in self.sessions if ahead.eligible(s)]):
            room -= s.seq.kv.capacity * self.sessions.column_bytes
            if room < 0:
                break
            todo.append((s, short))
        return todo

    def cohosted(self) -> bool:
        """A target on this host is connected: its idle gaps are when it verifies, on the cores this
        server would pre-draft on (measured: a target sharing 2 cores with a pre-drafting server
        decoded at 0.4x; so pre-drafting waits for them to leave, unless `predraft_cohosted`)."""
        return not self.cfg.predraft_cohosted and any(s.local for s in self.sessions)

    def _predraft(self, todo: list[tuple[Session, int]]) -> None:
        """Pre-draft these outcomes of idle chain sessions (ahead.py, `_predraft_todo`), yielding to
        the first request that arrives."""
        if not todo:
            return
        self.sessions.free_room(sum(s.seq.kv.capacity for s, _ in todo) * self.sessions.column_bytes)
        start = time.perf_counter()
        try:
            if ahead.predraft(self.drafter, todo, stop=lambda: not self.q_in.empty() or self.stopping.is_set()):
                self.stats.count("predraft_yields")
            self.stats.count("predrafts", len(todo))
        except Exception:  # a pre-draft is optional work: its failure costs nothing but the attempt
            log.exception("pre-draft of %d outcomes failed", len(todo))
            for s, _ in todo:
                s.last_chain = []  # not eligible again until its next real draft
        self.stats.predrafted(start, time.perf_counter())

    def _reply(self, s: Session, req: Request, tree: DraftTree, start: float, end: float, batch_size: int) -> None:
        tensors = [tree.tokens.to(torch.int32), tree.parents.to(torch.int32)]
        if tree.q is not None:
            tensors += [tree.q.ids.to(torch.int32), tree.q.weights]
        reply = P.DraftReply(s.tag, req.msg.step, (start - req.received) * 1e3, (end - start) * 1e3, batch_size,
                             P.specs(*tensors))
        self.stats.count("replies")  # before the send: a peer that has its reply sees it counted
        self.stats.replied(reply.queue_ms)
        self._outbox.send(s.peer, reply, tuple(tensors))

    def _draft(self, items: list[tuple[Session, Request]]) -> None:
        start = time.perf_counter()
        self.stats.begin(start, len(items))
        fresh = [s for s, _ in items if s.seq.cached == 0]  # new streams, and those back from eviction
        for s in fresh:
            self.sessions.share_prefix(s)
        ingest = [_to_ingest(s, r) for s, r in items]
        jobs = [DraftJob(s.seq, [] if r.msg.reset else s.carry + r.tensors[0].tolist(), _shape(s.draft, r.msg.stop),
                         s.sampling, s.generator, max_depth=r.msg.budget - 1, features=self._features(r))
                for s, r in items]
        states = [None if s.generator is None else s.generator.get_state() for s, _ in items]
        replied: set[int] = set()

        def done(i: int, tree: DraftTree) -> None:  # a draft whole before the batch's deepest: its reply now
            replied.add(i)
            self._reply(*items[i], tree, start, time.perf_counter(), len(items))

        try:
            mine = {s.tag for s, _ in items}
            trees = self.drafter.propose_batch(jobs, stop=None if self.cfg.serial else lambda: self._cut(mine),
                                               done=done)
        except Exception:
            self.stats.abandon()
            for i in replied:  # its reply went out, and the drafter has undone the state it was drafted from:
                items[i][0].seq = None  # the stream's next request must be a reset
            rest = [k for k in range(len(items)) if k not in replied]
            return self._isolate([items[k] for k in rest], [states[k] for k in rest]) if rest else None
        end = time.perf_counter()
        self.stats.batch(start, end, len(items))
        if not any(r.msg.reset for _, r in items):  # a prompt's ingest is not what a level costs
            self.stats.level((end - start) * 1e3, max(t.depth() for t in trees), len(items))
        for k, ((s, r), job, tree, tokens) in enumerate(zip(items, jobs, trees, ingest)):
            self.stats.drafted("reset" if r.msg.reset else "step", tokens)
            s.carry = []
            s.draft = job.cfg  # where its chain stops, as the last request said: pre-drafts follow it
            s.last_chain = tree.tokens.tolist() if s.draft.is_chain and tree.q is None else []
            s.last_second = job.second[:len(s.last_chain)]
            s.budget = r.msg.budget
            if k not in replied:
                self._reply(s, r, tree, start, end, len(items))
        for s in fresh:
            self.sessions.drafted(s)

    def _cut(self, mine: set[int]) -> bool:
        """Whether a batch of the sessions `mine` ends at the level it has reached (each draft as deep as it
        got): a draft request of another session, from its own connection, came meanwhile, or the server
        stops (nothing else: noise, hellos, others' tags and a batch's own next requests cut no draft). A
        request that came during another stream's draft ten levels deep waited for all ten: with two
        targets on one server, one drafted at 1.98x while the other's drafts, waited behind it, missed
        their deadlines, and it decoded alone (0.995x). Asked before every level: nothing is copied while
        nothing came."""
        if self.stopping.is_set():
            return True
        if self.q_in.empty():
            return False
        with self.q_in.mutex:
            came = list(self.q_in.queue)
        return any(isinstance(r.msg, P.DraftRequest) and r.msg.tag not in mine
                   and self.sessions.holds(r.peer, r.user, r.msg.tag) for r in came)

    def _features(self, req: Request) -> torch.Tensor | None:
        """An EAGLE head's input from a request: its tokens' target features (a reset's from its
        second token on: the drafter's sequence starts there)."""
        if self.drafter.taps is None:
            return None
        features = P.features_from_wire(req.tensors[1:])
        return features[1:] if req.msg.reset else features

    def _isolate(self, items: list[tuple[Session, Request]], states: list) -> None:
        """A failed batch: retry its requests one by one, so only the culprit fails. The drafter
        has left every sequence as it was; the generators are rewound here."""
        log.exception("batch of %d failed%s", len(items), "; retrying one by one" if len(items) > 1 else "")
        if len(items) > 1:
            for (s, _), state in zip(items, states):
                if state is not None:  # the failed pass may have drawn from it
                    s.generator.set_state(state)
            for item in items:
                self._draft([item])
            return
        s, r = items[0]
        s.seq = None  # its draft state may be half-updated: require a reset
        self._refuse(r, "reset_required", "drafting failed; resend the whole sequence with reset")


def _to_ingest(s: Session, req: Request) -> int:
    """Tokens the draft model must ingest for a request before it drafts: its session's uncached ones
    (a reset's whole sequence), the tokens carried from refused steps and the request's own."""
    carried = 0 if req.msg.reset else len(s.carry) + req.tensors[0].shape[0]
    return len(s.seq.tokens) - s.seq.cached + carried


def _shape(draft: DraftConfig, stop: float) -> DraftConfig:
    """A session's draft settings with this request's chain stopping threshold (-1: the session's own)."""
    if stop < 0 or stop == draft.min_path_prob:
        return draft
    return dataclasses.replace(draft, min_path_prob=stop)
