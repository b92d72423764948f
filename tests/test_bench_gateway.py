"""`starsd bench gateway` end to end on tiny models: every path measured, JSON and plot written.
Sane figures only; the latency goals are the benchmark's to judge, not a test's."""

import json
import math
import subprocess
import sys

import tiny


def test_bench_gateway_measures_every_path(tmp_path):
    target_dir, draft_dir = tiny.save_pair(tmp_path)
    out = tmp_path / "gateway.json"
    run = subprocess.run([sys.executable, "-m", "starsd.cli", "bench", "gateway", "--rounds", "3", "--warmup", "1",
                          "--whole", "2", "--max-tokens", "8", "--target", target_dir, "--draft", draft_dir,
                          "--dtype", "float32", "--draft-quantize", "none", "--threads", "1", "--json-out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    f = result["figures"]
    assert list(f["whole"]) == ["direct", "httpx"]
    assert list(f["ttft"]) == list(f["gap"]) == ["direct", "httpx", "openai"]
    for what in ("whole", "ttft", "gap"):
        assert f[what]["direct"]["p50_ms"] > 0
        for path, s in f[what].items():
            assert 0 < s["p50_ms"] <= s["p90_ms"] and s["n"] >= 3, (what, path)
            if path != "direct":
                assert math.isfinite(s["overhead_ms"]) and s["ratio"] > 0, (what, path)
                assert what == "gap" or math.isfinite(s["paired_overhead_ms"]), (what, path)
    assert f["whole"]["httpx"]["n"] == f["health"]["n"] == 6 and f["ttft"]["httpx"]["n"] == 3
    assert 0 < f["health"]["p50_ms"] <= f["health"]["p90_ms"]
    assert f["chunks_per_stream"]["direct"] == 8  # one Output a step, one token a step
    assert result["connections"]["fresh"] == {"httpx": 0, "openai": 0}  # every measured request kept alive
    assert len(result["rounds"]) == 3 and set(result["goals"]) >= {"overhead_met", "gap_met"}
    assert out.with_suffix(".png").stat().st_size > 1000
