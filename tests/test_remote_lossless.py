"""Sampled decoding through the remote path keeps the target distribution, with everything that can
happen to a remote draft happening: RemoteDrafters on a live draft server (a process of its own, real
ZeroMQ sockets), the adaptive depth policy on, several targets at once (the server batches them), and a
server that is slow now and then. So drafts miss their deadline (the step decodes alone), drafts asked
without waiting come back late and are taken below the tokens committed meanwhile (DraftTree.follow),
and, for argmax chains, the server answers from its pre-drafts (star/ahead.py). Each is counted, and
must have happened.

The law of the first N sampled tokens is known exactly from the tiny target (top_k 3: 27 outcomes).
Many generations, each with seeds of its own, are compared with it by the check of the Markov tests
(tests/lossless.py: total variation to the target law, five times below that to reference laws, and a
chi-square test), the TV bound where an exact sampler exceeds it about once in 10^4 runs. The check
has power: it fails when the target verifies with a q other than the one each token was drawn from.

The targets' time is the policy's input, so it is set in multiples of the server's own round trip,
measured first: drafting pays here as it does for a real target, on a fast machine or a loaded one."""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import tiny
from lossless import assert_matches, expected_tv
from starsd.config import DraftConfig, SamplingConfig, ServerConfig
from starsd.models.drafter import Drafter
from starsd.spec_decode.decode import speculative_steps
from starsd.spec_decode.depth import DepthPolicy
from starsd.spec_decode.tree import DraftTree
from starsd.spec_decode.verify import warp
from starsd.star import remote_drafter as client_module
from starsd.star.client import DraftClient, query_stats
from starsd.star.remote_drafter import RemoteDrafter, Timing
from starsd.star.processes import free_port
from starsd.star.server import DraftServer

FP = "f" * 64
PROMPT = [10, 11, 12]
S = SamplingConfig(temperature=1.0, top_k=3)
N = 3  # tokens whose joint law is checked
BUDGET = 64  # tokens a generation may emit: the policy drafts as in a long stream, which ends after its N-th token
TINY = dict(seed=1, layers=1, hidden=64)  # the target (tiny.tiny_model): one layer, so that a draft costs little
DRAFT_NOISE = 0.03  # the draft: the target with this much noise on its weights (tiny.perturbed)
SAMPLED = DraftConfig(depth=2, sample=True, min_path_prob=0.0)  # adaptive, as by default
ARGMAX = DraftConfig(depth=2, min_path_prob=0.0)
STREAMS = 8  # targets on the server at once, each a thread here (the server batches them)
PREFILL = 1.0  # the target's prefill, in server round trips: the first draft, asked before it, mostly comes within it
VERIFY = 2.0  # each target pass, in server round trips: drafting pays
SLOW_EVERY = 400  # every this many batches the server takes SLOW longer: drafts miss their deadline, and come late
SLOW = 10.0  # in server round trips
SLOW_FIRST_EVERY = 8  # every this many batches with a prompt's first draft, the server takes SLOW_FIRST longer:
SLOW_FIRST = 1.5  # in round trips: past the target's prefill (PREFILL), so the first step decodes alone, but
# well within that step's pass (VERIFY), so the second takes the draft below the first token, where it follows
ROUNDS = 3  # runs of `trials` generations at most, until each event the test needs has happened
EXPLORE = 4  # the policy's: steps between its looks beside its choice, and after a missed deadline, decoding alone
# The TV bound of the first k tokens' law, in multiples of an exact sampler's mean TV: what an exact
# sampler exceeds about once in 10^4 runs here (simulated; fewer outcomes spread the TV more), as the
# bounds of test_verify's Markov checks are for theirs (1.64 on 64 outcomes)
NOISE_MULTIPLE = {1: 3.6, 2: 2.2, 3: 1.75}


class Logits:
    """A tiny model's next-token logits after any token path, each path's computed once (the paths
    of one length in one batched pass)."""

    def __init__(self, model):
        self.model = model
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}
        self.lock = threading.Lock()  # the targets' threads share it

    def __call__(self, paths: list[tuple[int, ...]]) -> torch.Tensor:
        """[len(paths), V] float32."""
        with self.lock:
            missing = sorted({p for p in paths if p not in self.rows}, key=len)
            for _, same in itertools.groupby(missing, key=len):
                same = list(same)
                with torch.inference_mode():
                    out = self.model(torch.tensor(same)).logits[:, -1].float()
                self.rows.update(zip(same, out))
            return torch.stack([self.rows[p] for p in paths])

    def warp(self, path: tuple[int, ...]) -> torch.Tensor:
        """[V] the sampling law S after `path`."""
        return warp(self([path])[0], S)


