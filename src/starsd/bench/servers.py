"""Several draft servers: two against one, past what one can serve, and one of the two killed.

Replay targets (replay.py) decode against real draft servers, each pinned to a core of its own
(taskset), so one draft host is one core and the one-server baseline has one core too. Side by
side in one run, over the same window:
- one server (core 0), N targets (8 by default);
- two servers (cores 0 and 1), the same N: target i opens its session at server i mod 2
  (client.for_target), and moves to the other when its server dies or has no room;
- the same two, server 1 killed (SIGKILL) --kill-at-s into the window: its sessions move to
  server 0, each with a reset of its whole accepted prefix.
Reported: system tokens/s and two servers' ratio to one; for the kill, whether every output is the
recording's (a replay target stops at the first token that differs), the moves, and each moved
target's gap from the kill to its first drafted step after it. The simulator's prediction for one
and two servers (theory/simulate.py) is calibrated apart, before the runs, on one server and one
target (the service sweep, the recording's acceptance and each draft's levels, then S(1), R and
resets); it cuts batches short as the server does, and assumes a fixed depth (--no-draft-adaptive):
it is marked so otherwise; --no-model-check skips it.
Figures and the calibration: docs/scaling.md#two-draft-servers-against-one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

from starsd import config as C
from starsd.bench import harness, metrics, profiles
from starsd.models.drafter import Drafter
from starsd.models.loading import load_model
from starsd.results import Steps, bar_plot, summary, write_json
from starsd.star.launch import Star, start_server
from starsd.theory import simulate, sysmodel


NICE = ["nice", "-n", "-10"] if os.geteuid() == 0 else []  # the replay host before the servers: it stands for
# hosts of its own, and a server pre-drafting in its idle time would otherwise starve its emulated passes


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_star_args(p, "results/servers.json")
    p.add_argument("--kill-at-s", type=float, default=10.0, help="seconds into the window the second server dies")
    p.add_argument("--no-model-check", dest="model_check", action="store_false",
                   help="skip the simulator's prediction (its calibration takes a few minutes)")
    p.set_defaults(targets="8", warmup_s=20.0, measure_s=40.0)


def servers(args, cores: list[int]) -> Star:
    """One draft server per core, each pinned to it, at one thread (--threads is the recorded target's)."""
    pair = dataclasses.replace(C.from_args(C.PairConfig, args), threads=1)
    star = Star([], [])
    try:
        for core in cores:
            one = start_server(pair, harness.server_config(args, serial=False, predraft=True),
                               prefix=["taskset", "-c", str(core)])
            star.servers += one.servers
            star.addresses += one.addresses
    except BaseException:
        star.close()
        raise
    return star


def run_point(runner: harness.Runner, star: Star, n: int, kill_at: float | None = None) -> tuple[list[dict], float]:
    """The replay host against the star's servers for warm-up + window; with `kill_at`, the last
    server is killed that many seconds into the window. Returns its rows and its go time."""
    def kill(go: float) -> None:
        time.sleep(max(0.0, go + runner.args.warmup_s + kill_at - time.time()))
        star.servers[-1].kill()
        star.servers[-1].wait()

    return runner.host(star.address, n, during=None if kill_at is None else kill)


def figures(rows: list[dict], n: int, go: float, args) -> dict:
    w0 = go + args.warmup_s
    return metrics.point(metrics.iterations(rows), n, w0, w0 + args.measure_s)


def takeover(rows: list[dict], killed: str, killed_at: float) -> dict:
    """What the kill of the server at `killed` cost. The targets whose session was there at the kill
    (the first move after it leaves from there, else the last row still says so: a session may have
    been spread to it or away from it before) and, for each, the seconds from the kill to the end of
    its first drafted step begun after it (a step begun before may verify a draft the killed server
    sent); the moves after the kill; and the targets whose session is elsewhere at the end."""
    steps: dict[str, list[tuple[float, float, int]]] = {}  # target -> (began, ended, depth)
    last: dict[str, dict] = {}  # each target's last row: its moves so far and where it drafts now
    for r in sorted(rows, key=lambda r: r["finished"]):
        began = r["started"]
        for (end, _), depth in zip(r["trace"], r["depths"]):
            steps.setdefault(r["target"], []).append((began, end, depth))
            began = end
        last[r["target"]] = r
    gaps = {}
    moved_after = 0
    for name, r in sorted(last.items()):
        after = [m for m in r["relocations"] if m[0] > killed_at]
        moved_after += len(after)
        if (after[0][1] if after else r["server"]) != killed:
            continue
        drafted = [end for began, end, depth in sorted(steps[name]) if began > killed_at and depth]
        gaps[name] = drafted[0] - killed_at if drafted else None
    known = [g for g in gaps.values() if g is not None]
    return {"on_the_killed": len(gaps), "moves_after": moved_after,
            "moves": sum(r["moves"] for r in last.values()),
            "elsewhere_at_the_end": sum(1 for r in last.values() if r["server"] != killed),
            "gap_s": gaps, "gap_median_s": statistics.median(known) if known else None,
            "gap_max_s": max(known) if known and len(known) == len(gaps) else None,
            "tokens_lost": 0}  # replay targets verify every token against the recording: a lost or
    # changed token fails the run (run_point raises), so a result means none was


def calibrate(args, inputs: harness.Inputs, runner: harness.Runner, steps: Steps) -> sysmodel.Profile:
    """The simulator's profile from runs apart from the N-target ones: the service sweep and the
    acceptance in this process pinned to core 0 at one thread, then one target against one server
    on core 0 (profiles.calibrated_profile)."""
    steps.begin("calibrating the simulator: service sweep and acceptance on core 0")
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    try:
        pair = C.from_args(C.PairConfig, args)
        drafter = Drafter(load_model(pair.draft_model(), pair.cache))
        sweep = harness.measure_service(drafter, inputs.recording, [b for b in (1, 2, 4, 8) if b <= args.max_batch],
                                        inputs.draft)
        tokens, levels = harness.measure_drafts(drafter, inputs.recording, inputs.draft)
        del drafter
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    steps.end()
    steps.begin("calibrating the simulator: one target, one server (core 0)")
    star = servers(args, [0])
    try:
        before = harness.server_stats(star.address)
        point, its = runner.point(star.address, 1)
        point = {"mode": "batched", **point, "server_work": profiles.work_figures(before, harness.server_stats(star.address))}
    finally:
        star.close()
    target_only = {"per_target_tokens_per_s": 1e3 / inputs.latency.mean(1)}  # a replay target decoding alone
    in_sample = profiles.build_profile([point], its, target_only, args.max_batch, modes=("batched",))
    profile = profiles.calibrated_profile([point], {b: v["service_ms"] for b, v in sweep.items()}, in_sample, tokens,
                                       harness.reset_cost(sweep), levels)
    steps.end(f"S(1) {profile.service(1):.0f} ms, R {profile.return_ms:.0f} ms, tau {profile.tokens_per_iteration:.2f}")
    return profile


def predictions(profile: sysmodel.Profile, points: dict, n: int, seed: int, adaptive: bool) -> dict:
    """The simulator's system tokens/s for one and two servers against the measured, and the errors."""
    out = {"profile": profile.to_json(), "adaptive": adaptive}
    for name, k in (("one server", 1), ("two servers", 2)):
        sim = simulate.simulate(profile, n, servers=k, seed=seed)
        predicted = sim.system_tokens_per_s
        measured = points[name]["system_tokens_per_s"]
        uncut = simulate.simulate(dataclasses.replace(profile, levels_samples=()), n, servers=k,
                                  seed=seed).system_tokens_per_s
        out[name] = {"servers": k, "predicted_tokens_per_s": predicted, "measured_tokens_per_s": measured,
                     "error": predicted / measured - 1, "predicted_without_cuts_tokens_per_s": uncut,
                     "predicted_mean_batch": sim.mean_batch,
                     "predicted_tokens_per_iteration": sim.per_target_tokens_per_s * sim.t_gamma_ms / 1e3}
    out["max_error"] = max(abs(out[name]["error"]) for name in ("one server", "two servers"))
    out["two_over_one_predicted"] = (out["two servers"]["predicted_tokens_per_s"]
                                     / out["one server"]["predicted_tokens_per_s"])
    return out


def run(args, steps: Steps) -> dict:
    inputs = harness.prepare(args)
    runner = harness.Runner(inputs, args, NICE)
    n = harness.numbers(args.targets)[0]
    profile = calibrate(args, inputs, runner, steps) if args.model_check else None
    out = {}
    for name, cores, kill in (("one server", [0], None), ("two servers", [0, 1], None),
                              ("two servers, one killed", [0, 1], args.kill_at_s)):
        steps.begin(f"{name}, N={n}")
        star = servers(args, cores)
        try:
            rows, go = run_point(runner, star, n, kill)
            w0 = go + args.warmup_s
            busy = [metrics.busy_fraction(harness.server_stats(a)["timeline"], w0, w0 + args.measure_s)
                    for a, proc in zip(star.addresses, star.servers) if proc.poll() is None]
        finally:
            star.close()
        point = figures(rows, n, go, args)
        point["servers_busy"] = busy  # each live server's busy share of the window (the killed one's: none)
        if kill is not None:
            point["takeover"] = takeover(rows, star.addresses[-1], go + args.warmup_s + kill)
        out[name] = point
        steps.end(f"{name}: {point['system_tokens_per_s']:.2f} tok/s")
    one, two, killed = (out[k]["system_tokens_per_s"] for k in out)
    result = {"replay": {"targets": "replay (remote targets emulated; the draft servers are real)",
                         "recording": inputs.recording_file, "latency_profile": inputs.latency.to_json()},
              "settings": {k: v for k, v in vars(args).items() if k != "func"}, "targets": n, "points": out,
              "checks": {"two_over_one": two / one, "killed_over_one": killed / one,
                         "two_at_least_1_8x_one": two / one >= 1.8,
                         "takeover_within_2_s": (out["two servers, one killed"]["takeover"]["gap_max_s"] or 99) <= 2.0}}
    if profile is not None:
        result["model"] = predictions(profile, out, n, args.seed, inputs.draft.adaptive)
        result["checks"]["simulator_within_10pct"] = result["model"]["max_error"] <= 0.10
    return result


def main(args) -> int:
    with Steps("bench servers", 3 + 2 * args.model_check, step_s=args.warmup_s + args.measure_s + 20) as steps:
        result = run(args, steps)
    write_json(args.json_out, result)
    png = str(args.json_out).rsplit(".", 1)[0] + ".png"
    points = result["points"]
    bar_plot(png, list(points), [p["system_tokens_per_s"] for p in points.values()], "system tokens / s",
             f"{result['targets']} replay targets, draft servers on one core each")
    take = points["two servers, one killed"]["takeover"]
    facts = {k: f"{v:.2f}" if isinstance(v, float) else str(v) for k, v in result["checks"].items()}
    facts["takeover"] = (f"{take['on_the_killed']} targets on the killed server ({take['moves_after']} moves after the "
                         f"kill), {take['elsewhere_at_the_end']} elsewhere at the end; gap from the kill to a "
                         f"drafted step: median {take['gap_median_s']} s, max {take['gap_max_s']} s")
    if "model" in result:
        model = result["model"]
        facts["simulator"] = ", ".join(f"{name}: {model[name]['predicted_tokens_per_s']:.2f} predicted "
                                       f"({model[name]['error']:+.1%})" for name in ("one server", "two servers"))
        if model["adaptive"]:
            facts["simulator"] += " (the model assumes a fixed depth; this run's was adaptive)"
    summary("Several draft servers", ["servers", "system tok/s", "per target", "drafted"],
            [[k, f"{p['system_tokens_per_s']:.2f}", f"{p['per_target_tokens_per_s']:.2f}", f"{p['drafted_share']:.0%}"]
             for k, p in points.items()], facts, {"results": args.json_out, "plot": png})
    return 0
