"""The depth policy replayed over drafts recorded once: every policy, fixed depth and chain stopping
rule on the same drafts and the same costs, without a real run's noise.

Greedy decoding is deterministic, so what any step can get is fixed by where it starts. `record`
runs the real pair once along the target's greedy answer and keeps, at each position, the chain
drafted `depth` deep with each level's path probability (the product of the draft's probabilities
of its tokens) and how many of its tokens are the target's next ones (`accepted`); and what the
passes cost on this host (a verify pass by width, a drafted level, the first draft's ingest of the
prompt, the prefill). A chain stops below `min_path_prob`, so a draft asked d deep has, at any
threshold, a known number of levels, and min(that, accepted) tokens accepted. `replay` drives a
fixed depth or a DepthPolicy with the calls the decoding loop makes (spec_decode/decode.py, a
drafter in this process), each cost drawn about its measured value (log-normal, 5%), tokens/s
summed over prompts. It measures the policy, not the engine (a real run's costs vary by step, and
the catch-up of tokens decoded alone is not charged): `bench depth` and `bench colocated` measure
the real thing. Figures and what was tried: docs/scheduler.md#replayed-over-recorded-drafts.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import replace
from pathlib import Path

from starsd import config as C
from starsd.models.drafter import DraftJob, chain_levels as levels
from starsd.results import Steps, bar_panels, summary, write_json
from starsd.spec_decode.decode import measure_verify, target_only
from starsd.spec_decode.depth import DepthPolicy, Source
from starsd.spec_decode.estimates import Costs

FIXED = (1, 2, 3, 4, 6, 8, 10)  # fixed depths replayed beside the policy
NOISE = 0.05  # sd of a cost's log-normal draw about its measured value


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default="humaneval", help="prompt set: humaneval or chat")
    p.add_argument("--limit", type=int, default=16, help="number of prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens of each answer at most")
    p.add_argument("--trace", default="", help="replay this recorded trace (JSON) instead of recording one")
    p.add_argument("--trace-out", default="results/depth-trace.json", help="where a recorded trace is written")
    p.add_argument("--stops", default="0.3,0.4,0.5,0.6,0.7", help="chain stopping thresholds (min_path_prob) to replay, "
                   "comma-separated; the policy's own (auto_stop, the default) is replayed beside them")
    p.add_argument("--seeds", type=int, default=8, help="replays of each mode, each with its own cost draws")
    p.add_argument("--json-out", default="results/depth-replay.json", help="results as JSON here, the plot beside it")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.DraftConfig, prefix="draft-")


def record(pair, prompts, max_new_tokens: int, draft: C.DraftConfig, steps: Steps | None = None) -> dict:
    """Per prompt: the target's greedy answer and, at each of its positions, the chain drafted there
    `draft.depth` deep without stopping (`path`: each level's path log-probability; `accepted`: how
    many of its tokens are the answer's next); the costs measured on this host."""
    greedy = C.SamplingConfig()
    whole = replace(draft, min_path_prob=0.0, top_k=1, total_tokens=draft.depth, sample=False)
    verify = measure_verify(pair.target, DepthPolicy(draft.depth))
    pair.generate(prompts[0], 16, greedy, draft)  # the drafter's first passes allocate: not measured
    out = {"draft_depth": draft.depth, "min_path_prob": draft.min_path_prob, "verify_ms": verify,
           "level_ms": pair.drafter.level_ms, "prompts": []}
    for prompt in prompts:
        if steps:
            steps.begin(prompt.id)
        ids = prompt.encode(pair.tokenizer)
        t0 = time.perf_counter()
        pair.target.start(ids)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        answer = target_only(pair.target, ids, max_new_tokens, greedy, pair.eos_ids).token_ids
        seq = pair.drafter.start(ids)
        paths, accepted, new = [], [], []
        for t in range(len(answer)):
            job = DraftJob(seq, new, whole, greedy)
            t0 = time.perf_counter()
            chain = pair.drafter.propose_batch([job])[0].tokens.tolist()
            if t == 0:
                ingest_ms = max(0.0, (time.perf_counter() - t0) * 1e3 - len(chain) * pair.drafter.level_ms)
            a = 0
            while a < len(chain) and t + a < len(answer) and chain[a] == answer[t + a]:
                a += 1
            paths.append([round(x, 4) for x in job.path])
            accepted.append(a)
            new = [answer[t]]
        out["prompts"].append({"id": prompt.id, "tokens": len(answer), "prefill_ms": prefill_ms,
                               "ingest_ms": ingest_ms, "path": paths, "accepted": accepted})
        if steps:
            steps.end(f"{prompt.id}: {len(answer)} tokens, {sum(accepted) / max(len(accepted), 1):.2f} of a "
                      f"{draft.depth}-level chain accepted on average")
    return out


def replay(trace: dict, prompt: dict, depth: int | None, policy: DepthPolicy | None, rng: random.Random,
           max_new_tokens: int, min_path_prob: float | None, noise: float = NOISE) -> tuple[int, float]:
    """(tokens, ms) of one prompt's answer at a fixed `depth`, or under `policy` (fresh or carried
    over earlier prompts), as spec_decode/decode.py drives it for a drafter in this process, its chains
    stopping below `min_path_prob` (None: where the policy says, Situation.stop, as with
    DraftConfig.auto_stop); each cost drawn log-normally about its measured value (`noise`: the
    draws' sd)."""
    verify = Costs(0.0)
    for width, ms in trace["verify_ms"].items():
        verify.add(width, ms)

    def cost(ms: float) -> float:
        return ms * math.exp(rng.gauss(0.0, noise)) if noise else ms

    level_ms, n = trace["level_ms"], prompt["tokens"]
    source = Source(inline=True, stops=min_path_prob is None)
    if policy is not None:
        policy.server_prior(level_ms)
        policy.prefill(cost(prompt["prefill_ms"]))
    t, ms, ingest = 0, 0.0, prompt["ingest_ms"]  # the prompt, ingested by the stream's first draft
    while t < n:
        limit = max_new_tokens - t - 1
        decision = policy.choose(limit, source) if policy is not None else None
        d = decision.depth if decision else min(depth, limit)
        if d > 0:
            stop = decision.stop if min_path_prob is None else min_path_prob
            drafted = min(d, levels(prompt["path"][t], stop))
            accepted = min(prompt["accepted"][t], drafted)
            draft_ms = cost(level_ms * drafted)
            verify_ms = cost(verify(drafted + 1))
            ms += draft_ms + verify_ms + ingest
            if policy is not None:
                policy.observe(drafted, accepted, None if ingest else draft_ms, drafted + 1, verify_ms, asked=d)
            ingest = 0.0
            t += accepted + 1
        else:
            verify_ms = cost(verify(1))
            ms += verify_ms
            if policy is not None:
                policy.observe(0, 0, None, 1, verify_ms)
            t += 1
    return min(t, n), ms


def tokens_per_s(trace: dict, seeds: int, max_new_tokens: int, min_path_prob: float | None, depth: int | None = None,
                 carried: bool = False) -> float:
    """Tokens/s over every prompt and seed: at a fixed `depth`, else the default policy, a fresh one
    per prompt (`starsd generate`) or one `carried` over the prompts (a target process, a Pair)."""
    tokens = ms = 0.0
    for seed in range(seeds):
        rng = random.Random(seed)
        kept = DepthPolicy(trace["draft_depth"], rng=random.Random(seed)) if carried else None
        for prompt in trace["prompts"]:
            policy = None if depth else kept or DepthPolicy(trace["draft_depth"], rng=random.Random(seed))
            n, t = replay(trace, prompt, depth, policy, rng, max_new_tokens, min_path_prob)
            tokens += n
            ms += t
    return tokens / ms * 1e3


def evaluate(trace: dict, seeds: int, max_new_tokens: int, min_path_prob: float | None,
             stops: tuple[float, ...] = ()) -> dict:
    """Fixed depths, and the default fresh and carried, with chains stopping below `min_path_prob`;
    None: the policy's threshold (auto_stop, the default) against each fixed depth at the best of
    `stops` for it, chosen in hindsight."""
    fixed = {d: max(tokens_per_s(trace, seeds, max_new_tokens, stop, depth=d)
                    for stop in ([min_path_prob] if min_path_prob is not None else stops))
             for d in FIXED if d <= trace["draft_depth"]}
    best = max(fixed, key=fixed.get)
    modes = {"fresh": tokens_per_s(trace, seeds, max_new_tokens, min_path_prob),
             "carried": tokens_per_s(trace, seeds, max_new_tokens, min_path_prob, carried=True)}
    return {"min_path_prob": "auto" if min_path_prob is None else min_path_prob,
            "target_only": 1e3 / trace["verify_ms"][1], "fixed": fixed, "best_fixed_depth": best, **modes,
            **{f"{k}_over_best_fixed": v / fixed[best] for k, v in modes.items()}}


def load(path: str | Path) -> dict:
    """A recorded trace (JSON keys are strings: the verify widths become numbers again)."""
    trace = json.loads(Path(path).read_text())
    trace["verify_ms"] = {int(width): ms for width, ms in trace["verify_ms"].items()}
    return trace


def main(args) -> int:
    if args.trace:
        trace = load(args.trace)
    else:
        from starsd.models.pair import Pair
        from starsd.prompts import load as load_prompts
        cfg = C.from_args(C.PairConfig, args)
        draft = C.from_args(C.DraftConfig, args, prefix="draft-")
        pair = Pair.load(cfg.target_model(), cfg.draft_model(), cfg.cache, cfg.threads)
        prompts = load_prompts(args.prompts, args.limit)
        with Steps("bench depth-replay: recording", len(prompts)) as steps:
            trace = record(pair, prompts, args.max_new_tokens, draft, steps)
        trace.update(prompt_set=args.prompts, target=cfg.target, draft=cfg.draft, engine=cfg.target_engine,
                     max_new_tokens=args.max_new_tokens)
        write_json(args.trace_out, trace)
    stops = [float(x) for x in args.stops.split(",")]
    tokens = trace.get("max_new_tokens", args.max_new_tokens)
    points = [evaluate(trace, args.seeds, tokens, None, tuple(stops))]
    points += [evaluate(trace, args.seeds, tokens, stop) for stop in stops]
    result = {"benchmark": "depth-replay", "trace": args.trace or args.trace_out, "seeds": args.seeds,
              "answers": len(trace["prompts"]), "level_ms": trace["level_ms"], "verify_ms": trace["verify_ms"],
              "points": points}
    write_json(args.json_out, result)
    png = str(args.json_out).rsplit(".", 1)[0] + ".png"
    labels = [f"fixed {d}" for d in points[0]["fixed"]] + ["default, fresh", "default, carried"]

    def values(point: dict) -> list[float]:
        return [*point["fixed"].values(), point["fresh"], point["carried"]]

    bar_panels(png, [{"labels": labels, "values": [round(v, 2) for v in values(point)],
                      "ylabel": "tokens/s (replayed)", "title": f"chains stop below {point['min_path_prob']}"}
                     for point in points])
    rows = []
    for point in points:
        best = point["fixed"][point["best_fixed_depth"]]
        rows += [[point["min_path_prob"], label, f"{v:.2f}", f"{v / best:.3f}x", f"{v / point['target_only']:.2f}x"]
                 for label, v in zip(labels, values(point))]
    summary(f"bench depth-replay: {len(trace['prompts'])} recorded answers, {args.seeds} replays each",
            ["chain stops below", "mode", "tokens/s", "vs best fixed", "vs target-only"], rows,
            files={"JSON": args.json_out, "plot": png})
    return 0
