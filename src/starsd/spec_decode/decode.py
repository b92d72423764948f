"""The decoding loops: target-only, and speculative (draft -> verify -> accept).

Both loops share the target's forward pass and the sampling code, so greedy speculative output can
be compared token for token with target-only output. They work on interfaces, not on models:
a target has `device`, `start`, `score` and `commit` (models.target.TargetModel, or a replay
target), and the sequence its `start` returns has `pass_ms`, the stream's share of its last
scoring pass where the engine shares passes among streams (None: the pass was the stream's own,
and the loop's clock tells its cost); a drafter is a DraftSource (spec_decode/drafting.py: models.drafter.Drafter in this process,
star.remote_drafter.RemoteDrafter on a draft server), and may say it is `asynchronous`: a draft
can then be asked without waiting, on a step that decodes alone, and taken at a later step as far
as it still follows what was committed meanwhile (its sequence's `behind` says how late the draft
it gave is; the drafter's `lateness` how many tokens such drafts usually come after their ask, and
its `server_ms` the server's own time on one, over the prompts so far). A drafter whose `taps` is
not None drafts from the target's features (an EAGLE head): each committed token goes to it with
the target's feature of the position before it. `start` is told the first step's
draft before the target's prefill, so that a remote drafter can draft while the target prefills (a
remote one is told it as a draft asked ahead: none where the server would answer too late to pay).
Each random generator lives on the device of the tensors it draws for."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from starsd.config import DraftConfig, SamplingConfig
from starsd.spec_decode.depth import Decision, DepthPolicy, Source
from starsd.spec_decode.drafting import DraftSource
from starsd.spec_decode.tree import DraftTree
from starsd.spec_decode.verify import Verdict, make_generator, next_token, verify
from starsd.errors import SettingError


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
    prefilled: float = 0.0  # unix time the target's prefill ended (0: no step)

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per step that had a draft."""
        drafted = [a for a, d in zip(self.accepted, self.depths) if d] if self.depths else self.accepted
        return sum(drafted) / len(drafted) if drafted else 0.0

    @property
    def decoding_s(self) -> float:
        """Seconds from the end of the prefill to the last step (the decoding alone; 0: no step)."""
        return self.trace[-1][0] - self.prefilled if self.trace else 0.0

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
        raise SettingError("empty prompt: at least one token is needed to condition on")


@dataclass(frozen=True)
class Step:
    """One target step of a stream: the tokens it emitted (accepted drafts + one more, cut at the
    budget or an EOS) and its draft's figures."""

    tokens: list[int]
    accepted: int = 0  # drafted tokens the target accepted
    depth: int = 0  # depth of the draft it verified (0: the step decoded alone)
    asked: int = 0  # depth asked of the drafter (0: not asked)
    end: float = 0.0  # unix time the step ended
    prefilled: float = 0.0  # unix time the stream's prefill ended


def collect(steps, deadline: float = math.inf) -> Generation:
    """Run a stream of Steps to its end, or to the first step ending past `deadline` (unix s)."""
    t0 = time.perf_counter()
    gen = Generation([], 0)
    for step in steps:
        gen.token_ids += step.tokens
        gen.num_steps += 1
        gen.accepted.append(step.accepted)
        gen.depths.append(step.depth)
        gen.asked.append(step.asked)
        gen.trace.append((step.end, len(step.tokens)))
        gen.prefilled = step.prefilled
        if step.end > deadline:
            break
    gen.seconds = time.perf_counter() - t0
    return gen


def target_only(target, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig,
                eos_ids: frozenset[int] = frozenset(), deadline: float = math.inf) -> Generation:
    return collect(target_only_steps(target, prompt_ids, max_new_tokens, sampling, eos_ids), deadline)


