"""Sessions: the per-target state of a draft server, and the rules a draft request must pass.

A handshake (Hello) binds a fresh random tag to the peer's connection; all draft state of that
target (its draft KV cache, its committed tokens, its settings and random generator) lives under
the tag, and a request is honoured only from the connection that owns it (and, with keys, from its
authenticated key), so sessions never see or disturb each other. A session's `next_step` advances
by one per request taken; a refused request is not taken and leaves it where it was. A session is freed on Bye, on a second Hello from its
connection, or once neither a request nor a heartbeat has come for session_timeout_s.

Only the compute loop calls these methods, except `heartbeat` (the IO thread). `heartbeat` writes
nothing but the `pinged` field of a session it finds, so a ping that races with `free` (the compute
loop) lands on a session object that is gone with it, and leaves nothing behind.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

import torch

from starsd.config import MAX_DRAFT_NODES, DraftConfig, SamplingConfig, ServerConfig
from starsd.models.drafter import Drafter, DraftSequence
from starsd.models.kv import KV
from starsd.spec_decode.verify import make_generator
from starsd.star import protocol as P
from starsd.star.ahead import Outcome
from starsd.star.stats import ServerStats

log = logging.getLogger("starsd.sessions")


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


class Sessions:
    def __init__(self, cfg: ServerConfig, drafter: Drafter, fingerprint: str, vocab_size: int, stats: ServerStats):
        self.cfg = cfg
        self.drafter = drafter
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.stats = stats
        self._by_tag: dict[int, Session] = {}
        self._by_peer: dict[bytes, int] = {}
        self.column_bytes = KV.bytes_per_column(drafter.model)  # one token of draft KV
        self.kv_budget = int(cfg.kv_budget_gib * (1 << 30))

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
        old = self._by_peer.get(peer)
        if old is not None:  # one session per connection: a second hello replaces the first
            self.free(self._by_tag[old], "replaced")
        if len(self._by_tag) >= self.cfg.max_sessions:
            raise Refused("too_many_sessions", f"the draft server holds its maximum of {self.cfg.max_sessions} "
                          "sessions; retry later or use another draft server")
        s = Session(secrets.randbits(62) + 1, peer, hello.name, user, local)
        self._by_tag[s.tag] = s
        self._by_peer[peer] = s.tag
        self.stats.count("sessions_opened")
        log.info("session %x opened for %s%s", s.tag, s.name, " (on this host)" if local else "")
        return s

    def owned(self, peer: bytes, user: str, tag: int) -> Session:
        """The session `tag`, if this connection (and this authenticated key) owns it. Raises Refused."""
        s = self._by_tag.get(tag)
        if s is None or s.peer != peer or s.user != user:
            raise Refused("unknown_session", f"no session {tag:x} on this connection; say hello first")
        s.last_seen = time.monotonic()
        return s

    def admit(self, peer: bytes, user: str, msg: P.DraftRequest, tensors: tuple[torch.Tensor, ...]) -> Session:
        """Check a draft request against its session and apply a reset; the request is taken
        (next_step advances) only if nothing is refused. Raises Refused."""
        s = self.owned(peer, user, msg.tag)
        tokens = tensors[0]
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            raise Refused("bad_tokens", f"token ids must lie in [0, {self.vocab_size})")
        if self.drafter.taps is not None and (len(tensors) < 2 or tensors[1].shape[1] != self.drafter.model.feature_width):
            raise Refused("bad_features", f"this server drafts with an EAGLE head: each token needs the target's "
                          f"features [m, {self.drafter.model.feature_width}] (taps {self.drafter.taps})")
        if msg.reset:
            s.seq = None  # the old stream's state goes whether or not the new one is admitted
        elif s.seq is None:
            raise Refused("reset_required", "this session has no draft state: send a reset request")
        elif msg.step != s.next_step:
            raise Refused("bad_step", f"expected step {s.next_step}, got {msg.step}")
        length = tokens.shape[0] + (0 if msg.reset else len(s.seq.tokens) + len(s.carry))
        if length > self.cfg.max_context:
            s.seq = None
            raise Refused("context_full", f"the session would exceed {self.cfg.max_context} tokens")
        self._check_memory(s, length)
        if msg.reset:
            s.draft = msg.draft
            s.sampling = msg.sampling
            s.generator = make_generator(msg.sampling.seed + 1, self.drafter.device)
            s.seq = self.drafter.start(tokens.tolist())
            s.carry, s.last_chain, s.last_second, s.ahead = [], [], [], None
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

    def _check_memory(self, s: Session, length: int) -> None:
        """Refuse (kv_full) a request whose session would take the draft KV past its budget: its
        tokens, a draft tree below them, and an allocation that grows geometrically. A request its
        session's allocation already holds asks for nothing new and is not counted again."""
        if s.seq is not None and length + MAX_DRAFT_NODES <= s.seq.kv.capacity:
            return  # the common step: no sum over the other sessions
        need = max(2 * length, length + MAX_DRAFT_NODES) * self.column_bytes
        if s.seq is not None:
            need = max(need, s.seq.kv.capacity * self.column_bytes)
        if self.kv_bytes(skip=s) + need > self.kv_budget:
            raise Refused("kv_full", f"the draft KV budget ({self.cfg.kv_budget_gib:g} GiB) is taken by other "
                          "sessions; go on without drafts and retry later")

    def heartbeat(self, tag: int) -> bool:
        """A Ping with this tag came in (IO thread): the target is alive. The tag is the proof.
        Whether the session is held (its Pong says so). One lookup, then a write to the session
        itself: a session freed meanwhile takes the write with it (a dict keyed by tag kept it)."""
        s = self._by_tag.get(tag)
        if s is None:
            return False
        s.pinged = time.monotonic()
        return True

    def free(self, s: Session, why: str) -> None:
        self._by_tag.pop(s.tag, None)
        if self._by_peer.get(s.peer) == s.tag:
            del self._by_peer[s.peer]
        self.stats.count("sessions_freed")
        log.info("session %x of %s freed (%s)", s.tag, s.name, why)

    def reap(self) -> None:
        """Free every session whose target has been silent for session_timeout_s."""
        now = time.monotonic()
        for s in list(self._by_tag.values()):
            if now - max(s.last_seen, s.pinged) > self.cfg.session_timeout_s:
                self.free(s, "timed out")
