"""Fuzz: the draft server's wire decoding and message handling, fed inputs that are wrong on purpose.

Two runs, both seeded:
  decode  N inputs straight into protocol.decode, a kind at a time in turn (DECODE_KINDS: each
          breaks a message in one way). An input *breaks* decode when it raises anything but
          ProtocolError, or decodes to a message that does not survive encode -> decode unchanged.
  live    M inputs over a real ZeroMQ socket to a draft server on tiny random-weight models (fp32,
          built here), sent by a *noise* connection while two *honest* targets (a chain and a tree)
          draft on connections of their own. Each kind (LIVE_KINDS) expects one Error code. An input
          breaks the server when its reply is not an Error with that code echoing its tag and step,
          when no reply comes, or when the server logs a failure (ERROR) while handling it. At the
          end the server's error counters must equal the codes sent, it must answer a ping, and
          each honest session's greedy drafts must be exactly those of the same drafter run locally
          on the same requests. One frame over MAX_FRAME_BYTES is sent as well, on a connection of
          its own: ZeroMQ drops that connection, so it gets no reply and is counted nowhere.

An input that broke anything goes into the JSON as frames in the format of the test corpus
(tests/data/fuzz/*.jsonl: one message per line, `corpus_frames`), ready to be added to it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import math
import random
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterator

import msgspec
import torch
import zmq

from starsd.config import DraftConfig, SamplingConfig, ServerConfig
from starsd.models.drafter import Drafter
from starsd.models.tiny import VOCAB, tiny_model
from starsd.results import bar_panels, summary, write_json
from starsd.spec_decode.tree import depths
from starsd.star import protocol as P
from starsd.star.client import DraftClient
from starsd.star.processes import free_port
from starsd.star.server import DraftServer

FINGERPRINT = "fuzz" * 16
MAX_CONTEXT = 512  # the live server's: context_full is cheap to reach
GREEDY = SamplingConfig()
HONEST = {"chain": DraftConfig(depth=4, min_path_prob=0.0, adaptive=False),
          "tree": DraftConfig(depth=3, top_k=2, total_tokens=6, min_path_prob=0.0, adaptive=False)}
Frames = list[bytes]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-inputs", type=int, default=20000, help="inputs fed straight into protocol.decode")
    p.add_argument("--live-inputs", type=int, default=2000, help="bad inputs sent to a live draft server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the draft server (tiny models)")
    p.add_argument("--json-out", default="results/fuzz.json")
    p.add_argument("--plot-out", default=None, help="PNG path (default: the JSON path with .png)")


# ---------------------------------------------------------------------------------- valid input
def token_tensor(rng: random.Random, n: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.tensor([rng.randrange(vocab) for _ in range(n)], dtype=torch.int32)


def frames(msg: msgspec.Struct, tensors: tuple[torch.Tensor, ...] = ()) -> Frames:
    return [bytes(f) for f in P.encode(msg, tensors)]


def header(kind: int, fields: object) -> bytes:
    """A header frame with any msgpack value as its body: what a broken peer might send."""
    return bytes([kind]) + msgspec.msgpack.encode(fields)


def draft_request(tag: int, step: int, tokens: torch.Tensor, reset: bool, budget: int = 16,
                  draft: DraftConfig = HONEST["chain"], sampling: SamplingConfig = GREEDY,
                  extra: tuple[torch.Tensor, ...] = ()) -> Frames:
    """A draft request's frames; a reset carries `draft` and `sampling`."""
    settings = (draft, sampling) if reset else (None, None)
    return frames(*P.draft_request(tag, step, tokens, budget, *settings, extra))


