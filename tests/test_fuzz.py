"""Fuzzing the wire: protocol.decode under hypothesis, a live draft server under a stream of bad
inputs while honest sessions draft beside them, and the corpus of tests/data/fuzz replayed.

A decoded message must survive encode -> decode unchanged; anything decode refuses must raise
ProtocolError with one of CODES, never another exception. A live server must answer every bad
input with an Error carrying the expected code (and the tag and step of a request that got as far
as its session), count it, keep drafting exactly what the drafter drafts alone for the honest
sessions, and stay up."""

from __future__ import annotations

import collections
import json
import math
import random
import threading
import tracemalloc
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from starsd.bench import fuzz as F
from starsd.config import ServerConfig
from starsd.star import protocol as P
from starsd.star.client import DraftClient
from starsd.star.processes import free_port
from starsd.star.server import DraftServer

CODES = {"empty", "unknown_type", "bad_header", "bad_settings", "bad_frames", "bad_tensor", "bad_request", "bad_reply"}
CORPUS = Path(__file__).parent / "data" / "fuzz"
FAST = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ------------------------------------------------------------------------------------ strategies
ints = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.sampled_from(F.INTS), st.integers(-3, 70))
text = st.one_of(st.text(max_size=12), st.sampled_from(F.STRINGS))
deep = st.builds(F.nested, st.integers(1, 20000), st.booleans())  # raw msgpack, nested deeper than Python goes
msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, st.floats(), text, st.binary(max_size=12), deep,
              st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=8))),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)), max_leaves=8)
spec = st.tuples(st.sampled_from(F.DTYPES), st.lists(st.one_of(st.integers(0, 6), st.sampled_from(F.DIMS)),
                                                     max_size=3)).map(list)
setting_value = st.one_of(st.integers(-2, 70), st.floats(), st.booleans(), ints, msgpack_values)
draft_map = st.dictionaries(st.sampled_from(["depth", "top_k", "total_tokens", "sample", "min_path_prob", "adaptive",
                                             "bogus"]), setting_value, max_size=6)
sampling_map = st.dictionaries(st.sampled_from(["temperature", "top_k", "top_p", "seed", "bogus"]), setting_value,
                               max_size=5)
specs = st.lists(spec, min_size=0, max_size=3)
FIELDS = {  # every message's header fields, each drawn with its declared type (mostly)
    P.MsgType.HELLO: (ints, text, text), P.MsgType.WELCOME: (ints, text, ints),
    P.MsgType.DRAFT_REQUEST: (ints, ints, st.booleans(), st.none() | draft_map, st.none() | sampling_map,
                              st.integers(-1, 40), specs),
    P.MsgType.DRAFT_REPLY: (ints, ints, st.floats(), st.floats(), ints, specs), P.MsgType.BYE: (ints,),
    P.MsgType.ERROR: (text, text, ints, ints), P.MsgType.PING: (ints, st.floats()), P.MsgType.PONG: (ints, st.floats()),
    P.MsgType.STATS_REQUEST: (), P.MsgType.STATS: (text,), P.MsgType.DESCRIBE: (),
    P.MsgType.TARGET_INFO: (text, text, ints, st.booleans(), st.booleans()),
    P.MsgType.GENERATE: (ints, st.none() | text, st.none() | st.lists(st.tuples(text, text).map(list), max_size=3),
                         st.integers(-1, 40), sampling_map, st.lists(text, max_size=5), st.booleans()),
    P.MsgType.OUTPUT: (ints, text, ints, ints, ints, text, ints), P.MsgType.CANCEL: (ints,),
    P.MsgType.DRAFT_MOVED: (text | st.just("tcp://10.0.0.1:5555"), text | st.just("ipc:///tmp/d")),
    P.MsgType.DRAFT_SERVERS: (st.lists(text | st.just("tcp://10.0.0.1:5555"), max_size=3),),
}


def declared_bytes(s: list) -> int | None:
    """The frame size a tensor spec declares, if its dtype is one decode knows and its shape is sane."""
    sizes = {"int32": 4, "float32": 4, "float16": 2, "bfloat16": 2}
    dtype, shape = s
    if dtype not in sizes or any(d < 0 for d in shape):
        return None
    return math.prod(shape) * sizes[dtype]


@st.composite
def tensor_frame(draw, s: list) -> bytes:
    """A frame for a tensor spec: the size it declares (when small), one byte off, or any size."""
    size = declared_bytes(s)
    if size is not None and size <= 2048:
        return draw(st.one_of(st.binary(min_size=size, max_size=size),
                              st.binary(min_size=max(0, size - 1), max_size=size + 1), st.binary(max_size=16)))
    return draw(st.binary(max_size=16))