class MemoSequence(list):
    """The committed tokens; its passes are its own (spec_decode/decode.py reads pass_ms)."""

    pass_ms = None


class MemoTarget:
    """The tiny target, scoring a draft by looking up each of its rows by token path (Logits), so
    that thousands of generations cost the draft server's work and the wire's, not the target's;
    its prefill and its passes take their time all the same (sleeps, while the server drafts)."""

    def __init__(self, logits: Logits, round_trip_ms: float):
        self.logits = logits
        self.device = torch.device("cpu")
        self.prefill_s = PREFILL * round_trip_ms / 1e3
        self.verify_s = VERIFY * round_trip_ms / 1e3

    def start(self, ids: list[int]) -> MemoSequence:
        time.sleep(self.prefill_s)
        return MemoSequence(ids)

    def commit(self, seq: list[int], verdict) -> None:
        seq.extend(verdict.tokens)

    def score(self, seq: list[int], tree: DraftTree) -> torch.Tensor:
        time.sleep(self.verify_s)
        paths = [tuple(seq)]
        for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
            paths.append(paths[parent + 1] + (token,))
        return self.logits(paths)


class SlowNowAndThen(Drafter):
    """The draft model, every SLOW_EVERY-th batch (pre-drafts included) `slow_s` seconds slower (a
    value the test process sets, once it knows the server's round trip), and every SLOW_FIRST_EVERY-th
    batch that drafts a prompt's first draft SLOW_FIRST round trips slower: the events the test needs
    come from the server's pace, not from the machine's."""

    def __init__(self, model, slow_s):
        super().__init__(model)
        self.slow_s = slow_s
        self.batches = 0
        self.firsts = 0

    def propose_batch(self, jobs, stop=None, done=None):
        self.batches += 1
        if any(j.seq.cached == 0 for j in jobs):
            self.firsts += 1
            if self.firsts % SLOW_FIRST_EVERY == 0:
                time.sleep(self.slow_s.value * SLOW_FIRST / SLOW)
        if self.batches % SLOW_EVERY == 0:
            time.sleep(self.slow_s.value)
        return super().propose_batch(jobs, stop, done)


def draft_model():
    return tiny.perturbed(tiny.tiny_model(**TINY), seed=7, scale=DRAFT_NOISE)


def serve(address: str, slow_s) -> None:
    """The draft server's process: the tiny draft model, slow now and then."""
    torch.set_num_threads(1)
    # its targets are on this host, but sleep through their passes: pre-drafts take no cores from them
    server = DraftServer(SlowNowAndThen(draft_model(), slow_s), FP, tiny.VOCAB,
                         ServerConfig(bind=address, predraft_cohosted=True))
    server.serve()


@dataclass
class Server:
    address: str
    slow_s: object  # shared with the server's process: how much slower its slow batches are (s)
    round_trip_ms: float = 0.0


@pytest.fixture(scope="module")
def server() -> Server:
    """A draft server in a process of its own (the targets' threads here do not share its GIL), and
    its round trip for a stream's first draft (a reset) while STREAMS targets ask at once, here and
    now: the median of a few rounds, after one (the process's start is paid for). Its slow batches
    are SLOW round trips slower from then on."""
    ctx = multiprocessing.get_context("spawn")
    server = Server(f"tcp://127.0.0.1:{free_port()}", ctx.RawValue("d", 0.0))
    process = ctx.Process(target=serve, args=(server.address, server.slow_s), daemon=True)
    process.start()
    try:
        started = time.monotonic()
        while query_stats(server.address, timeout_s=1.0) is None:
            assert process.is_alive() and time.monotonic() - started < 120, "the draft server did not start"
        server.round_trip_ms = statistics.median(round_trips(server.address))
        server.slow_s.value = SLOW * server.round_trip_ms / 1e3
        yield server
    finally:
        process.kill()  # nothing of it is needed after the tests
        process.join(10)


