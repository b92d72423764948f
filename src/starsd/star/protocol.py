"""The wire protocol between target workers and the draft server.

A message is a ZeroMQ multipart message: frame 0 is one byte of message type followed by a
msgspec/msgpack header (a typed Struct, encoded as an array); every tensor travels as its own raw
frame after it, described by a TensorSpec in the header (zero-copy on both sides: no pickle, no
torch.save). `decode` validates everything before anything else sees it (the type byte, the
header's types, frame counts, dtypes, shapes against frame sizes, the size limits below); a
message that fails raises ProtocolError, which the server turns into an Error reply.
One draft iteration of a session:
  target -> server  DraftRequest(tag, step, tokens = committed since the last request [, features])
  server -> target  DraftReply(tag, step, tokens, parents [, q ids, q weights])
The first request of a stream carries reset=True, the whole prompt and the settings. One connection
may hold many sessions (an engine's requests), each opened by a Hello with its own `stream` number
and told apart by tag: its Welcome and refusals echo the number, one Ping carries all their tags. A sampled
draft's q travels as each node's support (spec_decode/sparse_q.py); a server drafting with an
EAGLE head names in its Welcome the target features it needs (`taps`), which each request then
carries (`features_to_wire`). A target server (star/target_server.py) speaks the same wire to the
gateway: Describe -> TargetInfo; Generate -> an Output per target step; Cancel; DraftMoved; DraftServers.
Every message and field: docs/protocol.md.
"""

from __future__ import annotations

import enum
import math
import re
import warnings
from typing import Annotated

import msgspec
import torch
import zmq

from starsd.config import MAX_SAMPLE_TOP_K, DraftConfig, SamplingConfig

PROTOCOL_VERSION = 11  # 2: settings travel by name, as DraftConfig and SamplingConfig; 3: a sampled draft's q
# travels as its support (ids and float16 weights), not as float32 [n, V]; 4: Welcome and Pong say the server's
# level_ms; 5: and its sessions of targets on its own host (`local`); 6: a draft request may say where its chain
# stops (`stop`: the stream's depth policy chooses it per step); 7: Welcome says the server's ingest_ms; 8: Welcome
# and Pong say its wait_ms; 9: a draft request may say that more of its sender's follow at once (`more`); 10: a
# connection holds a session per Hello `stream` (one engine, one connection), a Ping carries many `tags`, and
# DraftServers lists the star's draft servers to its targets (star/elastic.py); 11: Welcome and Pong's wait_ms is
# a request's queue, no longer its queue and draft, and pace_ms says a level's time

# Bounds on what one message may carry: a peer cannot make the server allocate without limit.
# A draft's own bounds (depth, top_k, nodes, seed) are DraftConfig's and SamplingConfig's.
MAX_TOKENS_PER_REQUEST = 32768
MAX_HIDDEN = 1 << 16
MAX_DIM = 1 << 24  # any one tensor dimension
MAX_FRAME_BYTES = 64 << 20  # any one frame; the server's socket refuses larger messages outright
MAX_PROMPT_CHARS = 1 << 20  # a Generate's prompt text, or all its messages together
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 256
MAX_ADDRESS_CHARS = 256  # a ZeroMQ address in a DraftMoved
MAX_SERVERS = 256  # draft servers in a DraftServers
MAX_MESSAGES = 1 << 14  # a Generate's chat messages: each costs template tokens, so more fit no context
MAX_MORE = 1 << 16  # a draft request's `more`
MAX_STREAM = (1 << 62) - 1  # a Hello's stream number
MAX_PING_TAGS = 1 << 12  # the sessions one Ping keeps alive (a client with more sends several)
# Every variable-length part of a header is bounded in its type, so that msgspec refuses an
# oversized one before building it: a header of millions of tiny items (tensor specs, a shape's
# dimensions, messages) used to cost the IO thread seconds and gigabytes, and came back quoted
# in an Error megabytes long.
MAX_TENSORS = 3  # a draft request's tokens, features and their scales
MAX_REPLY_TENSORS = 4  # a draft reply's tokens, parents, q ids and q weights
MAX_DTYPE_CHARS = 16
MAX_TAPS = 8