@st.composite
def structured(draw) -> list[bytes]:
    """A header of any type with fields of their declared types, perhaps one replaced by any
    msgpack value, cut short or extended; tensor frames that match its specs or not; perhaps a
    frame too many or too few."""
    kind = draw(st.sampled_from(list(P.MsgType)))
    fields = list(draw(st.tuples(*FIELDS[kind])))
    change = draw(st.sampled_from(["none", "replace", "cut", "extend"]))
    if change == "replace" and fields:
        fields[draw(st.integers(0, len(fields) - 1))] = draw(msgpack_values)
    elif change == "cut":
        fields = fields[:draw(st.integers(0, len(fields)))]
    elif change == "extend":
        fields.append(draw(msgpack_values))
    tensors = fields[-1] if kind in (P.MsgType.DRAFT_REQUEST, P.MsgType.DRAFT_REPLY) and change == "none" else []
    out = [F.header(kind, fields), *(draw(tensor_frame(s)) for s in tensors)]
    frames_change = draw(st.sampled_from(["none", "none", "extra", "drop"]))
    if frames_change == "extra":
        out.append(draw(st.binary(max_size=8)))
    elif frames_change == "drop" and len(out) > 1:
        del out[draw(st.integers(1, len(out) - 1))]
    return out


@st.composite
def truncated(draw) -> list[bytes]:
    """A well-formed message (from the bench's generator) with one frame cut short."""
    out = F.valid_frames(draw(st.randoms(use_true_random=False)))
    i = draw(st.integers(0, len(out) - 1))
    out[i] = out[i][:draw(st.integers(0, max(0, len(out[i]) - 1)))]
    return out


raw = st.lists(st.binary(max_size=48), max_size=4)
typed_bytes = st.tuples(st.integers(0, 255), st.binary(max_size=48), st.lists(st.binary(max_size=16), max_size=2)).map(
    lambda t: [bytes([t[0]]) + t[1], *t[2]])
any_frames = st.one_of(raw, typed_bytes, structured(), truncated())


# ------------------------------------------------------------------------------- decode properties
def decode_outcome(frames: list) -> str:
    """"ok" for a message that comes back unchanged through encode -> decode, else the code of the
    ProtocolError; any other exception fails the test."""
    try:
        msg, tensors = P.decode(frames)
    except P.ProtocolError as e:
        assert e.code in CODES, e.code
        assert len(str(e)) <= F.MAX_ERROR_CHARS, f"a {len(str(e))}-character error message"
        return e.code
    assert isinstance(msg, tuple(P.STRUCTS.values())) and all(isinstance(t, torch.Tensor) for t in tensors)
    again = [bytes(f) for f in P.encode(msg, tensors)]
    assert [bytes(f) for f in P.encode(*P.decode(again))] == again
    return "ok"


@FAST
@given(raw)
def test_random_frames_decode_or_raise_protocol_error(frames):
    decode_outcome(frames)


@FAST
@given(typed_bytes)
def test_a_type_byte_with_random_bytes_decodes_or_raises_protocol_error(frames):
    decode_outcome(frames)


@settings(FAST, max_examples=500)
@given(structured(), st.booleans())
def test_structured_headers_and_tensor_frames_decode_or_raise_protocol_error(frames, as_zmq_frames):
    if as_zmq_frames:  # what the server's socket hands decode
        frames = [zmq.Frame(f) for f in frames]
    decode_outcome(frames)


@FAST
@given(truncated())
def test_truncated_messages_raise_protocol_error(frames):
    assert decode_outcome(frames) != "ok"


@FAST
@given(st.integers(0, 255).filter(lambda b: b not in set(P.MsgType)), st.binary(max_size=32))
def test_unknown_type_bytes_are_refused_as_such(byte, rest):
    assert decode_outcome([bytes([byte]) + rest]) == "unknown_type"


