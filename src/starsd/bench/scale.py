"""Scaling benchmark: the star against N, side by side with its baselines, in one run.

Targets are replay targets (replay.py: remote target machines emulated from the real target's
recorded greedy continuations and verify latency, costing this machine nothing); the draft server
is real. Modes, each measured over the same window after a warm-up, at the fixed depth
--draft-depth without pre-drafting (the analytical model's subject) unless said otherwise:
- target-only, single-pair (each target with a draft server of its own): measured at N = 1, the
  system figure N times it (targets on separate machines do not interact);
- serial, batched: one draft server for N targets, one request at a time or the batched loop;
- adaptive: batched, each target choosing its depth step by step (spec_decode/depth.py);
- predraft: batched, pre-drafting in its idle time (star/ahead.py); star: both (the defaults);
- eagle (--eagle): batched, drafting with an EAGLE head from the recorded target features;
- batched-dD: batched at another fixed depth D (--fixed-depths): the best fixed depth at each N.
The analytical model (sysmodel.py) and the simulator (simulate.py) get its profile: S(b), the
server's mean batch time by batch size over every server point, and R and tau from the
single-pair point. Writes JSON (points, profile, checks) and plots; `--reanalyse JSON` redoes
predictions, checks and plots from a result. Modes in full: docs/scaling.md#what-bench-scale-runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from starsd import config as C
from starsd.bench import harness, metrics
from starsd.bench.profiles import build_profile, calibrated_profile, work_figures
from starsd.errors import SettingError
from starsd.models.drafter import Drafter
from starsd.emulate.replay import load_features
from starsd.models.loading import load_eagle, load_model
from starsd.results import Steps, line_plot, panel_plot, summary, write_json
from starsd.star.launch import start_server
from starsd.theory import simulate, sysmodel

SWEEP = [1, 2, 4, 8, 16, 32, 48]  # batch sizes of the service sweep


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_star_args(p, json_out="results/scale.json")
    p.add_argument("--modes", default="target-only,single-pair,serial,batched,adaptive,predraft,star",
                   help="modes to measure, comma-separated")
    p.add_argument("--fixed-depths", default="", metavar="D,D",
                   help="also run the batched server at these fixed draft depths (modes batched-dD)")
    p.add_argument("--reanalyse", default=None, metavar="JSON",
                   help="measure nothing: redo the model's and the simulator's predictions, the checks and "
                        "the plots of a result JSON from its measured points and profile")


def run_server_mode(runner: harness.Runner, address: str, ns: list[int], mode: str, draft: C.DraftConfig,
                    predraft: bool, steps: Steps) -> tuple[list[dict], dict[int, list[metrics.Iteration]]]:
    """One mode's points against the draft server at `address` (modes with the same server
    settings share one: its sessions end with each point)."""
    points = []
    its = {}
    for n in ns:
        steps.begin(f"{mode} N={n}")
        before = harness.server_stats(address)
        pt, its[n] = runner.point(address, n, draft=draft)
        pt = {"mode": mode, "draft_depth": draft.depth, "adaptive": draft.adaptive, "predraft": predraft, **pt}
        after = harness.server_stats(address)
        pt["server_work"] = work_figures(before, after)
        if predraft:
            pt["predrafting"] = predraft_figures(before, after)
        points.append(pt)
        steps.end(f"{mode} N={n}: {pt['system_tokens_per_s']:.1f} tok/s, utilisation {pt['draft_utilization']:.0%}, "
                  f"batch {pt.get('mean_batch', 0):.1f}, drafted {pt['drafted_share']:.0%} of steps, "
                  f"latency CV {pt['latency_cv']:.2f}, {pt['server_work']['reset_token_share']:.0%} of the "
                  f"tokens ingested by resets")
    return points, its


def predraft_figures(before: dict, after: dict) -> dict:
    """What pre-drafting did over one point (warm-up and window): outcomes pre-drafted, requests
    answered from a pre-draft (hits) and not (misses: other tokens than it assumed, or cut too
    short), batches cut short for a request, and its compute time; hit_rate = hits / draft requests."""
    d = {k: after["predraft"][k] - before["predraft"][k] for k in after["predraft"]}
    requests = after["requests"] - before["requests"]
    return d | {"requests": requests, "hit_rate": d["hits"] / requests if requests else 0.0}


def derived(base: dict, mode: str, ns: list[int]) -> list[dict]:
    """N independent copies of a one-target point (targets on machines of their own do not interact)."""
    out = []
    for n in ns:
        pt = {k: v for k, v in base.items() if k != "utilization_over_time"}
        pt.update(mode=mode, n=n, system_tokens_per_s=base["system_tokens_per_s"] * n, derived_from_n=1)
        pt.setdefault("draft_utilization", None)  # target-only decoding has no draft server
        out.append(pt)
    return out


def eagle_figures(points: list[dict], its: dict, target_only: dict, max_batch: int, service: dict) -> dict:
    """The EAGLE head's server: its own profile (S(b) from its points, R and tau from its N = 1
    point), its N_full measured and predicted, each point's prediction, and its service sweep."""
    mine = sorted((p for p in points if p["mode"] == "eagle"), key=lambda p: p["n"])
    profile = build_profile(points, its[("eagle", 1)], target_only, max_batch, modes=("eagle",))
    x1 = mine[0]["system_tokens_per_s"] if mine[0]["n"] == 1 else None
    n_full = {"measured": max(p["system_tokens_per_s"] for p in mine) / x1 if x1 else None,
              "predicted": sysmodel.n_full(profile, False)}
    for p in mine:
        p.update(predicted_system_tokens_per_s=sysmodel.predict(profile, p["n"], False).system_tokens_per_s,
                 n_full_measured=n_full["measured"], n_full_predicted=n_full["predicted"])
    return {"profile": profile.to_json(), "n_full": n_full, "service_sweep_ms": service,
            "tokens_per_iteration": profile.tokens_per_iteration}


