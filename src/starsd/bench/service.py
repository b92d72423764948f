"""Service sweep: the draft server's draft time S(b) by batch size b, against its bound, in one run.

For each b, b sessions are drafted together in steady state: each is a recorded prompt whose real
target's accepted tokens (the replay recording) come back after every draft, as from a real target.
S(b) is the wall time of one batched draft: the draft server's compute for one batch. The bound is
the bare model doing the same forward passes right after (the same rows, tokens and attended
columns, one LM-head call per pass), with nothing else: what S(b) would be if drafting cost only
the model. Each group's first batch, where every session ingests its prompt, gives what a reset adds
per prompt token (`reset_ms_per_token`). Writes JSON and a plot of both against b.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from starsd import config as C
from starsd.bench import harness
from starsd.models.drafter import Drafter
from starsd.models.loading import load_model
from starsd.results import panel_plot, summary, write_json


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1,2,4,8,16,32,64", help="batch sizes b, comma-separated")
    p.add_argument("--prompts", default="humaneval", help="prompt set: humaneval or chat")
    p.add_argument("--limit", type=int, default=16, help="prompts recorded and cycled through")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens recorded per prompt (a continuation's length)")
    p.add_argument("--reps", type=int, default=3, help="timed drafts per group of sessions")
    p.add_argument("--json-out", default="results/service.json", help="results as JSON here, the plot (PNG) beside it")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.DraftConfig, prefix="draft-")
    p.set_defaults(threads=2, target_engine="transformers")  # the figures in docs/ were measured so


def summarize(sweep: dict[int, dict[str, list[float]]]) -> dict:
    """Means by b, the ratio to the bound, and S(b) / S(1) (b = 1 must be in the sweep)."""
    rows = {b: {"service_ms": statistics.fmean(v["service_ms"]), "bound_ms": statistics.fmean(v["bound_ms"]),
                "samples": len(v["service_ms"])} for b, v in sorted(sweep.items())}
    one = rows[min(rows)]["service_ms"]
    for r in rows.values():
        r["over_bound"] = r["service_ms"] / r["bound_ms"] - 1
        r["vs_one"] = r["service_ms"] / one
    return rows


def main(args) -> int:
    pair = C.from_args(C.PairConfig, args)
    torch.set_num_threads(args.threads)
    rec, _ = harness.recording(args)
    draft = C.from_args(C.DraftConfig, args, prefix="draft-")
    drafter = Drafter(load_model(pair.draft_model(), pair.cache))
    sizes = harness.numbers(args.sizes)
    sweep = harness.measure_service(drafter, rec, sizes, draft, reps=args.reps)
    rows = summarize(sweep)
    result = {"benchmark": "service", "draft": pair.draft, "draft_model": vars(pair.draft_model()),
              "threads": args.threads, "draft_config": vars(draft), "by_batch": {str(b): r for b, r in rows.items()},
              "samples_ms": {str(b): v for b, v in sweep.items()}, "reset_ms_per_token": harness.reset_cost(sweep)}
    write_json(args.json_out, result)
    bs = list(rows)
    png = str(args.json_out).rsplit(".", 1)[0] + ".png"
    panel_plot(png, [
        {"series": [{"label": "S(b): the draft server's batch", "x": bs, "y": [rows[b]["service_ms"] for b in bs], "marker": "o"},
                    {"label": "bound: the bare model's passes", "x": bs, "y": [rows[b]["bound_ms"] for b in bs], "marker": "s", "ls": "--"}],
         "xlabel": "batch size b", "ylabel": "ms per batch", "title": "Draft time of one batch", "logx": True, "logy": True},
        {"series": [{"label": "S(b) / b", "x": bs, "y": [rows[b]["service_ms"] / b for b in bs], "marker": "o"},
                    {"label": "bound / b", "x": bs, "y": [rows[b]["bound_ms"] / b for b in bs], "marker": "s", "ls": "--"}],
         "xlabel": "batch size b", "ylabel": "ms per request", "title": "Draft time per request", "logx": True, "logy": True},
    ])
    summary(f"bench service: draft time of one batch of b sessions ({pair.draft_model().dtype}, "
            f"threads={args.threads})", ["b", "S(b) ms", "bound ms", "over bound", "S(b)/S(1)", "ms per request"],
            [[b, f"{r['service_ms']:.0f}", f"{r['bound_ms']:.0f}", f"{r['over_bound']:.0%}", f"{r['vs_one']:.2f}",
              f"{r['service_ms'] / b:.0f}"] for b, r in rows.items()],
            {"a reset": f"{result['reset_ms_per_token']:.2f} ms more per prompt token ingested (first batches "
                        "over steady ones)"},
            files={"JSON": args.json_out, "plot": png})
    return 0