@FAST
@given(st.integers(1, 5000), st.sampled_from(["specs", "dims", "dtype", "messages", "stop"]))
def test_thousands_of_tiny_items_are_refused_before_they_are_built(n, where):
    """A header of n items more than allowed (tensor specs, a shape's dimensions, a dtype's
    characters, a Generate's messages or stop strings) is refused with a short message."""
    fields = {"specs": [["int32", [1]]] * (P.MAX_TENSORS + n), "dims": [["int32", [1] * (2 + n)]],
              "dtype": [["x" * (P.MAX_DTYPE_CHARS + n), [1]]]}
    if where in fields:
        frames = [F.header(P.MsgType.DRAFT_REQUEST, [1, 0, False, None, None, 8, fields[where]]), b"\0" * 4]
    elif where == "messages":
        frames = [F.header(P.MsgType.GENERATE, [1, None, [["user", ""]] * (P.MAX_MESSAGES + n), 8, {}, [], False])]
    else:
        frames = [F.header(P.MsgType.GENERATE, [1, "hi", None, 8, {}, ["a"] * (P.MAX_STOPS + n), False])]
    assert decode_outcome(frames) == ("bad_request" if where in ("messages", "stop") else "bad_tensor")


def test_a_huge_header_is_refused_without_building_it():
    """Two million tensor specs in a 6 MB header: refused before msgspec builds them (it used to
    take seconds and half a gigabyte of the server's IO thread, and answer with a 6 MB Error)."""
    head = F.header(P.MsgType.DRAFT_REQUEST, [1, 0, False, None, None, 8, [["", []]] * 2_000_000])
    tracemalloc.start()
    try:
        outcome = decode_outcome([head])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert outcome == "bad_tensor" and peak < 1 << 20


def test_msgpack_nested_too_deep_for_msgspec_is_a_bad_header():
    """A header with a value nested a few thousand arrays deep, where a field is skipped (a settings
    map's unknown key, a trailing extra field): msgspec raised RecursionError, which the draft
    server answered as an "internal" failure with a logged traceback, and which ended a target
    server (it catches ProtocolError only)."""
    for frames in (F.header(P.MsgType.DRAFT_REQUEST, [1, 0, True, {"bogus": F.nested(5000)}, {}, 8, []]),
                   F.header(P.MsgType.HELLO, [2, "f", "t", F.nested(5000, in_maps=True)])):
        assert decode_outcome([frames]) == "bad_header"


def test_a_header_nested_near_pythons_limit_is_refused_alike_in_any_thread():
    """Nested 900 levels: msgspec followed it in the draft server's thread (a shallow stack) but not
    in a caller deep in its own stack, so the same bytes were a BYE for session 0 there and a bad
    header here (the fuzzer saw it as a flaky refusal). Refused by depth, it is bad_header everywhere."""
    frames = F.header(P.MsgType.BYE, [0, F.nested(900)])
    outcomes = []
    thread = threading.Thread(target=lambda: outcomes.append(decode_outcome([frames])))
    thread.start()
    thread.join()

    def deep(n: int) -> str:
        return decode_outcome([frames]) if n == 0 else deep(n - 1)

    assert outcomes == [deep(400)] == ["bad_header"]


@FAST
@given(st.sampled_from([[P.MAX_DIM + 1], [P.MAX_DIM, P.MAX_DIM], [1 << 62, 1 << 62], [(1 << 64) - 1], [1, 1, 1]]),
       st.sampled_from(["int32", "float32", "bfloat16"]), st.binary(max_size=16))
def test_oversize_declared_shapes_are_refused_without_allocating(shape, dtype, frame):
    head = F.header(P.MsgType.DRAFT_REQUEST, [1, 0, False, None, None, 8, [[dtype, shape]]])
    assert decode_outcome([head, frame]) == "bad_tensor"


def test_the_bench_generator_finds_nothing_either():
    """The bench's own (seeded, non-hypothesis) generator, every kind a few hundred times."""
    tally = F.fuzz_decode(len(F.DECODE_KINDS) * 150, random.Random(1))
    assert tally.broke == []
    assert set(tally.by_kind) == set(F.DECODE_KINDS) and tally.by_kind["valid"] == {"ok": 150}


# ------------------------------------------------------------------------------------ live server
@pytest.fixture
def live(tiny_drafters):
    """A draft server on the tiny "good" drafter (fp32) with a small context, on a real TCP socket."""
    address = f"tcp://127.0.0.1:{free_port()}"
    server = DraftServer(tiny_drafters["good"], F.FINGERPRINT, F.VOCAB,
                         ServerConfig(bind=address, max_context=F.MAX_CONTEXT))
    thread = server.start()
    yield server, address, tiny_drafters["good"]
    server.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()