# Received frames are read-only buffers; tensors view them without copying and are never written.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class ProtocolError(ValueError):
    """A message that is malformed, oversized or out of place. `code` names the kind for counters."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class MsgType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    DRAFT_REQUEST = 3
    DRAFT_REPLY = 4
    BYE = 5
    ERROR = 6
    PING = 7
    PONG = 8
    STATS_REQUEST = 9
    STATS = 10
    DESCRIBE = 11
    TARGET_INFO = 12
    GENERATE = 13
    OUTPUT = 14
    CANCEL = 15
    DRAFT_MOVED = 16
    DRAFT_SERVERS = 17


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    dtype: Annotated[str, msgspec.Meta(max_length=MAX_DTYPE_CHARS)]
    shape: Annotated[tuple[int, ...], msgspec.Meta(max_length=2)]


TensorSpecs = Annotated[tuple[TensorSpec, ...], msgspec.Meta(max_length=MAX_TENSORS)]
ReplySpecs = Annotated[tuple[TensorSpec, ...], msgspec.Meta(max_length=MAX_REPLY_TENSORS)]


class Hello(msgspec.Struct, array_like=True, frozen=True):
    version: int
    fingerprint: str  # models.loading.vocab_fingerprint of the target's tokenizer and logits width
    name: str  # for logs: which target this is
    stream: Annotated[int, msgspec.Meta(ge=0, le=MAX_STREAM)] = 0  # the session's number on its connection:
    # a second Hello with the same number replaces that session (0: the connection's only one), any other
    # opens one more beside it (an engine's requests on one connection: star/connection.py)


class Welcome(msgspec.Struct, array_like=True, frozen=True):
    tag: int  # the session tag: every later message of this session carries it
    server: str
    max_nodes: int  # config.MAX_DRAFT_NODES: no draft of this server has more
    taps: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_TAPS)] | None = None  # the target features
    # its drafter needs (models/eagle.py: () the last hidden state, else those hidden states); None: tokens only
    level_ms: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 0.0  # the server's recent time per drafted level
    # of one stream's draft (ServerStats.level_ms; 0: none measured yet): a new stream's prior for what a draft costs
    local: Annotated[int, msgspec.Meta(ge=-1, le=1 << 31)] = -1  # the server's sessions of targets on its own host
    # (-1: not said): a co-hosted target's draft takes its compute from each of them (spec_decode/depth.py, Source.neighbours)
    ingest_ms: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 0.0  # the server's time to ingest one token of a
    # stream it does not hold (a prompt), as its warm-up measured (0: not measured): what a stream's first draft
    # costs beyond its levels (spec_decode/depth.py, Source.unsent)
    wait_ms: Annotated[float, msgspec.Meta(ge=-1.0, le=1e9)] = -1.0  # the server's recent time on a request from its
    # arrival to the start of its draft (its queue; ServerStats.wait_ms; -1: none answered yet): a stream that joins
    # a saturated server knows at once that a draft waited for comes too late (spec_decode/depth.py, Source.server_ms)
    stream: Annotated[int, msgspec.Meta(ge=0, le=MAX_STREAM)] = 0  # its Hello's: which session of the connection
    pace_ms: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 0.0  # the server's recent time per level of a draft
    # batch, the batch's whole time (ServerStats.pace_ms; 0: none measured): a request d levels deep waits about
    # wait_ms + d * pace_ms


class DraftRequest(msgspec.Struct, array_like=True, frozen=True):
    tag: int
    step: int  # the session's request count: a taken request advances it by one; a reply echoes it
    reset: bool  # a new generation stream: tokens is the whole prompt
    draft: DraftConfig | None  # the draft's shape, required with reset (a map, by field name)
    sampling: SamplingConfig | None  # the target's sampling law, required with reset (ditto)
    budget: int  # tokens the target may still emit: no point drafting deeper than budget - 1
    tensors: TensorSpecs  # tokens int32 [m]; for an EAGLE head, features [m, F] (bf16, or uint8 and scales [m, 2])
    stop: float = -1.0  # this draft's min_path_prob, in [0, 1) (-1: the session's own, as its settings say)
    more: int = 0  # requests of its sender that go out right after it, at most (an engine's batch of rows,
    # one session each): the server may wait a moment for them and draft them in one batch


class DraftReply(msgspec.Struct, array_like=True, frozen=True):
    tag: int
    step: int
    queue_ms: float  # time the request waited in Q_in
    service_ms: float  # time the draft model spent on this request's batch
    batch_size: int  # sessions drafted together in that batch
    tensors: ReplySpecs  # tokens int32 [n], parents int32 [n]; if sampled, q: ids int32 [n, K], weights float16 [n, K]


class Bye(msgspec.Struct, array_like=True, frozen=True):
    tag: int


class Error(msgspec.Struct, array_like=True, frozen=True):
    """A refusal. An Error answering a DraftRequest means the request was not taken: the session's
    step stays where it was, and the tokens it carried must be sent again with the next request."""

    code: str
    message: str
    tag: int = 0
    step: int = -1
    stream: Annotated[int, msgspec.Meta(ge=0, le=MAX_STREAM)] = 0  # a refused Hello's (tag 0): which one it was


class Ping(msgspec.Struct, array_like=True, frozen=True):
    tag: int
    sent: float
    tags: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_PING_TAGS)] = ()  # more sessions it keeps alive
    # (a connection's: star/connection.py)


class Pong(msgspec.Struct, array_like=True, frozen=True):
    tag: int
    sent: float
    known: bool = True  # whether the server holds session `tag` (a draft server's answer; False after a
    # restart or once the session was freed, so its target opens a new one without waiting for a refusal)
    level_ms: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 0.0  # a draft server's, as in Welcome, kept fresh
    sessions: Annotated[int, msgspec.Meta(ge=-1, le=1 << 31)] = -1  # the sessions a draft server holds (-1: not
    # said): its load, by which a target given several servers places its session (star/placement.py)
    local: Annotated[int, msgspec.Meta(ge=-1, le=1 << 31)] = -1  # of them, those of targets on its host, as in Welcome
    wait_ms: Annotated[float, msgspec.Meta(ge=-1.0, le=1e9)] = -1.0  # as in Welcome, kept fresh: a stream that asks
    # for no draft (none pays while the server is saturated) still knows when it has caught up
    unknown: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_PING_TAGS)] = ()  # those of the Ping's `tags`
    # that the server does not hold
    pace_ms: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 0.0  # as in Welcome, kept fresh


class StatsRequest(msgspec.Struct, array_like=True, frozen=True):
    pass


class Stats(msgspec.Struct, array_like=True, frozen=True):
    json: str  # the server's counters, a JSON object (see star.stats.ServerStats)


class Describe(msgspec.Struct, array_like=True, frozen=True):
    pass


class TargetInfo(msgspec.Struct, array_like=True, frozen=True):
    name: str
    model: str  # what the target serves, as clients name it
    max_context: int  # prompt + generated tokens one stream may hold
    speculative: bool  # drafts through a draft server (False: decodes alone)
    busy: bool  # a stream is running now
    max_tokens: int = MAX_TOKENS_PER_REQUEST  # tokens one Generate may ask for; a gateway checks it before sending
    streams: int = 1  # streams it serves at once: a gateway sends it at most this many


class Message(msgspec.Struct, array_like=True, frozen=True):
    role: str
    content: str


class Generate(msgspec.Struct, array_like=True, frozen=True):
    """One generation stream. Exactly one of `prompt` (raw text) and `messages` (through the
    target's chat template)."""

    id: int  # chosen by the sender; every Output and a Cancel carry it
    prompt: str | None
    messages: Annotated[tuple[Message, ...], msgspec.Meta(max_length=MAX_MESSAGES)] | None
    max_tokens: int
    sampling: SamplingConfig
    stop: Annotated[tuple[str, ...], msgspec.Meta(max_length=MAX_STOPS)] = ()  # the text ends before the first of these
    ignore_eos: bool = False  # always decode max_tokens (load tests)
    speculate: bool = True  # False: decode without drafts (target-only), e.g. to compare


class Output(msgspec.Struct, array_like=True, frozen=True):
    """What one target step added to a stream. `finish` is "" until the last Output of the stream:
    then "stop" (an EOS or a stop string), "length" (max_tokens) or "cancelled"."""

    id: int
    text: str  # new text (held back while it could still become a stop string)
    tokens: int  # tokens this step emitted
    drafted: int  # depth of the draft this step verified (0: decoded alone)
    accepted: int  # drafted tokens accepted
    finish: str = ""
    prompt_tokens: int = 0  # the prompt's length, on the first Output


class Cancel(msgspec.Struct, array_like=True, frozen=True):
    id: int


Address = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ADDRESS_CHARS, pattern=r"^(tcp|ipc)://")]