def round_trips(address: str) -> list[float]:
    """Round trips (ms) of resets that STREAMS targets send at once, five rounds after a first."""
    took = []

    def ask():
        client = DraftClient(address, FP, "pace", timeout_s=60, heartbeat_s=0)
        try:
            client.hello()
            for i in range(6):
                t0 = time.perf_counter()
                client.draft(PROMPT, SAMPLED.depth + 1, SAMPLED, S)
                if i:
                    took.append((time.perf_counter() - t0) * 1e3)
        finally:
            client.close()

    threads = [threading.Thread(target=ask) for _ in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return took


@dataclass
class Stream:
    """One target's generations, one after another on one session and one depth policy (as a target
    server runs them), each with seeds of its own: their first N tokens, and what happened to the drafts."""

    cfg: DraftConfig
    trials: range
    counts: Counter = field(default_factory=Counter)
    accepted: int = 0  # drafted tokens accepted among the first N
    timing: Timing | None = None
    failure: BaseException | None = None

    def run(self, address: str, target: MemoTarget) -> None:
        client = DraftClient(address, FP, "t", timeout_s=60, heartbeat_s=0)
        try:
            client.hello()
            drafter = RemoteDrafter(client)
            assert drafter.asynchronous, "the drafts must be asked ahead: one torch thread, two cores or more"
            policy = DepthPolicy(self.cfg.depth, explore=EXPLORE)
            for trial in self.trials:
                sampling = dataclasses.replace(S, seed=2 * trial)  # the draft's generator takes seed + 1: no two
                # generations share a random stream
                steps = speculative_steps(target, drafter, PROMPT, BUDGET, self.cfg, sampling, policy=policy)
                tokens = []
                for step in steps:
                    self.accepted += min(step.accepted, N - len(tokens))
                    tokens += step.tokens
                    if len(tokens) >= N:
                        break
                steps.close()
                self.counts[tuple(tokens[:N])] += 1
            self.timing = drafter.timing
        except BaseException as e:  # raised again in the test's thread
            self.failure = e
        finally:
            client.close()


def sample_remotely(address: str, target: MemoTarget, targets: tuple[DraftConfig, ...],
                    trials: int) -> tuple[list[Stream], dict]:
    """`trials` generations of N tokens from PROMPT by one target per config, at once on the draft
    server: each target's stream, and the server's pre-draft counters meanwhile."""
    streams = [Stream(cfg, range(k, trials, len(targets))) for k, cfg in enumerate(targets)]
    before = query_stats(address)["predraft"]
    threads = [threading.Thread(target=s.run, args=(address, target)) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in streams:
        if s.failure is not None:
            raise s.failure
    after = query_stats(address)["predraft"]
    return streams, {k: after[k] - before[k] for k in ("outcomes", "hits")}


def exact_law(logits: Logits, n: int) -> dict[tuple[int, ...], float]:
    """The law of the first n tokens after PROMPT of sampling S, from the model's own distributions."""
    law = {(): 1.0}
    for _ in range(n):
        longer = {}
        for prefix, mass in law.items():
            p = logits.warp(tuple(PROMPT) + prefix)
            for t in p.nonzero().squeeze(1).tolist():
                longer[prefix + (t,)] = mass * float(p[t])
        law = longer
    return law


@pytest.fixture(scope="module")
def logits() -> Logits:
    """The target's logits, computed ahead for every path a verify pass can ask for: each prefix the
    target can sample (fewer than N tokens), and below it every chain of draft tokens as deep as a
    draft or a pre-draft goes (each among the draft's top S.top_k at its place)."""
    target = Logits(tiny.tiny_model(**TINY))
    draft = Logits(draft_model())
    prefixes = {tuple(PROMPT) + o[:k] for o in exact_law(target, N - 1) for k in range(N)}
    paths = set(prefixes)
    for _ in range(SAMPLED.depth + 1):
        prefixes = {p + (t,) for p in prefixes for t in draft.warp(p).nonzero().squeeze(1).tolist()}
        paths |= prefixes
    target(sorted(paths))
    return target


@pytest.fixture(scope="module")
def laws(logits) -> tuple[dict, dict]:
    """The target's law of the first N tokens, and the draft model's own (a reference)."""
    return exact_law(logits, N), exact_law(Logits(draft_model()), N)


@pytest.fixture
def target(logits, server) -> MemoTarget:
    return MemoTarget(logits, server.round_trip_ms)


def check(streams: list[Stream], law: dict, draft_law: dict) -> None:
    """The empirical law of the streams' first 1, 2 and N tokens against the exact one."""
    counts = sum((s.counts for s in streams), Counter())
    trials = sum(counts.values())
    for k in (1, 2, N):
        outcomes = sorted({o[:k] for o in itertools.chain(law, draft_law, counts)})
        target = np.array([sum(m for o, m in law.items() if o[:k] == x) for x in outcomes])
        drafted = np.array([sum(m for o, m in draft_law.items() if o[:k] == x) for x in outcomes])
        seen = np.array([sum(c for o, c in counts.items() if o[:k] == x) for x in outcomes])
        refs = {"uniform": (target > 0) / (target > 0).sum(), "shifted p": np.roll(target, 1), "draft law": drafted}
        max_tv = NOISE_MULTIPLE[k] * expected_tv(target, trials)
        # a reference is told apart from the target only if the law within max_tv of the target can be
        # five times nearer to it than to the reference: 6 max_tv away at the least
        refs = {name: ref for name, ref in refs.items() if 0.5 * np.abs(target - ref).sum() > max(0.1, 6 * max_tv)}
        assert_matches(f"first {k} tokens", seen, target, refs, max_tv=max_tv)


def what_happened(streams: list[Stream]) -> dict:
    trials = sum(len(s.trials) for s in streams)
    return {"accepted per trial": sum(s.accepted for s in streams) / trials,
            **{k: sum(getattr(s.timing, k) for s in streams) for k in ("late", "ahead", "taken_late")}}


@pytest.mark.parametrize("cfg, trials", [(SAMPLED, 1000), (ARGMAX, 240)],
                         ids=["sampled-chains", "argmax-chains"])
def test_remote_sampling_keeps_the_target_law(server, target, laws, cfg, trials):
    assert cfg.adaptive
    streams, predraft = sample_remotely(server.address, target, (cfg,) * STREAMS, trials)
    for _ in range(ROUNDS - 1):  # what must happen depends on timing: a loaded machine may need more streams
        happened = what_happened(streams)
        if (happened["late"] and happened["taken_late"]) if cfg.sample else predraft["hits"]:
            break
        more, extra = sample_remotely(server.address, target, (cfg,) * STREAMS, trials)
        streams += more
        predraft = {k: predraft[k] + extra[k] for k in predraft}
    happened = what_happened(streams) | {"predraft": predraft}
    if cfg.sample:  # q travels with each draft
        assert happened["late"] >= 1, happened  # a draft missed its deadline: the step decoded alone
        assert happened["taken_late"] >= 1, happened  # a draft came late, taken below the tokens committed since
        assert happened["accepted per trial"] > 0.25, happened  # drafts made many of the tokens
    else:  # pre-drafts: argmax chains only
        assert predraft["hits"] >= 1, happened  # pre-drafts answered requests
    check(streams, *laws)


def test_the_remote_check_fails_when_q_is_not_the_one_drawn_from(server, target, laws, monkeypatch):
    """The target verifies each sampled draft with the q of other positions: the rows of the stream's
    previous draft (its deepest first) instead of those its tokens were drawn from. The check tells
    only where drafts made many of the tokens, so the targets draft every step at full depth and wait
    for it (not adaptive): how loaded the machine is decides nothing here. Adaptive targets under the
    parallel suite's load once decoded alone often enough to pass it, drafts making just over a quarter
    of a token a trial; waiting for every draft, they make about two of the three."""
    read = client_module._tree
    last = {}

    def swapped(tensors):
        tree = read(tensors)
        other = last.get(threading.get_ident(), tree.q)
        last[threading.get_ident()] = tree.q
        return DraftTree(tree.tokens, tree.parents, other[(len(other) - 1 - torch.arange(len(tree))) % len(other)])

    monkeypatch.setattr(client_module, "_tree", swapped)
    every_step = dataclasses.replace(SAMPLED, adaptive=False)
    streams, _ = sample_remotely(server.address, target, (every_step,) * STREAMS, 600)
    assert what_happened(streams)["accepted per trial"] > 1.5, what_happened(streams)
    with pytest.raises(AssertionError, match="TV to target|chi-square") as err:
        check(streams, *laws)
    assert "setup" not in str(err.value)