def calibrations(result: dict, in_sample: sysmodel.Profile) -> dict[str, sysmodel.Profile | None]:
    """A result's model calibrated apart, with the resets' cost (the one reported as out of sample)
    and without it, as it was before the sweep timed resets (beside it, for comparison)."""
    args = (result["points"], result.get("service_sweep_ms"), in_sample, result.get("acceptance_tokens"))
    return {"out_of_sample": calibrated_profile(*args, result.get("reset_ms_per_token")),
            "out_of_sample_without_resets": calibrated_profile(*args)}


def out_of_sample(points: list[dict], profile: sysmodel.Profile | None) -> dict:
    """The calibrated model's errors at every N but the one it was calibrated on, and on N_full.
    N_full is measured twice: as the model defines it, in iterations (the saturated server's
    iteration rate over the N = 1 point's), and in tokens (as `n_full`), which also moves with the
    acceptance of the prompts each window happened to cover."""
    if profile is None:
        return {}
    out = {"profile_service_ms": {str(b): round(v, 1) for b, v in profile.service_ms.items()},
           "profile_tokens_per_iteration": round(profile.tokens_per_iteration, 3)}
    for mode in ("serial", "batched"):
        mine = sorted((p for p in points if p["mode"] == mode), key=lambda p: p["n"])
        if not mine:
            continue
        errors = {str(p["n"]): round(sysmodel.predict(profile, p["n"], mode == "serial").system_tokens_per_s
                                     / p["system_tokens_per_s"] - 1, 3) for p in mine if p["n"] != 1}
        predicted = sysmodel.n_full(profile, mode == "serial")
        measured = mine[0]["n_full_measured"] if mine[0]["n"] == 1 else None
        rate = [p["iterations"] / p["window_s"] for p in mine]
        in_its = max(rate) / rate[0] if measured and rate[0] else None
        out[mode] = {"throughput_errors": errors,
                     "throughput_max_error": max(map(abs, errors.values())) if errors else None,
                     "n_full_predicted": predicted, "n_full_measured": measured,
                     "n_full_error": abs(predicted / measured - 1) if measured else None,
                     "n_full_measured_iterations": in_its,
                     "n_full_error_iterations": abs(predicted / in_its - 1) if in_its else None}
    return out


