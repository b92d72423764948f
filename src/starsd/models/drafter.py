"""The drafter backend: a small LM that proposes chains or top-k token trees, for one sequence or
for many at once (the draft server batches every pending session into one pass per level).

A DraftSequence's KV holds its *committed* tokens (those its target has accepted) in columns
[0, cached) and, after a draft, the draft nodes fed to the model after them. A draft request brings
the tokens committed since the last one: the last draft's accepted path and the recovered or bonus
token. Accepted nodes already computed while drafting are moved into place, the rest ingested;
rejected nodes are overwritten by the next pass (that is the rollback).
Batching sequences of different lengths: each sequence's committed columns are copied side by side
into one batch KV, right-padded to the longest; each query has its own attention mask over the
batch's columns and its own rotary positions. Each level is one forward pass over the rows still
growing and one LM-head call over their new nodes; a finished row's new columns go back to its
sequence's KV, and once half the rows are finished the batch drops them. A batch of one works in
its sequence's own KV. With an EAGLE head (models/eagle.py) each committed token comes with the
target's feature of the position before it (`DraftJob.features`, kept in `DraftSequence.features`
until ingested), a sequence holds its stream from the second token on, and accepted nodes are
ingested again (their keys and values came from the head's own predicted features).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from starsd.config import DraftConfig, SamplingConfig
from starsd.models import forward as fw
from starsd.models.eagle import EagleHead
from starsd.models.kv import KV
from starsd.spec_decode.drafting import LocalDrafting
from starsd.spec_decode.sparse_q import SparseQ
from starsd.spec_decode.tree import DraftTree
from starsd.spec_decode.verify import sample, warp

SOLO_INGEST = 32  # an ingest longer than this (a prompt) runs on its own instead of padding a batch
ROOT = -1  # the parent of a tree's first level


@dataclass
class DraftSequence:
    tokens: list[int]  # committed tokens
    kv: KV  # one row: tokens[:cached] in columns [0, cached), then the last draft's fed nodes
    cached: int = 0
    kept: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent column or ROOT, token) -> column
    # of a node of the last draft that was fed to the model; columns count from the start of the KV
    features: torch.Tensor | None = None  # EAGLE: [len(tokens) - cached, H] the lifted target features of
    # the tokens not yet ingested, row i the feature of the position before tokens[cached + i]

    def clone(self) -> DraftSequence:
        """An independent copy (a draft into it leaves this one as it was)."""
        return DraftSequence(list(self.tokens), self.kv.clone(), self.cached, dict(self.kept), self.features)


@dataclass
class DraftJob:
    """One sequence's share of a batched draft."""

    seq: DraftSequence
    new_tokens: list[int]
    cfg: DraftConfig
    sampling: SamplingConfig
    generator: torch.Generator | None = None
    max_depth: int = 1 << 30  # the target's remaining budget may cap the depth
    given: int = 0  # leading levels taken as given: min_path_prob counts the path below them only
    features: torch.Tensor | None = None  # EAGLE: [len(new_tokens), F] the target's features, row i the
    # feature of the position before new_tokens[i] (the first request's: the prompt's from its second token)
    second: list[int] = field(default_factory=list)  # set by the draft, for a deterministic chain: each
    # level's runner-up token (the likeliest target token where the draft's is rejected; see star/ahead.py)
    path: list[float] = field(default_factory=list)  # set by the draft, for a deterministic chain: each level's
    # path log-probability (where min_path_prob would stop it; bench/depth_replay.py records it)


def chain_levels(path: list[float], min_path_prob: float) -> int:
    """The levels a chain with these path log-probabilities (one a level) drafts when it stops below
    min_path_prob: the level that falls below it is the last (Expansion.wants_more).

    >>> chain_levels([-0.1, -0.5, -1.5, -3.0], 0.3), chain_levels([-0.1, -0.5], 0.0)
    (3, 2)
    """
    floor = math.log(min_path_prob) if min_path_prob > 0 else -math.inf
    return next((k + 1 for k, score in enumerate(path) if score < floor), len(path))