class HonestSession:
    """A well-behaved target in lockstep with the drafter run locally: one request in flight at a
    time; each reply must equal the local draft for the same request."""

    def __init__(self, address: str, drafter, name: str):
        self.client = DraftClient(address, F.FINGERPRINT, name, timeout_s=60, heartbeat_s=0)
        self.client.hello()
        self.drafter = drafter
        self.draft = F.HONEST[name]
        self.local = None
        self.sent: tuple[bool, list[int], int] | None = None  # the request in flight
        self.drafts = 0

    def send(self, tokens: list[int], budget: int, reset: bool) -> None:
        self.client.send_draft(tokens, budget, *((self.draft, F.GREEDY) if reset else ()))
        self.sent = (reset, tokens, budget)

    def receive(self) -> F.Exchange:
        """The reply to the request in flight, checked against the local drafter as deep as the reply went
        (the server ends a batch at its level when another session's request comes: server._cut)."""
        reset, tokens, budget = self.sent
        _, tensors = self.client.receive_draft()
        if reset:
            self.local = self.drafter.start(tokens)
        got = F.Exchange(reset, tokens, budget, tensors[0].tolist(), tensors[1].tolist())
        depth = F.depth_of(got.parents)
        assert depth, "an empty draft"
        want = self.drafter.propose(self.local, [] if reset else tokens, self.draft, F.GREEDY,
                                    max_depth=min(budget - 1, depth))
        assert (got.drafted, got.parents) == (want.tokens.tolist(), want.parents.tolist()), "noise changed a draft"
        self.sent = None
        self.drafts += 1
        return got


class NoisyServer(RuleBasedStateMachine):
    """Bad inputs from a noise connection, interleaved with honest sessions' requests in flight."""

    def __init__(self, server: DraftServer, address: str, drafter):
        super().__init__()
        self.server = server
        self.errors_before = collections.Counter(server.stats.snapshot(0)["errors"])
        self.ctx = zmq.Context()
        self.honest = {name: HonestSession(address, drafter, name) for name in F.HONEST}
        self.noise = F.Noise(self.ctx, address, [h.client.tag for h in self.honest.values()])
        self.sent: collections.Counter = collections.Counter()
        self.next_send = {name: None for name in F.HONEST}  # tokens to send next; None: a reset is due

    def _send_honest(self, name: str, rnd: random.Random) -> None:
        h = self.honest[name]
        tokens = self.next_send[name]
        if tokens is None:
            tokens = [rnd.randrange(1, F.VOCAB) for _ in range(rnd.randint(1, 30))]
        h.send(tokens, rnd.randint(2, 20), reset=self.next_send[name] is None)

    @precondition(lambda self: any(h.sent is None for h in self.honest.values()))
    @rule(rnd=st.randoms(use_true_random=False))
    def honest_send(self, rnd):
        self._send_honest(rnd.choice([n for n, h in self.honest.items() if h.sent is None]), rnd)

    @precondition(lambda self: any(h.sent is not None for h in self.honest.values()))
    @rule(rnd=st.randoms(use_true_random=False))
    def honest_receive(self, rnd):
        name = rnd.choice([n for n, h in self.honest.items() if h.sent is not None])
        x = self.honest[name].receive()
        accepted = F.accepted_path(x.drafted, x.parents, rnd)
        self.next_send[name] = None if rnd.random() < 0.1 else [*accepted, rnd.randrange(1, F.VOCAB)]

    @rule(frames=any_frames.filter(bool))  # ZeroMQ sends no message of no frames
    def garbage(self, frames):
        """Anything decode refuses gets decode's code back from the IO thread."""
        try:
            P.decode(frames)
        except P.ProtocolError as e:
            self._probe(F.Probe(frames, e.code))

    @rule(kind=st.sampled_from(list(F.LIVE_KINDS)), rnd=st.randoms(use_true_random=False))
    def misbehave(self, kind, rnd):
        """Foreign, stale and made-up tags, replays, bad steps and tokens, no reset, a full context..."""
        self._probe(F.LIVE_KINDS[kind](rnd, self.noise))

    def _probe(self, probe: F.Probe) -> None:
        assert F.judge(probe, self.noise.ask(probe.frames)) == probe.expect
        self.sent[probe.expect] += 1

    @invariant()
    def server_is_up(self):
        assert self.server.transport._thread.is_alive()

    def teardown(self):
        """Every refusal counted, the server still up; the sessions freed, even after a failure."""
        try:
            for h in self.honest.values():
                if h.sent is not None:
                    h.receive()
            counted = collections.Counter(self.server.stats.snapshot(0)["errors"]) - self.errors_before
            assert counted == self.sent
            assert F.server_alive(self.ctx, self.server.cfg.bind)
        finally:
            if self.noise.tag:
                self.noise.sock.send_multipart(F.frames(P.Bye(self.noise.tag)))
            for h in self.honest.values():
                h.client.close()
            self.ctx.destroy(linger=1000)  # the Bye goes out first


