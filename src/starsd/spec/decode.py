"""The decoding loops: target-only, and speculative (draft -> verify -> accept).

Both loops share the target's forward pass and the sampling code, so greedy speculative output can
be compared token for token with target-only output. They work on interfaces, not on models:
a target has `device`, `start`, `score` and `commit` (models.target.TargetModel, or a replay
target); a drafter has `device`, `start` and `propose` (models.drafter.Drafter in this process,
star.client.RemoteDrafter on a draft server). Each random generator lives on the device of the
tensors it draws for."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from starsd.config import DraftConfig, SamplingConfig
from starsd.spec.depth import DepthPolicy
from starsd.spec.tree import DraftTree
from starsd.spec.verify import Verdict, make_generator, next_token, verify


@dataclass
class Generation:
    """What one request produced. token_ids excludes the prompt and includes a final EOS if hit."""

    token_ids: list[int]
    num_steps: int  # target forward passes after the prefill
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted at each verify step
    seconds: float = 0.0
    trace: list[tuple[float, int]] = field(default_factory=list)  # (unix time a step ended, tokens it emitted)
    depths: list[int] = field(default_factory=list)  # depth of each step's draft (0: the step decoded alone)
    asked: list[int] = field(default_factory=list)  # depth asked of the drafter each step (0: not asked)

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per step that had a draft."""
        drafted = [a for a, d in zip(self.accepted, self.depths) if d] if self.depths else self.accepted
        return sum(drafted) / len(drafted) if drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


def clip(tokens: list[int], budget: int, eos_ids: frozenset[int]) -> tuple[list[int], bool]:
    """Cut emitted tokens at the budget and just after the first EOS; say whether decoding ends."""
    out = []
    for t in tokens[:budget]:
        out.append(t)
        if t in eos_ids:
            return out, True
    return out, len(out) >= budget


def require_prompt(prompt_ids: list[int]) -> None:
    if not prompt_ids:
        raise ValueError("empty prompt: at least one token is needed to condition on")


def target_only(target, prompt_ids: list[int], max_new_tokens: int,
                sampling: SamplingConfig, eos_ids: frozenset[int] = frozenset(),
                deadline: float = math.inf) -> Generation:
    require_prompt(prompt_ids)
    t0 = time.perf_counter()
    gen = make_generator(sampling.seed, target.device)
    seq = target.start(prompt_ids)
    out: list[int] = []
    trace: list[tuple[float, int]] = []
    steps = 0
    done = max_new_tokens <= 0
    while not done:
        logits = target.score(seq, DraftTree.empty())
        steps += 1
        emitted, done = clip([next_token(logits[0], sampling, gen)], max_new_tokens - len(out), eos_ids)
        out += emitted
        trace.append((time.time(), len(emitted)))
        done = done or trace[-1][0] > deadline
        if not done:
            target.commit(seq, Verdict([], emitted))
    return Generation(out, steps, seconds=time.perf_counter() - t0, trace=trace)


def speculative(target, drafter, prompt_ids: list[int], max_new_tokens: int,
                draft_cfg: DraftConfig, sampling: SamplingConfig,
                eos_ids: frozenset[int] = frozenset(), deadline: float = math.inf,
                policy: DepthPolicy | None = None) -> Generation:
    """Draft -> verify -> accept until the budget, an EOS, or the first step ending past `deadline`
    (unix s; the generation so far is returned). With draft_cfg.adaptive a DepthPolicy picks each
    step's depth, 0 meaning no draft: the committed tokens then go to the drafter with the next one.
    Pass one `policy` to every generation of a stream, so that what it learnt carries over."""
    require_prompt(prompt_ids)
    t0 = time.perf_counter()
    verify_gen = make_generator(sampling.seed, target.device)
    draft_gen = make_generator(sampling.seed + 1, drafter.device)
    if not draft_cfg.adaptive:
        policy = None
    elif policy is None or policy.max_depth != draft_cfg.depth:
        policy = DepthPolicy(draft_cfg.depth)
    seq = target.start(prompt_ids)
    dseq = drafter.start(prompt_ids)
    new_tokens: list[int] = []  # committed, not yet given to the drafter
    out: list[int] = []
    accepted: list[int] = []
    depths: list[int] = []
    asked: list[int] = []
    trace: list[tuple[float, int]] = []
    done = max_new_tokens <= 0
    while not done:
        budget = max_new_tokens - len(out)  # at most budget tokens come out: budget-1 drafted + 1
        depth = policy.choose(budget - 1) if policy else min(draft_cfg.depth, budget - 1)
        draft_ms = None
        if depth > 0:
            t_draft = time.perf_counter()
            tree = drafter.propose(dseq, new_tokens, draft_cfg, sampling, draft_gen, max_depth=depth)
            draft_ms = (time.perf_counter() - t_draft) * 1e3
            new_tokens = []
            tree = tree.truncate(depth)
        else:
            tree = DraftTree.empty()
        t_verify = time.perf_counter()
        logits = target.score(seq, tree)
        verdict = verify(tree, logits, sampling, verify_gen)
        if policy:
            policy.observe(tree.depth(), verdict.num_accepted, draft_ms, len(tree) + 1,
                           (time.perf_counter() - t_verify) * 1e3)
        accepted.append(verdict.num_accepted)
        depths.append(tree.depth())
        asked.append(depth)
        emitted, done = clip(verdict.tokens, budget, eos_ids)
        out += emitted
        trace.append((time.time(), len(emitted)))
        done = done or trace[-1][0] > deadline
        if not done:
            target.commit(seq, verdict)
            new_tokens += verdict.tokens
    return Generation(out, len(accepted), accepted, time.perf_counter() - t0, trace, depths, asked)