def speculative(target, drafter: DraftSource, prompt_ids: list[int], max_new_tokens: int,
                draft_cfg: DraftConfig, sampling: SamplingConfig, eos_ids: frozenset[int] = frozenset(),
                deadline: float = math.inf, policy: DepthPolicy | None = None) -> Generation:
    """The whole generation of speculative_steps, or its steps up to the first ending past `deadline`."""
    return collect(speculative_steps(target, drafter, prompt_ids, max_new_tokens, draft_cfg, sampling, eos_ids,
                                     policy), deadline)


def target_only_steps(target, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig,
                      eos_ids: frozenset[int] = frozenset()) -> Iterator[Step]:
    """Decode one token per target step. A consumer that stops iterating ends the stream."""
    require_prompt(prompt_ids)
    gen = make_generator(sampling.seed, target.device)
    seq = target.start(prompt_ids)
    prefilled = time.time()
    produced = 0
    done = max_new_tokens <= 0
    while not done:
        logits = target.score(seq, DraftTree.empty())
        emitted, done = clip([next_token(logits[0], sampling, gen)], max_new_tokens - produced, eos_ids)
        produced += len(emitted)
        yield Step(emitted, end=time.time(), prefilled=prefilled)
        if not done:
            target.commit(seq, Verdict([], emitted))