@dataclass(frozen=True)
class Pass:
    """The shape of one forward pass of a draft, to measure it against the bare model."""

    rows: int  # batch rows
    tokens: int  # tokens per row (padded to the widest)
    past: int  # columns attended before the pass's own
    heads: int  # hidden states the LM head read


@dataclass
class _Node:
    token: int
    parent: int  # index into the candidate list, ROOT for the first level
    score: float  # cumulative draft log-probability of the path
    depth: int
    column: int = -1  # batch column once the node has been fed to the model
    feature: torch.Tensor | None = None  # EAGLE: the head's output at the node once fed: its children's input


@dataclass
class Expansion:
    """The growing tree of one job. Pure bookkeeping: the model runs elsewhere."""

    cfg: DraftConfig
    sampling: SamplingConfig
    generator: torch.Generator | None
    depth: int
    given: int = 0
    nodes: list[_Node] = field(default_factory=list)
    frontier: list[int] = field(default_factory=list)
    qs: list[SparseQ] = field(default_factory=list)  # a sampled chain's: each level's q, one row
    level: int = 0
    root_feature: torch.Tensor | None = None  # EAGLE: the head's output at the last committed token
    second: list[int] = field(default_factory=list)  # a chain's runner-up token at each level

    def feature(self, node: int) -> torch.Tensor:
        """The feature fed with `node`: its parent's output (EAGLE)."""
        parent = self.nodes[node].parent
        return self.root_feature if parent == ROOT else self.nodes[parent].feature

    def grow_sampled(self, parent: int, logits: torch.Tensor) -> None:
        """A sampled chain's next node below `parent`, drawn from the draft's truncation of its
        warped logits [V] (SparseQ.truncate): exactly the q that goes with it to verification."""
        self.level += 1
        q = SparseQ.truncate(warp(logits, self.sampling)[None], self.cfg.sample_top_k, self.cfg.sample_top_p)
        self.qs.append(q)
        token = int(q.ids[0, sample(q.probs[0], self.generator)])
        self.nodes.append(_Node(token, parent, 0.0, self.level))
        self.frontier = [len(self.nodes) - 1]

    def grow_top(self, parents: list[int], logp: torch.Tensor, tokens: torch.Tensor) -> None:
        """top_k children below each of `parents` from their best log-probabilities and tokens
        [len(parents), >= top_k] (sorted, best first); the frontier becomes the top_k best of them."""
        self.level += 1
        k = self.cfg.top_k
        first = len(self.nodes)
        if k == 1 and len(parents) == 1 and tokens.shape[1] > 1:
            self.second.append(int(tokens[0, 1]))
        for p, lps, toks in zip(parents, logp[:, :k].tolist(), tokens[:, :k].tolist()):
            base = 0.0 if p == ROOT else self.nodes[p].score
            self.nodes += [_Node(t, p, base + lp, self.level) for lp, t in zip(lps, toks)]
        self.frontier = sorted(range(first, len(self.nodes)), key=lambda i: -self.nodes[i].score)[:k]

    def wants_more(self) -> bool:
        if self.level >= self.depth:
            return False
        if self.cfg.sample or self.cfg.min_path_prob <= 0 or self.level <= self.given:
            return True
        node = base = self.nodes[self.frontier[0]]
        while self.given and base.depth > self.given:  # the best path's node at the last given level
            base = self.nodes[base.parent]
        return node.score - (base.score if self.given else 0.0) >= math.log(self.cfg.min_path_prob)

    def tree(self) -> DraftTree:
        if self.cfg.sample:
            return DraftTree.chain([n.token for n in self.nodes], SparseQ.cat(self.qs))
        # Re-rank every candidate by its path score. A child never outscores its parent and a stable
        # sort keeps parents (created first) ahead of children on ties, so the kept set is a tree.
        order = sorted(range(len(self.nodes)), key=lambda i: -self.nodes[i].score)[: self.cfg.max_nodes]
        kept = sorted(order)
        index = {old: new for new, old in enumerate(kept)}
        tokens = torch.tensor([self.nodes[i].token for i in kept], dtype=torch.long)
        parents = torch.tensor([index.get(self.nodes[i].parent, -1) for i in kept], dtype=torch.long)
        return DraftTree(tokens, parents)