def test_a_live_server_refuses_every_bad_input_and_drafts_on_for_honest_sessions(live):
    server, address, drafter = live
    run_state_machine_as_test(lambda: NoisyServer(server, address, drafter),
                              settings=settings(FAST, max_examples=30, stateful_step_count=50))
    snap = server.stats.snapshot(len(server.sessions))
    assert snap["errors"].get("internal", 0) == 0 and snap["replies"] > 0


# ------------------------------------------------------------------------------------------ corpus
def corpus() -> list[dict]:
    return [{"file": path.name, **json.loads(line)} for path in sorted(CORPUS.glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def test_the_corpus_is_small_and_covers_every_kind():
    entries = corpus()
    assert sum(p.stat().st_size for p in CORPUS.glob("*.jsonl")) < 50_000
    assert {e["kind"] for e in entries} >= set(F.DECODE_KINDS) - {"valid"} | {"not_a_request", "made_up_tag",
                                                                              "bad_hello"}


@pytest.mark.parametrize("entry", corpus(), ids=lambda e: f"{e['file']}:{e['kind']}")
def test_corpus_decodes_as_recorded(entry):
    assert decode_outcome(F.from_corpus(entry["frames"])) == entry["decode"]


def test_corpus_replayed_to_a_live_server(live):
    server, address, _ = live
    ctx = zmq.Context()
    noise = F.Noise(ctx, address, [])
    try:
        want = collections.Counter()
        for entry in corpus():
            frames = F.from_corpus(entry["frames"])
            probe = F.Probe(frames, entry["server"], entry.get("tag", 0), entry.get("step", -1))
            F.judge(probe, noise.ask(frames))
            want[entry["server"]] += 1
        assert server.stats.snapshot(0)["errors"] == want
        assert F.server_alive(ctx, address)
    finally:
        ctx.destroy(0)  # a context left with open sockets would hang the process when collected


# ------------------------------------------------------------------------ the other direction
def test_a_server_that_answers_nonsense_costs_a_target_its_drafts_not_its_stream():
    """A malformed reply used to escape DraftClient as a ProtocolError and end the generation."""
    from starsd.config import DraftConfig, SamplingConfig
    from starsd.star.client import DraftServerError
    from starsd.star.remote_drafter import RemoteDrafter

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        c = DraftClient(f"tcp://127.0.0.1:{port}", "f" * 64, "t", timeout_s=5, heartbeat_s=0)
        c.send_draft([1, 2, 3], 5, DraftConfig(depth=3), SamplingConfig())
        peer, *_ = router.recv_multipart()
        router.send_multipart([peer, b"\xff"])
        with pytest.raises(DraftServerError, match="bad_reply"):
            c.receive_draft()
        drafter = RemoteDrafter(c)
        c.tag = 7  # as if a session were open
        drafter.down = False
        seq = drafter.start([1, 2, 3])
        answered = []

        def answer():
            peer, *_ = router.recv_multipart()
            router.send_multipart([peer, b"\x04garbage"])
            answered.append(True)


        t = threading.Thread(target=answer)
        t.start()
        tree = drafter.propose(seq, [], DraftConfig(depth=3), SamplingConfig(), max_depth=3)
        t.join(5)
        assert answered and len(tree) == 0 and drafter.down  # decodes alone; a new session comes later
        c.link.close(0)
    finally:
        router.close(0)


def test_gateway_refuses_what_the_wire_would_refuse():
    from starsd.serve.openai_api import ApiError, ChatRequest, CompletionRequest

    with pytest.raises(ApiError, match="messages"):
        ChatRequest(model="m", messages=[{"role": "user", "content": "x"}] * (P.MAX_MESSAGES + 1)).check()
    with pytest.raises(ApiError, match="characters"):
        ChatRequest(model="m", messages=[{"role": "user", "content": "x" * (P.MAX_PROMPT_CHARS // 2 + 1)}] * 2).check()
    with pytest.raises(ApiError, match="characters"):
        CompletionRequest(model="m", prompt="x" * (P.MAX_PROMPT_CHARS + 1)).check()
    CompletionRequest(model="m", prompt="x" * 100).check()
