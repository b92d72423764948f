"""The drafter backend: a small LM that proposes chains or top-k token trees, for one sequence or
for many sequences at once (the draft server batches every pending session into one pass per level).

A DraftSequence's KV cache covers exactly its *committed* tokens, the sequence its target has
accepted so far. A draft first ingests the tokens committed since the last draft (the accepted path
and the recovered/bonus token: this is how rejected draft tokens are rolled back), then expands a
tree level by level above the cache, and finally drops the tree's entries again.

Batching sequences of different lengths: the sequences' caches are copied side by side into one
batch cache, right-padded to the longest; every query row carries its own attention mask over the
batch's columns and its own rotary positions, so each sequence sees exactly its own context. The
ingested tokens' keys and values are copied back to each sequence's cache; tree entries never are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from starsd.config import DraftConfig, SamplingConfig
from starsd.models import forward as fw
from starsd.spec.tree import DraftTree
from starsd.spec.verify import sample, warp

SOLO_INGEST = 32  # ingest longer than this (a prompt) runs on its own instead of padding a batch


@dataclass
class DraftSequence:
    tokens: list[int]  # committed tokens; the cache covers tokens[:cached]
    cache: object
    cached: int = 0


@dataclass
class DraftJob:
    """One sequence's share of a batched draft."""

    seq: DraftSequence
    new_tokens: list[int]
    cfg: DraftConfig
    sampling: SamplingConfig
    generator: torch.Generator | None = None
    max_depth: int = 1 << 30  # the target's remaining budget may cap the depth


@dataclass
class _Node:
    token: int
    parent: int  # index into the candidate list, -1 for the root
    score: float  # cumulative draft log-probability of the path
    depth: int
    slot: int = -1  # batch-cache column once the node has been fed to the model


@dataclass
class Expansion:
    """The growing tree of one job. Pure bookkeeping: the model runs elsewhere."""

    cfg: DraftConfig
    sampling: SamplingConfig
    generator: torch.Generator | None
    depth: int
    nodes: list[_Node] = field(default_factory=list)
    frontier: list[int] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)
    level: int = 0

    def grow(self, parents: list[int], logits: torch.Tensor) -> None:
        """Add children below `parents` from their logits [len(parents), V]."""
        self.level += 1
        if self.cfg.sample:
            q = warp(logits[0], self.sampling)
            self.qs.append(q)
            self.nodes.append(_Node(sample(q, self.generator), parents[0], 0.0, self.level))
            self.frontier = [len(self.nodes) - 1]
            return
        logp = logits.float().log_softmax(-1)
        top = logp.topk(self.cfg.top_k, dim=-1)
        first = len(self.nodes)
        for row, p in enumerate(parents):
            base = 0.0 if p < 0 else self.nodes[p].score
            for lp, tok in zip(top.values[row].tolist(), top.indices[row].tolist()):
                self.nodes.append(_Node(tok, p, base + lp, self.level))
        new = range(first, len(self.nodes))
        self.frontier = sorted(new, key=lambda i: -self.nodes[i].score)[: self.cfg.top_k]

    def wants_more(self) -> bool:
        if self.level >= self.depth:
            return False
        best = self.nodes[self.frontier[0]].score
        return self.cfg.sample or self.cfg.min_path_prob <= 0 or best >= math.log(self.cfg.min_path_prob)

    def tree(self) -> DraftTree:
        if self.cfg.sample:
            return DraftTree.chain([n.token for n in self.nodes], torch.stack(self.qs))
        # Re-rank every candidate by its path score. A child never outscores its parent and a stable
        # sort keeps parents (created first) ahead of children on ties, so the kept set is a tree.
        order = sorted(range(len(self.nodes)), key=lambda i: -self.nodes[i].score)[: self.cfg.max_nodes]
        kept = sorted(order)
        index = {old: new for new, old in enumerate(kept)}
        tokens = torch.tensor([self.nodes[i].token for i in kept], dtype=torch.long)
        parents = torch.tensor([index.get(self.nodes[i].parent, -1) for i in kept], dtype=torch.long)
        return DraftTree(tokens, parents)


