"""bench latency: its arithmetic (idle gaps, drafted tokens, the spread of latencies, the checks) and
the benchmark end to end on tiny models (a real draft server, replay targets)."""

import json
import subprocess
import sys

import pytest

import tiny
from starsd.bench import latency


def test_idle_gaps_are_the_spans_without_a_batch_or_a_predraft_inside_the_window():
    timeline = [(0.5, 1.2, 1), (1.5, 2.0, 2), (1.8, 2.5), (3.0, 3.1, 1), (9.0, 9.5, 1)]  # (1.8, 2.5): a pre-draft
    # window [1, 4]: busy 1-1.2, 1.5-2.5 (a batch and a pre-draft overlapping), 3-3.1; idle 1.2-1.5, 2.5-3, 3.1-4
    spans = latency.busy_spans(timeline, 1.0, 4.0)
    assert [x for span in spans for x in span] == pytest.approx([1.0, 1.2, 1.5, 2.5, 3.0, 3.1])
    assert latency.idle_gaps_ms(spans, 1.0, 4.0) == pytest.approx([300.0, 500.0, 900.0])
    assert latency.idle_gaps_ms([], 1.0, 2.0) == pytest.approx([1000.0])  # a server that never drafted
    assert latency.idle_gaps_ms(latency.busy_spans([(0.0, 5.0, 1)], 1.0, 2.0), 1.0, 2.0) == []  # busy throughout
    assert latency.idle_gaps_ms([(1.0, 1.5)], 1.0, 2.0) == pytest.approx([500.0])  # busy from the window's start


def test_drafted_tokens_count_the_steps_that_ended_inside_the_window():
    rows = [{"trace": [(1.0, 3), (2.0, 1), (3.0, 5)], "depths": [4, 0, 4]},
            {"trace": [(2.5, 2), (5.0, 1)], "depths": [2, 6]}]
    assert latency.drafted_tokens(rows, 1.5, 4.0) == 0 + 4 + 2


def test_spread_gives_the_variance_and_cv():
    s = latency.spread([10.0, 10.0, 40.0, 20.0])
    assert s["mean"] == 20.0 and s["variance"] == pytest.approx(150.0) and s["cv"] == pytest.approx(150 ** 0.5 / 20)
    assert s["p50"] in (10.0, 20.0) and s["p99"] == 40.0


def point(mode, n, per_token, variance, cv, p99=100.0):
    return {"mode": mode, "n": n, "draft_ms_per_drafted_token": per_token,
            "per_token_latency_ms": {"variance": variance, "cv": cv, "p99": p99}}


def test_checks_compare_the_largest_star_with_the_pair_alone():
    points = [point("fixed", 4, 10.0, 50.0, 0.2, 150.0), point("fixed", 1, 40.0, 100.0, 0.5),
              point("fixed", 2, 20.0, 80.0, 0.3), point("defaults", 1, 30.0, 100.0, 0.5),
              point("defaults", 4, 45.0, 300.0, 0.6)]
    c = latency.checks(points)
    assert c["fixed"]["n"] == 4 and c["fixed"]["draft_ms_per_drafted_token_vs_pair"] == pytest.approx(0.25)
    assert c["fixed"]["per_token_latency_variance_vs_pair"] == pytest.approx(0.5)
    assert c["fixed"]["per_token_latency_p99_vs_pair"] == pytest.approx(1.5)
    assert c["fixed"]["draft_time_per_token_lower"] and c["fixed"]["latency_variance_lower"]
    assert not c["defaults"]["draft_time_per_token_lower"] and not c["defaults"]["latency_variance_lower"]
    assert latency.checks([point("fixed", 2, 1.0, 1.0, 1.0), point("fixed", 4, 1.0, 1.0, 1.0)]) == {}  # no pair alone


def test_latency_benchmark_end_to_end_on_tiny_models(tmp_path):
    t, d = tiny.save_pair(tmp_path)
    out = tmp_path / "latency.json"
    cmd = [sys.executable, "-m", "starsd.cli", "bench", "latency", "--target", t, "--draft", d, "--dtype", "float32",
           "--draft-quantize", "none", "--threads", "1", "--targets", "1,2", "--limit", "3", "--max-new-tokens", "24",
           "--warmup-s", "0.5", "--measure-s", "1.5", "--max-batch", "4", "--cache-dir", str(tmp_path / "cache"),
           "--json-out", str(out), "--draft-depth", "4"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(p["mode"], p["n"]) for p in result["points"]] == [("fixed", 1), ("fixed", 2), ("defaults", 1),
                                                               ("defaults", 2)]
    for p in result["points"]:
        assert p["per_target_tokens_per_s"] > 0 and p["per_token_latency_ms"]["p99"] >= p["per_token_latency_ms"]["p50"]
        assert 0 < p["draft_utilization"] <= 1 and p["idle_gap_ms"]["max"] >= p["idle_gap_ms"]["p50"]
        assert p["predraft"] == (p["mode"] == "defaults") and p["adaptive"] == (p["mode"] == "defaults")
        if p["mode"] == "fixed":  # every step waits for a draft: the server drafted for the window's steps
            assert p["drafted_tokens"] > 0 and p["draft_ms_per_drafted_token"] > 0
    assert set(result["checks"]) <= {"fixed", "defaults"} and result["checks"]["fixed"]["n"] == 2
    assert (tmp_path / "latency.png").stat().st_size > 1000
    bad = subprocess.run([*cmd[:-2], "--modes", "fixed,bursty"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
        "starsd: error: unknown modes ['bursty']")
