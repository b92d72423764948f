"""Sessions: the per-target state of a draft server, and the rules a draft request must pass.

A Hello binds a fresh random tag to the peer's connection, one per Hello `stream` number; all draft
state of that target (draft KV, committed tokens, settings, random generator) lives under the tag,
and a request is honoured only from the connection (and, with keys, the authenticated key) that owns
it. `next_step` advances by one per request taken; a refused request leaves it where it was. A
session is freed on Bye, on a second Hello of its stream number from its connection, or after
session_timeout_s without a request or a heartbeat.

Memory bounds the sessions: their draft KV shares one budget (kv_budget_gib). A request that needs
more than is free takes it from what is idle: retired states first, then pre-drafts, then the least
recently served sessions' draft KV (*evicted*: the session keeps its tokens, and its next request
ingests them again, one slower draft for its target). Refused (kv_full) is only a context that the
whole budget cannot hold; a request that needs room held by requests waiting to be drafted waits for
their batch. A stream's draft state that its session leaves (Bye, timeout, a reset) is *retired*:
kept up to prefix_keep_s for a later stream that begins with the same tokens (prefixes.py).

Only the compute loop calls these methods, except `heartbeat` (the IO thread), which writes only the
`pinged` field of a session it finds (one that races with `free` lands on an object gone with it).
"""

from __future__ import annotations

import collections
import logging
import secrets
import time
from dataclasses import dataclass, field

import torch

from starsd.config import MAX_DRAFT_NODES, DraftConfig, SamplingConfig, ServerConfig
from starsd.models.drafter import Drafter, DraftSequence
from starsd.models.kv import GROWTH_MIN, KV, grown
from starsd.spec_decode.verify import make_generator
from starsd.star import protocol as P
from starsd.star.ahead import Outcome
from starsd.star.prefixes import BLOCK, PrefixIndex
from starsd.star.stats import ServerStats

log = logging.getLogger("starsd.sessions")

SESSION_COLUMNS = GROWTH_MIN  # by default the draft KV budget bounds the sessions at this many tokens each


class Wait(Exception):
    """A draft request that needs draft KV which requests waiting to be drafted hold: the server takes
    it again once their batch is done (their sessions are idle then, and can be evicted)."""


class Refused(Exception):
    """A message the server answers with an Error and does not take. `code` names the kind."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Session:
    tag: int
    peer: bytes  # the ZeroMQ routing id of the target's connection
    name: str
    user: str = ""  # the target's authenticated public key (star/security.py); "" without keys
    local: bool = False  # the target runs on this host: its cores are the ones this server drafts on
    stream: int = 0  # its Hello's stream number on the connection
    seq: DraftSequence | None = None  # draft state; None until a reset request, or after a failure
    draft: DraftConfig | None = None
    sampling: SamplingConfig | None = None
    generator: torch.Generator | None = None  # draws sampled drafts; on the drafter's device
    next_step: int = 0
    carry: list[int] = field(default_factory=list)  # committed by the target, not yet by seq: they go in
    # front of the next request's tokens (after a pre-drafted answer, its bonus guess; see ahead.py)
    last_chain: list[int] = field(default_factory=list)  # the last chain sent (empty after a tree)
    last_second: list[int] = field(default_factory=list)  # each level's runner-up token in that chain
    budget: int = 0  # the last request's budget (tokens the target may emit: the depth asked, plus one)
    shortfall: list[float] = field(default_factory=list)  # requests by how many tokens short of the whole
    # chain they came, recent ones weighing more (ahead.observe)
    ahead: dict[tuple[int, ...], Outcome] | None = None  # pre-drafts of its next request, by the tokens it brings
    last_seen: float = field(default_factory=time.monotonic)  # its last request (compute loop)
    group: int = 0  # the batch of requests its last one came in, as their sender announced them
    # (DraftRequest.more; DraftServer._join): sessions of one group come together
    pinged: float = 0.0  # its last heartbeat (monotonic s); written by the IO thread only
    parked: list[int] | None = None  # an evicted session's committed tokens (its draft KV was freed for
    # another's): its next request ingests them again; None while it holds its draft state


@dataclass
class Retired:
    """A stream's draft state its session left, kept for prefixes: since `at` (monotonic s)."""

    seq: DraftSequence
    at: float