class DraftMoved(msgspec.Struct, array_like=True, frozen=True):
    """The draft server at `old` serves at `new` from now on: each draft session there moves with it.
    No answer: a target that lists no `old` has nothing to do."""

    old: Address
    new: Address


class DraftServers(msgspec.Struct, array_like=True, frozen=True):
    """The star's draft servers from now on (a server added, or one retired: star/elastic.py). No
    answer: each draft session places itself among them, a session on a server no longer listed
    moving at its next step with its whole prefix (no token lost)."""

    addresses: Annotated[tuple[Address, ...], msgspec.Meta(min_length=1, max_length=MAX_SERVERS)]


STRUCTS: dict[MsgType, type] = {
    MsgType.HELLO: Hello, MsgType.WELCOME: Welcome, MsgType.DRAFT_REQUEST: DraftRequest,
    MsgType.DRAFT_REPLY: DraftReply, MsgType.BYE: Bye, MsgType.ERROR: Error, MsgType.PING: Ping,
    MsgType.PONG: Pong, MsgType.STATS_REQUEST: StatsRequest, MsgType.STATS: Stats,
    MsgType.DESCRIBE: Describe, MsgType.TARGET_INFO: TargetInfo, MsgType.GENERATE: Generate,
    MsgType.OUTPUT: Output, MsgType.CANCEL: Cancel, MsgType.DRAFT_MOVED: DraftMoved,
    MsgType.DRAFT_SERVERS: DraftServers,
}
TYPES = {cls: t for t, cls in STRUCTS.items()}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {t: msgspec.msgpack.Decoder(cls) for t, cls in STRUCTS.items()}
# The code of a ValidationError in these fields (in any other: bad_header): settings that fail
# DraftConfig's or SamplingConfig's checks, tensor specs past their bounds, too many stop strings or
# messages (what `validate` would say of them).
_FIELD_CODES = {
    MsgType.DRAFT_REQUEST: {"draft": "bad_settings", "sampling": "bad_settings", "tensors": "bad_tensor"},
    MsgType.DRAFT_REPLY: {"tensors": "bad_tensor"},
    MsgType.GENERATE: {"sampling": "bad_settings", "messages": "bad_request", "stop": "bad_request"},
}
_FIELD_AT = re.compile(r"at `\$\[(\d+)\]")  # a ValidationError's path into a header, e.g. "at `$[4].top_p`"
_DTYPES = {"int32": torch.int32, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "uint8": torch.uint8}
_NAMES = {v: k for k, v in _DTYPES.items()}


