"""A target on llama.cpp (through llama-cpp-python's low-level API): the GGUF file the pair comes
from, run as llama.cpp runs it, behind the interface of models/target.py.

One llama.cpp context holds one stream's KV cache. A draft is scored in one `llama_decode` of the
pending root and its nodes, every position's logits kept. A chain lives in one sequence of the
context. A tree lives in as many sequences as it has leaves: a node belongs to the sequence of
every leaf below it, so it attends to exactly its ancestors (llama.cpp lets a token see the cells
of its own sequences at earlier positions), and the committed prefix is shared by all of them.
`commit` then keeps one leaf's sequence below the accepted node, cut after the accepted path, and
folds it back into sequence 0.

llama.cpp rounds a batch of k tokens differently from k single-token passes (its kernels block the
work differently), so its greedy output with drafts equals its target-only greedy output except at
near-ties of its own arithmetic; `starsd bench llamacpp` reports every divergence with its margin.
EAGLE heads need the target's hidden states, which this engine does not hand out: they need the
transformers engine.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from starsd.config import ModelConfig
from starsd.errors import StarsdError
from starsd.models import pinned
from starsd.spec.tree import DraftTree, children, depths
from starsd.spec.verify import Verdict

MAX_SEQUENCES = 256  # llama.cpp's own bound on a context's sequences: a tree of at most this many leaves
PREFILL_CHUNK = 512  # tokens a prefill submits in one llama_decode


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


@dataclass
class LlamaSequence:
    """One stream in the context: tokens as TargetSequence's (the cache covers all but the last)."""

    tokens: list[int]
    cached: int = 0  # positions in sequence 0: the committed tokens but the pending one
    scored: int = 0  # nodes of the last scored tree, in the cache until commit
    leaf_of: list[int] | None = None  # the last tree's: for each node, the sequence of a leaf below it
    features: None = None  # no features: EAGLE heads need the transformers engine
    epoch: int = 0  # which start() of its context it belongs to


