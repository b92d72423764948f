"""An emulated draft host: a draft server answering from a recording of the real draft model.

Each draft comes after the real server's measured service time, so that a target keeps every core
of this machine, as on a host of its own (as replay targets emulate target hosts: replay.py).
- `record` drafts, with the real drafter, from every prefix of each prompt's target-only greedy
  output: the chain a request there gets (the server's chain rule, DraftConfig's depth and
  min_path_prob), each level's runner-up (for pre-drafting) and every draft's time. A greedy
  target only ever asks there (lossless), and a shallower chain is a prefix of the recorded one.
- `RecordedDrafter` answers from the recording and sleeps what the real drafter took, by a cost
  fitted to the recorded timings (`Cost`: a fixed part, per ingested token, per drafted level),
  yielding between levels to a request as the real drafter does. A context not on the recording
  (a missed pre-draft, a stream parted at a near-tie) gets an empty draft after the cost of its
  levels (`misses`). A batch is charged a level at the real drafter's cost for that batch size,
  measured when recording (`batch_scale`), and its ingest as its streams' tokens together.
- `starsd draft-server --recording FILE`: the real server (protocol, sessions, batching,
  pre-drafting, transport) around the recorded drafter, running for real on the target's cores.
Figures: docs/benchmarks.md#a-draft-host-of-its-own-emulated.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from starsd.config import DraftConfig, SamplingConfig
from starsd.errors import SettingError
from starsd.models.drafter import DraftJob, Drafter, chain_levels
from starsd.spec_decode.tree import DraftTree


def _key(tokens: list[int]) -> str:
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int32).tobytes(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class Cost:
    """What the real drafter took for one draft of one stream (ms): `fixed` + `per_token` x (tokens
    ingested - 1) + `per_level` x levels drafted, fitted by least squares to the recorded drafts; and
    a level of a batch of b streams, `batch[b - 1]` times one stream's (measured for a few sizes,
    by a line through the last two beyond; none measured: b times)."""

    fixed: float
    per_token: float
    per_level: float
    source: str = ""
    batch: tuple[float, ...] = ()

    def ms(self, ingested: int, levels: int) -> float:
        return max(0.0, self.fixed + self.per_token * max(0, ingested - 1) + self.per_level * levels)

    def level_ms(self, streams: int) -> float:
        """A drafted level of a batch of `streams`."""
        b = self.batch
        if not b:
            return self.per_level * streams
        if streams <= len(b):
            return self.per_level * b[streams - 1]
        slope = b[-1] - b[-2] if len(b) > 1 else b[-1]
        return self.per_level * (b[-1] + slope * (streams - len(b)))

    @classmethod
    def fit(cls, samples: list[tuple[int, int, float]], source: str) -> Cost:
        """From (tokens ingested, levels drafted, ms) samples: prompts' first drafts and single steps."""
        x = np.array([[1.0, max(0, n - 1), levels] for n, levels, _ in samples])
        y = np.array([ms for _, _, ms in samples])
        fixed, per_token, per_level = np.linalg.lstsq(x, y, rcond=None)[0]
        return cls(float(fixed), float(per_token), float(per_level), source)


@dataclass
class Recording:
    """Chains by context (the whole committed sequence), with the service time's fitted cost."""

    chains: dict[str, tuple]  # context key -> (chain, each level's runner-up, each level's path log-probability)
    cost: Cost
    depth: int  # the recorded chains' depth limit: requests may ask for this much at most
    min_path_prob: float  # the chain rule's, recorded: a request stopping lower gets no draft
    samples: list[tuple[int, int, float]]

    def chain(self, context: list[int], depth: int, given: int = 0,
              stop: float | None = None) -> tuple[list[int], list[int]] | None:
        """The real drafter's chain below `context`, `depth` levels at most, stopping below `stop` (the
        request's min_path_prob; None: the recorded one), and its runner-ups; with `given` = 1 (a
        pre-draft of a whole chain's bonus guess) the first level is the draft's best and the chain
        rule counts the levels below it. None where the recording has no such context, or cannot
        tell where the chain stops: below the recorded threshold, or at another one where it kept no
        path probabilities (recordings before they were kept)."""
        got = self.chains.get(_key(context))
        if got is None or not got[0]:
            return None
        if not given:
            return self._cut(got, depth, stop)
        below = self.chains.get(_key(context + got[0][:1]))
        cut = None if below is None else self._cut(below, depth - 1, stop)
        if cut is None:
            return None
        return got[0][:1] + cut[0], got[1][:1] + cut[1]

    def _cut(self, got: tuple, depth: int, stop: float | None) -> tuple[list[int], list[int]] | None:
        if stop is None or stop == self.min_path_prob:
            return got[0][:depth], got[1][:depth]
        if stop < self.min_path_prob or len(got) < 3:
            return None
        n = min(depth, chain_levels(got[2], stop))
        return got[0][:n], got[1][:n]

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"depth": self.depth, "min_path_prob": self.min_path_prob,
                                          "cost": asdict(self.cost), "samples": self.samples, "chains": self.chains}))

    @classmethod
    def load(cls, path: str | Path) -> Recording:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SettingError(f"cannot read the recording {path}: {e}") from None
        cost = Cost(**{**d["cost"], "batch": tuple(d["cost"].get("batch", ()))})
        return cls({k: tuple(v) for k, v in d["chains"].items()}, cost, d["depth"],
                   d["min_path_prob"], [tuple(s) for s in d["samples"]])


