"""A target on llama.cpp (llama-cpp-python's low-level API): the GGUF file the pair comes from, run
as llama.cpp runs it, behind the interface of models/target.py.

One llama.cpp context holds the KV cache of `streams` streams, each in a *slot*: a block of the
context's sequence ids, whose first (the slot's *base*) holds its committed tokens. A draft is
scored in one `llama_decode` of the pending root and its nodes, every position's logits kept. A
chain lives in the base sequence; a tree in as many sequences of the block as it has leaves, a
node belonging to the sequence of every leaf below it, so it attends to exactly its ancestors and
the committed prefix is shared. `commit` keeps one leaf's sequence, cut after the accepted path,
and folds it back into the base. With several slots, the passes streams ask for at about the same
time go through a Batcher as one `llama_decode`, and a new stream's prompt is fed in chunks of
SHARED_PREFILL_CHUNK tokens riding in the running streams' passes; each slot's stream is driven by
a thread of its own (star/target_server.py), the context touched under one lock. A batch of k
tokens rounds differently from k single-token passes, so greedy output with drafts can part from
target-only output at near-ties (docs/lossless.md#on-llamacpp). EAGLE heads need hidden states,
which this engine does not hand out. Figures: docs/benchmarks.md#several-streams-per-target-server.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from starsd.config import LLAMACPP_SEQUENCES, MAX_STREAMS, ModelConfig
from starsd.errors import StarsdError
from starsd.models import pinned
from starsd.models.batcher import Batcher, Job
from starsd.spec_decode.tree import DraftTree, children, depths
from starsd.spec_decode.verify import Verdict

MAX_SEQUENCES = LLAMACPP_SEQUENCES  # shared by the slots: their trees' leaves
PREFILL_CHUNK = 512  # tokens a prefill submits in one llama_decode
SHARED_PREFILL_CHUNK = 64  # with several slots: prompt tokens a pass carries beside the running streams' rows


class EngineMissing(StarsdError, RuntimeError):
    """llama-cpp-python is not installed."""


class ContextFull(StarsdError, ValueError):
    """A stream would outgrow the llama.cpp context."""


def _lib():
    try:
        import llama_cpp
    except ImportError:
        raise EngineMissing("the llama.cpp target engine needs llama-cpp-python: `make setup` builds it "
                            "(or `pip install 'starsd[llamacpp]'`, which compiles llama.cpp, ~15-20 min on 2 cores)") from None
    return llama_cpp


def built_with_amx(ll) -> bool:
    """Whether this llama.cpp was built with its AMX kernels. Those repack a Q4_K_M file's weights
    into their AMX buffer and then crash in the first llama_decode (a segmentation fault in
    ggml_backend_amx_mul_mat on a Xeon with AMX here, at every prompt; llama.cpp issue #20824).
    `make setup` builds llama.cpp without them (-mno-amx-*), so that an AMX CPU repacks its weights
    for AVX-512 as other x86 CPUs do: 65 ms a token at 2 threads on that Xeon, against 81 ms with
    the weights left in plain buffers (docs/benchmarks.md#llamacpp-on-amx). A build that has them
    (another `pip install`) loads without llama.cpp's extra buffer types, plain but safe."""
    return b"AMX_INT8 = 1" in ll.llama_print_system_info()


_LOG_CALLBACK = None  # kept alive: llama.cpp calls it for as long as the process runs


def _quiet(ll) -> None:
    """llama.cpp logs every load step on stderr; keep its warnings and errors only."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        warn = 3  # GGML_LOG_LEVEL_WARN; ERROR is 4, CONT (a continued line) 5

        @ll.llama_log_callback
        def forward(level, text, user_data):
            if warn <= level < 5:
                os.write(2, text)

        _LOG_CALLBACK = forward
        ll.llama_backend_init()
    ll.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def gguf_file(path: str, cache: str | None = None) -> Path:
    """The GGUF file of a target: a pinned model's own (kept beside its conversion), a .gguf file,
    or the one .gguf in a directory."""
    if path in pinned.PINNED:
        return pinned.gguf(path, cache)
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return p
    found = sorted(p.glob("*.gguf")) if p.is_dir() else []
    if len(found) != 1:
        what = f"{len(found)} .gguf files" if p.is_dir() else "no such file or directory"
        raise StarsdError(f"the llama.cpp engine runs a GGUF file: {path!r} holds {what}. Give a pinned name "
                          f"({', '.join(pinned.PINNED)}), a .gguf file, or a directory with one .gguf and its tokenizer")
    return found[0]


Row = tuple[int, int, tuple[int, ...], bool]  # (token, position, sequences, logits?) in a llama_decode


@dataclass
class LlamaSequence:
    """One stream in the context: tokens as TargetSequence's (the cache covers all but the last)."""

    tokens: list[int]
    slot: int = 0  # which slot of the context holds it
    cached: int = 0  # positions in the slot's base sequence: the committed tokens but the pending one
    scored: int = 0  # nodes of the last scored tree, in the cache until commit
    leaf_of: list[int] | None = None  # the last tree's: for each node, the sequence of a leaf below it
    features: None = None  # no features: EAGLE heads need the transformers engine
    epoch: int = 0  # which start() of its slot it belongs to
    pass_ms: float | None = None  # with several slots: its share of its last scoring pass (its rows' part of
    # the llama_decode's time), what a draft costs the stream when others' rows share the pass; None: alone


@dataclass
class _Pass(Job):
    """Rows a stream asks to have decoded, and, once done, the logits of those that want them."""

    rows: list[Row] = field(default_factory=list)
    logits: np.ndarray | None = None  # [rows with logits, V]

    @property
    def size(self) -> int:
        return len(self.rows)


class LlamaCppTarget:
    """A llama.cpp target with models/target.py's interface: start, score, commit, on its first slot
    (a start() ends that slot's previous stream). With `streams` > 1, `slots` holds a view of each
    slot with the same interface, each to be driven by a thread of its own."""

    device = torch.device("cpu")
    engine = "llamacpp"

    def __init__(self, file: Path, context: int = 0, threads: int = 0, streams: int = 1):
        if not 1 <= streams <= MAX_STREAMS:
            raise StarsdError(f"a llama.cpp target serves 1 to {MAX_STREAMS} streams, not {streams}")
        ll = self.ll = _lib()
        _quiet(ll)
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = not built_with_amx(ll)
        self.model = ll.llama_model_load_from_file(str(file).encode(), mparams)
        if not self.model:
            raise StarsdError(f"llama.cpp could not load {file}")
        self.file = file
        self.width = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        trained = ll.llama_model_n_ctx_train(self.model)
        self.max_context = min(context, trained) if context else trained  # one stream's
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = self.max_context * streams
        cparams.n_batch = cparams.n_ubatch = cparams.n_outputs_max = PREFILL_CHUNK  # a tree: n + 1 logits
        cparams.n_seq_max = MAX_SEQUENCES
        cparams.kv_unified = True  # one cell pool for every sequence: a tree's branches share the prefix
        cparams.n_threads = cparams.n_threads_batch = threads or os.cpu_count() or 1
        cparams.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            ll.llama_model_free(self.model)
            raise StarsdError(f"llama.cpp could not make a context of {streams} x {self.max_context} tokens for {file} "
                              "(its KV cache is allocated at start): lower --target-context or --target-streams")
        self.memory = ll.llama_get_memory(self.ctx)
        self.capacity = ll.llama_n_batch(self.ctx)  # rows one llama_decode takes
        self.chunk = self.capacity if streams == 1 else min(SHARED_PREFILL_CHUNK, self.capacity)
        self.batch = ll.llama_batch_init(PREFILL_CHUNK, 0, MAX_SEQUENCES)
        self.block = MAX_SEQUENCES // streams  # sequence ids per slot: its base, then its tree's other leaves
        self.epochs = [0] * streams  # each slot's count of start()s
        self.live = [0] * streams  # each slot's sequences that may hold cells
        self.lock = threading.Lock()  # over the context: decodes and memory edits
        self.batcher = Batcher(self._run, self.capacity, "llamacpp-batcher") if streams > 1 else None
        self.slots = [LlamaCppSlot(self, i) for i in range(streams)]

    @classmethod
    def load(cls, cfg: ModelConfig, cache: str | None = None, threads: int = 0) -> "LlamaCppTarget":
        if not cfg.device.startswith("cpu"):
            raise StarsdError("the llama.cpp target engine runs on the CPU here (--device cpu)")
        return cls(gguf_file(cfg.path, cache), cfg.context, threads, cfg.streams)

    def close(self) -> None:
        """Free the llama.cpp context and model; the batcher's thread ends first."""
        if getattr(self, "batcher", None):
            self.batcher.close()
        if getattr(self, "ctx", None):
            with self.lock:
                self.ll.llama_batch_free(self.batch)
                self.ll.llama_free(self.ctx)
                self.ll.llama_model_free(self.model)
                self.ctx = None

    def __del__(self):
        self.close()

    # the interface of models/target.py

    def start(self, prompt_ids: list[int], taps: tuple[int, ...] | None = None, slot: int = 0) -> LlamaSequence:
        """Prefill the prompt but its last token (the pending root) in chunks; ends the slot's
        previous stream."""
        if taps is not None:
            raise StarsdError("EAGLE heads draft from the target's hidden states: use --target-engine transformers")
        self._room(len(prompt_ids))
        self.end(slot)
        with self.lock:
            self.epochs[slot] += 1
            self.live[slot] = 1
        if self.batcher:
            self.batcher.opened(1)
        seq = LlamaSequence(list(prompt_ids), slot, epoch=self.epochs[slot])
        base = self._base(slot)
        body = prompt_ids[:-1]
        for at in range(0, len(body), self.chunk):
            chunk = body[at:at + self.chunk]
            self._pass([(t, at + i, (base,), False) for i, t in enumerate(chunk)])
        seq.cached = len(body)
        return seq

    def score(self, seq: LlamaSequence, tree: DraftTree, taps: tuple[int, ...] | None = None) -> torch.Tensor:
        """Target logits after the root and after each node: [n+1, V] float32, in one llama_decode."""
        self._own(seq)
        if seq.scored:
            raise RuntimeError("score() called twice without commit()")
        n = len(tree)
        self._room(seq.cached + n + 1)
        if n + 1 > self.capacity:
            raise StarsdError(f"a draft of {n} nodes: this llama.cpp context scores at most {self.capacity - 1} in one pass")
        past = seq.cached
        base = self._base(seq.slot)
        if bool((tree.parents == torch.arange(n) - 1).all()):  # empty too
            sets = [(base,)] * (n + 1)  # a chain: the base sequence
            seq.leaf_of = [base] * n
        else:
            sets, seq.leaf_of = self._tree_sequences(seq.slot, tree)
        level = depths(tree.parents).tolist()
        rows = [(seq.tokens[-1], past, sets[0], True)]
        rows += [(int(t), past + level[i], sets[i + 1], True) for i, t in enumerate(tree.tokens.tolist())]
        job = self._pass(rows)
        seq.scored = n
        seq.pass_ms = job.ms if self.batcher else None
        return torch.from_numpy(job.logits)

    def commit(self, seq: LlamaSequence, verdict: Verdict) -> None:
        """Keep the root and the accepted path in the base sequence; the last emitted token becomes pending."""
        self._own(seq)
        base = self._base(seq.slot)
        keep_to = seq.cached + 1 + len(verdict.path)  # positions below this stay
        leaf = seq.leaf_of[verdict.path[-1]] if verdict.path else base
        with self.lock:
            if seq.scored and any(s != base for s in seq.leaf_of):
                for s in range(base + 1, base + self.live[seq.slot]):  # the other branches go
                    if s != leaf:
                        self.ll.llama_memory_seq_rm(self.memory, s, -1, -1)
                if leaf != base:
                    self.ll.llama_memory_seq_rm(self.memory, base, -1, -1)
                    self.ll.llama_memory_seq_cp(self.memory, leaf, base, -1, -1)
                    self.ll.llama_memory_seq_rm(self.memory, leaf, -1, -1)
                self.live[seq.slot] = 1
            self.ll.llama_memory_seq_rm(self.memory, base, keep_to, -1)
        seq.cached = keep_to
        seq.tokens.extend(verdict.tokens)
        seq.scored = 0
        seq.leaf_of = None

    def end(self, slot: int = 0) -> None:
        """The slot's stream is over: its cells are freed, and the batcher no longer waits for it."""
        with self.lock:
            if not self.live[slot]:
                return
            base = self._base(slot)
            for s in range(base, base + self.live[slot]):
                self.ll.llama_memory_seq_rm(self.memory, s, -1, -1)
            self.live[slot] = 0
            self.epochs[slot] += 1
        if self.batcher:
            self.batcher.opened(-1)

    # internals

    def _base(self, slot: int) -> int:
        return slot * self.block

    def _tree_sequences(self, slot: int, tree: DraftTree) -> tuple[list[tuple[int, ...]], list[int]]:
        """Each leaf a sequence of the slot's block; a node belongs to those of the leaves below it,
        the root to all. The base, which holds the prefix, is copied to the others first."""
        kids = children(tree.parents)
        leaves = [i for i in range(len(tree)) if not kids[i + 1]]
        if len(leaves) > self.block:
            raise StarsdError(f"a draft tree of {len(leaves)} leaves: this llama.cpp target scores at most "
                              f"{self.block} a stream (fewer --draft-top-k or --draft-total-tokens)")
        base = self._base(slot)
        below: list[list[int]] = [[] for _ in range(len(tree))]
        for s, leaf in enumerate(leaves):
            node = leaf
            while node >= 0:
                below[node].append(base + s)
                node = int(tree.parents[node])
        with self.lock:
            for s in range(1, len(leaves)):
                self.ll.llama_memory_seq_cp(self.memory, base, base + s, -1, -1)
            self.live[slot] = max(self.live[slot], len(leaves))
        root = tuple(range(base, base + len(leaves)))
        return [root] + [tuple(b) for b in below], [b[0] for b in below]

    def _pass(self, rows: list[Row]) -> _Pass:
        """Decode rows: at once with one slot, else in a pass the batcher gathers with other streams' rows."""
        job = _Pass(rows=rows)
        if self.batcher:
            self.batcher.submit(job)
        else:
            self._run([job])
        return job

    def _run(self, jobs: list[_Pass]) -> None:
        """One llama_decode of every job's rows; each job gets a copy of its own logits."""
        b = self.batch
        with self.lock:
            i = 0
            for job in jobs:
                for token, pos, seqs, logits in job.rows:
                    b.token[i] = token
                    b.pos[i] = pos
                    b.n_seq_id[i] = len(seqs)
                    ids = b.seq_id[i]
                    for j, s in enumerate(seqs):
                        ids[j] = s
                    b.logits[i] = logits
                    i += 1
            b.n_tokens = i
            t0 = time.perf_counter()
            rc = self.ll.llama_decode(self.ctx, b)
            if rc != 0:
                raise StarsdError(f"llama_decode failed ({rc}) on {i} tokens")
            ms = (time.perf_counter() - t0) * 1e3
            for job in jobs:
                job.ms = ms * job.size / i
            wanted = sum(row[3] for job in jobs for row in job.rows)
            if not wanted:
                return
            out = np.ctypeslib.as_array(self.ll.llama_get_logits(self.ctx), shape=(wanted, self.width))
            at = 0
            for job in jobs:
                k = sum(row[3] for row in job.rows)
                if k:
                    job.logits = out[at:at + k].copy()
                at += k

    def _room(self, tokens: int) -> None:
        if tokens > self.max_context:
            raise ContextFull(f"{tokens} tokens do not fit the llama.cpp context of {self.max_context} "
                              "(--target-context)")

    def _own(self, seq: LlamaSequence) -> None:
        if seq.epoch != self.epochs[seq.slot]:
            raise RuntimeError("this llama.cpp slot has started another stream since")


class LlamaCppSlot:
    """One slot of a LlamaCppTarget, with the target interface: its streams' start, score and commit,
    and end() when a stream is over."""

    device = LlamaCppTarget.device
    engine = LlamaCppTarget.engine

    def __init__(self, target: LlamaCppTarget, slot: int):
        self.target = target
        self.slot = slot
        self.width = target.width
        self.max_context = target.max_context

    def start(self, prompt_ids: list[int], taps: tuple[int, ...] | None = None) -> LlamaSequence:
        return self.target.start(prompt_ids, taps, self.slot)

    def score(self, seq: LlamaSequence, tree: DraftTree, taps: tuple[int, ...] | None = None) -> torch.Tensor:
        return self.target.score(seq, tree, taps)

    def commit(self, seq: LlamaSequence, verdict: Verdict) -> None:
        self.target.commit(seq, verdict)

    def end(self) -> None:
        self.target.end(self.slot)