def annotate(points: list[dict], profile: sysmodel.Profile, seed: int) -> dict:
    """Add model and simulator predictions to each draft-server point; return N_full per mode."""
    sims = {(s["mode"], s["n"]): s for s in simulate.compare(profile, points, seed)}
    n_full = {}
    for mode in ("serial", "batched"):
        mine = [p for p in points if p["mode"] == mode]
        if not mine:
            continue
        x1 = next((p["system_tokens_per_s"] for p in mine if p["n"] == 1), None)
        n_full[mode] = {"measured": max(p["system_tokens_per_s"] for p in mine) / x1 if x1 else None,
                        "predicted": sysmodel.n_full(profile, mode == "serial")}
        for p in mine:
            pred = sysmodel.predict(profile, p["n"], mode == "serial")
            p.update(predicted_system_tokens_per_s=pred.system_tokens_per_s, predicted_utilization=pred.utilization,
                     simulated_system_tokens_per_s=sims[(mode, p["n"])]["simulated_tokens_per_s"],
                     n_full_measured=n_full[mode]["measured"], n_full_predicted=n_full[mode]["predicted"])
    return n_full


def checks(points: list[dict], n_full: dict, calibrated: dict[str, sysmodel.Profile | None] | None = None) -> dict:
    """The issue's targets, each with the figures it was judged on (`calibrated`: the model's
    profiles calibrated apart, by the key their out-of-sample errors go under)."""
    by = {m: sorted((p for p in points if p["mode"] == m), key=lambda p: p["n"]) for m in {p["mode"] for p in points}}
    out = {}
    for mode, nf in n_full.items():
        loaded = [p for p in by[mode] if nf["measured"] and p["n"] >= nf["measured"]]
        errs = [abs(p["predicted_system_tokens_per_s"] / p["system_tokens_per_s"] - 1) for p in by[mode]]
        sim_errs = [abs(p["simulated_system_tokens_per_s"] / p["system_tokens_per_s"] - 1) for p in by[mode]]
        out[mode] = {
            "utilization_past_n_full": [round(p["draft_utilization"], 3) for p in loaded],
            "utilization_past_n_full_ge_90pct": all(p["draft_utilization"] >= 0.9 for p in loaded) if loaded else None,
            "n_full_error": abs(nf["predicted"] / nf["measured"] - 1) if nf["measured"] else None,
            "throughput_max_error": max(errs),
            "throughput_errors": [round(e, 3) for e in errs],
            "simulator_max_error": max(sim_errs),
            "simulator_errors": [round(e, 3) for e in sim_errs],
        }
    if "serial" in n_full and "batched" in n_full:
        sat = {m: max(p["system_tokens_per_s"] for p in by[m]) for m in ("serial", "batched")}
        out["batched_vs_serial"] = {"n_full_ratio": n_full["batched"]["measured"] / n_full["serial"]["measured"],
                                    "saturated_throughput_ratio": sat["batched"] / sat["serial"]}
    out.update(depth_checks(by))
    out.update(predraft_checks(by))
    for key, profile in (calibrated or {"out_of_sample": None}).items():
        out[key] = out_of_sample(points, profile)
    if "single-pair" in by and "batched" in n_full:
        at = min(by["batched"], key=lambda p: abs(p["n"] - n_full["batched"]["measured"]))
        out["latency_cv"] = {"single_pair": by["single-pair"][0]["latency_cv"], "batched_n": at["n"],
                             "batched_at_n_full": at["latency_cv"]}
    return out