def encode(msg: msgspec.Struct, tensors: tuple[torch.Tensor, ...] = ()) -> list:
    """Message -> frames. The header's `tensors` field must describe `tensors` (see `specs`)."""
    header = bytes([TYPES[type(msg)]]) + _ENCODER.encode(msg)
    return [header, *(_buffer(t) for t in tensors)]


def specs(*tensors: torch.Tensor) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(_NAMES[t.dtype], tuple(t.shape)) for t in tensors)


def draft_request(tag: int, step: int, tokens: torch.Tensor, budget: int, draft: DraftConfig | None = None,
                  sampling: SamplingConfig | None = None, extra: tuple[torch.Tensor, ...] = (),
                  stop: float = -1.0, more: int = 0) -> tuple[DraftRequest, tuple[torch.Tensor, ...]]:
    """A DraftRequest and its tensors (tokens int32 [m], then `extra`: an EAGLE head's features),
    for `encode`: a reset (a new stream, `tokens` its whole sequence) when it carries settings;
    `stop`: where its chain stops (-1: the session's min_path_prob); `more`: requests of this sender that
    follow it at once, at most (DraftRequest). The one builder of the client,
    the soak and the fuzzer."""
    tensors = (tokens, *extra)
    return DraftRequest(tag, step, draft is not None, draft, sampling, budget, specs(*tensors), stop, more), tensors


