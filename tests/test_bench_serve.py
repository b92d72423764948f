"""`starsd bench serve` end to end on tiny models: both modes measured, JSON and plot written."""

import json
import subprocess
import sys

import tiny


def test_bench_serve_measures_both_modes(tmp_path):
    target_dir, draft_dir = tiny.save_pair(tmp_path)
    out = tmp_path / "serve.json"
    run = subprocess.run([sys.executable, "-m", "starsd.cli", "bench", "serve", "--targets", "1", "--clients", "1,2",
                          "--duration-s", "1", "--max-tokens", "12", "--limit", "3", "--target", target_dir,
                          "--draft", draft_dir, "--dtype", "float32", "--draft-quantize", "none",
                          "--json-out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    points = json.loads(out.read_text())["points"]
    assert [(p["mode"], p["clients"]) for p in points] == [
        ("target-only", 1), ("target-only", 2), ("speculative", 1), ("speculative", 2)]
    for p in points:
        assert p["requests"] >= 1 and p["tokens"] > 0 and p["output_tokens_per_s"] > 0
        assert 0 < p["ttft_p50_s"] <= p["ttft_p99_s"] and p["itl_p50_s"] <= p["itl_p99_s"]
    assert out.with_suffix(".png").stat().st_size > 1000