def depth_checks(by: dict[str, list[dict]]) -> dict:
    """Every server mode's per-target throughput against target-only, and the adaptive depth's system
    throughput against the best fixed depth measured at the same N."""
    out = {}
    fixed = sorted((m for m in by if m == "batched" or m.startswith("batched-d")),
                   key=lambda m: by[m][0].get("draft_depth", 0))
    if "target-only" in by:
        alone = by["target-only"][0]["per_target_tokens_per_s"]
        out["per_target_vs_target_only"] = {
            m: {str(p["n"]): round(p["per_target_tokens_per_s"] / alone, 3) for p in by[m]}
            for m in ("star", "adaptive", "predraft", *fixed, "serial") if m in by}
        if "adaptive" in by:
            out["adaptive_min_vs_target_only"] = min(p["per_target_tokens_per_s"] / alone for p in by["adaptive"])
    if "adaptive" in by and fixed:
        rows = []
        for p in by["adaptive"]:
            same_n = [q for m in fixed for q in by[m] if q["n"] == p["n"]]
            if same_n:
                best = max(same_n, key=lambda q: q["system_tokens_per_s"])
                rows.append({"n": p["n"], "adaptive": round(p["system_tokens_per_s"], 2),
                             "best_fixed": round(best["system_tokens_per_s"], 2), "best_fixed_depth": best.get("draft_depth"),
                             "ratio": round(p["system_tokens_per_s"] / best["system_tokens_per_s"], 3),
                             "adaptive_drafted_share": round(p["drafted_share"], 3)})
        out["adaptive_vs_best_fixed"] = rows
        out["adaptive_min_vs_best_fixed"] = min(r["ratio"] for r in rows) if rows else None
    return out


def predraft_checks(by: dict[str, list[dict]]) -> dict:
    """System throughput with pre-drafting against the same mode without it, at each N, and its hit rate."""
    out = {}
    for on, off in (("predraft", "batched"), ("star", "adaptive")):
        if on in by and off in by:
            rows = []
            for p in by[on]:
                q = next((q for q in by[off] if q["n"] == p["n"]), None)
                if q:
                    rows.append({"n": p["n"], "with": round(p["system_tokens_per_s"], 2),
                                 "without": round(q["system_tokens_per_s"], 2),
                                 "ratio": round(p["system_tokens_per_s"] / q["system_tokens_per_s"], 3),
                                 "hit_rate": round(p["predrafting"]["hit_rate"], 3)})
            out[f"{on}_vs_{off}"] = rows
    return out


def predraft_ceiling(alone: list[metrics.Iteration]) -> float | None:
    """The most pre-drafting could gain at N = 1 (`alone`: the batched N = 1 point's iterations): every
    draft answered at once, each iteration shorter by its draft's round trip and nothing else. A
    target whose verify dwarfs its draft's wait has little to win here, whatever the hit rate."""
    total = sum(it.ms for it in alone)
    saved = sum(it.wall_ms for it in alone)
    return total / (total - saved) if alone and total > saved else None


COLOURS = {"target-only": "#7f7f7f", "single-pair": "#2ca02c", "serial": "#ff7f0e", "batched": "#1f77b4",
           "adaptive": "#d62728", "predraft": "#9467bd", "star": "#000000", "eagle": "#e6ab02"}
MORE_COLOURS = ["#8c564b", "#e377c2", "#17becf", "#bcbd22"]  # batched-dD modes, in turn


