"""A draft server slowed on purpose: does it ever make a target slower than decoding alone?

Every draft reaches its target `delay` late (a delaying proxy between the targets and a real draft
server; the server itself answers as fast as ever, so heartbeats still say it is alive). Replay
targets decode in three ways, side by side in one run, at each delay:
- target-only: no drafts (the floor a draft server must never push a target below);
- fixed depth: every step waits for its draft, however late (the behaviour without a guard);
- adaptive: each draft gets the deadline the target's own decode time allows (spec_decode/depth.py); a
  step whose draft misses it decodes alone, and so do the steps after it for a while, each asking a
  draft ahead without waiting; a draft that comes back late is verified below the tokens committed
  meanwhile, as far as it still follows them.
Reported per delay: per-target tokens/s of each mode and its ratio to target-only.
"""

from __future__ import annotations

import argparse
import dataclasses

from starsd import config as C
from starsd.bench import harness
from starsd.emulate.delay_proxy import DelayProxy
from starsd.results import Steps, line_plot, summary, write_json
from starsd.star.launch import start_server


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_star_args(p, "results/slow-server.json")
    p.add_argument("--delays-ms", default="0,50,150,300", help="one-way delays added to every message, comma-"
                   "separated (a round trip adds twice; keep it under the heartbeat's 1 s)")
    p.set_defaults(targets="2", warmup_s=10.0, measure_s=30.0)


def run(args, steps: Steps) -> dict:
    inputs = harness.prepare(args)
    runner = harness.Runner(inputs, args)
    n = harness.numbers(args.targets)[0]
    delays = [float(d) for d in args.delays_ms.split(",")]
    modes = {"fixed": dataclasses.replace(inputs.draft, adaptive=False),
             "adaptive": dataclasses.replace(inputs.draft, adaptive=True)}
    steps.begin("target-only")
    alone, _ = runner.point(None, n, no_spec=True)
    steps.end(f"target-only: {alone['per_target_tokens_per_s']:.2f} tok/s per target")
    rows = [{"mode": "target-only", "delay_ms": d, **_figures(alone, alone)} for d in delays]
    star = start_server(C.from_args(C.PairConfig, args), harness.server_config(args, serial=False))
    port = int(star.address.rsplit(":", 1)[1])
    try:
        for delay in delays:
            with DelayProxy(("127.0.0.1", 0), ("127.0.0.1", port), delay) as proxy:
                for mode, draft in modes.items():
                    steps.begin(f"{mode}, drafts {2 * delay:g} ms late")
                    point, _ = runner.point(f"tcp://127.0.0.1:{proxy.port}", n, draft=draft)
                    rows.append({"mode": mode, "delay_ms": delay, **_figures(point, alone)})
                    steps.end(f"{mode} @ {delay:g} ms: {rows[-1]['vs_target_only']:.2f}x target-only")
    finally:
        star.close()
    return {"replay": {"targets": "replay (remote targets emulated; the draft server is real)",
                       "recording": inputs.recording_file, "latency_profile": inputs.latency.to_json()},
            "settings": {k: v for k, v in vars(args).items() if k != "func"}, "targets": n, "points": rows,
            "checks": checks(rows)}


def _figures(point: dict, alone: dict) -> dict:
    return {"per_target_tokens_per_s": point["per_target_tokens_per_s"],
            "per_target_min_tokens_per_s": point["per_target_min_tokens_per_s"],
            "drafted_share": point["drafted_share"],
            "vs_target_only": point["per_target_tokens_per_s"] / alone["per_target_tokens_per_s"]}


def checks(rows: list[dict]) -> dict:
    """The guard's claim: the adaptive targets are never slower than target-only (a 5% noise margin),
    at any delay; and how far below it the unguarded fixed depth falls."""
    adaptive = [r["vs_target_only"] for r in rows if r["mode"] == "adaptive"]
    fixed = [r["vs_target_only"] for r in rows if r["mode"] == "fixed"]
    return {"adaptive_min_vs_target_only": min(adaptive), "fixed_min_vs_target_only": min(fixed),
            "adaptive_never_below_target_only": min(adaptive) >= 0.95}


def main(args) -> int:
    delays = args.delays_ms.split(",")
    with Steps("bench slow-server", 1 + 2 * len(delays), step_s=args.warmup_s + args.measure_s) as steps:
        result = run(args, steps)
    write_json(args.json_out, result)
    stem = str(args.json_out).rsplit(".", 1)[0]
    series = []
    for mode in ("target-only", "fixed", "adaptive"):
        rows = [r for r in result["points"] if r["mode"] == mode]
        series.append({"label": mode, "x": [2 * r["delay_ms"] for r in rows],
                       "y": [r["per_target_tokens_per_s"] for r in rows], "marker": "o"})
    line_plot(stem + ".png", series, "added draft latency (ms, round trip)", "tokens/s per target",
              f"A slowed draft server, {result['targets']} replay targets")
    summary("A slowed draft server", ["mode", "added RTT (ms)", "tok/s per target", "vs target-only", "drafted"],
            [[r["mode"], f"{2 * r['delay_ms']:g}", f"{r['per_target_tokens_per_s']:.2f}",
              f"{r['vs_target_only']:.2f}x", f"{r['drafted_share']:.0%}"] for r in result["points"]],
            {k: f"{v:.2f}" if isinstance(v, float) else str(v) for k, v in result["checks"].items()},
            {"results": args.json_out, "plot": stem + ".png"})
    return 0