def speculative_steps(target, drafter: DraftSource, prompt_ids: list[int], max_new_tokens: int,
                      draft_cfg: DraftConfig, sampling: SamplingConfig, eos_ids: frozenset[int] = frozenset(),
                      policy: DepthPolicy | None = None) -> Iterator[Step]:
    """Draft -> verify -> accept until the budget or an EOS, one Step per target pass; a consumer
    that stops iterating ends the stream. With draft_cfg.adaptive a DepthPolicy picks each step's
    depth, 0 meaning no draft: the committed tokens then go to the drafter with the next one. It
    also gives each draft a deadline (spec_decode/depth.py): a draft that misses it comes back empty from
    a remote drafter, and that step decodes alone. Pass one `policy` to every generation of a
    stream, so that what it learnt carries over."""
    require_prompt(prompt_ids)
    verify_gen = make_generator(sampling.seed, target.device)
    draft_gen = make_generator(sampling.seed + 1, drafter.device)
    if not draft_cfg.adaptive:
        policy = None
    elif policy is None or policy.max_depth != draft_cfg.depth:
        policy = DepthPolicy(draft_cfg.depth)

    taps = drafter.taps
    width = getattr(target, "width", None)
    ask_ahead = policy is not None and drafter.asynchronous
    inline = policy is not None and not drafter.asynchronous
    holds = False  # the drafter holds the stream: a draft of it was asked, and went out
    ingests = True  # the stream's next draft is its first: the drafter ingests the prompt with it
    new_tokens: list[int] = []  # committed, not yet given to the drafter
    produced = 0

    def pick(budget: int, before_prefill: bool = False) -> Decision:  # at most budget tokens: budget-1 drafted + 1
        if not policy:
            return Decision(min(draft_cfg.depth, budget - 1))
        source = Source(inline=inline, cohosted=drafter.cohosted, neighbours=drafter.neighbours,
                        server_ms=drafter.server_ms, pace_ms=drafter.pace_ms, lateness=drafter.lateness, holds=holds,
                        unsent=len(new_tokens) if holds else len(prompt_ids) + produced,  # its next draft ingests
                        ingest_ms=drafter.ingest_ms, stops=draft_cfg.auto_stop)
        return policy.choose(budget - 1, source, before_prefill)

    def shaped() -> DraftConfig:  # this step's draft: with auto_stop, its chain stops where the policy's costs say
        return replace(draft_cfg, min_path_prob=decision.stop) if policy and draft_cfg.auto_stop else draft_cfg

    if policy is not None:
        policy.server_prior(drafter.level_ms)
    # a remote draft may start before the prefill: a draft asked ahead, with the prefill's time to come
    decision = pick(max_new_tokens, before_prefill=ask_ahead) if max_new_tokens > 0 and not inline else Decision()
    depth = decision.depth
    first = decision.ahead if ask_ahead else depth
    dseq = drafter.start(prompt_ids, shaped(), sampling, first)
    holds = first > 0 and drafter.holds(dseq)
    t_prefill = time.perf_counter()
    seq = target.start(prompt_ids) if taps is None else target.start(prompt_ids, taps)
    prefilled = time.time()
    if policy:
        policy.prefill((time.perf_counter() - t_prefill) * 1e3)
    if inline and max_new_tokens > 0:  # a draft computed when asked, nothing to overlap with the prefill:
        decision = pick(max_new_tokens)  # the first depth is chosen after the prefill (a fresh policy decodes
        depth = decision.depth  # the first step alone, measuring what every draft is weighed against)
    new_features = [] if taps is None or seq.features is None else [seq.features]  # theirs, for a feature-level drafter
    done = max_new_tokens <= 0
    while not done:
        budget = max_new_tokens - produced
        if policy and policy.follow(drafter.moves, drafter.level_ms):  # another server drafts for it now
            holds = False
        if produced:
            decision = pick(budget)
            depth = decision.depth
        elif taps is not None and len(prompt_ids) < 2:
            depth = 0  # one token has no feature before it: nothing for a head to draft from yet
        draft_ms = None
        asked = None  # the depth asked of a draft this step waited for
        ahead = decision.ahead if ask_ahead and depth == 0 and produced else 0
        if depth > 0 or ahead:
            # a first draft asked before the prefill has had all of it: taken if here, else decoded
            # without and taken late (no miss: a server busy with other prompts is not a slow one)
            first = ask_ahead and not produced and dseq.pending
            deadline_ms = (decision.deadline_ms if depth and not first else 0) if policy else None
            t_draft = time.perf_counter()
            tree = drafter.propose(dseq, new_tokens, shaped(), sampling, draft_gen, max_depth=depth or ahead,
                                   deadline_ms=deadline_ms,
                                   features=torch.cat(new_features) if new_features else None)
            draft_ms = waited_ms = (time.perf_counter() - t_draft) * 1e3
            holds = drafter.holds(dseq)
            share = (tree.depth(), dseq.share_ms) if policy and drafter.cohosted and len(tree) else None
            new_tokens = []
            new_features = []
            waited_for = not (ask_ahead and (dseq.behind or not depth or first))
            if not waited_for:  # asked earlier and not waited for: it costs no wait now, so it is
                # verified as deep as that pays
                tree = tree.truncate(policy.worth(min(tree.depth(), budget - 1)))
                draft_ms = None
            else:
                tree = tree.truncate(depth)
                asked = depth
                if ingests:  # the prompt's first draft also ingested the prompt: not what a draft costs,
                    draft_ms = None  # but its levels tell what one costs a level, until the stream measures it
                    if policy:  # (a fresh policy co-located took drafts as free, and its next draft went 10 deep)
                        policy.server_prior(drafter.level_ms)
            # a miss is a draft's: not a prompt's ingest, nor a wait for a session's Welcome (nothing went out)
            if policy and waited_for and depth and len(tree) == 0 and waited_ms >= deadline_ms and holds \
                    and not ingests:
                policy.missed(depth, waited_ms)
            if not within(tree, width):  # a draft server's bug (or worse) must not reach the target's model
                tree = DraftTree.empty()
            ingests = not holds  # nothing went out: the next request is the reset
        else:
            tree = DraftTree.empty()
            share = None
            if ask_ahead:
                drafter.keep_up(dseq, len(new_tokens))  # a remote drafter reads what its server sent meanwhile
                holds = holds and drafter.holds(dseq)  # (or lost its session, and the next request is a reset)
        t_verify = time.perf_counter()
        logits = target.score(seq, tree) if taps is None else target.score(seq, tree, taps)
        verdict = verify(tree, logits, sampling, verify_gen)
        if policy:  # a pass shared with other streams costs this one its share (models/llamacpp.py)
            verify_ms = seq.pass_ms if seq.pass_ms is not None else (time.perf_counter() - t_verify) * 1e3
            policy.observe(tree.depth(), verdict.num_accepted, draft_ms, len(tree) + 1, verify_ms, share, asked)
        emitted, done = clip(verdict.tokens, budget, eos_ids)
        produced += len(emitted)
        yield Step(emitted, verdict.num_accepted, tree.depth(), depth or ahead, time.time(), prefilled)
        if not done:
            if taps is not None:  # the root's feature, then each accepted node's
                new_features.append(seq.features[torch.tensor([0] + [p + 1 for p in verdict.path])])
            target.commit(seq, verdict)
            new_tokens += verdict.tokens