def valid_message(rng: random.Random) -> tuple[msgspec.Struct, tuple[torch.Tensor, ...]]:
    """A well-formed message of a random type, with its tensors."""
    tag = rng.getrandbits(62) + 1
    n = rng.randint(1, 8)
    kind = rng.choice(list(P.MsgType))
    if kind == P.MsgType.DRAFT_REQUEST:
        tensors = (token_tensor(rng, n),) if rng.random() < 0.7 else (token_tensor(rng, n), torch.randn(n, 4))
        reset = rng.random() < 0.5
        settings = (DraftConfig(depth=rng.randint(1, 8), top_k=rng.randint(1, 3)), SamplingConfig(seed=n))
        return P.DraftRequest(tag, n, reset, *(settings if reset else (None, None)), 9, P.specs(*tensors)), tensors
    if kind == P.MsgType.DRAFT_REPLY:
        tokens = token_tensor(rng, n)
        ids = torch.cat([tokens[:, None], token_tensor(rng, 3 * n).view(n, 3)], dim=1)  # each node's own token first
        tree = (tokens, torch.arange(-1, n - 1, dtype=torch.int32), ids, torch.rand(n, 4).half() + 0.01)
        tensors = tree[:rng.choice([2, 4])]  # q (ids, weights): sampled drafts only
        return P.DraftReply(tag, n, 0.5, 1.5, 2, P.specs(*tensors)), tensors
    return {
        P.MsgType.HELLO: P.Hello(P.PROTOCOL_VERSION, FINGERPRINT, "t"), P.MsgType.WELCOME: P.Welcome(tag, "s", 256),
        P.MsgType.BYE: P.Bye(tag), P.MsgType.ERROR: P.Error("bad_step", "m", tag, n), P.MsgType.PING: P.Ping(tag, 1.0),
        P.MsgType.PONG: P.Pong(tag, 1.0), P.MsgType.STATS_REQUEST: P.StatsRequest(), P.MsgType.STATS: P.Stats("{}"),
        P.MsgType.DESCRIBE: P.Describe(), P.MsgType.TARGET_INFO: P.TargetInfo("t", "m", 4096, True, False),
        P.MsgType.GENERATE: P.Generate(tag, "hi" * n, None, 16, GREEDY, ("\n",)) if n % 2 else
        P.Generate(tag, None, (P.Message("user", "hi"),), 16, GREEDY),
        P.MsgType.OUTPUT: P.Output(tag, "x", 1, 2, 1), P.MsgType.CANCEL: P.Cancel(tag),
        P.MsgType.DRAFT_MOVED: P.DraftMoved("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"),
        P.MsgType.DRAFT_SERVERS: P.DraftServers(tuple(f"tcp://127.0.0.1:{i + 1}" for i in range(1 + n % 3))),
    }[kind], ()


def random_settings(rng: random.Random) -> tuple[DraftConfig, SamplingConfig]:
    """Valid settings of any kind: chains and trees, greedy and sampled targets, sampled chains."""
    sampling = SamplingConfig(temperature=rng.choice([0.0, 0.0, 0.7, 1.5]), top_k=rng.choice([0, 0, 5]),
                              top_p=rng.choice([1.0, 1.0, 0.9]), seed=rng.randrange(1 << 40))
    if rng.random() < 0.25:
        return DraftConfig(depth=rng.randint(1, 6), sample=True, min_path_prob=0.0), sampling
    top_k = rng.randint(1, 3)
    return DraftConfig(depth=rng.randint(1, 6), top_k=top_k, total_tokens=rng.randint(0, 6 * top_k),
                       min_path_prob=rng.choice([0.0, 0.3])), sampling


def valid_frames(rng: random.Random) -> Frames:
    return frames(*valid_message(rng))


# --------------------------------------------------------------------------------- hostile input
INTS = (0, 1, -1, 2, 255, (1 << 31) - 1, 1 << 31, -(1 << 31) - 1, (1 << 63) - 1, -(1 << 63), (1 << 64) - 1,
        P.MAX_DIM + 1, P.MAX_TOKENS_PER_REQUEST + 1)
FLOATS = (0.0, -0.0, 0.5, 1.0, 1e308, 5e-324, float("nan"), float("inf"), float("-inf"))
STRINGS = ("", "int32", "float32", "bfloat16", "int64", "INT32", "\x00", "é€𝄞", "x" * 300)
DTYPES = ("int32", "float32", "float16", "bfloat16", "int64", "uint8", "bool", "", "Int32", "int32 ")
DIMS = (0, 1, 2, 3, 5, -1, -(1 << 63), P.MAX_DIM, P.MAX_DIM + 1, 1 << 62, (1 << 64) - 1)


def nested(depth: int, in_maps: bool = False) -> msgspec.Raw:
    """Arrays (or maps) nested `depth` deep around a nil, as raw msgpack: deeper than any encoder
    here would go, and what a decoder that recurses cannot follow."""
    return msgspec.Raw((b"\x81\xa0" if in_maps else b"\x91") * depth + b"\xc0")  # a map: {"": ...}


