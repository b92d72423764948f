"""The default depth policy against fixed depths, as a person meets it: one target on this machine,
drafting with a draft model in its own process (co-located) and through a draft-server process with
its default settings over loopback (the star at N = 1), greedy and sampled, side by side in one run.

Per prompt every mode runs once, in an order rotated per prompt so that drift in the machine's
speed hits every mode alike: target-only decoding, the default (the adaptive depth policy) and each
fixed depth (`--no-draft-adaptive --draft-depth d`). Co-located, each generation starts a fresh
policy, as `starsd generate` does; through the server one policy serves all the prompts of a
temperature, as a target process keeps one for its life (its verify costs measured first, then one
warm-up prompt, not measured).
The figure of merit is the default's tokens/s over the best fixed depth's, the best chosen in
hindsight per placement and temperature, and over target-only, two ways: the decoding's tokens/s
after each prompt's prefill (the prefill costs every mode alike and would only dilute the
difference the depth makes), and the whole answer's, prefill included, as a person waits for it.
(Before, the first was counted after each prompt's first step: but the default's first step
differs, decoding alone where a fixed depth's drafts and ingests the prompt, and the default's
first draft then carried the prompt's ingest into the figure where a fixed depth's did not.)
"""

from __future__ import annotations

import argparse
import dataclasses

from starsd import config as C
from starsd.models.loading import vocab_fingerprint
from starsd.models.pair import Pair
from starsd.prompts import load as load_prompts
from starsd.results import Steps, bar_panels, summary, write_json
from starsd.spec_decode.decode import measure_verify, speculative, target_only
from starsd.spec_decode.depth import DepthPolicy
from starsd.star.client import DraftClient
from starsd.star.remote_drafter import RemoteDrafter
from starsd.star.launch import start_server


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default="humaneval", help="prompt set: humaneval or chat")
    p.add_argument("--limit", type=int, default=3, help="number of prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt at most")
    p.add_argument("--depths", default="2,4,6,10", help="the fixed depths to compare with")
    p.add_argument("--temperatures", default="0,0.7", help="sampling temperatures, comma-separated")
    p.add_argument("--placements", default="colocated,star", help="colocated, star, or both")
    p.add_argument("--json-out", default="results/depth.json", help="results as JSON here, the plot beside it")
    C.add_flags(p, C.PairConfig)
    p.set_defaults(threads=2, target_engine="transformers")  # the figures in docs/ were measured so


def modes(depths: list[int]) -> list[str]:
    return ["default", *(f"fixed-{d}" for d in depths)]


def draft_config(mode: str) -> C.DraftConfig:
    if mode == "default":
        return C.DraftConfig()
    depth = int(mode.split("-")[1])
    return C.DraftConfig(depth=depth, adaptive=False)


def ratios(rate: dict[str, float], depths: list[int]) -> dict:
    """The default's tokens/s over the best fixed depth's and over target-only."""
    fixed = {m: rate[m] for m in modes(depths)[1:]}
    best = max(fixed, key=fixed.get)
    return {"best_fixed": best, "default_vs_best_fixed": rate["default"] / fixed[best],
            "default_vs_target_only": rate["default"] / rate["target_only"]}


