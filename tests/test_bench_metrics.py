"""Benchmark arithmetic: iterations from traces, window figures, checks; and the scale benchmark
end to end on tiny models (real draft server, replay targets)."""

import json
import statistics
import subprocess
import sys

import pytest

import tiny
from starsd import cli
from starsd import config as C
from starsd.bench import harness, metrics, profiles, scale
from starsd.theory import sysmodel


def row(target, started, trace, wall=None):
    r = {"target": target, "started": started, "trace": trace}
    if wall is not None:
        k = len(trace)
        r["requests"] = {"wall": [wall] * k, "queue": [1.0] * k, "service": [10.0] * k, "batch": [2] * k}
    return r


def test_iterations_run_from_the_previous_step():
    its = metrics.iterations([row("a", 100.0, [(100.5, 3), (101.5, 2)], wall=12.0)])
    assert [(it.start, it.end, it.tokens) for it in its] == [(100.0, 100.5, 3), (100.5, 101.5, 2)]
    assert its[1].ms == pytest.approx(1000) and its[0].wall_ms == 12.0 and its[0].batch == 2
    assert metrics.iterations([row("b", 0.0, [(0.1, 1)])])[0].wall_ms == 0.0  # target-only: no draft request


def test_requests_belong_to_the_steps_that_asked_for_a_draft():
    r = {"target": "a", "started": 0.0, "trace": [(1.0, 3), (2.0, 1), (3.0, 1), (4.0, 2)], "asked": [4, 0, 2, 3],
         "requests": {"wall": [10.0, 20.0, 30.0], "queue": [1.0, 0.0, 3.0], "service": [5.0, 0.0, 6.0],
                      "batch": [2, 0, 4]}}  # the 2nd request was refused as busy
    its = metrics.iterations([r])
    assert [(it.wall_ms, it.batch) for it in its] == [(10.0, 2), (0.0, 0), (20.0, 0), (30.0, 4)]
    pt = metrics.point(its, 1, 0.0, 4.0)
    assert pt["drafted_share"] == 0.5 and pt["mean_batch"] == 3.0  # only answered drafts count
    assert pt["queue_ms"] == 2.0