def _buffer(t: torch.Tensor):
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the raw 16-bit words
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


MAX_NESTING = 32  # arrays and maps in a header: no message nests more than a few levels
_SKIP = {**{b: 1 for b in (0xcc, 0xd0)}, **{b: 2 for b in (0xcd, 0xd1, 0xd4)}, **{b: 3 for b in (0xd5,)},
         **{b: 4 for b in (0xca, 0xce, 0xd2)}, **{b: 5 for b in (0xd6,)}, **{b: 8 for b in (0xcb, 0xcf, 0xd3)},
         **{b: 9 for b in (0xd7,)}, **{b: 17 for b in (0xd8,)}}  # msgpack's fixed-size items: bytes after the tag
_SIZED = {0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0), 0xc7: (1, 1), 0xc8: (2, 1), 0xc9: (4, 1), 0xd9: (1, 0),
          0xda: (2, 0), 0xdb: (4, 0)}  # bin, ext, str: (bytes of the length, bytes before the data)
_COUNTED = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}  # array, map: (bytes of the count, items each)


def _nests_deeper(buf: bytes, start: int, limit: int) -> bool:
    """Whether the msgpack object at buf[start:] nests arrays or maps more than `limit` deep, walked
    without recursion. msgspec follows nesting as deep as the calling thread's stack allows (a thousand
    levels less the caller's frames), so the same header could decode in the server's thread and fail
    in another: refused by this, it fails alike everywhere. A truncated object is left to msgspec."""
    left = [1]  # items still to come at each open level
    i, n = start, len(buf)
    while left and i < n:
        b = buf[i]
        i += 1
        left[-1] -= 1
        items = 0
        if 0x80 <= b <= 0x8f:
            items = 2 * (b & 0x0f)
        elif 0x90 <= b <= 0x9f:
            items = b & 0x0f
        elif 0xa0 <= b <= 0xbf:
            i += b & 0x1f
        elif b in _SKIP:
            i += _SKIP[b]
        elif b in _SIZED:
            width, extra = _SIZED[b]
            i += width + extra + int.from_bytes(buf[i:i + width], "big")
        elif b in _COUNTED:
            width, each = _COUNTED[b]
            items = each * int.from_bytes(buf[i:i + width], "big")
            i += width
        if items:
            left.append(items)
            if len(left) > limit + 1:  # (left[0]: the object itself, no level)
                return True
        while left and not left[-1]:
            left.pop()
    return False


def decode(frames: list) -> tuple[msgspec.Struct, tuple[torch.Tensor, ...]]:
    """Frames -> (message, tensors), validated. Raises ProtocolError."""
    if not frames:
        raise ProtocolError("empty", "empty message")
    head = _bytes(frames[0])
    if not head:
        raise ProtocolError("empty", "empty header frame")
    try:
        kind = MsgType(head[0])
    except ValueError:
        raise ProtocolError("unknown_type", f"unknown message type {head[0]}") from None
    if len(head) > MAX_NESTING and _nests_deeper(head, 1, MAX_NESTING):
        raise ProtocolError("bad_header", f"malformed {kind.name} header: nested deeper than {MAX_NESTING} levels")
    try:
        msg = _DECODERS[kind].decode(memoryview(head)[1:])  # no copy of the header
    except msgspec.ValidationError as e:
        raise ProtocolError(_validation_code(kind, e), f"malformed {kind.name} header: {e}") from None
    except (msgspec.DecodeError, RecursionError) as e:  # RecursionError: msgpack nested deeper than
        # msgspec follows (a thousand levels, less the caller's stack), in a field it skips or checks
        raise ProtocolError("bad_header", f"malformed {kind.name} header: {e}") from None
    tensor_specs = msg.tensors if isinstance(msg, (DraftRequest, DraftReply)) else ()
    if len(frames) - 1 != len(tensor_specs):
        raise ProtocolError("bad_frames", f"{kind.name} announces {len(tensor_specs)} tensors, got {len(frames) - 1} frames")
    tensors = tuple(_tensor(s, f) for s, f in zip(tensor_specs, frames[1:]))
    validate(msg, tensors)
    return msg, tensors