def hostile_value(rng: random.Random, depth: int = 0) -> object:
    """Any msgpack value, biased towards boundaries: None, bools, extreme ints and floats, odd
    strings, bytes, extension types, (two levels deep at most) arrays and maps, and now and then
    arrays or maps nested hundreds to tens of thousands deep."""
    pick = rng.randrange(9 if depth < 2 else 7)
    if depth == 0 and rng.random() < 0.05:
        return nested(rng.choice([100, 1000, 5000, 50000]), rng.random() < 0.5)
    if pick == 0:
        return None
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return rng.choice(INTS) if rng.random() < 0.7 else rng.randint(-1000, 1000)
    if pick == 3:
        return rng.choice(FLOATS)
    if pick == 4:
        return rng.choice(STRINGS)
    if pick == 5:
        return rng.randbytes(rng.randint(0, 12))
    if pick == 6:
        return msgspec.msgpack.Ext(rng.randint(-128, 127), rng.randbytes(rng.randint(0, 12)))
    if pick == 7:
        return [hostile_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(STRINGS[:6] + ("depth", "top_k", "seed", "top_p")): hostile_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def mutate(value: object, rng: random.Random) -> object:
    """`value` with one part of it (itself, or recursively an element or a map's value) replaced."""
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        return [*value[:i], mutate(value[i], rng), *value[i + 1:]]
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        return {**value, key: mutate(value[key], rng)}
    return hostile_value(rng)


def random_frames(rng: random.Random) -> Frames:
    return [rng.randbytes(rng.randint(0, 48)) for _ in range(rng.randint(0, 4))]


def unknown_type(rng: random.Random) -> Frames:
    head, *rest = valid_frames(rng)
    return [bytes([rng.choice([0, *range(max(P.MsgType) + 1, 256)])]) + head[1:], *rest]


def random_header(rng: random.Random) -> Frames:
    body = rng.randbytes(rng.randint(0, 48)) if rng.random() < 0.5 else msgspec.msgpack.encode(hostile_value(rng))
    return [bytes([rng.choice(list(P.MsgType))]) + body, *random_frames(rng)[:2]]


def mutated_field(rng: random.Random) -> Frames:
    """A valid message with one field (or a part of one: a setting, a tensor spec) replaced, the
    header's array cut short, or a field added."""
    msg, tensors = valid_message(rng)
    fields = msgspec.to_builtins(msg)
    pick = rng.random()
    if pick < 0.7:
        fields = mutate(fields, rng)
    elif pick < 0.85:
        del fields[rng.randrange(len(fields) + 1):]
    else:
        fields.append(hostile_value(rng))
    return [header(P.TYPES[type(msg)], fields), *frames(msg, tensors)[1:]]


def tensor_frame(spec: list, rng: random.Random) -> bytes:
    """A frame for one tensor spec: the size it declares where that is small, else near it or random."""
    dtype, shape = spec
    itemsize = {"int32": 4, "float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, rng.choice([1, 8]))
    size = math.prod(shape) * itemsize if all(d >= 0 for d in shape) else -1
    pick = rng.random()
    if 0 <= size <= 4096 and pick < 0.5:
        return rng.randbytes(size)
    if 0 < size <= 4096 and pick < 0.8:
        return rng.randbytes(size + rng.choice([-1, 1]))
    return rng.randbytes(rng.randint(0, 32))


def bad_tensor(rng: random.Random) -> Frames:
    """A draft request or reply whose tensor specs (dtype, shape) and frames disagree, or are odd."""
    specs = [[rng.choice(DTYPES if rng.random() < 0.5 else DTYPES[:4]),
              [rng.choice(DIMS) if rng.random() < 0.3 else rng.randint(0, 6) for _ in range(rng.randint(0, 3))]]
             for _ in range(rng.randint(1, 3))]
    tag, step = rng.getrandbits(62) + 1, rng.randint(0, 9)
    if rng.random() < 0.75:
        head = header(P.MsgType.DRAFT_REQUEST, [tag, step, False, None, None, 8, specs])
    else:
        head = header(P.MsgType.DRAFT_REPLY, [tag, step, 0.5, 1.5, 1, specs])
    return [head, *(tensor_frame(s, rng) for s in specs)]


def truncated(rng: random.Random) -> Frames:
    out = valid_frames(rng)
    i = rng.randrange(len(out))
    out[i] = out[i][:rng.randrange(len(out[i]))] if out[i] else out[i]
    return out


def frame_count(rng: random.Random) -> Frames:
    """A valid message with a frame too many, one missing, none after the header, or hundreds."""
    out = valid_frames(rng)
    pick = rng.random()
    if pick < 0.4:
        return [*out, rng.randbytes(rng.randint(0, 16))]
    if pick < 0.7 and len(out) > 1:
        del out[rng.randrange(1, len(out))]
        return out
    if pick < 0.85:
        return out[:1] if len(out) > 1 else [*out, out[0]]
    return [*out, *[b""] * rng.randint(2, 500)]


def many(rng: random.Random) -> Frames:
    """A header of thousands of tiny items where a few are expected: tensor specs, a shape's
    dimensions, a dtype's characters, a Generate's messages or stop strings. Decoding must not
    allocate for each of them, nor quote them back in its error."""
    n = rng.choice([1000, 20000])
    pick = rng.randrange(5)
    if pick < 3:
        spec = [[["int32", [1]]] * n, [["int32", [1] * n]], [["x" * n, [1]]]][pick]
        return [header(P.MsgType.DRAFT_REQUEST, [1, 0, False, None, None, 8, spec]), b"\x00" * 4]
    if pick == 3:
        return [header(P.MsgType.GENERATE, [1, None, [["user", ""]] * n, 8, {}, [], False])]
    return [header(P.MsgType.GENERATE, [1, "hi", None, 8, {}, ["a"] * n, False])]


def oversize(rng: random.Random) -> Frames:
    """Past a size limit of protocol.py: tokens, hidden width, declared shapes, a prompt, stop
    strings, max_tokens, or a header announcing thousands of tensors."""
    pick = rng.randrange(7)
    if pick == 0:
        return draft_request(1, 0, torch.zeros(P.MAX_TOKENS_PER_REQUEST + 1, dtype=torch.int32), False)
    if pick == 1:
        return draft_request(1, 0, torch.zeros(1, dtype=torch.int32), False,
                             extra=(torch.zeros(1, P.MAX_HIDDEN + 1, dtype=torch.float16),))
    if pick == 2:
        shape = rng.choice([[P.MAX_DIM + 1], [P.MAX_DIM, P.MAX_DIM], [1 << 40], [2, 2, 2]])
        return [header(P.MsgType.DRAFT_REQUEST, [1, 0, False, None, None, 8, [["int32", shape]]]), b"\x00" * 8]
    if pick == 3:
        return frames(P.Generate(1, "a" * (P.MAX_PROMPT_CHARS + 1), None, 8, GREEDY))
    if pick == 4:
        stop = rng.choice([("a",) * (P.MAX_STOPS + 1), ("a" * (P.MAX_STOP_CHARS + 1),), ("",)])
        return frames(P.Generate(1, "hi", None, 8, GREEDY, stop))
    if pick == 5:
        return frames(P.Generate(1, "hi", None, rng.choice([0, P.MAX_TOKENS_PER_REQUEST + 1]), GREEDY))
    return [header(P.MsgType.DRAFT_REQUEST, [1, 0, False, None, None, 8, [["int32", [1]]] * 5000]), b"\x00" * 4]


DECODE_KINDS: dict[str, Callable[[random.Random], Frames]] = {
    "random_frames": random_frames, "unknown_type": unknown_type, "random_header": random_header,
    "mutated_field": mutated_field, "bad_tensor": bad_tensor, "truncated": truncated, "frame_count": frame_count,
    "oversize": oversize, "many": many, "valid": valid_frames,
}
MAX_ERROR_CHARS = 1000  # an Error's message: a peer cannot make the server write megabytes back


# ------------------------------------------------------------------------------------ outcomes
class Broken(Exception):
    """An input did something no input may do."""


def check_decode(msg_frames: list) -> str:
    """Decode `msg_frames`: "ok", or the ProtocolError's code. A message that decodes must come back
    unchanged through encode -> decode, and an error's message must be short (else Broken); any other
    exception propagates."""
    try:
        msg, tensors = P.decode(msg_frames)
    except P.ProtocolError as e:
        if len(str(e)) > MAX_ERROR_CHARS:
            raise Broken(f"a {len(str(e))}-character error message: {str(e)[:200]}...") from None
        return e.code
    again = frames(msg, tensors)
    if frames(*P.decode(again)) != again:
        raise Broken(f"{type(msg).__name__} changed through encode -> decode")
    return "ok"


def corpus_frames(msg_frames: list) -> list:
    """Frames as the corpus stores them: hex, or {"byte": hex, "times": n} for a long run of one byte."""
    out = []
    for f in map(bytes, msg_frames):
        if len(f) > 64 and f == f[:1] * len(f):
            out.append({"byte": f[:1].hex(), "times": len(f)})
        else:
            out.append(f.hex())
    return out


def from_corpus(stored: list) -> Frames:
    return [bytes.fromhex(f) if isinstance(f, str) else bytes.fromhex(f["byte"]) * f["times"] for f in stored]


@dataclass
class Tally:
    """Inputs tried and their outcomes, per kind; the inputs that broke something."""

    by_kind: dict[str, collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    broke: list[dict] = field(default_factory=list)

    def add(self, kind: str, outcome: str) -> None:
        self.by_kind[kind][outcome] += 1

    def broken(self, kind: str, msg_frames: list, expect: str, why: str) -> None:
        self.add(kind, "BROKE")
        self.broke.append({"kind": kind, "expect": expect, "why": why[-3000:], "frames": corpus_frames(msg_frames)})

    def outcomes(self) -> collections.Counter:
        return sum(self.by_kind.values(), collections.Counter())

    def as_json(self) -> dict:
        return {"inputs": sum(self.outcomes().values()),
                "by_kind": {k: {"inputs": sum(c.values()), "outcomes": dict(c)} for k, c in self.by_kind.items()},
                "outcomes": dict(self.outcomes()), "broke": self.broke}


def fuzz_decode(n: int, rng: random.Random) -> Tally:
    """n inputs into protocol.decode, the kinds taking turns."""
    tally = Tally()
    kinds = list(DECODE_KINDS)
    for i in range(n):
        kind = kinds[i % len(kinds)]
        msg_frames = DECODE_KINDS[kind](rng)
        try:
            tally.add(kind, check_decode(msg_frames))
        except Exception:
            tally.broken(kind, msg_frames, "ok or a ProtocolError", traceback.format_exc())
    return tally


# --------------------------------------------------------------------------------- live server
def tiny_drafter(seed: int = 1, vocab: int = VOCAB) -> Drafter:
    """A random-weight two-layer Qwen2 (hidden 64), fp32: a draft model built in a second."""
    return Drafter(tiny_model(seed, vocab=vocab))


@dataclass
class Exchange:
    """One request of an honest session and the draft it got."""

    reset: bool
    tokens: list[int]
    budget: int
    drafted: list[int]
    parents: list[int]


def accepted_path(tokens: list[int], parents: list[int], rng: random.Random) -> list[int]:
    """The tokens from the root to a random node of a draft (none, sometimes): what a target accepts. One
    draw whatever the draft's size (a test's hypothesis-driven generator must draw alike in every replay,
    and a draft's depth depends on what else the server had to do: server._cut)."""
    node = min(len(tokens) - 1, int(rng.random() * (len(tokens) + 1)) - 1)
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


class Honest(threading.Thread):
    """A well-behaved target on a connection of its own: a reset, then draft after draft, each
    request carrying an accepted path of the last draft and a token of its own (as verification
    would), a fresh prompt before the context fills up, a short pause per step for verifying.
    Records every exchange; a refusal ends it (`error`)."""

    def __init__(self, address: str, draft: DraftConfig, seed: int, verify_s: float = 0.003):
        super().__init__(name=f"fuzz-honest-{seed}", daemon=True)
        self.client = DraftClient(address, FINGERPRINT, f"honest-{seed}", timeout_s=60, heartbeat_s=0)
        self.draft = draft
        self.rng = random.Random(seed)
        self.verify_s = verify_s
        self.log: list[Exchange] = []
        self.error: str | None = None
        self.done = threading.Event()

    def run(self) -> None:
        length = MAX_CONTEXT
        send: list[int] = []
        try:
            while not self.done.is_set():
                reset = length + len(send) + self.draft.depth + 2 > MAX_CONTEXT - 8
                if reset:
                    send = [self.rng.randrange(1, VOCAB) for _ in range(self.rng.randint(1, 40))]
                    length = 0
                budget = self.rng.randint(2, 24)
                reply, tensors = self.client.draft(send, budget, *((self.draft, GREEDY) if reset else ()))
                x = Exchange(reset, send, budget, tensors[0].tolist(), tensors[1].tolist())
                self.log.append(x)
                length += len(send)
                send = [*accepted_path(x.drafted, x.parents, self.rng), self.rng.randrange(1, VOCAB)]
                time.sleep(self.verify_s)
        except Exception as e:  # a refusal or a timeout: the run reports it
            self.error = f"{type(e).__name__}: {e}"

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=120)
        self.client.close()


def depth_of(parents: list[int]) -> int:
    """The levels of a draft, from its nodes' parents (-1: the root)."""
    return int(depths(torch.tensor(parents, dtype=torch.long)).max()) if parents else 0


def replay_locally(drafter: Drafter, draft: DraftConfig, log: list[Exchange]) -> int:
    """Run an honest session's requests through the drafter in this process, each as deep as the
    server's went (a batch ends at its level when another session's request comes: server._cut); the
    number of drafts that differ from what the server sent, an empty one included."""
    seq = None
    differ = 0
    for x in log:
        if x.reset:
            seq = drafter.start(x.tokens)
        depth = depth_of(x.parents)
        if not depth:
            differ += 1
            continue
        tree = drafter.propose(seq, [] if x.reset else x.tokens, draft, GREEDY, max_depth=min(x.budget - 1, depth))
        differ += tree.tokens.tolist() != x.drafted or tree.parents.tolist() != x.parents
    return differ


@dataclass
class Probe:
    """A bad input and the Error it must get: its code, and the tag and step it echoes."""

    frames: Frames
    expect: str
    tag: int = 0
    step: int = -1


class Noise:
    """The fuzzing connection: a DEALER socket of its own and what it knows of its own session.
    Its setup steps (hello, reset, a good request) must succeed, or the server is Broken."""

    def __init__(self, ctx: zmq.Context, address: str, honest_tags: list[int], timeout_s: float = 60.0):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.honest_tags = honest_tags
        self.timeout_s = timeout_s
        self.tag = 0  # its session's (0: none yet)
        self.stale: list[int] = []  # its earlier sessions' tags, freed when it said hello again
        self.next_step: int | None = None  # its session's next step; None while it has no draft state
        self.taken: Frames | None = None  # the last non-reset request its session took

    def ask(self, msg_frames: list) -> tuple[msgspec.Struct, tuple] | None:
        """Send a message and decode the answer (None: no answer within timeout_s)."""
        self.sock.send_multipart(msg_frames, copy=False)
        if not self.sock.poll(int(self.timeout_s * 1000)):
            return None
        return P.decode(self.sock.recv_multipart())

    def expect(self, msg_frames: list, want: type) -> msgspec.Struct:
        answer = self.ask(msg_frames)
        if answer is None or not isinstance(answer[0], want):
            raise Broken(f"setup: expected {want.__name__}, got {answer and answer[0]}")
        return answer[0]

    def hello(self) -> None:
        welcome = self.expect(frames(P.Hello(P.PROTOCOL_VERSION, FINGERPRINT, "noise")), P.Welcome)
        if self.tag:
            self.stale.append(self.tag)
        self.tag = welcome.tag
        self.next_step = None
        self.taken = None

    def reset(self, rng: random.Random) -> None:
        """Give its session draft state: a reset at a fresh step, with settings of any kind (the
        honest sessions' drafts are batched with its draft)."""
        if not self.tag:
            self.hello()
        step = rng.randint(0, 1000)
        tokens = token_tensor(rng, rng.randint(1, 12))
        reset = draft_request(self.tag, step, tokens, True, rng.randint(1, 20), *random_settings(rng))
        self.expect(reset, P.DraftReply)
        self.next_step = step + 1
        self.taken = None

    def request(self, rng: random.Random) -> None:
        """A good non-reset request, taken by the server: the one `replayed` sends again."""
        if self.next_step is None:
            self.reset(rng)
        self.taken = draft_request(self.tag, self.next_step, token_tensor(rng, rng.randint(1, 3)), False)
        self.expect(self.taken, P.DraftReply)
        self.next_step += 1


# Each live kind makes one probe, first setting up the noise session it needs.
def garbage(rng: random.Random, noise: Noise) -> Probe:
    """Any decode kind's input that decode refuses: the IO thread answers with decode's code. (No
    empty message: ZeroMQ cannot send one.)"""
    while True:
        msg_frames = DECODE_KINDS[rng.choice(list(DECODE_KINDS)[:-1])](rng)
        try:
            P.decode(msg_frames)
        except P.ProtocolError as e:
            if msg_frames:
                return Probe(msg_frames, e.code)


def not_a_request(rng: random.Random, noise: Noise) -> Probe:
    kinds = set(P.MsgType) - {P.MsgType.HELLO, P.MsgType.DRAFT_REQUEST, P.MsgType.BYE, P.MsgType.PING,
                              P.MsgType.STATS_REQUEST}
    while True:
        msg, tensors = valid_message(rng)
        if P.TYPES[type(msg)] in kinds:
            return Probe(frames(msg, tensors), "unexpected")


def bad_hello(rng: random.Random, noise: Noise) -> Probe:
    if rng.random() < 0.5:
        return Probe(frames(P.Hello(rng.choice([0, P.PROTOCOL_VERSION - 1, P.PROTOCOL_VERSION + 1, -1, 1 << 40]),
                                    FINGERPRINT, "noise")), "version")
    return Probe(frames(P.Hello(P.PROTOCOL_VERSION, rng.choice(["", "0" * 64, FINGERPRINT[:-1]]), "n")),
                 "vocab_mismatch")


def _someone_elses(tag: int, rng: random.Random) -> Probe:
    """A request or a Bye with a tag this connection does not own."""
    if rng.random() < 0.25:
        return Probe(frames(P.Bye(tag)), "unknown_session", tag)
    step = rng.randint(0, 50)
    return Probe(draft_request(tag, step, token_tensor(rng, 3), rng.random() < 0.5), "unknown_session", tag, step)


def foreign_tag(rng: random.Random, noise: Noise) -> Probe:
    return _someone_elses(rng.choice(noise.honest_tags), rng)


def made_up_tag(rng: random.Random, noise: Noise) -> Probe:
    return _someone_elses(rng.choice([0, -1, rng.getrandbits(62) + 1, (1 << 64) - 1, -(1 << 63)]), rng)


def stale_tag(rng: random.Random, noise: Noise) -> Probe:
    """A tag this connection owned before its last hello."""
    while not noise.stale:
        noise.hello()
    return _someone_elses(rng.choice(noise.stale), rng)


def replayed(rng: random.Random, noise: Noise) -> Probe:
    """The last request the session took, sent again."""
    if noise.taken is None or noise.next_step is None:
        noise.request(rng)
    return Probe(noise.taken, "bad_step", noise.tag, noise.next_step - 1)


def bad_step(rng: random.Random, noise: Noise) -> Probe:
    if noise.next_step is None:
        noise.reset(rng)
    step = noise.next_step + rng.choice([-1, 1, 2, 1000, -(1 << 40)])
    return Probe(draft_request(noise.tag, step, token_tensor(rng, 2), False), "bad_step", noise.tag, step)


def bad_tokens(rng: random.Random, noise: Noise) -> Probe:
    """Token ids outside the vocabulary, from the session's owner."""
    if not noise.tag:
        noise.hello()
    tokens = token_tensor(rng, rng.randint(1, 6))
    tokens[rng.randrange(len(tokens))] = rng.choice([VOCAB, VOCAB + 1, -1, (1 << 31) - 1, -(1 << 31)])
    step = noise.next_step if noise.next_step is not None else 0
    return Probe(draft_request(noise.tag, step, tokens, rng.random() < 0.5), "bad_tokens", noise.tag, step)


def no_reset(rng: random.Random, noise: Noise) -> Probe:
    """A request on a fresh session, before any reset."""
    noise.hello()
    return Probe(draft_request(noise.tag, 0, token_tensor(rng, 2), False), "reset_required", noise.tag, 0)


def context_full(rng: random.Random, noise: Noise) -> Probe:
    """More tokens than the server's max_context, in a reset or a request; the session loses its state."""
    if noise.next_step is None:
        noise.reset(rng)
    reset = rng.random() < 0.5
    step = rng.randint(0, 100) if reset else noise.next_step
    probe = Probe(draft_request(noise.tag, step, token_tensor(rng, MAX_CONTEXT + rng.randint(1, 64)), reset),
                  "context_full", noise.tag, step)
    noise.next_step = None
    return probe


LIVE_KINDS: dict[str, Callable[[random.Random, Noise], Probe]] = {
    "garbage": garbage, "not_a_request": not_a_request, "bad_hello": bad_hello, "foreign_tag": foreign_tag,
    "made_up_tag": made_up_tag, "stale_tag": stale_tag, "replayed": replayed, "bad_step": bad_step,
    "bad_tokens": bad_tokens, "no_reset": no_reset, "context_full": context_full,
}


def judge(probe: Probe, answer: tuple | None) -> str:
    """The Error's code, if it is the one the probe expects (else Broken)."""
    if answer is None:
        raise Broken("no answer")
    msg = answer[0]
    if not isinstance(msg, P.Error):
        raise Broken(f"answered {type(msg).__name__}, not an Error")
    if (msg.code, msg.tag, msg.step) != (probe.expect, probe.tag, probe.step):
        raise Broken(f"Error {msg.code!r} tag {msg.tag} step {msg.step}: {msg.message[:300]}")
    return msg.code


class Failures(logging.Handler):
    """What the draft server logs at ERROR or above while fuzzed: no input may cause any."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


@contextlib.contextmanager
def logged_failures(quiet: bool) -> Iterator[Failures]:
    """Collect the `starsd` loggers' failures; `quiet`: and keep their warnings (a refusal each) off stderr."""
    logger = logging.getLogger("starsd")
    handler = Failures()
    before = (logger.level, logger.propagate)
    logger.addHandler(handler)
    if quiet:
        logger.setLevel(logging.ERROR)
        logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before[0])
        logger.propagate = before[1]


def over_frame_limit(ctx: zmq.Context, address: str) -> str:
    """One frame over MAX_FRAME_BYTES on a connection of its own: "dropped" when no answer comes."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(bytes([P.MsgType.PING]) + bytes(P.MAX_FRAME_BYTES + 1), copy=False)
        return "dropped" if not sock.poll(1000) else "answered"
    finally:
        sock.close(0)


def server_alive(ctx: zmq.Context, address: str) -> bool:
    """Whether the server answers a Ping on a fresh connection within 10 s."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames(P.Ping(7, 1.0)))
        return bool(sock.poll(10_000)) and isinstance(P.decode(sock.recv_multipart())[0], P.Pong)
    finally:
        sock.close(0)


def probe_once(kind: str, rng: random.Random, noise: Noise, failures: Failures, tally: Tally) -> str | None:
    """One live input of `kind`; its expected code when the server answered it rightly, else None."""
    seen = len(failures.records)
    probe = Probe([], "setup")
    try:
        probe = LIVE_KINDS[kind](rng, noise)
        code = judge(probe, noise.ask(probe.frames))
        if len(failures.records) > seen:
            raise Broken("the server logged a failure: " + "\n".join(failures.records[seen:]))
    except Broken as e:
        tally.broken(kind, probe.frames, probe.expect, str(e))
        return None
    tally.add(kind, code)
    return code


def fuzz_live(n: int, rng: random.Random, drafter: Drafter, quiet: bool = False) -> dict:
    """n bad inputs to a live draft server while honest sessions draft (module docstring)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    server = DraftServer(drafter, FINGERPRINT, VOCAB, ServerConfig(bind=address, max_context=MAX_CONTEXT))
    thread = server.start()
    ctx = zmq.Context()
    honest = {name: Honest(address, cfg, seed=rng.randrange(1 << 30)) for name, cfg in HONEST.items()}
    tally = Tally()
    sent: collections.Counter = collections.Counter()
    try:
        with logged_failures(quiet) as failures:
            for h in honest.values():
                h.client.hello()
                h.start()
            noise = Noise(ctx, address, [h.client.tag for h in honest.values()])
            kinds = list(LIVE_KINDS)
            for i in range(n):
                sent[probe_once(kinds[i % len(kinds)], rng, noise, failures, tally)] += 1
            tally.add("over_frame_limit", over_frame_limit(ctx, address))
            for h in honest.values():
                h.stop()
            counted = json.loads(noise.expect(frames(P.StatsRequest()), P.Stats).json)["errors"]
            alive = thread.is_alive() and server_alive(ctx, address)
            noise.sock.close(0)
    finally:
        for h in honest.values():
            h.done.set()
        server.stop()
        thread.join(timeout=10)
        ctx.destroy(0)
    sent.pop(None, None)
    return {**tally.as_json(), "errors_sent": dict(sent), "errors_counted": counted,
            "counted_match": counted == dict(sent), "server_alive": alive,
            "honest": {name: {"drafts": len(h.log), "resets": sum(x.reset for x in h.log), "error": h.error,
                              "differ_from_local": replay_locally(drafter, h.draft, h.log)}
                       for name, h in honest.items()}}


def broke_count(live: dict, decode: dict) -> int:
    """Inputs that broke anything, and a live run's failed checks (each counts one)."""
    honest = live["honest"].values()
    return (len(decode["broke"]) + len(live["broke"]) + (not live["counted_match"]) + (not live["server_alive"])
            + sum(bool(h["error"]) + h["differ_from_local"] for h in honest))


def main(args) -> int:
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    decode = fuzz_decode(args.decode_inputs, rng).as_json()
    decode_s = time.monotonic() - t0
    live = fuzz_live(args.live_inputs, rng, tiny_drafter(), quiet=True)
    result = {"benchmark": "fuzz", "seed": args.seed, "decode": decode, "live": live,
              "broke": broke_count(live, decode), "decode_s": decode_s, "live_s": time.monotonic() - t0 - decode_s}
    write_json(args.json_out, result)
    png = args.plot_out or str(args.json_out).rsplit(".", 1)[0] + ".png"
    plot(png, result)
    report(result, args.json_out, png)
    return 1 if result["broke"] else 0


def plot(path: str, result: dict) -> None:
    panels = []
    for run in ("decode", "live"):
        outcomes = sorted(result[run]["outcomes"].items(), key=lambda kv: -kv[1])
        title = f"{run}: {result[run]['inputs']} inputs by outcome ({len(result[run]['broke'])} broke)"
        panels.append({"labels": [k for k, _ in outcomes], "values": [v for _, v in outcomes], "ylabel": "inputs",
                       "title": title})
    bar_panels(path, panels)


def report(result: dict, json_path: str, png: str) -> None:
    decode, live = result["decode"], result["live"]
    rows = [[f"decode {k}", v["inputs"], ", ".join(f"{c} {n}" for c, n in sorted(v["outcomes"].items()))]
            for k, v in decode["by_kind"].items()]
    rows += [None, *([f"live {k}", v["inputs"], ", ".join(f"{c} {n}" for c, n in sorted(v["outcomes"].items()))]
                     for k, v in live["by_kind"].items())]
    honest = ", ".join(f"{name} {h['drafts']} drafts ({h['resets']} resets), {h['differ_from_local']} differ"
                       f"{', refused: ' + h['error'] if h['error'] else ''}" for name, h in live["honest"].items())
    summary(f"bench fuzz: seed {result['seed']}, {decode['inputs']} decode inputs ({result['decode_s']:.1f} s), "
            f"{live['inputs']} live inputs ({result['live_s']:.1f} s)", ["kind", "inputs", "outcomes"], rows,
            {"broke": str(result["broke"]), "server alive": str(live["server_alive"]),
             "errors counted = sent": str(live["counted_match"]), "honest sessions": honest},
            {"JSON": json_path, "plot": png})