class Sessions:
    def __init__(self, cfg: ServerConfig, drafter: Drafter, fingerprint: str, vocab_size: int, stats: ServerStats):
        self.cfg = cfg
        self.drafter = drafter
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.stats = stats
        self._by_tag: dict[int, Session] = {}
        self._by_stream: dict[tuple[bytes, int], int] = {}  # (connection, Hello's stream number) -> tag
        self.column_bytes = KV.bytes_per_column(drafter.model)  # one token of draft KV
        self.kv_budget = int(cfg.kv_budget_gib * (1 << 30))
        self.max_sessions = cfg.max_sessions or max(1, self.kv_budget // (SESSION_COLUMNS * self.column_bytes))
        self.prefixes = PrefixIndex()  # owners: session tags, and the retired sequences' keys (< 0)
        self._retired: collections.OrderedDict[int, Retired] = collections.OrderedDict()  # least recently
        # used first
        self._retired_key = 0
        self._sharing = cfg.share_prefixes and drafter.taps is None  # a head drafts from the target's features

    def __len__(self) -> int:
        return len(self._by_tag)

    def __contains__(self, tag: int) -> bool:
        return tag in self._by_tag

    def __iter__(self):
        return iter(list(self._by_tag.values()))

    def local(self) -> int:
        """Sessions of targets on this host (they verify on the cores this server drafts on)."""
        return sum(s.local for s in self)

    def open(self, peer: bytes, hello: P.Hello, user: str = "", local: bool = False) -> Session:
        """A new session for this connection (replacing its old one). Raises Refused."""
        if hello.version != P.PROTOCOL_VERSION:
            raise Refused("version", f"protocol version {hello.version} is not supported; "
                          f"this server speaks version {P.PROTOCOL_VERSION}")
        if hello.fingerprint != self.fingerprint:
            raise Refused("vocab_mismatch", f"vocabulary fingerprint {hello.fingerprint[:12]} differs from the "
                          f"draft model's {self.fingerprint[:12]}: target and draft need one shared tokenizer")
        old = self._by_stream.get((peer, hello.stream))
        if old is not None:  # one session per stream number of a connection: a second hello replaces the first
            self.free(self._by_tag[old], "replaced")
        if len(self._by_tag) >= self.max_sessions:
            raise Refused("too_many_sessions", f"the draft server holds its maximum of {self.max_sessions} "
                          "sessions; retry later or use another draft server")
        s = Session(secrets.randbits(62) + 1, peer, hello.name, user, local, hello.stream)
        self._by_tag[s.tag] = s
        self._by_stream[peer, hello.stream] = s.tag
        self.stats.count("sessions_opened")
        log.info("session %x opened for %s%s", s.tag, s.name, " (on this host)" if local else "")
        return s

    def holds(self, peer: bytes, user: str, tag: int) -> bool:
        """Whether `tag` is a session of this connection (and key), as owned() would find it; changes nothing."""
        s = self._by_tag.get(tag)
        return s is not None and s.peer == peer and s.user == user

    def owned(self, peer: bytes, user: str, tag: int) -> Session:
        """The session `tag`, if this connection (and this authenticated key) owns it. Raises Refused."""
        if not self.holds(peer, user, tag):
            raise Refused("unknown_session", f"no session {tag:x} on this connection; say hello first")
        s = self._by_tag[tag]
        s.last_seen = time.monotonic()
        return s

    def admit(self, peer: bytes, user: str, msg: P.DraftRequest, tensors: tuple[torch.Tensor, ...],
              busy: frozenset[int] = frozenset()) -> Session:
        """Check a draft request against its session, make room for it (evicting idle sessions but
        those in `busy`, tags whose requests wait to be drafted) and apply a reset or restore an
        evicted session; the request is taken (next_step advances) only if nothing is refused.
        Raises Refused."""
        s = self.owned(peer, user, msg.tag)
        tokens = tensors[0]
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            raise Refused("bad_tokens", f"token ids must lie in [0, {self.vocab_size})")
        if self.drafter.taps is not None and (len(tensors) < 2 or tensors[1].shape[1] != self.drafter.model.feature_width):
            raise Refused("bad_features", f"this server drafts with an EAGLE head: each token needs the target's "
                          f"features [m, {self.drafter.model.feature_width}] (taps {self.drafter.taps})")
        if msg.reset:
            self._retire(s)  # the old stream's state goes whether or not the new one is admitted
            s.parked = None
        elif s.seq is None and s.parked is None:
            raise Refused("reset_required", "this session has no draft state: send a reset request")
        elif msg.step != s.next_step:
            raise Refused("bad_step", f"expected step {s.next_step}, got {msg.step}")
        held = [] if msg.reset else s.parked if s.seq is None else s.seq.tokens
        length = tokens.shape[0] + len(held) + (0 if msg.reset else len(s.carry))
        if length > self.cfg.max_context:
            s.seq = s.parked = None
            raise Refused("context_full", f"the session would exceed {self.cfg.max_context} tokens")
        self._make_room(s, length, len(tokens if msg.reset else held), msg.draft if msg.reset else s.draft, busy)
        if msg.reset:
            s.draft = msg.draft
            s.sampling = msg.sampling
            s.generator = make_generator(msg.sampling.seed + 1, self.drafter.device)
            s.seq = self.drafter.start(tokens.tolist())
            s.carry, s.last_chain, s.last_second, s.ahead = [], [], [], None
        elif s.seq is None:  # evicted: its tokens are ingested again, with this request's
            s.seq = self.drafter.start(s.parked)
            s.parked = None
            self.stats.count("sessions_restored")
        s.next_step = msg.step + 1
        return s

    def kv_bytes(self, skip: Session | None = None) -> int:
        """Draft KV memory the sessions hold (their allocations), but for `skip`'s."""
        return sum(x.seq.kv.capacity * self.column_bytes for x in self._by_tag.values()
                   if x.seq is not None and x is not skip)

    def predraft_bytes(self) -> int:
        """Draft KV memory the sessions' pre-drafts hold (copies of their state; star/ahead.py)."""
        return sum(o.seq.kv.capacity * self.column_bytes for x in self._by_tag.values()
                   for o in (x.ahead or {}).values())

    def retired_bytes(self) -> int:
        """Draft KV memory the retired sequences hold."""
        return sum(r.seq.kv.capacity for r in self._retired.values()) * self.column_bytes

    def held_bytes(self) -> int:
        """All the draft KV held: the sessions', their pre-drafts' and the retired sequences'."""
        return self.kv_bytes() + self.predraft_bytes() + self.retired_bytes()

    def free_room(self, nbytes: int) -> None:
        """Retired sequences go, least recently used first, until `nbytes` more fit in the budget."""
        self._shrink_retired(self.kv_budget - self.kv_bytes() - self.predraft_bytes() - nbytes)

    def _shrink_retired(self, room: int) -> None:
        """Retired sequences go, least recently used first, until they hold `room` bytes at most."""
        held = self.retired_bytes()
        while held > room and self._retired:
            key, retired = self._retired.popitem(last=False)
            self.prefixes.drop(key)
            held -= retired.seq.kv.capacity * self.column_bytes

    def share_prefix(self, s: Session) -> int:
        """Start session s's fresh sequence (nothing ingested yet) from the longest prefix of its tokens
        whose draft KV another session or a retired sequence holds: those columns are copied, and the
        draft ingests only the rest. Returns the tokens taken (0: none)."""
        seq = s.seq
        if seq is None or seq.cached or not self._sharing:
            return 0
        for n, owner in self.prefixes.candidates(seq.tokens):
            n = min(n, len(seq.tokens) - 1)  # the draft feeds one token at least: its last
            donor = (getattr(self._retired.get(owner), "seq", None) if owner < 0
                     else getattr(self._by_tag.get(owner), "seq", None))
            if donor is None or donor is seq or donor.cached < n or donor.tokens[:n] != seq.tokens[:n]:
                continue
            seq.kv.gather([donor.kv], [n])
            seq.cached = n
            if owner < 0:
                self._retired.move_to_end(owner)
            self.stats.count("prefix_hits")
            self.stats.count("prefix_tokens", n)
            return n
        return 0

    def drafted(self, s: Session) -> None:
        """Session s's sequence has ingested its tokens: its prefix is there for others (after a draft
        that started it from nothing: a new stream, or one back from eviction)."""
        if self._sharing and s.seq is not None:
            self.prefixes.register(s.tag, s.seq.tokens, upto=s.seq.cached)

    def _retire(self, s: Session) -> None:
        """Session s leaves its draft state: kept for others' prefixes where it holds a block, while the
        budget has room (free_room)."""
        seq, s.seq = s.seq, None
        if seq is None or seq.cached < BLOCK or not self._sharing or self.cfg.prefix_keep_s <= 0:
            self.prefixes.drop(s.tag)
            return
        self._retired_key -= 1
        self._retired[self._retired_key] = Retired(seq, time.monotonic())
        self.prefixes.register(self._retired_key, seq.tokens, upto=seq.cached)
        self.prefixes.drop(s.tag)

    def _make_room(self, s: Session, length: int, start: int, draft: DraftConfig, busy: frozenset[int]) -> None:
        """Room in the draft KV budget for session `s` at `length` tokens and a draft of `draft`'s shape
        below them, as its allocation will grow to hold them (a sequence starts at `start` tokens when
        it has none: models/kv.py). A request its session's allocation already holds asks for nothing
        new. Where the others hold too much, the retired sequences go, then the pre-drafts, then the
        idle sessions' draft KV, least recently served first (evicted). Raises Refused (kv_full) where
        the whole budget cannot hold this session, and Wait where the sessions in `busy` hold the rest."""
        needed = length + min(draft.max_nodes, MAX_DRAFT_NODES)
        if s.seq is not None and needed <= s.seq.kv.capacity:
            return  # the common step: no sum over the other sessions
        capacity = s.seq.kv.capacity if s.seq is not None else start + GROWTH_MIN  # Drafter.start's
        need = grown(capacity, needed) * self.column_bytes
        if need > self.kv_budget:
            raise Refused("kv_full", f"a session of {length} tokens needs more draft KV than the server's whole "
                          f"budget ({self.cfg.kv_budget_gib:g} GiB); go on without drafts")
        others = self.kv_bytes(skip=s) + self.predraft_bytes()
        self._shrink_retired(self.kv_budget - others - need)
        over = others + need - self.kv_budget
        if over <= 0:
            return
        for x in self._by_tag.values():
            over -= sum(o.seq.kv.capacity for o in (x.ahead or {}).values()) * self.column_bytes
            x.ahead = None
        idle = [x for x in self._by_tag.values()
                if x.seq is not None and x is not s and x.tag not in busy and self.drafter.taps is None]
        for x in sorted(idle, key=lambda x: x.last_seen):
            if over <= 0:
                return
            over -= x.seq.kv.capacity * self.column_bytes
            self._evict(x)
        if over > 0:
            raise Wait()

    def _evict(self, s: Session) -> None:
        """Free a session's draft KV, keeping its committed tokens for its next request to ingest again."""
        s.parked = s.seq.tokens
        s.seq = None
        s.ahead = None
        self.prefixes.drop(s.tag)
        self.stats.count("sessions_evicted")
        log.debug("session %x of %s evicted (draft KV budget)", s.tag, s.name)

    def heartbeat(self, tag: int) -> bool:
        """A Ping with this tag came in (IO thread): the target is alive. The tag is the proof.
        Whether the session is held (its Pong says so). One lookup, then a write to the session
        itself: a session freed meanwhile takes the write with it (a dict keyed by tag kept it)."""
        s = self._by_tag.get(tag)
        if s is None:
            return False
        s.pinged = time.monotonic()
        return True

    def connections(self) -> int:
        """The connections that hold sessions (an engine's requests share one)."""
        return len({s.peer for s in self})

    def free(self, s: Session, why: str) -> None:
        self._retire(s)
        self._by_tag.pop(s.tag, None)
        if self._by_stream.get((s.peer, s.stream)) == s.tag:
            del self._by_stream[s.peer, s.stream]
        self.stats.count("sessions_freed")
        log.info("session %x of %s freed (%s)", s.tag, s.name, why)

    def reap(self) -> None:
        """Free every session whose target has been silent for session_timeout_s, and drop the retired
        sequences kept for prefix_keep_s."""
        now = time.monotonic()
        for s in list(self._by_tag.values()):
            if now - max(s.last_seen, s.pinged) > self.cfg.session_timeout_s:
                self.free(s, "timed out")
        for key in [k for k, r in self._retired.items() if now - r.at > self.cfg.prefix_keep_s]:
            del self._retired[key]
            self.prefixes.drop(key)