class Drafter(LocalDrafting):
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.eagle = isinstance(model, EagleHead)
        self.passes: list[Pass] | None = None  # a list: every forward pass's shape is appended to it
        self.levels: deque[float] = deque(maxlen=9)  # ms a level of each recent draft, past its first level

    @property
    def level_ms(self) -> float:
        """What a drafted level has cost of late (the median over the last drafts, each draft's levels
        after its first: the first comes with ingesting the new tokens, a prompt for a stream's
        first draft; 0: none drafted yet). A stream drafting here takes it as its prior (spec_decode/decode.py)."""
        return statistics.median(self.levels) if self.levels else 0.0

    @property
    def device(self) -> torch.device:
        return fw.device_of(self.model)

    @property
    def taps(self) -> tuple[int, ...] | None:
        """The target features this drafter drafts from (None: none; see TargetModel.start)."""
        return self.model.taps if self.eagle else None

    def start(self, prompt_ids: list[int], cfg: DraftConfig | None = None, sampling: SamplingConfig | None = None,
              max_depth: int = 0) -> DraftSequence:
        """A sequence for `prompt_ids`. The first draft's settings are those of the Drafter
        interface (spec_decode/decode.py); in this process nothing can run beside the target's prefill.
        An EAGLE head's sequence starts at the second token, whose feature is the first's."""
        tokens = list(prompt_ids[1:] if self.eagle else prompt_ids)
        return DraftSequence(tokens, KV.allocate(self.model, 1, len(tokens) + 64))

    def propose(self, seq: DraftSequence, new_tokens: list[int], cfg: DraftConfig, sampling: SamplingConfig,
                generator: torch.Generator | None = None, max_depth: int = 1 << 30,
                deadline_ms: float | None = None, features: torch.Tensor | None = None) -> DraftTree:
        """Append `new_tokens` to the committed sequence and draft a tree below its last token,
        at most max_depth deep (the target's remaining budget less its bonus token). `deadline_ms`
        is for a remote drafter; a draft computed here costs the caller its own time either way.
        `features`: an EAGLE head's, as DraftJob.features."""
        return self.propose_batch([DraftJob(seq, new_tokens, cfg, sampling, generator, max_depth,
                                            features=features)])[0]

    @torch.inference_mode()
    def propose_batch(self, jobs: list[DraftJob], stop=None, done=None) -> list[DraftTree]:
        """Draft for several sequences at once: one forward pass per tree level for all of them.
        `stop()`, if given, is asked before every level after the first; True ends every draft there
        (each tree holds the levels drafted so far, and each sequence the state that goes with them).
        `done(i, tree)`, if given, is called with job i's draft as soon as it is whole (its chain stopped,
        or it reached its depth), before the others' later levels: a server replies to it then, and a
        draft one level deep does not wait for one ten deep beside it. On an error every sequence is
        left as it was, those already given to `done` too."""
        before = [(len(j.seq.tokens), j.seq.cached, j.seq.features) for j in jobs]
        try:
            return self._propose_batch(jobs, stop, done)
        except BaseException:  # leave every sequence as it was, so the caller may retry or isolate
            for job, (length, cached, features) in zip(jobs, before):
                del job.seq.tokens[length:]
                job.seq.cached = cached
                job.seq.kv.cut(cached)
                job.seq.kept = {}
                job.seq.features = features
            raise

    def _propose_batch(self, jobs: list[DraftJob], stop, done=None) -> list[DraftTree]:
        for job in jobs:
            job.seq.tokens.extend(job.new_tokens)
            if self.eagle:
                self._absorb(job)
            else:
                reuse(job.seq, job.new_tokens)
        roots: dict[int, torch.Tensor] = {}  # job -> the last output at its last committed token [H]
        for i, job in enumerate(jobs):  # prompts alone: no padding everyone else to their length
            if len(jobs) > 1 and (job.seq.cached == 0 or len(job.seq.tokens) - job.seq.cached > SOLO_INGEST):
                roots[i] = _Batch(self.model, [job], self.passes).ingest([0])[0]
        expansions = [Expansion(j.cfg, j.sampling, j.generator, max(1, min(j.cfg.depth, j.max_depth)), j.given)
                      for j in jobs]
        batch = _Batch(self.model, jobs, self.passes)
        rest = [i for i in range(len(jobs)) if i not in roots]
        if rest:
            roots.update(zip(rest, batch.ingest(rest)))
        hidden = torch.stack([roots[i] for i in range(len(jobs))])
        if self.eagle:
            for e, h in zip(expansions, hidden):
                e.root_feature = h
        _grow(expansions, list(range(len(jobs))), [[ROOT]] * len(jobs), _logits(self.model, hidden))
        start, fed = time.perf_counter(), 0
        given = set()  # jobs whose drafts went to `done`
        while active := [i for i, e in enumerate(expansions) if e.wants_more()]:
            if done is not None and len(active) + len(given) < len(jobs):
                for i in sorted(set(range(len(jobs))) - set(active) - given):
                    given.add(i)
                    done(i, expansions[i].tree())
            if stop is not None and stop():
                break
            batch.retire_all_but(active, expansions)
            parents = [expansions[i].frontier for i in active]
            _grow(expansions, active, parents, _logits(self.model, batch.feed(active, expansions)))
            fed += 1
        if fed:
            self.levels.append((time.perf_counter() - start) * 1e3 / fed)
        batch.retire_all_but([], expansions)
        for job, e in zip(jobs, expansions):
            job.second = e.second
            job.path = [n.score for n in e.nodes] if e.cfg.top_k == 1 and not e.cfg.sample else []
        return [e.tree() for e in expansions]

    def _absorb(self, job: DraftJob) -> None:
        """EAGLE: queue the new tokens' features behind the waiting ones, and forget the last
        draft's nodes (they are ingested again, from the target's features)."""
        seq = job.seq
        seq.kept = {}
        seq.kv.cut(seq.cached)
        width = self.model.feature_width
        rows = 0 if job.features is None else job.features.shape[0]
        if rows != len(job.new_tokens) and not (seq.cached == 0 and seq.features is None):
            raise ValueError(f"{len(job.new_tokens)} new tokens came with {rows} feature rows")
        if job.features is not None:
            if job.features.ndim != 2 or job.features.shape[1] != width:
                raise ValueError(f"features must be [rows, {width}], not {list(job.features.shape)}")
            lifted = self.model.lift(job.features.to(self.device))
            seq.features = lifted if seq.features is None else torch.cat([seq.features, lifted])
        waiting = 0 if seq.features is None else seq.features.shape[0]
        if waiting != len(seq.tokens) - seq.cached or not len(seq.tokens):
            raise ValueError(f"{len(seq.tokens) - seq.cached} tokens to ingest have {waiting} features")