def test_point_counts_only_the_window_and_defines_latency():
    rows = [row("a", 0.0, [(1.0, 4), (2.0, 2), (3.0, 1)], wall=12.0), row("b", 0.0, [(2.5, 5)], wall=12.0)]
    timeline = [(1.0, 1.5, 1), (2.0, 3.0, 2), (9.0, 10.0, 1)]
    pt = metrics.point(metrics.iterations(rows), 3, 1.5, 3.5, timeline)
    assert pt["iterations"] == 3 and pt["tokens"] == 8  # a's steps ending at 2 and 3, b's at 2.5
    assert pt["system_tokens_per_s"] == pytest.approx(4.0)
    assert pt["per_target_tokens_per_s"] == pytest.approx(8 / 2 / 3)
    assert pt["per_target_min_tokens_per_s"] == 0.0  # the third target never finished a step
    assert pt["jain_index"] == pytest.approx(8 ** 2 / (3 * (3 ** 2 + 5 ** 2)))  # tokens 3, 5 and 0
    assert metrics.jain([2.0, 2.0, 2.0]) == 1.0 and metrics.jain([6.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    lat = sorted([500.0] * 2 + [1000.0] + [500.0] * 5)  # per token: 1000/2, 1000/1, 2500/5
    assert pt["latency_mean_ms"] == pytest.approx(sum(lat) / len(lat))
    assert pt["latency_p50_ms"] == 500.0 and pt["latency_p99_ms"] == 1000.0
    assert pt["draft_utilization"] == pytest.approx(1.0 / 2.0) and pt["idle_ratio"] == pytest.approx(0.5)
    assert pt["overhead_ms"] == pytest.approx(1.0) and pt["return_ms"] == pytest.approx((1000 + 1000 + 2500) / 3 - 11)
    with pytest.raises(RuntimeError, match="window"):
        metrics.point(metrics.iterations(rows), 2, 50.0, 60.0)


def test_busy_over_time_bins():
    assert metrics.busy_over_time([(0.0, 0.5, 1), (1.25, 2.0, 3)], 0.0, 2.0) == [0.5, 0.75]


def test_settings_round_trip_through_the_cli():
    """to_flags is from_args' inverse: a process started with a config's flags holds that config."""
    from starsd.cli import build_parser

    draft = C.DraftConfig(depth=6, top_k=1, sample=True, min_path_prob=0.1)
    argv = ["replay-targets", "--connect", "x", "--recording", "r", "--latency", "l", *C.to_flags(draft, prefix="draft-")]
    assert C.from_args(C.DraftConfig, build_parser(argv).parse_args(argv), prefix="draft-") == draft
    pair = C.PairConfig(draft="d", draft_device="cpu", dtype="float32", draft_quantize="none", threads=3)
    server = C.ServerConfig(bind="tcp://127.0.0.1:1", serial=True, max_batch=5, session_timeout_s=2.5)
    from starsd.star.launch import server_command

    argv = server_command(pair, server)
    args = build_parser(argv).parse_args(argv)
    assert C.from_args(C.ServerConfig, args) == server
    assert C.from_args(C.PairConfig, args) == pair


def test_derived_points_scale_one_target():
    base = {"n": 1, "system_tokens_per_s": 5.0, "per_target_tokens_per_s": 5.0, "latency_cv": 0.3,
            "utilization_over_time": [0.5]}
    pts = scale.derived(base, "single-pair", [1, 4])
    assert [p["system_tokens_per_s"] for p in pts] == [5.0, 20.0]
    assert all(p["per_target_tokens_per_s"] == 5.0 and p["derived_from_n"] == 1 for p in pts)
    assert "utilization_over_time" not in pts[1]


def test_checks_judge_the_issue_targets():
    pts = [{"mode": "serial", "n": n, "system_tokens_per_s": x, "draft_utilization": u, "latency_cv": 0.2,
            "predicted_system_tokens_per_s": x * 1.1, "simulated_system_tokens_per_s": x}
           for n, x, u in ((1, 10.0, 0.3), (2, 20.0, 0.6), (4, 25.0, 0.95))]
    pts += [{"mode": "batched", "n": n, "system_tokens_per_s": x, "draft_utilization": u, "latency_cv": 0.1,
             "predicted_system_tokens_per_s": x, "simulated_system_tokens_per_s": x * 0.9}
            for n, x, u in ((1, 10.0, 0.3), (4, 40.0, 0.8), (8, 80.0, 0.97))]
    pts += [{"mode": "single-pair", "n": 1, "system_tokens_per_s": 10.0, "latency_cv": 0.4}]
    n_full = {"serial": {"measured": 2.5, "predicted": 2.0}, "batched": {"measured": 8.0, "predicted": 8.0}}
    c = scale.checks(pts, n_full)
    assert c["serial"]["utilization_past_n_full"] == [0.95] and c["serial"]["utilization_past_n_full_ge_90pct"]
    assert c["serial"]["n_full_error"] == pytest.approx(0.2)
    assert c["serial"]["throughput_max_error"] == pytest.approx(0.1)
    assert c["batched"]["simulator_max_error"] == pytest.approx(0.1)
    assert c["batched_vs_serial"] == {"n_full_ratio": pytest.approx(3.2), "saturated_throughput_ratio": pytest.approx(3.2)}
    assert c["latency_cv"] == {"single_pair": 0.4, "batched_n": 8, "batched_at_n_full": 0.1}


def test_network_list_parses():
    assert harness.networks("0.2@1000,5,1@0") == [(0.2, 1000.0), (5.0, None), (1.0, None)]


def test_out_of_sample_profile_takes_the_sweeps_shape_and_the_n1_points_scale():
    in_sample = sysmodel.Profile({1: 90.0, 4: 200.0}, return_ms=300.0, tokens_per_iteration=3.0)
    points = [{"mode": "batched", "n": 1, "batch_times": [(1, 100.0), (1, 120.0)]},
              {"mode": "batched", "n": 4, "batch_times": [(4, 999.0)]}]  # never read: another point
    got = profiles.calibrated_profile(points, {"1": [50.0, 60.0], "2": [80.0]}, in_sample)
    assert got.service_ms == pytest.approx({1: 110.0, 2: 160.0})
    assert got.return_ms == 300.0 and got.tokens_per_iteration == 3.0
    assert profiles.calibrated_profile(points[1:], {"1": [50.0]}, in_sample) is None
    whole = profiles.calibrated_profile(points, {"1": [50.0]}, in_sample, tokens=[2, 5, 5])  # the recording's tau
    assert whole.tokens_per_iteration == 4.0 and whole.tokens_samples == (2, 5, 5) and whole.return_ms == 300.0


def test_out_of_sample_profile_carries_the_resets_the_n1_server_ingested():
    """Each request of a batch of b carries the prompt tokens a request made the N = 1 server ingest
    on average, at the sweep's cost per token; k then scales S(1) to the N = 1 point's."""
    in_sample = sysmodel.Profile({1: 90.0}, return_ms=300.0, tokens_per_iteration=3.0)
    work = {"reset_rows": 1, "reset_tokens": 100, "step_rows": 9, "step_tokens": 40}  # 10 prompt tokens per request
    points = [{"mode": "batched", "n": 1, "batch_times": [(1, 120.0)], "server_work": work}]
    sweep = {"1": [50.0], "4": [110.0]}
    got = profiles.calibrated_profile(points, sweep, in_sample, reset_ms_per_token=1.0)
    # shape: S(1) 50 + 10 = 60, S(4) 110 + 40 = 150; k = 120 / 60
    assert got.service_ms == pytest.approx({1: 120.0, 4: 300.0})
    without = profiles.calibrated_profile(points, sweep, in_sample)
    assert without.service_ms == pytest.approx({1: 120.0, 4: 264.0})
    both = scale.calibrations({"points": points, "service_sweep_ms": sweep, "reset_ms_per_token": 1.0}, in_sample)
    assert both["out_of_sample"].service_ms == got.service_ms
    assert both["out_of_sample_without_resets"].service_ms == without.service_ms


def test_reset_cost_is_the_first_batches_extra_time_per_prompt_token():
    sweep = {1: {"service_ms": [50.0, 70.0], "reset_ms": [160.0], "reset_tokens": [100]},
             4: {"service_ms": [200.0], "reset_ms": [600.0, 640.0], "reset_tokens": [300, 500]}}
    assert harness.reset_cost(sweep) == pytest.approx((100.0 + 420.0) / (100 + 400))
    assert harness.reset_cost({1: {"service_ms": [50.0], "bound_ms": [40.0]}}) is None  # timed before resets were


def test_predraft_ceiling_is_every_draft_answered_at_once():
    its = [metrics.Iteration("t", 0.0, 1.0, 3, wall_ms=250.0), metrics.Iteration("t", 1.0, 1.5, 1)]
    assert scale.predraft_ceiling(its) == pytest.approx(1500 / 1250)
    assert scale.predraft_ceiling([]) is None


def test_acceptance_covers_every_recorded_continuation(tmp_path):
    """tau's samples come from the whole recording: a draft that is the target itself is always
    accepted, so each iteration commits the depth plus the target's token, to each continuation's end."""
    from starsd.bench.harness import measure_acceptance
    from starsd.emulate.replay import record
    from starsd.models.drafter import Drafter
    from starsd.models.loading import load_model
    from starsd.prompts import load as load_prompts

    t, _ = tiny.save_pair(tmp_path)
    cfg = C.ModelConfig(t, dtype="float32")
    rec = record(cfg, load_prompts("humaneval", 3), 23, str(tmp_path), log=lambda *_: None)
    tokens = measure_acceptance(Drafter(load_model(cfg, str(tmp_path))), rec,
                                C.DraftConfig(depth=4, adaptive=False, min_path_prob=0.0))
    expected = []
    for p in rec.prompts.values():
        left = len(p["continuation"])
        while left >= 2:  # the last draft is cut to the tokens left
            expected.append(min(5, left))
            left -= expected[-1]
    assert sorted(tokens) == sorted(expected) and len(tokens) >= 15


def test_scale_runs_the_batched_single_pair_whatever_the_ns_asked():
    """The model's R and tau come from the batched server at N = 1: `--targets 2,8` measured every
    point and then failed (KeyError ('batched', 1)) before writing anything."""
    draft = C.DraftConfig()
    modes = scale.server_modes(draft, "2", False)
    asked = [(p[0], p[3], p[4]) for p in scale.plan_points(modes, ["target-only", "batched", "star"], [2, 8])]
    assert asked == [("batched", [1], False), ("batched", [2, 8], True), ("star", [2, 8], True),
                     ("batched-d2", [2, 8], True)]
    asked = [(p[0], p[3], p[4]) for p in scale.plan_points(modes, ["star"], [1, 4])]
    assert asked == [("batched", [1], False), ("star", [1, 4], True), ("batched-d2", [1, 4], True)]
    asked = [(p[0], p[3], p[4]) for p in scale.plan_points(modes, ["batched"], [1, 4])]
    assert asked == [("batched", [1, 4], True), ("batched-d2", [1, 4], True)]


def test_scale_benchmark_end_to_end_on_tiny_models(tmp_path):
    t, d = tiny.save_pair(tmp_path)
    out = tmp_path / "scale.json"
    # 9 points (every mode measured at N = 1 and 3), each a replay host process over warm-up + window: a
    # 1 s window still holds a dozen or more steps per target; --max-batch 4 (room for N = 3) keeps the
    # service sweep to batches 1, 2, 4. The serial server and pre-drafting without the adaptive depth
    # are left out (a server per mode costs time here; the serial server has its own tests).
    cmd = [sys.executable, "-m", "starsd.cli", "bench", "scale", "--target", t, "--draft", d, "--dtype", "float32",
           "--draft-quantize", "none", "--threads", "1", "--targets", "1,3", "--limit", "3", "--max-new-tokens", "24",
           "--warmup-s", "0.5", "--measure-s", "1", "--max-batch", "4", "--cache-dir", str(tmp_path / "cache"),
           "--json-out", str(out), "--draft-depth", "4", "--fixed-depths", "2",
           "--modes", "target-only,single-pair,batched,adaptive,star"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    modes = {(p["mode"], p["n"]) for p in result["points"]}
    assert modes == {(m, n) for m in ("target-only", "single-pair", "batched", "adaptive", "star", "batched-d2")
                     for n in (1, 3)}
    for p in result["points"]:
        assert p["system_tokens_per_s"] > 0 and p["per_target_tokens_per_s"] > 0 and "latency_cv" in p
        if p["mode"] == "batched":
            assert 0 < p["draft_utilization"] <= 1
            assert p["n_full_measured"] > 0 and p["n_full_predicted"] > 0
            assert p["drafted_share"] > 0.8 and not p["adaptive"]  # a fixed depth asks at every step but the last
        if p["mode"].startswith("batched"):
            assert p["draft_depth"] == {"batched": 4, "batched-d2": 2}[p["mode"]]
        if p["mode"] in ("batched", "adaptive", "star", "batched-d2"):
            assert p["predraft"] == (p["mode"] == "star")
            assert ("predrafting" in p) == p["predraft"]
        if p["mode"] == "star":
            assert p["predrafting"]["outcomes"] >= 0 and 0 <= p["predrafting"]["hit_rate"] <= 1
    checks = result["checks"]
    assert [r["n"] for r in checks["adaptive_vs_best_fixed"]] == [1, 3]
    assert {r["best_fixed_depth"] for r in checks["adaptive_vs_best_fixed"]} <= {2, 4}
    assert set(checks["per_target_vs_target_only"]) == {"star", "adaptive", "batched", "batched-d2"}
    oos = checks["out_of_sample"]
    assert set(oos["batched"]["throughput_errors"]) == {"3"} and oos["batched"]["n_full_predicted"] > 0
    assert oos["profile_tokens_per_iteration"] == pytest.approx(statistics.fmean(result["acceptance_tokens"]), abs=1e-3)
    assert oos["batched"]["n_full_measured_iterations"] > 0
    assert checks["predraft_ceiling_n1"] > 1
    assert [r["n"] for r in checks["star_vs_adaptive"]] == [1, 3]
    assert "replay" in result["replay"]["targets"]
    assert set(result["n_full"]) == {"batched"}
    assert set(result["service_sweep_ms"]) == {"1", "2", "4"}
    assert result["reset_ms_per_token"] > 0  # a prompt costs the draft something to ingest
    without = checks["out_of_sample_without_resets"]
    assert set(without["batched"]["throughput_errors"]) == {"3"}
    assert without["profile_service_ms"] != oos["profile_service_ms"]  # the resets' term
    for suffix in ("", "-utilization", "-latency"):
        assert (tmp_path / f"scale{suffix}.png").stat().st_size > 1000
    model = subprocess.run([sys.executable, "-m", "starsd.cli", "model", "--from", str(out), "--targets", "1,2,8"],
                           capture_output=True, text=True, timeout=60)
    assert model.returncode == 0 and "N_full" in model.stdout
    for suffix in ("", "-utilization", "-latency"):
        (tmp_path / f"scale{suffix}.png").unlink()
    assert cli.main(["bench", "scale", "--reanalyse", str(out)]) == 0  # measures nothing: run here, no torch import
    for suffix in ("", "-utilization", "-latency"):
        assert (tmp_path / f"scale{suffix}.png").stat().st_size > 1000  # redrawn
    redone = json.loads(out.read_text())
    assert redone["points"] == result["points"] and redone["reanalysed_from"] == result["meta"]
    assert redone["checks"]["predraft_ceiling_n1"] == checks["predraft_ceiling_n1"]


def test_multihost_benchmark_across_namespaces(tmp_path):
    from starsd.emulate import netns

    reason = netns.available()
    if reason:
        pytest.skip(reason)
    before = set(netns.list_namespaces())
    t, d = tiny.save_pair(tmp_path)
    out = tmp_path / "multihost.json"
    cmd = [sys.executable, "-m", "starsd.cli", "bench", "multihost", "--target", t, "--draft", d, "--dtype", "float32",
           "--draft-quantize", "none", "--threads", "1", "--targets", "2", "--limit", "3", "--max-new-tokens", "24",
           "--warmup-s", "0.5", "--measure-s", "1.5", "--network", "0@0,4@10", "--cache-dir", str(tmp_path / "cache"),
           "--json-out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    points = json.loads(out.read_text())["points"]
    assert [(p["rtt_ms"], p["rate_mbit"]) for p in points] == [(0.0, None), (4.0, 10.0)]
    fast, slow = points
    # The proxy holds every message 2 ms each way: a floor under the slow path's round trips, however
    # fast or loaded the machine (the fast path has no such floor, so it is not compared).
    assert slow["ping_rtt_ms"] >= 4 and slow["network_ms"] >= 4 - slow["serialisation_ms"]
    assert all(p["serialisation_ms"] < 1 and p["system_tokens_per_s"] > 0 for p in points)
    assert set(netns.list_namespaces()) == before  # the benchmark removed its namespaces


def test_service_table_from_the_server_timeline():
    timeline = [(10.0, 10.1, 1), (10.2, 10.3, 1), (10.4, 10.5, 1), (11.0, 11.4, 4), (11.5, 11.9, 4),
                (12.0, 12.5, 4), (12.6, 13.6, 9), (20.0, 21.0, 1)]
    pairs = metrics.batch_times(timeline, 10.0, 13.0)
    assert pairs[0] == (1, pytest.approx(100.0)) and len(pairs) == 7  # the batch starting at 20 s is outside
    table = metrics.service_table(pairs)
    assert set(table) == {1, 4}  # size 9 was seen once: left to interpolation
    assert table[4] == pytest.approx(433.333, rel=1e-3)


def test_service_benchmark_measures_s_of_b_against_the_bound(tmp_path):
    t, d = tiny.save_pair(tmp_path)
    out = tmp_path / "service.json"
    cmd = [sys.executable, "-m", "starsd.cli", "bench", "service", "--target", t, "--draft", d, "--dtype", "float32",
           "--draft-quantize", "none", "--threads", "1", "--sizes", "1,3", "--limit", "3", "--max-new-tokens", "24",
           "--reps", "2", "--cache-dir", str(tmp_path / "cache"), "--json-out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["by_batch"]
    assert set(rows) == {"1", "3"} and rows["1"]["vs_one"] == 1.0
    for r in rows.values():
        assert r["service_ms"] > 0 and r["bound_ms"] > 0 and r["samples"] >= 2
    assert (tmp_path / "service.png").stat().st_size > 1000


def test_takeover_counts_from_the_kill_to_a_drafted_step_begun_after_it():
    """bench servers, server B killed at t = 10. replay-1 was at B: its step ending just after the kill
    verified a draft sent before it and does not count; its first drafted step begun after the kill
    ends 1.5 s after it. replay-2 had been spread to B before the kill and moved off it after (its
    last row says A). replay-3 was spread from B to A before the kill: not a target of the kill.
    replay-4 stays at B and never drafts again: no gap, and no maximum."""
    from starsd.bench.servers import takeover

    rows = [
        {"target": "replay-0", "started": 9.0, "finished": 10.5, "trace": [(10.5, 3)], "depths": [4], "moves": 0,
         "server": "A", "relocations": []},
        {"target": "replay-1", "started": 9.0, "finished": 11.5, "trace": [(10.2, 3), (10.8, 1), (11.5, 4)],
         "depths": [4, 0, 4], "moves": 1, "server": "A", "relocations": [[10.7, "B", "A", "lost"]]},
        {"target": "replay-2", "started": 9.0, "finished": 12.0, "trace": [(11.0, 1), (12.0, 3)], "depths": [0, 2],
         "moves": 2, "server": "A", "relocations": [[5.0, "A", "B", "spread"], [10.9, "B", "A", "lost"]]},
        {"target": "replay-3", "started": 9.0, "finished": 10.4, "trace": [(10.4, 2)], "depths": [3], "moves": 1,
         "server": "A", "relocations": [[6.0, "B", "A", "spread"]]},
        {"target": "replay-4", "started": 9.0, "finished": 11.0, "trace": [(11.0, 1)], "depths": [0], "moves": 0,
         "server": "B", "relocations": []},
    ]
    out = takeover(rows, "B", killed_at=10.0)
    assert out["gap_s"] == {"replay-1": pytest.approx(1.5), "replay-2": pytest.approx(2.0), "replay-4": None}
    assert out["on_the_killed"] == 3 and out["moves_after"] == 2 and out["moves"] == 4
    assert out["elsewhere_at_the_end"] == 4 and out["gap_max_s"] is None