class LlamaCppTarget:
    """A llama.cpp target with models/target.py's interface: start, score, commit. One stream at a
    time: a start() ends the previous stream of this context."""

    device = torch.device("cpu")
    engine = "llamacpp"

    def __init__(self, file: Path, context: int = 0, threads: int = 0):
        ll = self.ll = _lib()
        _quiet(ll)
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = ll.llama_model_load_from_file(str(file).encode(), mparams)
        if not self.model:
            raise StarsdError(f"llama.cpp could not load {file}")
        self.file = file
        self.width = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        trained = ll.llama_model_n_ctx_train(self.model)
        self.max_context = min(context, trained) if context else trained
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = self.max_context
        cparams.n_batch = cparams.n_ubatch = cparams.n_outputs_max = PREFILL_CHUNK  # a tree: n + 1 logits
        cparams.n_seq_max = MAX_SEQUENCES
        cparams.kv_unified = True  # one cell pool for every sequence: a tree's branches share the prefix
        cparams.n_threads = cparams.n_threads_batch = threads or os.cpu_count() or 1
        cparams.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            ll.llama_model_free(self.model)
            raise StarsdError(f"llama.cpp could not make a context of {self.max_context} tokens for {file}")
        self.memory = ll.llama_get_memory(self.ctx)
        self.chunk = ll.llama_n_batch(self.ctx)  # PREFILL_CHUNK, or the context if smaller
        self.batch = ll.llama_batch_init(PREFILL_CHUNK, 0, MAX_SEQUENCES)
        self.epoch = 0

    @classmethod
    def load(cls, cfg: ModelConfig, cache: str | None = None, threads: int = 0) -> "LlamaCppTarget":
        if not cfg.device.startswith("cpu"):
            raise StarsdError("the llama.cpp target engine runs on the CPU here (--device cpu)")
        return cls(gguf_file(cfg.path, cache), cfg.context, threads)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
            self.ll.llama_model_free(self.model)
            self.ctx = None

    def __del__(self):
        self.close()

    # the interface of models/target.py

    def start(self, prompt_ids: list[int], taps: tuple[int, ...] | None = None) -> LlamaSequence:
        """Prefill the prompt but its last token (the pending root) in chunks; ends this context's
        previous stream."""
        if taps is not None:
            raise StarsdError("EAGLE heads draft from the target's hidden states: use --target-engine transformers")
        self._room(len(prompt_ids))
        self.ll.llama_memory_clear(self.memory, True)
        self.epoch += 1
        seq = LlamaSequence(list(prompt_ids), epoch=self.epoch)
        body = prompt_ids[:-1]
        for at in range(0, len(body), self.chunk):
            chunk = body[at:at + self.chunk]
            self._decode([(t, at + i, (0,), False) for i, t in enumerate(chunk)])
        seq.cached = len(body)
        return seq

    def score(self, seq: LlamaSequence, tree: DraftTree, taps: tuple[int, ...] | None = None) -> torch.Tensor:
        """Target logits after the root and after each node: [n+1, V] float32, in one llama_decode."""
        self._own(seq)
        if seq.scored:
            raise RuntimeError("score() called twice without commit()")
        n = len(tree)
        self._room(seq.cached + n + 1)
        if n + 1 > self.chunk:
            raise StarsdError(f"a draft of {n} nodes: this llama.cpp context scores at most {self.chunk - 1} in one pass")
        past = seq.cached
        if bool((tree.parents == torch.arange(n) - 1).all()):  # empty too
            sets = [(0,)] * (n + 1)  # a chain: one sequence
            seq.leaf_of = [0] * n
        else:
            sets, seq.leaf_of = self._tree_sequences(tree)
        level = depths(tree.parents).tolist()
        rows = [(seq.tokens[-1], past, sets[0], True)]
        rows += [(int(t), past + level[i], sets[i + 1], True) for i, t in enumerate(tree.tokens.tolist())]
        self._decode(rows)
        seq.scored = n
        out = np.ctypeslib.as_array(self.ll.llama_get_logits(self.ctx), shape=(n + 1, self.width))
        return torch.from_numpy(out.copy())

    def commit(self, seq: LlamaSequence, verdict: Verdict) -> None:
        """Keep the root and the accepted path in sequence 0; the last emitted token becomes pending."""
        self._own(seq)
        keep_to = seq.cached + 1 + len(verdict.path)  # positions below this stay
        leaf = seq.leaf_of[verdict.path[-1]] if verdict.path else 0
        if seq.scored and any(seq.leaf_of):
            self.ll.llama_memory_seq_keep(self.memory, leaf)  # the other branches go
            if leaf:
                self.ll.llama_memory_seq_cp(self.memory, leaf, 0, -1, -1)
                self.ll.llama_memory_seq_rm(self.memory, leaf, -1, -1)
        self.ll.llama_memory_seq_rm(self.memory, 0, keep_to, -1)
        seq.cached = keep_to
        seq.tokens.extend(verdict.tokens)
        seq.scored = 0
        seq.leaf_of = None

    # internals

    def _tree_sequences(self, tree: DraftTree) -> tuple[list[tuple[int, ...]], list[int]]:
        """Each leaf its own sequence; a node belongs to those of the leaves below it, the root to
        all. Sequence 0, which holds the prefix, is copied to the others first."""
        kids = children(tree.parents)
        leaves = [i for i in range(len(tree)) if not kids[i + 1]]
        if len(leaves) > MAX_SEQUENCES:
            raise StarsdError(f"a draft tree of {len(leaves)} leaves: the llama.cpp engine scores at most "
                              f"{MAX_SEQUENCES} (fewer --draft-top-k or --draft-total-tokens)")
        below: list[list[int]] = [[] for _ in range(len(tree))]
        for s, leaf in enumerate(leaves):
            node = leaf
            while node >= 0:
                below[node].append(s)
                node = int(tree.parents[node])
        for s in range(1, len(leaves)):
            self.ll.llama_memory_seq_cp(self.memory, 0, s, -1, -1)
        root = tuple(range(len(leaves)))
        return [root] + [tuple(b) for b in below], [b[0] for b in below]

    def _decode(self, rows: list[tuple[int, int, tuple[int, ...], bool]]) -> None:
        """One llama_decode of (token, position, sequences, logits?) rows."""
        b = self.batch
        b.n_tokens = len(rows)
        for i, (token, pos, seqs, logits) in enumerate(rows):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = len(seqs)
            ids = b.seq_id[i]
            for j, s in enumerate(seqs):
                ids[j] = s
            b.logits[i] = logits
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise StarsdError(f"llama_decode failed ({rc}) on {len(rows)} tokens")

    def _room(self, tokens: int) -> None:
        if tokens > self.max_context:
            raise ContextFull(f"{tokens} tokens do not fit the llama.cpp context of {self.max_context} "
                              "(--target-context)")

    def _own(self, seq: LlamaSequence) -> None:
        if seq.epoch != self.epoch:
            raise RuntimeError("this llama.cpp context has started another stream since")
