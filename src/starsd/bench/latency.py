"""The paper's latency claim, measured: one pair alone against the same pair inside a star of N.

The claim: a draft model paired with one target idles while the target verifies, then bursts; one
shared by N targets drafts continuously, so a drafted token costs less of the draft's time and the
targets' per-token latency varies less. One real draft server serves N replay targets (remote
targets emulated from the real target's recorded answers and verify latencies); N = 1 is the pair
alone. Each mode runs every N in one run:
- fixed: every step drafts --draft-depth deep and waits for it, no pre-drafting (the paper's);
- defaults: the target's depth policy (spec_decode/depth.py) and the server's pre-drafting.
Per point, over the window: draft ms per drafted token (the server's busy time, pre-drafts
included, over the tokens drafted for the steps that ended in the window); the server's idle gaps
(spans with neither a batch nor a pre-draft running: p50, p99, longest) and utilisation; a
target's step gap (between two deliveries of tokens: p50, p99, std); per-token latency (a step of
T ms committing a tokens gives each T / a, metrics.py: p50, p99, variance, CV). The checks say, for
each mode, whether the largest N beats N = 1 on each claim.
Figures: docs/scaling.md#the-papers-latency-claim-one-pair-alone-against-a-star-of-n.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from starsd import config as C
from starsd.bench import harness, metrics
from starsd.errors import SettingError
from starsd.results import Steps, panel_plot, summary, write_json
from starsd.star.launch import start_server


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_star_args(p, "results/latency.json")
    p.add_argument("--modes", default="fixed,defaults", help="fixed (every step drafts --draft-depth deep, no "
                   "pre-drafting) and/or defaults (adaptive depth, pre-drafting), comma-separated")
    p.set_defaults(targets="1,2,4,8", warmup_s=10.0, measure_s=30.0)


def modes(draft: C.DraftConfig, names: list[str]) -> dict[str, tuple[C.DraftConfig, bool]]:
    """Each mode's draft settings and whether its server pre-drafts."""
    known = {"fixed": (dataclasses.replace(draft, adaptive=False), False),
             "defaults": (dataclasses.replace(draft, adaptive=True), C.ServerConfig.predraft)}
    unknown = set(names) - set(known)
    if unknown:
        raise SettingError(f"unknown modes {sorted(unknown)}: pick from {', '.join(known)}")
    return {name: known[name] for name in names}


def busy_spans(timeline: list, w0: float, w1: float) -> list[tuple[float, float]]:
    """The spans inside [w0, w1] (unix s) in which the server computed: its entries (start, end, ...)
    cut to the window, overlapping ones merged, in order."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted((max(a, w0), min(b, w1)) for a, b, *_ in timeline if b > w0 and a < w1):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def idle_gaps_ms(spans: list[tuple[float, float]], w0: float, w1: float) -> list[float]:
    """The gaps between busy spans (busy_spans) inside [w0, w1], in ms, the window's edges included."""
    edges = [w0, *(x for span in spans for x in span), w1]
    return [(b - a) * 1e3 for a, b in zip(edges[::2], edges[1::2]) if b > a]


def drafted_tokens(rows: list[dict], w0: float, w1: float) -> int:
    """Tokens drafted for the steps that ended inside [w0, w1]: each step's draft depth (a chain's
    length), from the replay targets' rows."""
    return sum(depth for r in rows for (end, _), depth in zip(r["trace"], r["depths"]) if w0 <= end <= w1)


def spread(xs: list[float]) -> dict:
    """p50, p99, mean, std, variance and coefficient of variation of xs (ms)."""
    mean = statistics.fmean(xs)
    std = statistics.pstdev(xs)
    return {"p50": metrics.percentile(xs, 50), "p99": metrics.percentile(xs, 99), "mean": mean, "std": std,
            "variance": std * std, "cv": std / mean if mean else 0.0}


def figures(rows: list[dict], its: list[metrics.Iteration], timeline: list, predrafts: list, n: int, w0: float,
            w1: float) -> dict:
    """One point's figures over the window [w0, w1] (see the module docstring), from the server's
    timelines of batches and of pre-drafts."""
    inside = [it for it in its if w0 <= it.end <= w1]
    base = metrics.point(its, n, w0, w1, timeline)
    drafted = drafted_tokens(rows, w0, w1)
    spans = busy_spans(timeline + predrafts, w0, w1)
    busy_ms = sum(b - a for a, b in spans) * 1e3
    gaps = idle_gaps_ms(spans, w0, w1)
    return {"n": n, "system_tokens_per_s": base["system_tokens_per_s"],
            "per_target_tokens_per_s": base["per_target_tokens_per_s"],
            "tokens_per_step": base["tokens_per_iteration"], "drafted_share": base["drafted_share"],
            "drafted_tokens": drafted, "draft_busy_ms": busy_ms,
            "draft_ms_per_drafted_token": busy_ms / drafted if drafted else None,
            "draft_utilization": busy_ms / ((w1 - w0) * 1e3), "mean_batch": base.get("mean_batch", 0.0),
            "idle_gap_ms": {"count": len(gaps), "p50": metrics.percentile(gaps, 50),
                            "p99": metrics.percentile(gaps, 99), "max": max(gaps, default=0.0)},
            "step_gap_ms": spread([it.ms for it in inside]),
            "per_token_latency_ms": spread(metrics.per_token_latencies(inside))}


def by_mode(points: list[dict]) -> dict[str, list[dict]]:
    """The points of each mode, in the order the modes ran, each mode's by N."""
    out: dict[str, list[dict]] = {}
    for p in points:
        out.setdefault(p["mode"], []).append(p)
    return {mode: sorted(mine, key=lambda p: p["n"]) for mode, mine in out.items()}