def main(args) -> int:
    cfg = C.from_args(C.PairConfig, args)
    depths = [int(d) for d in args.depths.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    placements = args.placements.split(",")
    prompts = load_prompts(args.prompts, args.limit)
    star = start_server(cfg) if "star" in placements else None  # the server's defaults
    try:
        pair = Pair.load(cfg.target_model(), cfg.draft_model(), cfg.cache, cfg.threads)
        remote = None
        if star:
            client = DraftClient(star.address, vocab_fingerprint(pair.tokenizer, pair.target.width),
                                 "bench")
            client.hello()
            remote = RemoteDrafter(client)
        runs = [(p, m) for p in placements for m in modes(depths)]
        tokens: dict[tuple, int] = {}
        seconds: dict[tuple, float] = {}
        whole: dict[tuple, tuple[int, float]] = {}  # the whole answers' tokens and seconds
        with Steps("bench depth", len(temperatures) * len(prompts) * (1 + len(runs))) as steps:
            for temperature in temperatures:
                sampling = C.SamplingConfig(temperature=temperature, seed=1)
                policy = DepthPolicy(C.DraftConfig().depth)  # the star target's, carried over its prompts
                if remote:
                    measure_verify(pair.target, policy)  # as a target process does before its first stream
                    steps.say(f"warm-up at temperature {temperature}")
                    speculative(pair.target, remote, prompts[0].encode(pair.tokenizer), args.max_new_tokens,
                                C.DraftConfig(), sampling, pair.eos_ids, policy=policy)
                for i, prompt in enumerate(prompts):
                    ids = prompt.encode(pair.tokenizer)
                    order = [("target_only", "target_only"), *runs]
                    k = i % len(order)
                    for placement, mode in order[k:] + order[:k]:
                        steps.begin(f"t={temperature} {placement} {mode}, prompt {i + 1}/{len(prompts)}")
                        if mode == "target_only":
                            gen = target_only(pair.target, ids, args.max_new_tokens, sampling, pair.eos_ids)
                        else:
                            drafter = remote if placement == "star" else pair.drafter
                            kept = policy if placement == "star" and mode == "default" else None
                            gen = speculative(pair.target, drafter, ids, args.max_new_tokens, draft_config(mode),
                                              sampling, pair.eos_ids, policy=kept)
                        key = (temperature, placement, mode)
                        tokens[key] = tokens.get(key, 0) + len(gen.token_ids)
                        seconds[key] = seconds.get(key, 0.0) + gen.decoding_s
                        n, t = whole.get(key, (0, 0.0))
                        whole[key] = (n + len(gen.token_ids), t + gen.seconds)
                        steps.end(f"t={temperature} {placement} {mode}, prompt {i + 1}: {len(gen.token_ids)} tokens, "
                                  f"{gen.tokens_per_s:.2f} tok/s, {gen.num_steps} steps")
        if remote:
            client.close()
    finally:
        if star:
            star.close()
    points = []
    for temperature in temperatures:
        for placement in placements:
            keys = {m: (temperature, placement, m) for m in modes(depths)}
            keys["target_only"] = (temperature, "target_only", "target_only")
            rate = {m: tokens[k] / seconds[k] for m, k in keys.items()}
            answers = {m: whole[k][0] / whole[k][1] for m, k in keys.items()}
            points.append({"temperature": temperature, "placement": placement, "tokens_per_s": rate,
                           **ratios(rate, depths), "whole_answers": {"tokens_per_s": answers,
                                                                     **ratios(answers, depths)}})
    result = {"benchmark": "depth", "target": args.target, "draft": args.draft, "dtype": cfg.target_model().dtype,
              "threads": args.threads, "prompts": args.prompts, "num_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "server": dataclasses.asdict(C.ServerConfig()),
              "default_draft": dataclasses.asdict(C.DraftConfig()), "points": points}
    write_json(args.json_out, result)
    png = str(args.json_out).rsplit(".", 1)[0] + ".png"
    bar_panels(png, [{"labels": ["target only", *modes(depths)],
                      "values": [round(p["tokens_per_s"][m], 2) for m in ("target_only", *modes(depths))],
                      "ylabel": "tokens / s", "title": f"{p['placement']}, temperature {p['temperature']}"}
                     for p in points])
    summary(f"bench depth: the default policy vs fixed depths, {len(prompts)} {args.prompts} prompts, "
            f"{cfg.target_model().dtype}, threads={args.threads}; decoding tokens/s after the prefill",
            ["placement", "temperature", "target-only", "default", "best fixed", "default / best fixed",
             "default / target-only", "whole answers: default / best fixed"],
            [[p["placement"], p["temperature"], f"{p['tokens_per_s']['target_only']:.2f}",
              f"{p['tokens_per_s']['default']:.2f}",
              f"{p['best_fixed']} {p['tokens_per_s'][p['best_fixed']]:.2f}",
              f"{p['default_vs_best_fixed']:.2f}x", f"{p['default_vs_target_only']:.2f}x",
              f"{p['whole_answers']['default_vs_best_fixed']:.2f}x"] for p in points],
            files={"JSON": args.json_out, "plot": png})
    return 0