class Drafter:
    def __init__(self, model: torch.nn.Module):
        self.model = model

    @property
    def device(self) -> torch.device:
        return fw.device_of(self.model)

    def start(self, prompt_ids: list[int]) -> DraftSequence:
        return DraftSequence(list(prompt_ids), fw.new_cache(self.model))

    def propose(self, seq: DraftSequence, new_tokens: list[int], cfg: DraftConfig, sampling: SamplingConfig,
                generator: torch.Generator | None = None, max_depth: int = 1 << 30) -> DraftTree:
        """Append `new_tokens` to the committed sequence and draft a tree below its last token,
        at most max_depth deep (the target's remaining budget less its bonus token)."""
        return self.propose_batch([DraftJob(seq, new_tokens, cfg, sampling, generator, max_depth)])[0]

    @torch.inference_mode()
    def propose_batch(self, jobs: list[DraftJob]) -> list[DraftTree]:
        """Draft for several sequences at once: one forward pass per tree level for all of them."""
        before = [(len(j.seq.tokens), j.seq.cached) for j in jobs]
        try:
            return self._propose_batch(jobs)
        except BaseException:  # leave every sequence as it was, so the caller may retry or isolate
            for job, (length, cached) in zip(jobs, before):
                del job.seq.tokens[length:]
                job.seq.cached = min(job.seq.cached, cached)
                fw.truncate(job.seq.cache, job.seq.cached)
            raise

    def _propose_batch(self, jobs: list[DraftJob]) -> list[DraftTree]:
        for job in jobs:
            job.seq.tokens.extend(job.new_tokens)
        roots: dict[int, torch.Tensor] = {}
        for i, job in enumerate(jobs):  # prompts alone: no padding everyone else to their length
            fresh = len(job.seq.tokens) - job.seq.cached
            if len(jobs) == 1 or job.seq.cached == 0 or fresh > SOLO_INGEST:
                roots[i] = self._ingest_alone(job.seq)
        batch = _Batch(self.model, [j.seq for j in jobs])
        rest = [i for i in range(len(jobs)) if i not in roots]
        if rest:
            roots.update(zip(rest, batch.ingest(rest)))
        expansions = [Expansion(j.cfg, j.sampling, j.generator, max(1, min(j.cfg.depth, j.max_depth))) for j in jobs]
        for i, e in enumerate(expansions):
            e.grow([-1], roots[i][None])
        while active := [i for i, e in enumerate(expansions) if e.wants_more()]:
            for i, logits in zip(active, batch.feed(active, [expansions[i] for i in active])):
                expansions[i].grow(expansions[i].frontier, logits)
        batch.close()
        return [e.tree() for e in expansions]

    def _ingest_alone(self, seq: DraftSequence) -> torch.Tensor:
        """Feed the committed tokens the cache lacks, in the sequence's own cache; return the
        logits after the last one: [V]."""
        return _Batch(self.model, [seq]).ingest([0])[0]