class _Named(msgspec.Struct, array_like=True):
    id: int  # the first field of a Generate and of a Cancel; the rest of the header is skipped


_NAMED = msgspec.msgpack.Decoder(_Named)


def request_id(frames: list) -> int:
    """The id of the Generate or Cancel in `frames`, read as leniently as possible, so that an Error
    refusing a malformed one names the request it refuses; 0 where none can be read."""
    head = _bytes(frames[0]) if frames else b""
    if len(head) < 2 or head[0] not in (MsgType.GENERATE, MsgType.CANCEL):
        return 0
    try:
        return _NAMED.decode(memoryview(head)[1:]).id
    except (msgspec.DecodeError, RecursionError):  # ValidationError is a DecodeError
        return 0


def _validation_code(kind: MsgType, error: msgspec.ValidationError) -> str:
    at = _FIELD_AT.search(str(error))
    fields = STRUCTS[kind].__struct_fields__
    if at is None or int(at.group(1)) >= len(fields):
        return "bad_header"
    return _FIELD_CODES.get(kind, {}).get(fields[int(at.group(1))], "bad_header")


def _bytes(frame) -> bytes | memoryview:
    return frame.buffer if isinstance(frame, zmq.Frame) else frame


def _tensor(spec: TensorSpec, frame) -> torch.Tensor:
    if spec.dtype not in _DTYPES:
        raise ProtocolError("bad_tensor", f"unsupported dtype {spec.dtype!r}")
    if len(spec.shape) > 2 or any(not 0 <= d <= MAX_DIM for d in spec.shape):
        raise ProtocolError("bad_tensor", f"bad shape {spec.shape}")
    dtype = _DTYPES[spec.dtype]
    buf = _bytes(frame)
    count = math.prod(spec.shape)  # Python ints: no overflow
    if count * dtype.itemsize != len(buf):
        raise ProtocolError("bad_tensor", f"{spec.dtype}{list(spec.shape)} needs {count * dtype.itemsize} bytes, frame has {len(buf)}")
    if count == 0:
        return torch.empty(spec.shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.int16 if dtype == torch.bfloat16 else dtype)
    return (raw.view(torch.bfloat16) if dtype == torch.bfloat16 else raw).view(spec.shape)