def checks(points: list[dict]) -> dict:
    """Per mode, the largest N against N = 1 (the pair alone): the ratio of draft time per drafted
    token and of per-token latency variance and CV, and whether each is lower in the star."""
    out = {}
    for mode, mine in by_mode(points).items():
        pair, star = mine[0], mine[-1]
        if pair["n"] != 1 or star["n"] == 1:
            continue
        per_token = [p["draft_ms_per_drafted_token"] for p in (pair, star)]
        ratio = per_token[1] / per_token[0] if None not in per_token else None
        var = star["per_token_latency_ms"]["variance"] / pair["per_token_latency_ms"]["variance"]
        cv = star["per_token_latency_ms"]["cv"] / pair["per_token_latency_ms"]["cv"]
        out[mode] = {"n": star["n"], "draft_ms_per_drafted_token_vs_pair": ratio,
                     "per_token_latency_variance_vs_pair": var, "per_token_latency_cv_vs_pair": cv,
                     "per_token_latency_p99_vs_pair": star["per_token_latency_ms"]["p99"]
                     / pair["per_token_latency_ms"]["p99"],
                     "draft_time_per_token_lower": ratio is not None and ratio < 1.0,
                     "latency_variance_lower": var < 1.0}
    return out


def run(args, steps: Steps) -> dict:
    chosen = modes(C.from_args(C.DraftConfig, args, prefix="draft-"), args.modes.split(","))  # before recording
    inputs = harness.prepare(args)
    runner = harness.Runner(inputs, args)
    pair = C.from_args(C.PairConfig, args)
    points = []
    for mode, (draft, predraft) in chosen.items():
        star = start_server(pair, harness.server_config(args, serial=False, predraft=predraft))
        try:
            for n in harness.numbers(args.targets):
                steps.begin(f"{mode} N={n}")
                rows, go = runner.host(star.address, n, draft=draft)
                w0 = go + args.warmup_s
                w1 = w0 + args.measure_s
                stats = harness.server_stats(star.address)
                pt = {"mode": mode, "predraft": predraft, "adaptive": draft.adaptive,
                      **figures(rows, metrics.iterations(rows), stats["timeline"], stats["predraft_timeline"], n,
                                w0, w1)}
                points.append(pt)
                per_token = pt["draft_ms_per_drafted_token"]
                steps.end(f"{mode} N={n}: {per_token or 0:.1f} draft ms per drafted token, per-token latency "
                          f"p50 {pt['per_token_latency_ms']['p50']:.0f} p99 {pt['per_token_latency_ms']['p99']:.0f} "
                          f"ms, CV {pt['per_token_latency_ms']['cv']:.2f}, server {pt['draft_utilization']:.0%} busy")
        finally:
            star.close()
    return {"replay": {"targets": "replay (remote targets emulated, each as on a host of its own; the draft "
                                  "server is real)", "recording": inputs.recording_file,
                       "latency_profile": inputs.latency.to_json()},
            "settings": {k: v for k, v in vars(args).items() if k != "func"}, "points": points,
            "checks": checks(points)}


def _series(points: list[dict], key) -> list[dict]:
    return [{"label": mode, "x": [p["n"] for p in mine], "y": [key(p) for p in mine], "marker": "o"}
            for mode, mine in by_mode(points).items()]


def main(args) -> int:
    total = len(args.modes.split(",")) * len(harness.numbers(args.targets))
    with Steps("bench latency", total, step_s=args.warmup_s + args.measure_s) as steps:
        result = run(args, steps)
    write_json(args.json_out, result)
    stem = str(args.json_out).rsplit(".", 1)[0]
    points = result["points"]
    panel_plot(stem + ".png", [
        {"series": _series(points, lambda p: p["draft_ms_per_drafted_token"] or 0.0), "xlabel": "targets N",
         "ylabel": "draft server ms per drafted token", "title": "Draft time per drafted token", "logx": True},
        {"series": [s | {"label": f"{s['label']} {q}", "ls": ls} for q, ls in (("p50", "-"), ("p99", "--"))
                    for s in _series(points, lambda p, q=q: p["per_token_latency_ms"][q])],
         "xlabel": "targets N", "ylabel": "ms", "title": "A target's per-token latency", "logx": True},
        {"series": _series(points, lambda p: p["per_token_latency_ms"]["cv"]), "xlabel": "targets N",
         "ylabel": "std / mean", "title": "Per-token latency: coefficient of variation", "logx": True}])
    summary("One pair alone (N = 1) against the same pair in a star of N",
            ["mode", "N", "tok/s per target", "draft ms / drafted token", "server busy", "idle gap p50 (ms)",
             "per-token p50 / p99 (ms)", "per-token std (ms)", "CV"],
            [[p["mode"], p["n"], f"{p['per_target_tokens_per_s']:.2f}", f"{p['draft_ms_per_drafted_token'] or 0:.1f}",
              f"{p['draft_utilization']:.0%}", f"{p['idle_gap_ms']['p50']:.0f}",
              f"{p['per_token_latency_ms']['p50']:.0f} / {p['per_token_latency_ms']['p99']:.0f}",
              f"{p['per_token_latency_ms']['std']:.0f}", f"{p['per_token_latency_ms']['cv']:.2f}"] for p in points],
            {f"{mode} N={c['n']}": f"draft time per token {c['draft_ms_per_drafted_token_vs_pair'] or 0:.2f}x, "
             f"latency variance {c['per_token_latency_variance_vs_pair']:.2f}x, CV "
             f"{c['per_token_latency_cv_vs_pair']:.2f}x the pair alone" for mode, c in result["checks"].items()},
            {"results": args.json_out, "plot": stem + ".png"})
    return 0
