"""The target backend: the model whose distribution the output must follow.

A TargetSequence holds one generation stream. Its KV cache covers every token but the last, the
*pending* token, which is the root of the next draft tree: one forward pass over [pending] + tree
nodes scores the whole draft (tree attention), and `commit` keeps only the accepted path.
The cache is a KV (models/kv.py): allocated for the prompt and some spare columns, written in
place by each pass, grown geometrically when a pass needs more room. `commit` moves the accepted
path's columns down behind the root; a failed pass is cut back. The prompt is prefilled in causal
chunks of `prefill_chunk` tokens (forward.py), so prefill memory grows with the prompt, not with
its square. For an EAGLE drafter a pass also keeps its positions' *features* (models/eagle.py):
`start` and `score` take which (`taps`; None for none), and `seq.features` holds the last pass's.
With several streams (`slots`), the passes they ask for at about the same time go through a
Batcher (models/batcher.py) as one forward pass (`score_batch`): each stream's cached columns
copied side by side into one batch KV, each row's tree attending to its own columns with its own
rotary positions, its new columns copied back. Batched logits equal a stream's alone ones to float
rounding, not bit for bit; prompts and commits take turns under one lock, one at a time.
Figures: docs/serving.md#several-streams-per-target-server.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from starsd.models import forward as fw
from starsd.models.batcher import Batcher, Job
from starsd.models.kv import KV
from starsd.spec_decode.tree import DraftTree, ancestor_mask, depths
from starsd.spec_decode.verify import Verdict


SPARE = 256  # columns allocated beyond the prompt: the first drafts fit before the KV grows
PREFILL_CHUNK = 512  # prompt tokens a prefill pass feeds at most
BATCH_ROWS = 512  # tokens (roots and nodes) one shared scoring pass takes at most, over its streams


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
        self.lock = threading.Lock()  # over the model: one pass at a time
        self.batcher = Batcher(self._run, BATCH_ROWS, "target-batcher") if streams > 1 else None
        self.slots = [TargetSlot(self) for _ in range(streams)]  # one per stream served at once

    def close(self) -> None:
        """End the batcher's thread (the model is freed once nothing holds it)."""
        if self.batcher:
            self.batcher.close()

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

    def score_batch(self, seqs: list[TargetSequence], trees: list[DraftTree]) -> list[torch.Tensor]:
        """score() of several streams in one forward pass: each stream's logits [n+1, V]."""
        if any(seq.scored for seq in seqs):
            raise RuntimeError("score() called twice without commit()")
        pasts = [seq.cache.length for seq in seqs]
        sizes = [len(tree) + 1 for tree in trees]
        start, width, rows = max(pasts), max(sizes), len(seqs)
        batch = KV.allocate(self.model, rows, start + width)
        batch.gather([seq.cache for seq in seqs], pasts)  # row r: its stream's columns, then padding to `start`
        tokens = torch.zeros(rows, width, dtype=torch.long)
        positions = torch.zeros(rows, width, dtype=torch.long)
        attend = torch.zeros(rows, width, start + width, dtype=torch.bool)
        attend[:, torch.arange(width), start + torch.arange(width)] = True  # padding sees itself: no NaN
        for r, (seq, tree, past, m) in enumerate(zip(seqs, trees, pasts, sizes)):
            tokens[r, :m] = torch.cat([torch.tensor([seq.tokens[-1]]), tree.tokens])
            positions[r, :m] = past + torch.cat([torch.zeros(1, dtype=torch.long), depths(tree.parents)])
            attend[r, :m, :past] = True
            attend[r, :m, start:start + m] = ancestor_mask(tree.parents)
        hidden = fw.forward(self.model, batch, tokens, positions, attend)
        row = torch.cat([torch.full((m,), r) for r, m in enumerate(sizes)])
        column = torch.cat([torch.arange(m) for m in sizes])
        logits = fw.lm_head(self.model, hidden[row, column]).split(sizes)
        for r, (seq, past, m) in enumerate(zip(seqs, pasts, sizes)):
            seq.cache.reserve(past + m)
            batch.copy_columns(r, start + torch.arange(m), seq.cache, 0, at=past)
            seq.cache.cut(past + m)  # its length: through the columns just copied
            seq.scored = m - 1
            seq.features = None
        return list(logits)

    def _run(self, jobs: list[_Score]) -> None:
        """The Batcher's pass: the jobs' trees scored together (one alone as score() does)."""
        with self.lock:
            t0 = time.perf_counter()
            if len(jobs) == 1:
                logits = [self.score(jobs[0].seq, jobs[0].tree)]
            else:
                logits = self.score_batch([job.seq for job in jobs], [job.tree for job in jobs])
            ms = (time.perf_counter() - t0) * 1e3
        total = sum(job.size for job in jobs)
        for job, out in zip(jobs, logits):
            job.logits = out
            job.ms = ms * job.size / total

    def commit(self, seq: TargetSequence, verdict: Verdict) -> None:
        """Keep the root and the accepted path in the cache; the last emitted token becomes pending."""
        root = seq.cache.length - seq.scored - 1
        if verdict.path != list(range(len(verdict.path))):  # not already in place behind the root
            kept = root + 1 + torch.tensor(verdict.path, dtype=torch.long)
            seq.cache.copy_columns(0, kept, seq.cache, 0, at=root + 1)
        seq.cache.cut(root + 1 + len(verdict.path))
        seq.tokens.extend(verdict.tokens)
        seq.scored = 0


@dataclass
class _Score(Job):
    """A stream's tree to score in a shared pass, and, once done, its logits."""

    seq: TargetSequence | None = None
    tree: DraftTree | None = None
    logits: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.tree) + 1


class TargetSlot:
    """One of the streams a TargetModel serves at once, with the target interface, each driven by a
    thread of its own (each stream's sequence holds its own cache). Its scoring passes share the
    target's batched passes; an EAGLE head's (features asked) run alone, as do prefills and commits,
    under the target's lock."""

    def __init__(self, target: TargetModel):
        self.target = target
        self.engine = target.engine
        self.device = target.device
        self.width = target.width
        self.max_context = target.max_context
        self.open = False  # a stream started and not ended: the batcher waits for its passes

    def start(self, prompt_ids: list[int], taps: tuple[int, ...] | None = None) -> TargetSequence:
        with self.target.lock:
            seq = self.target.start(prompt_ids, taps)
        if self.target.batcher and not self.open:
            self.target.batcher.opened(1)
            self.open = True
        return seq

    def score(self, seq: TargetSequence, tree: DraftTree, taps: tuple[int, ...] | None = None) -> torch.Tensor:
        if self.target.batcher is None or taps is not None:
            with self.target.lock:
                return self.target.score(seq, tree, taps)
        job = _Score(seq=seq, tree=tree)
        self.target.batcher.submit(job)
        seq.pass_ms = job.ms
        return job.logits

    def commit(self, seq: TargetSequence, verdict: Verdict) -> None:
        with self.target.lock:
            self.target.commit(seq, verdict)

    def end(self) -> None:
        """The stream is over (its cache goes with its sequence): the batcher no longer waits for it."""
        if self.open:
            self.target.batcher.opened(-1)
            self.open = False


def _features(out, taps: tuple[int, ...] | None) -> torch.Tensor | None:
    """The features asked of a pass: its tapped hidden states, or its final ones (taps == ())."""
    if taps is None:
        return None
    return out[1] if taps else out