def plot(path_stem: str, result: dict) -> None:
    """The three PNGs, from a result JSON: throughput vs N (system and per target) with the model's
    prediction, utilisation over time, per-token latency CDF."""
    points = result["points"]
    profile = sysmodel.Profile.from_json(result["profile"])
    calibrated = calibrations(result, profile)["out_of_sample"]
    ns = sorted({p["n"] for p in points})
    colours = COLOURS | dict(zip(sorted({p["mode"] for p in points} - set(COLOURS)), MORE_COLOURS))
    panels = []
    for key, ylabel in (("system_tokens_per_s", "system tokens / s"), ("per_target_tokens_per_s", "tokens / s per target")):
        series = []
        for mode, colour in colours.items():
            mine = sorted((p for p in points if p["mode"] == mode), key=lambda p: p["n"])
            if not mine:
                continue
            series.append({"label": f"{mode} (measured)", "x": [p["n"] for p in mine], "y": [p[key] for p in mine],
                           "marker": "o", "color": colour})
            if mode in ("serial", "batched"):
                grid = list(range(1, max(ns) + 1))
                for prof, label, ls in ((profile, "model, in-sample", "--"), (calibrated, "model, calibrated apart", ":")):
                    if prof is not None:
                        pred = [sysmodel.predict(prof, n, mode == "serial") for n in grid]
                        series.append({"label": f"{mode} ({label})", "x": grid, "ls": ls, "color": colour,
                                       "y": [getattr(r, key) for r in pred]})
        panels.append({"series": series, "xlabel": "targets N", "ylabel": ylabel, "logx": True, "logy": True,
                       "title": ylabel.capitalize() + " vs N"})
    panel_plot(f"{path_stem}.png", panels)
    panels = []
    for mode in ("serial", "batched"):
        mine = [p for p in points if p["mode"] == mode and "utilization_over_time" in p]
        panels.append({"xlabel": "seconds into the window", "ylabel": "draft server busy share",
                       "title": f"{mode} draft server utilisation", "series": [
                           {"label": f"N={p['n']}", "x": list(range(len(p["utilization_over_time"]))),
                            "y": p["utilization_over_time"]} for p in mine]})
    panel_plot(f"{path_stem}-utilization.png", panels)
    cdf = [{"label": label, "x": lat, "y": [(i + 1) / len(lat) for i in range(len(lat))],
            "color": COLOURS[label.split()[0]]} for label, lat in result.get("latency_cdf_ms", {}).items()]
    if cdf:
        line_plot(f"{path_stem}-latency.png", cdf, "per-token latency (ms)", "CDF",
                  "Per-token latency (single pair; one server at its N_full)")


def show(result: dict, json_out: str, extra_files: dict[str, str] | None = None) -> None:
    """The summary on the terminal: system tokens/s by mode and N, and the main checks."""
    points = result["points"]
    ns = sorted({p["n"] for p in points})
    order = list(COLOURS)  # the plots' order; batched-dD modes after them
    modes = sorted({p["mode"] for p in points}, key=lambda m: (order.index(m) if m in order else len(order), m))
    at = {(p["mode"], p["n"]): p for p in points}
    rows = [[mode, *(f"{at[mode, n]['system_tokens_per_s']:.1f}" if (mode, n) in at else None for n in ns)]
            for mode in modes]
    facts = {}
    for mode, nf in result["n_full"].items():
        c = result["checks"][mode]
        last = at.get((mode, ns[-1]), {}).get("draft_utilization")
        facts[f"{mode} server"] = (f"N_full {_num(nf['measured'])} measured, {_num(nf['predicted'])} predicted; "
                                   f"model error {c['throughput_max_error']:.0%} at most, simulator "
                                   f"{c['simulator_max_error']:.0%}; utilisation {_pct(last)} at N={ns[-1]}")
    fairest = {mode: at[mode, ns[-1]]["jain_index"] for mode in modes if "jain_index" in at.get((mode, ns[-1]), {})}
    if fairest:
        facts[f"fairness at N={ns[-1]}"] = "Jain's index " + ", ".join(f"{m} {j:.3f}" for m, j in fairest.items())
    if "batched_vs_serial" in result["checks"]:
        ratio = result["checks"]["batched_vs_serial"]["saturated_throughput_ratio"]
        facts["batched vs serial"] = f"{ratio:.2f}x the saturated system throughput"
    if "eagle" in result:
        e, b = result["eagle"], result["n_full"].get("batched", {})
        facts["EAGLE head server"] = (f"N_full {_num(e['n_full']['measured'])} measured, "
                                      f"{_num(e['n_full']['predicted'])} predicted (draft model: "
                                      f"{_num(b.get('measured'))}, {_num(b.get('predicted'))}); "
                                      f"{e['tokens_per_iteration']:.2f} tokens per iteration (draft model: "
                                      f"{sysmodel.Profile.from_json(result['profile']).tokens_per_iteration:.2f})")
    for mode in ("serial", "batched"):
        apart = {k: result["checks"].get(k, {}).get(mode) for k in ("out_of_sample", "out_of_sample_without_resets")}
        if apart["out_of_sample"] and apart["out_of_sample"]["throughput_max_error"] is not None:
            facts[f"{mode}, model calibrated apart"] = ", ".join(
                f"{label} {_pct(c['throughput_max_error'])} at most, N_full {_pct(c['n_full_error'])}"
                for label, c in zip(("error", "without resets"), apart.values()) if c)
    if result["checks"].get("adaptive_min_vs_best_fixed") is not None:
        facts["adaptive depth"] = (f"{result['checks']['adaptive_min_vs_best_fixed']:.2f}x the best fixed depth "
                                   "at its worst N")
    if result["checks"].get("predraft_ceiling_n1"):
        facts["pre-drafting"] = (f"at most {result['checks']['predraft_ceiling_n1']:.2f}x at N=1 (every draft "
                                 "answered at once), " + ", ".join(
                                     f"{r['ratio']:.2f}x at N={r['n']} ({r['hit_rate']:.0%} hits)"
                                     for r in result["checks"].get("star_vs_adaptive", [])))
    stem = str(json_out).rsplit(".", 1)[0]
    files = {"JSON": json_out, "plots": f"{stem}.png, {stem}-utilization.png"
             + (f", {stem}-latency.png" if result.get("latency_cdf_ms") else ""), **(extra_files or {})}
    summary("bench scale: system tokens/s by mode and number of targets N", ["mode", *(f"N={n}" for n in ns)],
            rows, facts, files)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def reanalyse(path: str, seed: int) -> int:
    result = json.loads(Path(path).read_text())
    profile = sysmodel.Profile.from_json(result["profile"])
    n_full = annotate(result["points"], profile, seed)
    calibrated = calibrations(result, profile)
    measured_only = {k: v for k, v in result["checks"].items() if k == "predraft_ceiling_n1"}  # needs iterations
    result.update(n_full=n_full, checks=checks(result["points"], n_full, calibrated) | measured_only)
    write_json(path, {k: v for k, v in result.items() if k != "meta"} | {"reanalysed_from": result.get("meta")})
    plot(str(path).rsplit(".", 1)[0], result)
    show(result, path)
    return 0