def warm_up(target, context: int = 16) -> None:
    """One untimed pass on a throwaway stream, right after the target is loaded. An engine's first
    verify pass is far slower than the next ones (transformers in bf16 on an AMX Xeon: 813 ms for 2
    tokens, then 220-230 ms for 1 to 4), and a fresh stream that measured it can take drafting for
    dear: in one of two such runs it decoded alone for 14 steps before it looked again (7.6 tokens/s
    on HumanEval/0 against 13.6 in the other). A target process measures its verify costs before its
    first stream instead (measure_verify), which warms it the same way."""
    width = getattr(target, "width", None) or 1 << 16
    ids = [(100 + i) % width for i in range(context + 1)]
    target.score(target.start(ids[:context]), DraftTree.chain(ids[context:]))


def verify_widths(max_depth: int) -> list[int]:
    """The widths measure_verify measures (the policy's Costs draw a line between them)."""
    return sorted({w for w in (1, 2, 3, 5, 8, max_depth + 1) if w <= max_depth + 1})


def measure_verify(target, policy: DepthPolicy, rounds: int = 3, context: int = 64) -> dict[int, float]:
    """The target's cost of verifying a chain of each width the policy's drafts are verified at, measured
    on a throwaway stream of `context` tokens before any request (a target process calls it once at
    start), into `policy.verify_ms`; returns each width's median, in ms. A policy that knows only
    what a one-token pass costs takes a wider one at the cost of its nearest measured width, and so
    finds out what a draft must win back by verifying drafts that do not pay: a llama.cpp target on
    one core here scores 11 tokens in about 300 ms against 70 for one, and a local star's first
    requests each spent a second or more learning it. Each width `rounds` times (a width measured 3
    times counts for good, spec_decode/depth.py's Costs), in turns, after one untimed pass (the engine's
    first touch of its buffers); a stream's own passes replace these as they come (the median of
    the last few)."""
    width = getattr(target, "width", None) or 1 << 16
    ids = [(100 + i) % width for i in range(context + rounds * 8)]
    widths = verify_widths(policy.max_depth)
    top = widths[-1]
    seq = target.start(ids[:context])
    spare = iter(ids[context:])

    def score(w: int) -> float:
        t0 = time.perf_counter()
        target.score(seq, DraftTree.chain(ids[:w - 1]))
        ms = (time.perf_counter() - t0) * 1e3
        target.commit(seq, Verdict([], [next(spare, ids[0])]))
        return ms

    score(top)
    for _ in range(rounds):
        for w in widths:
            policy.verify_ms.add(w, score(w))
    return {w: round(policy.verify_ms(w), 1) for w in widths}


def within(tree: DraftTree, width: int | None) -> bool:
    """Whether every token of a draft, and of its q's support, is one of the target's `width` ids
    (None: not known; every tree passes). A draft outside them is refused: the step decodes alone."""
    if width is None or not len(tree):
        return True
    ids = [tree.tokens] + ([tree.q.ids] if tree.q is not None else [])
    return all(int(t.min()) >= 0 and int(t.max()) < width for t in ids)
