"""Replay targets against real ones: the same star at small N, once with real target processes and
once with replay targets that use the latency profile measured here for the real target.

Both runs use the same draft server settings, the same prompts shared out the same way (target i
decodes prompts i, i+N, ...), and the same budget; system throughput is tokens over the wall time
from the common start to the last finish. Real targets share this machine's cores with the draft
server, replay targets do not: the ratio shows how faithful the emulation is where both can run.
"""

from __future__ import annotations

import argparse

import torch

from starsd import config as C
from starsd.bench import harness
from starsd.results import Steps, bar_plot, summary, write_json
from starsd.star.launch import run_targets, start_server, summarize, target_command


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_star_args(p, json_out="results/replay-check.json")
    p.set_defaults(targets="1,2", threads=1)


def real_point(args, n: int) -> dict:
    pair = C.from_args(C.PairConfig, args)
    star = start_server(pair, harness.server_config(args, serial=False))
    try:
        target_args = [*target_command(pair)[1:], "--prompts", args.prompts, "--max-new-tokens",
                       str(args.max_new_tokens), *C.to_flags(C.from_args(C.DraftConfig, args, prefix="draft-"),
                                                             prefix="draft-")]
        rows = run_targets(star, n, target_args, args.limit)
        return {**summarize(rows, n), "results": [brief(r) for r in rows]}
    finally:
        star.close()


def replay_point(runner: harness.Runner, args, n: int) -> dict:
    star = start_server(C.from_args(C.PairConfig, args), harness.server_config(args, serial=False))
    try:
        rows, go = runner.host(star.address, n, duration_s=0)
    finally:
        star.close()
    for r in rows:
        r["go"] = go
    return {**summarize(rows, n), "results": [brief(r) for r in rows]}


def brief(row: dict) -> dict:
    """What a comparison needs of one decoded prompt."""
    return {k: row[k] for k in ("target", "prompt_id", "num_steps", "mean_accepted", "seconds", "draft")}


def main(args) -> int:
    ns = harness.numbers(args.targets)
    torch.set_num_threads(args.threads)  # the latency profile is measured as the real targets run
    inputs = harness.prepare(args)
    runner = harness.Runner(inputs, args)
    points = []
    with Steps("bench replay-check", 2 * len(ns)) as steps:
        for n in ns:
            steps.begin(f"real targets N={n}")
            real = real_point(args, n)
            steps.end()
            steps.begin(f"replay targets N={n}")
            replay = replay_point(runner, args, n)
            ratio = replay["system_tokens_per_s"] / real["system_tokens_per_s"]
            points.append({"n": n, "real": real, "replay": replay, "ratio": ratio})
            steps.end(f"N={n}: real {real['system_tokens_per_s']:.2f} tok/s, replay "
                      f"{replay['system_tokens_per_s']:.2f} tok/s, ratio {ratio:.3f}")
    write_json(args.json_out, {
        "replay": {"latency_profile": inputs.latency.to_json(), "recording": inputs.recording_file},
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "points": points, "max_relative_error": max(abs(p["ratio"] - 1) for p in points)})
    labels = [f"{kind} N={p['n']}" for p in points for kind in ("real", "replay")]
    values = [p[kind]["system_tokens_per_s"] for p in points for kind in ("real", "replay")]
    png = str(args.json_out).rsplit(".", 1)[0] + ".png"
    bar_plot(png, labels, values, "system tokens / s",
             "Replay targets vs real targets (same draft server, same prompts)")
    summary("bench replay-check: system tokens/s of real and replay targets", ["N", "real", "replay", "replay / real"],
            [[p["n"], f"{p['real']['system_tokens_per_s']:.2f}", f"{p['replay']['system_tokens_per_s']:.2f}",
              f"{p['ratio']:.3f}"] for p in points],
            {"largest relative error": f"{max(abs(p['ratio'] - 1) for p in points):.1%}"},
            {"JSON": args.json_out, "plot": png, "latency profile": None if args.latency else inputs.latency_file})
    return 0