def features_to_wire(features: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    """A request's features [m, F] as frames: bfloat16, or uint8 codes with each row's (min, step)."""
    if bits == 16:
        return (features.to(torch.bfloat16),)
    x = features.float()
    low = x.min(dim=1, keepdim=True).values
    step = ((x.max(dim=1, keepdim=True).values - low) / 255).clamp_min(1e-12)
    codes = ((x - low) / step).round().clamp(0, 255).to(torch.uint8)
    return codes, torch.cat([low, step], dim=1)


def features_from_wire(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """features_to_wire's frames -> float32 [m, F] (validated by `decode`)."""
    if tensors[0].dtype != torch.uint8:
        return tensors[0].float()
    scales = tensors[1]
    return tensors[0].float() * scales[:, 1:] + scales[:, :1]


def _check_features(tensors: tuple[torch.Tensor, ...], m: int) -> None:
    f = tensors[0]
    if f.ndim != 2 or f.shape[0] != m or not 0 < f.shape[1] <= MAX_HIDDEN:
        raise ProtocolError("bad_request", f"features must be [m, F] for the {m} tokens, not {list(f.shape)}")
    if f.dtype == torch.uint8:
        if len(tensors) != 2 or tensors[1].dtype != torch.float32 or tuple(tensors[1].shape) != (m, 2):
            raise ProtocolError("bad_request", "8-bit features come with float32 scales [m, 2]")
        if not bool(torch.isfinite(tensors[1]).all()):
            raise ProtocolError("bad_request", "feature scales must be finite")
    elif len(tensors) != 1 or f.dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise ProtocolError("bad_request", "features are bfloat16/float16/float32, or uint8 with scales")
    elif not bool(torch.isfinite(f).all()):
        raise ProtocolError("bad_request", "features must be finite")


def _check_q(tokens: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
    """A sampled draft's q: int32 ids and float16 weights [n, K], each row a distribution whose
    support holds its node's token (a token drawn from q has q(token) > 0)."""
    n = tokens.shape[0]
    if ids.dtype != torch.int32 or weights.dtype != torch.float16 or ids.ndim != 2 or ids.shape != weights.shape:
        raise ProtocolError("bad_reply", "q is int32 ids and float16 weights, both [n, K]")
    rows, width = ids.shape
    if rows != n or width > MAX_SAMPLE_TOP_K or (n > 0 and width == 0):
        raise ProtocolError("bad_reply", f"q must be [{n}, 1..{MAX_SAMPLE_TOP_K}], not {list(ids.shape)}")
    if not n:
        return
    w = weights.double()
    if int(ids.min()) < 0 or not bool(torch.isfinite(w).all() and (w >= 0).all() and (w.sum(1) > 0).all()):
        raise ProtocolError("bad_reply", "q's ids must be >= 0 and each row's weights finite, >= 0, not all 0")
    if not bool(((ids == tokens[:, None]) & (weights > 0)).any(1).all()):
        raise ProtocolError("bad_reply", "a sampled token lies outside its q's support")


def validate(msg: msgspec.Struct, tensors: tuple[torch.Tensor, ...]) -> None:
    """Checks beyond types: sizes and the shape of each message's payload."""
    if isinstance(msg, DraftRequest):
        if not tensors or tensors[0].dtype != torch.int32 or tensors[0].ndim != 1:
            raise ProtocolError("bad_request", "a draft request carries int32 tokens [m] first")
        m = tensors[0].shape[0]
        if not 0 < m <= MAX_TOKENS_PER_REQUEST:
            raise ProtocolError("bad_request", f"a draft request carries 1..{MAX_TOKENS_PER_REQUEST} tokens, not {m}")
        if len(tensors) > 1:
            _check_features(tensors[1:], m)
        if msg.reset and (msg.draft is None or msg.sampling is None):
            raise ProtocolError("bad_request", "a reset request must carry draft and sampling settings")
        if msg.budget < 1:
            raise ProtocolError("bad_request", f"budget must be >= 1, not {msg.budget}")
        if msg.stop != -1.0 and not (math.isfinite(msg.stop) and 0 <= msg.stop < 1):
            raise ProtocolError("bad_request", f"stop must be in [0, 1), or -1 for the session's, not {msg.stop}")
        if not 0 <= msg.more <= MAX_MORE:
            raise ProtocolError("bad_request", f"more must be in [0, {MAX_MORE}], not {msg.more}")
    elif isinstance(msg, Generate):
        if (msg.prompt is None) == (msg.messages is None):
            raise ProtocolError("bad_request", "a generate request carries a prompt or messages, not both")
        chars = len(msg.prompt) if msg.prompt is not None else sum(len(m.content) for m in msg.messages)
        if chars > MAX_PROMPT_CHARS:
            raise ProtocolError("bad_request", f"the prompt has {chars} characters, more than {MAX_PROMPT_CHARS}")
        if not 1 <= msg.max_tokens <= MAX_TOKENS_PER_REQUEST:
            raise ProtocolError("bad_request", f"max_tokens must be in 1..{MAX_TOKENS_PER_REQUEST}, not {msg.max_tokens}")
        if len(msg.stop) > MAX_STOPS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in msg.stop):
            raise ProtocolError("bad_request", f"at most {MAX_STOPS} stop strings of 1..{MAX_STOP_CHARS} characters")
    elif isinstance(msg, DraftReply):
        if len(tensors) not in (2, 4) or tensors[0].shape != tensors[1].shape or tensors[0].ndim != 1:
            raise ProtocolError("bad_reply", "a draft reply carries tokens [n] and parents [n] (and q's ids and "
                                "weights [n, K])")
        if len(tensors) == 4:
            _check_q(tensors[0], tensors[2], tensors[3])