def latency_cdf(its: dict, n_full: dict) -> dict[str, list[float]]:
    """Sorted per-token latencies of the single pair and of each server mode at its measured N_full."""
    chosen = {"single-pair N=1": its[("batched", 1)]}
    for mode in ("serial", "batched"):
        if mode in n_full and n_full[mode]["measured"]:
            n = min((n for m, n in its if m == mode), key=lambda n: abs(n - n_full[mode]["measured"]))
            chosen[f"{mode} N={n}"] = its[(mode, n)]
    return {label: [round(x, 2) for x in sorted(metrics.per_token_latencies(v))] for label, v in chosen.items()}


def server_modes(draft: C.DraftConfig, fixed_depths: str, eagle: bool = False) -> list[tuple[str, C.DraftConfig, bool]]:
    """Each draft-server mode: how its targets draft, and whether the server pre-drafts."""
    fixed = dataclasses.replace(draft, adaptive=False)
    adaptive = dataclasses.replace(draft, adaptive=True)
    out = [("batched", fixed, False), ("serial", fixed, False), ("adaptive", adaptive, False),
           ("predraft", fixed, True), ("star", adaptive, True)] + ([("eagle", fixed, False)] if eagle else [])
    return out + [(f"batched-d{d}", dataclasses.replace(fixed, depth=d), False)
                  for d in (harness.numbers(fixed_depths) if fixed_depths else []) if d != draft.depth]


def plan_points(server_modes: list[tuple[str, C.DraftConfig, bool]], modes: list[str], ns: list[int]) -> list[tuple]:
    """What each server mode runs: (mode, how its targets draft, whether its server pre-drafts, its
    Ns, whether its points are reported). The batched server's N = 1 point is the analytical model's
    R and tau: it runs whatever was asked (unreported where N = 1 or batched was not)."""
    plan = []
    for mode, draft, predraft in server_modes:
        wanted = mode in modes or mode.startswith("batched-d") or mode == "eagle"
        if mode == "batched" and not (wanted and 1 in ns):
            plan.append((mode, draft, predraft, [1], False))
        if wanted:
            plan.append((mode, draft, predraft, ns, True))
    return plan