def reuse(seq: DraftSequence, new_tokens: list[int]) -> None:
    """Move the keys and values of the last draft's nodes that the target accepted into place after
    the committed ones, and forget the rest. The last new token (recovered or bonus) is always
    ingested: its logits are the root of the next draft."""
    node = ROOT
    path = []
    for t in new_tokens[:-1]:
        node = seq.kept.get((node, t))
        if node is None:
            break
        path.append(node)
    seq.kept = {}
    if path:
        seq.kv.copy_columns(0, torch.tensor(path), seq.kv, 0, at=seq.cached)
        seq.cached += len(path)
    seq.kv.cut(seq.cached)


def _logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """[..., H] outputs -> [..., V] float32 logits, by the LM's head or an EAGLE head's."""
    return model.logits(hidden) if isinstance(model, EagleHead) else fw.lm_head(model, hidden)


def _grow(expansions: list[Expansion], jobs: list[int], parents: list[list[int]], logits: torch.Tensor) -> None:
    """Grow each job's tree below its parents from their logits [sum of len(parents), V], with one
    log-softmax and top-k over all rows of deterministic drafts."""
    k = max(2, max(expansions[i].cfg.top_k for i in jobs))  # a chain's runner-up too
    logp = logits.float().log_softmax(-1)
    top = logp.topk(k, dim=-1)
    row = 0
    for i, ps in zip(jobs, parents):
        e = expansions[i]
        if e.cfg.sample:
            e.grow_sampled(ps[0], logits[row])
        else:
            e.grow_top(ps, top.values[row:row + len(ps)], top.indices[row:row + len(ps)])
        row += len(ps)