def record(drafter: Drafter, paths: list[tuple[list[int], list[int]]], cfg: DraftConfig, source: str) -> Recording:
    """Draft with the real drafter below every prefix of each (prompt, target-only output): the prompt
    first (a new stream's first request), then one output token at a time, as a server's session
    would be asked; time each draft. Each chain keeps its levels' path probabilities, so that a
    request that stops higher than `cfg` gets the chain the real drafter would have stopped."""
    chains: dict[str, tuple] = {}
    samples = []
    for prompt, output in paths:
        seq = drafter.start(prompt)
        for i in range(len(output) + 1):
            new = [] if i == 0 else [output[i - 1]]
            ingested = len(seq.tokens) - seq.cached + len(new)
            job = DraftJob(seq, new, cfg, SamplingConfig())
            start = time.perf_counter()
            tree = drafter.propose_batch([job])[0]
            ms = (time.perf_counter() - start) * 1e3
            chain = tree.tokens.tolist()
            chains[_key(prompt + output[:i])] = (chain, job.second[:len(chain)], job.path[:len(chain)])
            if i != 1:  # the first step after a prompt pays for the model's first touch of a new length
                samples.append((ingested, len(chain), ms))
    cost = replace(Cost.fit(samples, source), batch=batch_scale(drafter, paths[0][0], cfg))
    return Recording(chains, cost, cfg.depth, cfg.min_path_prob, samples)


def batch_scale(drafter: Drafter, prompt: list[int], cfg: DraftConfig, sizes: int = 4, depth: int = 4,
                repeats: int = 3) -> tuple[float, ...]:
    """A drafted level's cost for batches of 1..`sizes` streams, relative to one stream's: the real
    drafter drafting `depth` levels and one level for each batch (copies of `prompt`, a token a step),
    the difference per level, the median of `repeats`."""
    level_cfg = replace(cfg, depth=depth, min_path_prob=0.0)
    seqs = [drafter.start(prompt) for _ in range(sizes)]
    for seq in seqs:
        drafter.propose_batch([DraftJob(seq, [], level_cfg, SamplingConfig())])
    per_level = []
    for b in range(1, sizes + 1):
        times = []
        for _ in range(repeats):
            ms = {}
            for levels in (1, depth):
                jobs = [DraftJob(seq, [seq.tokens[-1]], replace(level_cfg, depth=levels), SamplingConfig())
                        for seq in seqs[:b]]
                start = time.perf_counter()
                drafter.propose_batch(jobs)
                ms[levels] = (time.perf_counter() - start) * 1e3
            times.append(max(0.0, ms[depth] - ms[1]) / (depth - 1))
        per_level.append(sorted(times)[len(times) // 2])
    return tuple(round(t / max(per_level[0], 1e-6), 3) for t in per_level)


class RecordedDrafter(Drafter):
    """The Drafter interface, answered from a Recording after its cost in time: no draft compute.
    `model` is the real draft model, for what the server sizes by it (its KV per token). Its sequences
    start as the real drafter's (Drafter.start) and their KV grows as its does, unwritten: the server
    budgets, evicts, shares prefixes into and clones them for pre-drafts as it would the real ones. A
    64-column KV whatever the prompt took a shared prefix's columns past its end, and every pre-draft
    of that session failed (bench vllm's star-remote: 31 failures in one run)."""

    def __init__(self, model: torch.nn.Module, recording: Recording):
        super().__init__(model)
        self.recording = recording
        self.misses = 0
        self.drafts = 0

    def _propose_batch(self, jobs: list[DraftJob], stop, done=None) -> list[DraftTree]:
        ingested = 0
        chains, own = [], []
        levels = 1
        for job in jobs:
            seq = job.seq
            seq.tokens.extend(job.new_tokens)
            # a prompt is ingested whole; a step ingests its last token (the accepted ones' keys and
            # values were computed while drafting them: models/drafter.py, reuse)
            ingested += len(seq.tokens) if not seq.cached else min(1, len(job.new_tokens))
            seq.cached = len(seq.tokens)
            depth = max(1, min(job.cfg.depth, job.max_depth))
            seq.kv.reserve(seq.cached + depth)  # the committed tokens' columns and the draft's, as the real
            seq.kv.cut(seq.cached)  # drafter's (its first chain's nodes)
            got = None
            rec = self.recording
            if not job.cfg.sample and job.cfg.top_k == 1 and depth <= rec.depth + job.given:
                got = rec.chain(seq.tokens, depth, job.given, job.cfg.min_path_prob)
            self.drafts += 1
            if got is None:
                self.misses += 1
                got = ([], [])
            chains.append(got)
            own.append(len(got[0]) or depth)  # the levels this job's draft takes
            levels = max(levels, own[-1])
        cost = self.recording.cost
        level_ms = cost.level_ms(len(jobs))
        time.sleep(max(0.0, cost.ms(ingested, 0) + level_ms) / 1e3)  # the ingest and the first level
        drafted = 1
        given = set()
        while drafted < levels and not (stop is not None and stop()):
            for i, ((chain, _), n) in enumerate(zip(chains, own)):  # whole before the deepest: given now, as
                if done is not None and i not in given and n <= drafted:  # the real drafter does
                    given.add(i)
                    done(i, DraftTree.chain(chain[:drafted]))
            time.sleep(level_ms / 1e3)
            drafted += 1
        trees = []
        for job, (chain, second) in zip(jobs, chains):
            job.second = second[:drafted]
            trees.append(DraftTree.chain(chain[:drafted]))
        return trees
