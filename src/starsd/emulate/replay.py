"""Replay targets: remote target machines emulated on a machine that cannot run N target models.

A replay target runs no target model. For each prompt it holds the real target's greedy
continuation, recorded once with the real model (`record`, cached), so greedy verification accepts
exactly the draft tokens the real target would accept: greedy verification reads the target's argmax
only along the accepted path, and along it the argmax is the recording. For an EAGLE head, the real
target's features along the recording are recorded too (`record_features`, one pass over prompt and
continuation, cached beside the recording), and a replay target sends those. Each verify pass waits the
real target's verify latency for that many scored tokens, drawn from a LatencyProfile: measured
here for the real target (`measure_latency`), or supplied as JSON for other hardware. The draft
server they talk to is fully real. Every result produced with replay targets says so ("replay").
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from starsd.config import ModelConfig, SamplingConfig
from starsd.models import pinned
from starsd.models.loading import vocab_fingerprint
from starsd.prompts import Prompt
from starsd.spec_decode.tree import DraftTree, depths
from starsd.spec_decode.verify import Verdict
from starsd.theory.sysmodel import interpolate
from starsd.errors import SettingError


def _interpolate(points: dict[int, tuple[float, ...]], x: float) -> float:
    """Mean of the samples at x, interpolated between the measured xs."""
    return interpolate({k: statistics.fmean(v) for k, v in points.items()}, x)


@dataclass(frozen=True)
class LatencyProfile:
    """A target's latencies (ms): one verify pass by the number of tokens it scores (root + draft
    nodes, the "width"), and the prompt prefill by prompt length (optional: none means free).

    JSON: {"source": "...", "verify_ms": {"1": [samples...] or mean, "8": ...},
           "prefill_ms": {"120": [samples...] or mean, "400": ...}}."""

    verify_ms: dict[int, tuple[float, ...]]
    source: str = ""
    prefill_ms: dict[int, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self):
        if not self.verify_ms or min(self.verify_ms) < 1:
            raise SettingError("a latency profile needs verify_ms for scored widths >= 1")
        if any(not v or min(v) <= 0 for v in [*self.verify_ms.values(), *self.prefill_ms.values()]):
            raise SettingError("latencies must be positive")

    def mean(self, width: int) -> float:
        """Mean verify latency at `width`."""
        return _interpolate(self.verify_ms, width)

    def prefill(self, length: int) -> float:
        """Mean prefill latency of a prompt of `length` tokens (0 when the profile has none)."""
        return _interpolate(self.prefill_ms, length) if self.prefill_ms else 0.0

    def draw(self, width: int, rng: random.Random) -> float:
        """One latency: a sample of the nearest measured width, scaled to this width's mean."""
        near = min(self.verify_ms, key=lambda w: (abs(w - width), w))
        samples = self.verify_ms[near]
        return rng.choice(samples) * self.mean(width) / statistics.fmean(samples)

    def to_json(self) -> dict:
        return {"source": self.source, "verify_ms": {str(w): list(v) for w, v in sorted(self.verify_ms.items())},
                "prefill_ms": {str(n): list(v) for n, v in sorted(self.prefill_ms.items())}}

    @classmethod
    def from_json(cls, d: dict) -> LatencyProfile:
        def table(raw: dict) -> dict[int, tuple[float, ...]]:
            return {int(k): tuple(float(x) for x in (v if isinstance(v, list) else [v])) for k, v in raw.items()}

        try:
            return cls(table(d["verify_ms"]), str(d.get("source", "")), table(d.get("prefill_ms", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SettingError(f"not a latency profile ({e!r}): expected {{\"verify_ms\": {{width: ms}}}}") from None

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise SettingError(f"cannot read a latency profile from {path}: {e}") from None


@dataclass
class Recording:
    """The real target's greedy continuations of a prompt set, and what a target needs to say hello."""

    target: str
    dtype: str
    max_new_tokens: int
    fingerprint: str  # vocabulary fingerprint, checked by the draft server at hello
    vocab_size: int  # width of the target's logits
    eos_ids: list[int]
    prompts: dict[str, dict] = field(default_factory=dict)  # id -> {"prompt_ids": [...], "continuation": [...]}

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__))
        tmp.rename(path)

    @classmethod
    def load(cls, path: str | Path) -> Recording:
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise SettingError(f"cannot read a recording from {path}: {e}") from None


def recording_path(target_cfg: ModelConfig, prompts: list[Prompt], max_new_tokens: int,
                   cache: str | None = None) -> Path:
    key = json.dumps([target_cfg.path, target_cfg.dtype, *([target_cfg.engine] if target_cfg.engine != "transformers" else []), max_new_tokens, [(p.id, p.text, p.chat) for p in prompts]])
    return pinned.cache_root(cache) / "replay" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def record(target_cfg: ModelConfig, prompts: list[Prompt], max_new_tokens: int, cache: str | None = None,
           threads: int = 0, log=print) -> Recording:
    """The real target's greedy continuation of each prompt; computed once, then read from the cache."""
    path = recording_path(target_cfg, prompts, max_new_tokens, cache)
    if path.exists():
        return Recording.load(path)
    from starsd.models.pair import Pair  # transformers: only where the real target runs, not in replay hosts

    pair = Pair.load(target_cfg, None, cache, threads)
    width = pair.target.width
    rec = Recording(target_cfg.path, target_cfg.dtype, max_new_tokens, vocab_fingerprint(pair.tokenizer, width),
                    width, sorted(pair.eos_ids))
    for i, prompt in enumerate(prompts):
        gen = pair.generate(prompt, max_new_tokens, SamplingConfig(), None)
        rec.prompts[prompt.id] = {"prompt_ids": prompt.encode(pair.tokenizer), "continuation": gen.token_ids}
        log(f"recorded {prompt.id} ({i + 1}/{len(prompts)}): {len(gen.token_ids)} tokens in {gen.seconds:.1f} s")
    rec.save(path)
    return rec


def features_path(recording_file: str | Path, taps: tuple[int, ...]) -> Path:
    """Where the features of these taps for a recording are kept: beside it."""
    key = "-".join(map(str, taps)) or "last"
    return Path(str(recording_file)).with_suffix(f".features-{key}.safetensors")


def record_features(target_cfg: ModelConfig, rec: Recording, recording_file: str | Path, taps: tuple[int, ...],
                    cache: str | None = None, threads: int = 0, log=print) -> Path:
    """The real target's features (models/eagle.py: `taps`) at every position of each recorded
    prompt and continuation, in bfloat16, from one pass over both; computed once, then cached."""
    from safetensors.torch import save_file

    from starsd.models.pair import Pair

    path = features_path(recording_file, taps)
    if path.exists():
        return path
    target = Pair.load(target_cfg, None, cache, threads).target
    out = {}
    for i, (pid, p) in enumerate(rec.prompts.items()):
        ids = p["prompt_ids"] + p["continuation"]
        seq = target.start(ids + [ids[-1]], taps)  # every token of ids is prefilled: a feature each
        out[pid] = seq.features.to(torch.bfloat16).contiguous()
        log(f"recorded features of {pid} ({i + 1}/{len(rec.prompts)}): {len(ids)} positions")
    tmp = path.with_suffix(".tmp")
    save_file(out, str(tmp))
    tmp.rename(path)
    return path


def load_features(recording_file: str | Path, taps: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """record_features' file for these taps: prompt id -> [positions, F]."""
    from safetensors.torch import load_file

    path = features_path(recording_file, taps)
    if not path.exists():
        raise SettingError(f"no recorded features for taps {taps} ({path}): the draft server drafts with an EAGLE "
                         "head; record them first (bench ... --eagle does)")
    return load_file(str(path))


def measure_latency(target, prompts: list[list[int]], widths: list[int], reps: int = 4,
                    source: str = "") -> LatencyProfile:
    """Time the real target's prompt prefill (each prompt, twice) and its verify pass (a chain of
    width-1 draft tokens, after the first prompt) at each width. Widths are interleaved round by
    round; a sample over twice its width's median is dropped as a disturbance from another process
    (a machine shared with other work)."""
    prefill: dict[int, list[float]] = {}
    for ids in [prompts[0], *prompts, *prompts]:  # the first prefill warms up and is dropped
        t0 = time.perf_counter()
        target.start(ids)
        prefill.setdefault(len(ids), []).append((time.perf_counter() - t0) * 1e3)
    prefill[len(prompts[0])].pop(0)
    prompt_ids = prompts[0]
    seq = target.start(prompt_ids)
    filler = prompt_ids[-1]
    samples: dict[int, list[float]] = {w: [] for w in widths}
    for rep in range(-2, reps):  # two rounds warm up and are dropped
        for w in widths:
            t0 = time.perf_counter()
            target.score(seq, DraftTree.chain([filler] * (w - 1)))
            ms = (time.perf_counter() - t0) * 1e3
            target.commit(seq, Verdict([], [filler]))
            if rep >= 0:
                samples[w].append(ms)
    kept = {w: tuple(x for x in v if x <= 2 * statistics.median(v)) for w, v in samples.items()}
    return LatencyProfile(kept, source, {n: tuple(v) for n, v in prefill.items()})


@dataclass
class ReplaySequence:
    tokens: list[int]  # prompt + committed
    continuation: list[int]  # the real target's greedy continuation
    position: int = 0  # continuation tokens committed so far
    recorded: torch.Tensor | None = None  # [positions, F]: the real target's features along prompt + continuation
    features: torch.Tensor | None = None  # those of the last pass, as TargetSequence.features
    pass_ms: float | None = None  # its own share of its last scoring pass: None, all of it


class ReplayTarget:
    """The TargetModel interface (start / score / commit), answered from a recording.

    Greedy only: a sampled target's choices cannot be replayed."""

    device = torch.device("cpu")  # its logits are built here

    def __init__(self, recording: Recording, latency: LatencyProfile, seed: int = 0,
                 features: dict[str, torch.Tensor] | None = None):
        self.vocab_size = recording.vocab_size
        self.latency = latency
        self.rng = random.Random(seed)
        self.by_prompt = {tuple(p["prompt_ids"]): (pid, p["continuation"]) for pid, p in recording.prompts.items()}
        self.recorded = features  # prompt id -> features (load_features), for an EAGLE head
        self.verify_ms: list[float] = []  # every latency waited, for reports

    def start(self, prompt_ids: list[int], taps: tuple[int, ...] | None = None) -> ReplaySequence:
        """Waits the target's prefill of a prompt this long."""
        pid, cont = self.by_prompt.get(tuple(prompt_ids), (None, None))
        if cont is None:
            raise SettingError("this prompt is not in the recording")
        seq = ReplaySequence(list(prompt_ids), cont)
        if taps is not None:
            if self.recorded is None:
                raise SettingError("this replay target has no recorded features for an EAGLE head")
            seq.recorded = self.recorded[pid]
            seq.features = seq.recorded[:len(prompt_ids) - 1]
        time.sleep(self.latency.prefill(len(prompt_ids)) / 1e3)
        return seq

    def score(self, seq: ReplaySequence, tree: DraftTree, taps: tuple[int, ...] | None = None) -> torch.Tensor:
        """Logits [n+1, V] whose argmax after each node is the recorded token at that depth; waits
        the verify latency of n+1 scored tokens. With taps, seq.features: the recorded features of
        the root and of each node on the recorded path (zeros off it: never accepted, never sent)."""
        t0 = time.perf_counter()
        if taps is not None:
            seq.features = _features_along(seq, tree)
        wait_s = self.latency.draw(len(tree) + 1, self.rng) / 1e3
        at = seq.position + torch.cat([torch.zeros(1, dtype=torch.long), depths(tree.parents)])
        cont = torch.tensor(seq.continuation + [0], dtype=torch.long)
        best = cont[at.clamp(max=len(seq.continuation))]  # past the recording: never on an accepted path
        logits = torch.zeros(len(tree) + 1, self.vocab_size)
        logits[torch.arange(len(tree) + 1), best] = 1.0
        self.verify_ms.append(wait_s * 1e3)
        time.sleep(max(0.0, wait_s - (time.perf_counter() - t0)))
        return logits

    def commit(self, seq: ReplaySequence, verdict: Verdict) -> None:
        want = seq.continuation[seq.position:seq.position + len(verdict.tokens)]
        if verdict.tokens != want:
            raise RuntimeError("replay diverged from the recording: replay targets verify greedily only")
        seq.tokens.extend(verdict.tokens)
        seq.position += len(verdict.tokens)


def _features_along(seq: ReplaySequence, tree: DraftTree) -> torch.Tensor:
    """[n+1, F]: the recorded feature of the root and of each node on the recorded path, zeros elsewhere."""
    root = len(seq.tokens) - 1
    out = seq.recorded.new_zeros(len(tree) + 1, seq.recorded.shape[1])
    out[0] = seq.recorded[root]
    on_path: list[bool] = []
    for j, (token, parent, depth) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(),
                                                   depths(tree.parents).tolist())):
        at = seq.position + depth - 1
        on_path.append((parent < 0 or on_path[parent]) and at < len(seq.continuation) and seq.continuation[at] == token)
        if on_path[j] and root + depth < len(seq.recorded):
            out[j + 1] = seq.recorded[root + depth]
    return out