class _Batch:
    """One draft pass over several jobs' sequences: the batch KV and what each row's columns mean.

    Invariants, all owned here:
    - kv: the committed columns [0, start[i]) of job i's sequence, copied to row row[i] (a batch of
      one works in the sequence's own KV: nothing is copied); every pass appends columns for all rows.
    - visible[row[i]]: the columns that hold job i's committed context (its prefix and ingest).
    - ingested[i]: the batch columns of the tokens job i ingested, in order; its nodes' columns
      are on the nodes (Expansion.nodes[n].column).
    - ancestry[n]: for fed node slot n, the tree columns it attends to (its ancestors and itself).
    - row[i] exists until job i is retired: its new columns copied back to its sequence."""

    def __init__(self, model, jobs: list[DraftJob], passes: list[Pass] | None):
        self.model = model
        self.jobs = jobs
        self.passes = passes
        self.start = [j.seq.cached for j in jobs]
        width = max(self.start)
        fresh = max(len(j.seq.tokens) - j.seq.cached for j in jobs)
        levels = max(max(1, min(j.cfg.depth, j.max_depth)) for j in jobs)
        capacity = width + fresh + levels * max(j.cfg.top_k for j in jobs)  # a level feeds <= top_k nodes a row
        if len(jobs) == 1:
            self.kv = jobs[0].seq.kv
            self.kv.reserve(capacity)
        else:
            self.kv = KV.allocate(model, len(jobs), capacity)
            self.kv.gather([j.seq.kv for j in jobs], self.start)
        self.row = {i: i for i in range(len(jobs))}
        self.visible = torch.arange(capacity)[None, :] < torch.tensor(self.start)[:, None]  # [rows, capacity]
        self.ingested: dict[int, list[int]] = {i: [] for i in range(len(jobs))}
        self.ancestry = torch.zeros(1, capacity, dtype=torch.bool)  # slot 0: the root's (none)
        self.slot: dict[tuple[int, int], int] = {}  # (job, node) -> its ancestry slot
        self.fed: dict[int, list[int]] = {i: [] for i in range(len(jobs))}  # job -> its fed nodes, in order

    @property
    def shared(self) -> bool:
        return len(self.jobs) == 1

    def ingest(self, jobs: list[int]) -> list[torch.Tensor]:
        """Feed each job's uncached committed tokens (causally, padded to the longest), with their
        waiting features for an EAGLE head; return the output at each one's last token: [H] per job."""
        start = self.kv.length
        fresh = [self.jobs[i].seq.tokens[self.jobs[i].seq.cached:] for i in jobs]
        m = max(len(f) for f in fresh)
        rows = len(self.row)
        tokens = torch.zeros(rows, m, dtype=torch.long)
        positions = torch.zeros(rows, m, dtype=torch.long)
        attend = torch.zeros(rows, m, start + m, dtype=torch.bool)
        attend[:, :, start:] = torch.ones(m, m, dtype=torch.bool).tril()  # causal; padding sees itself
        features = self._features(rows, m)
        for i, f in zip(jobs, fresh):
            r = self.row[i]
            seq = self.jobs[i].seq
            tokens[r, :len(f)] = torch.tensor(f)
            positions[r] = seq.cached + torch.arange(m)
            attend[r, :, :start] = self.visible[r, :start]
            if features is not None:
                features[r, :len(f)] = seq.features
                seq.features = None
            self.visible[r, start:start + len(f)] = True
            self.ingested[i] = list(range(start, start + len(f)))
            seq.cached += len(f)
        hidden = self._forward(tokens, positions, attend, features, heads=len(jobs))
        return [hidden[self.row[i], len(f) - 1] for i, f in zip(jobs, fresh)]

    def feed(self, jobs: list[int], expansions: list[Expansion]) -> torch.Tensor:
        """Feed each job's frontier nodes with tree attention (an EAGLE head: each with its parent's
        output, and keeps each node's own); return their outputs, job after job in frontier
        order: [sum of frontier sizes, H]."""
        start = self.kv.length
        width = max(len(expansions[i].frontier) for i in jobs)
        rows = len(self.row)
        q_row, q_col, q_parent, q_token, q_position, q_node = [], [], [], [], [], []
        for i in jobs:
            e = expansions[i]
            for j, n in enumerate(e.frontier):
                node = e.nodes[n]
                q_node.append(node)
                node.column = start + j
                q_row.append(self.row[i])
                q_col.append(j)
                q_parent.append(0 if node.parent == ROOT else self.slot[(i, node.parent)])
                q_token.append(node.token)
                q_position.append(self.jobs[i].seq.cached - 1 + node.depth)
                self.slot[(i, n)] = len(self.ancestry) + len(q_row) - 1
                self.fed[i].append(n)
        q_row = torch.tensor(q_row)
        q_col = torch.tensor(q_col)
        sees = self.ancestry[torch.tensor(q_parent)]  # [Q, capacity]: the parent's tree columns
        sees[torch.arange(len(q_row)), start + q_col] = True  # and its own column
        self.ancestry = torch.cat([self.ancestry, sees])
        tokens = torch.zeros(rows, width, dtype=torch.long)
        positions = torch.zeros(rows, width, dtype=torch.long)
        attend = torch.zeros(rows, width, start + width, dtype=torch.bool)
        attend[:, torch.arange(width), start + torch.arange(width)] = True  # padding sees itself: no NaN
        tokens[q_row, q_col] = torch.tensor(q_token)
        positions[q_row, q_col] = torch.tensor(q_position)
        attend[q_row, q_col] = (sees | self.visible[q_row])[:, :start + width]
        features = self._features(rows, width)
        if features is not None:
            features[q_row, q_col] = torch.stack([expansions[i].feature(n) for i in jobs for n in expansions[i].frontier])
        hidden = self._forward(tokens, positions, attend, features, heads=len(q_row))[q_row, q_col]
        if features is not None:
            for node, h in zip(q_node, hidden):
                node.feature = h
        return hidden

    def _features(self, rows: int, width: int) -> torch.Tensor | None:
        """Zeroed input features [rows, width, H] for an EAGLE head's pass (None for an LM)."""
        if not isinstance(self.model, EagleHead):
            return None
        weight = self.model.get_input_embeddings().weight
        return weight.new_zeros(rows, width, self.model.config.hidden_size)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor,
                 features: torch.Tensor | None, heads: int) -> torch.Tensor:
        if self.passes is not None:
            self.passes.append(Pass(tokens.shape[0], tokens.shape[1], self.kv.length, heads))
        if features is not None:
            return self.model.decode(self.kv, tokens, positions, attend, features)
        return fw.forward(self.model, self.kv, tokens, positions, attend)

    def retire_all_but(self, active: list[int], expansions: list[Expansion]) -> None:
        """Copy the new columns of every job not in `active` back to its sequence; once they are
        half the rows or more, drop their rows so that later levels compute only the growing ones."""
        done = [i for i in self.row if i not in active]
        if not done or (active and 2 * len(active) > len(self.row)):
            return
        for i in done:
            self._retire(i, expansions[i])
        if active:
            self.kv.select_rows(torch.tensor([self.row[i] for i in active]))
            self.visible = self.visible[[self.row[i] for i in active]]
        self.row = {i: r for r, i in enumerate(active)}

    def _retire(self, i: int, e: Expansion) -> None:
        """Job i's sequence keeps its ingested tokens as committed and its fed nodes after them."""
        seq = self.jobs[i].seq
        nodes = self.fed[i]
        if self.shared:  # the nodes already sit in the sequence's own KV
            column = {n: e.nodes[n].column for n in nodes}
        else:
            cols = self.ingested[i] + [e.nodes[n].column for n in nodes]
            seq.kv.reserve(self.start[i] + len(cols))
            self.kv.copy_columns(self.row[i], torch.tensor(cols, dtype=torch.long), seq.kv, 0, at=self.start[i])
            seq.kv.cut(self.start[i] + len(cols))
            column = {n: seq.cached + k for k, n in enumerate(nodes)}
        seq.kept = {(column.get(e.nodes[n].parent, ROOT), e.nodes[n].token): column[n] for n in nodes}