def main(args) -> int:
    if args.reanalyse:
        return reanalyse(args.reanalyse, args.seed)
    ns = harness.numbers(args.targets)
    modes = args.modes.split(",")
    known = ["target-only", "single-pair", "serial", "batched", "adaptive", "predraft", "star"]
    if set(modes) - set(known):
        raise SettingError(f"unknown modes {sorted(set(modes) - set(known))}: {', '.join(known)} "
                         "(more fixed depths: --fixed-depths; an EAGLE head: --eagle)")
    pair = C.from_args(C.PairConfig, args)
    torch.set_num_threads(args.threads)
    stem = str(args.json_out).rsplit(".", 1)[0]
    inputs = harness.prepare(args)
    sizes = [b for b in SWEEP if b <= args.max_batch]
    drafter = Drafter(load_model(pair.draft_model(), pair.cache))
    sweep = harness.measure_service(drafter, inputs.recording, sizes, inputs.draft)
    service = {b: v["service_ms"] for b, v in sweep.items()}
    tokens = harness.measure_acceptance(drafter, inputs.recording, inputs.draft)
    del drafter
    eagle_service = {}
    if pair.eagle:
        head = Drafter(load_eagle(pair.eagle_model(), pair.target_model(), pair.cache))
        eagle_service = {b: v["service_ms"] for b, v in harness.measure_service(
            head, inputs.recording, sizes, inputs.draft,
            features=load_features(inputs.recording_file, head.taps)).items()}
        del head
    runner = harness.Runner(inputs, args)
    plan = plan_points(server_modes(inputs.draft, args.fixed_depths, bool(pair.eagle)), modes, ns)
    its = {}
    servers = {}  # (serial, predraft, eagle) -> a running draft server
    with Steps("bench scale", 1 + sum(len(p[3]) for p in plan), step_s=args.warmup_s + args.measure_s) as steps:
        steps.begin("target-only N=1")
        alone, alone_its = runner.point(None, 1, no_spec=True)
        steps.end(f"target-only: {alone['per_target_tokens_per_s']:.2f} tok/s per target")
        points = derived(alone, "target-only", ns) if "target-only" in modes else []
        unshown = []  # points run for the model only
        try:
            for mode, draft, predraft, mode_ns, wanted in plan:
                key = (mode == "serial", predraft, mode == "eagle")
                if key not in servers:
                    steps.say(f"starting a draft server for {mode}")
                    servers[key] = start_server(pair if mode == "eagle" else dataclasses.replace(pair, eagle=""),
                                                harness.server_config(args, *key[:2]))
                pts, mode_its = run_server_mode(runner, servers[key].address, mode_ns, mode, draft, predraft, steps)
                (points if wanted else unshown).extend(pts)  # the model's N = 1 point, shown or not
                its.update({(mode, n): v for n, v in mode_its.items()})
                if mode == "batched" and "single-pair" in modes and 1 in mode_ns:
                    points += derived(pts[mode_ns.index(1)], "single-pair", ns)
        finally:
            for star in servers.values():
                star.close()
    profile = build_profile(points + unshown, its[("batched", 1)], alone, args.max_batch)
    n_full = annotate(points, profile, args.seed)
    result = {
        "replay": {"targets": "replay (remote targets emulated; the draft server is real)",
                   "recording": inputs.recording_file, "latency_profile": inputs.latency.to_json()},
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "profile": profile.to_json(), "service_sweep_ms": service, "acceptance_tokens": tokens,
        "reset_ms_per_token": harness.reset_cost(sweep), "n_full": n_full, "points": points,
    }
    result["checks"] = checks(points, n_full, calibrations(result | {"points": points + unshown}, profile))
    result["checks"]["predraft_ceiling_n1"] = predraft_ceiling(its[("batched", 1)])
    if pair.eagle:
        result["eagle"] = eagle_figures(points, its, alone, args.max_batch, eagle_service) | {"head": pair.eagle}
    result["latency_cdf_ms"] = latency_cdf(its, n_full)
    write_json(args.json_out, result)
    plot(stem, result)
    show(result, args.json_out, {"latency profile": None if args.latency else inputs.latency_file})
    return 0