class _Batch:
    """Several sequences' caches side by side in one batch cache (or, for one sequence, its own).

    Columns [0, width) hold each sequence's cached prefix (sequence i's first lengths[i] columns are
    real); each later pass appends as many columns as its widest row needs. visible[i] marks the
    columns that hold sequence i's committed context; tree nodes are reached through their
    ancestors' slots. row[i] is sequence i's row in the batch: once half the rows have stopped
    drafting, the batch drops them, so the remaining levels compute only the sequences still growing."""

    def __init__(self, model, seqs: list[DraftSequence]):
        self.model = model
        self.seqs = seqs
        self.shared = len(seqs) == 1  # a batch of one works in the sequence's own cache
        width = max(s.cached for s in seqs)
        self.cache = seqs[0].cache if self.shared else fw.stack_caches(model, [s.cache for s in seqs], width)
        self.visible = [torch.arange(width) < s.cached for s in seqs]
        self.row = {i: i for i in range(len(seqs))}

    def ingest(self, rows: list[int]) -> list[torch.Tensor]:
        """Feed each row's uncached committed tokens (causally); return the logits after each row's
        last token: [V] per row. The new entries are copied back to each sequence's own cache."""
        start = fw.cache_len(self.cache)
        fresh = [self.seqs[i].tokens[self.seqs[i].cached:] for i in rows]
        positions = [list(range(self.seqs[i].cached, self.seqs[i].cached + len(f))) for i, f in zip(rows, fresh)]
        wide = []
        for i, f in zip(rows, fresh):
            n = len(f)
            mask = torch.zeros(n, start + n, dtype=torch.bool)
            mask[:, :start] = self.visible[i]
            mask[:, start:] = torch.ones(n, n, dtype=torch.bool).tril()  # causal among the new tokens
            wide.append(mask)
        hidden = self._run_wide(rows, fresh, positions, wide)
        for r, i in enumerate(rows):
            n = len(fresh[r])
            self.visible[i][start:start + n] = True
            if not self.shared:
                fw.append_from(self.seqs[i].cache, self.cache, self.row[i], start, n)
            self.seqs[i].cached += n
        return [fw.lm_head(self.model, h[-1]) for h in hidden]

    def feed(self, rows: list[int], expansions: list[Expansion]) -> list[torch.Tensor]:
        """Feed each row's frontier nodes with tree attention; return their logits [k, V] per row."""
        if 2 * len(rows) <= len(self.row):
            self._compact(rows)
        start = fw.cache_len(self.cache)
        tokens, positions, wide = [], [], []
        for i, e in zip(rows, expansions):
            k = len(e.frontier)
            mask = torch.zeros(k, start + k, dtype=torch.bool)
            mask[:, :start] = self.visible[i]
            for j, n in enumerate(e.frontier):
                e.nodes[n].slot = start + j
                mask[j, start + j] = True
                a = e.nodes[n].parent
                while a >= 0:
                    mask[j, e.nodes[a].slot] = True
                    a = e.nodes[a].parent
            tokens.append([e.nodes[n].token for n in e.frontier])
            positions.append([self.seqs[i].cached - 1 + e.nodes[n].depth for n in e.frontier])
            wide.append(mask)
        return [fw.lm_head(self.model, h) for h in self._run_wide(rows, tokens, positions, wide)]

    def _run_wide(self, rows, tokens, positions, wide) -> list[torch.Tensor]:
        """One pass over all rows; wide[r] [n, start + n] is row r's full mask. Hidden [n, H] per row."""
        start = fw.cache_len(self.cache)
        m = max(len(t) for t in tokens)
        B = len(self.row)
        tok = torch.zeros(B, m, dtype=torch.long)
        pos = torch.zeros(B, m, dtype=torch.long)
        att = torch.zeros(B, m, start + m, dtype=torch.bool)
        att[:, torch.arange(m), start + torch.arange(m)] = True  # padding sees itself: no NaN
        for r, i in enumerate(rows):
            n = len(tokens[r])
            tok[self.row[i], :n] = torch.tensor(tokens[r])
            pos[self.row[i], :n] = torch.tensor(positions[r])
            att[self.row[i], :n, : start + n] = wide[r]
        hidden = fw.forward(self.model, self.cache, tok, pos, att)
        self.visible = [torch.cat([v, torch.zeros(m, dtype=torch.bool)]) for v in self.visible]
        return [hidden[self.row[i], : len(tokens[r])] for r, i in enumerate(rows)]

    def _compact(self, keep: list[int]) -> None:
        """Drop the rows of the sequences not in `keep` (they stopped drafting)."""
        if self.shared:
            return
        fw.select_rows(self.cache, torch.tensor([self.row[i] for i in keep]))
        self.row = {i: r for r, i in enumerate(keep)}

    def close(self) -> None:
        """Drop every tree entry: each sequence's cache covers its committed tokens again."""
        if self.shared:
            fw.truncate(self.cache, self.seqs[0].cached)
        self.cache = None
