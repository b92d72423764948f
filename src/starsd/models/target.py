"""The target backend: the model whose distribution the output must follow.

A TargetSequence holds one generation stream. Its KV cache covers every token but the last, the
*pending* token, which is the root of the next draft tree: one forward pass over
[pending] + tree nodes scores the whole draft (tree attention), and `commit` keeps only the
accepted path.

The cache is a KV (models/kv.py): allocated for the prompt and some spare columns, written in place
by each pass, grown geometrically when a pass needs more room. `commit` moves the accepted path's
columns down behind the root; a failed pass is cut back. The prompt is prefilled in chunks of
`prefill_chunk` tokens, each a causal pass (forward.py: the model's own mask, none for the first
chunk), so that prefill memory grows with the prompt, not with its square: no chunk's mask or
activations span more than [chunk, prompt].

For an EAGLE drafter, a pass also keeps each of its positions' *features* (models/eagle.py: the
last hidden state, or the outputs of some layers side by side): `start` and `score` take which
(`taps`; None for none), and `seq.features` holds those of the last pass.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from starsd.models import forward as fw
from starsd.models.kv import KV
from starsd.spec.tree import DraftTree, ancestor_mask, depths
from starsd.spec.verify import Verdict


SPARE = 256  # columns allocated beyond the prompt: the first drafts fit before the KV grows
PREFILL_CHUNK = 512  # prompt tokens a prefill pass feeds at most


@dataclass
class TargetSequence:
    tokens: list[int]  # prompt + generated
    cache: KV  # one row: tokens[:-1] in columns [0, cache.length - scored), then the last scored tree
    scored: int = 0  # nodes of the last scored tree, still in the cache until commit
    features: torch.Tensor | None = field(default=None, repr=False)  # [rows of the last pass, F], if asked:
    # the prefill's (every prompt token's but the pending one's; None for none), or the root's and each node's
    pass_ms: float | None = None  # its own share of its last scoring pass: None, all of it (passes are its own)


class TargetModel:
    """A target on transformers. models/llamacpp.py's LlamaCppTarget has the same interface: start,
    score, commit, device, width and max_context."""

    engine = "transformers"

    def __init__(self, model: torch.nn.Module, prefill_chunk: int = PREFILL_CHUNK, streams: int = 1):
        self.model = model
        self.prefill_chunk = prefill_chunk
        lock = threading.Lock()
        self.slots = [TargetSlot(self, lock) for _ in range(streams)]  # one per stream served at once

    @property
    def device(self) -> torch.device:
        return fw.device_of(self.model)

    @property
    def width(self) -> int:
        """Logits per position: the vocabulary the target scores."""
        return self.model.config.vocab_size

    @property
    def max_context(self) -> int:
        """Tokens a stream may hold, prompt and answer."""
        return int(getattr(self.model.config, "max_position_embeddings", 32768))

    def start(self, prompt_ids: list[int], taps: tuple[int, ...] | None = None) -> TargetSequence:
        """Prefill the prompt (all but its last token, which becomes the pending root), chunk by chunk."""
        body = torch.tensor(prompt_ids[:-1], dtype=torch.long)
        m = body.shape[0]
        seq = TargetSequence(list(prompt_ids), KV.allocate(self.model, 1, m + SPARE))
        features = []
        for at in range(0, m, self.prefill_chunk):
            chunk = body[at:at + self.prefill_chunk]
            out = fw.forward(self.model, seq.cache, chunk, at + torch.arange(chunk.shape[0]), None, taps or ())
            if taps is not None:
                features.append(_features(out, taps))
        if features:
            seq.features = torch.cat(features)
        return seq

    def score(self, seq: TargetSequence, tree: DraftTree, taps: tuple[int, ...] | None = None) -> torch.Tensor:
        """Target logits after the root and after each node: [n+1, V] float32, in one forward pass."""
        if seq.scored:
            raise RuntimeError("score() called twice without commit()")
        past = seq.cache.length
        n = len(tree)
        tokens = torch.cat([torch.tensor([seq.tokens[-1]]), tree.tokens])
        positions = past + torch.cat([torch.zeros(1, dtype=torch.long), depths(tree.parents)])
        attend = torch.cat([torch.ones(n + 1, past, dtype=torch.bool), ancestor_mask(tree.parents)], dim=1)
        seq.cache.reserve(past + n + 1)
        try:
            out = fw.forward(self.model, seq.cache, tokens, positions, attend, taps or ())
        except BaseException:  # a pass that fails part-way leaves some layers longer: cut them back
            seq.cache.cut(past)
            raise
        seq.scored = n
        seq.features = _features(out, taps)
        return fw.lm_head(self.model, out[0] if isinstance(out, tuple) else out)

    def commit(self, seq: TargetSequence, verdict: Verdict) -> None:
        """Keep the root and the accepted path in the cache; the last emitted token becomes pending."""
        root = seq.cache.length - seq.scored - 1
        if verdict.path != list(range(len(verdict.path))):  # not already in place behind the root
            kept = root + 1 + torch.tensor(verdict.path, dtype=torch.long)
            seq.cache.copy_columns(0, kept, seq.cache, 0, at=root + 1)
        seq.cache.cut(root + 1 + len(verdict.path))
        seq.tokens.extend(verdict.tokens)
        seq.scored = 0


class TargetSlot:
    """One of the streams a TargetModel serves at once, with the target interface, each driven by a
    thread of its own: their passes take turns under one lock (this engine does not batch streams;
    each stream's sequence holds its own cache)."""

    def __init__(self, target: TargetModel, lock: threading.Lock):
        self.target = target
        self.lock = lock
        self.engine = target.engine
        self.device = target.device
        self.width = target.width
        self.max_context = target.max_context

    def start(self, prompt_ids: list[int], taps: tuple[int, ...] | None = None) -> TargetSequence:
        with self.lock:
            return self.target.start(prompt_ids, taps)

    def score(self, seq: TargetSequence, tree: DraftTree, taps: tuple[int, ...] | None = None) -> torch.Tensor:
        with self.lock:
            return self.target.score(seq, tree, taps)

    def commit(self, seq: TargetSequence, verdict: Verdict) -> None:
        with self.lock:
            self.target.commit(seq, verdict)

    def end(self) -> None:
        """Nothing to free: a stream's cache goes with its sequence."""


def _features(out, taps: tuple[int, ...] | None) -> torch.Tensor | None:
    """The features asked of a pass: its tapped hidden states, or its final ones (taps == ())."""
    if taps is None:
        return None
    return out[1] if taps else out
