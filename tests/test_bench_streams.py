"""`starsd bench streams` end to end on a tiny GGUF: one llama.cpp target server given S requests at
once, served one at a time and together, against the bound from the engine's batched pass cost."""

import json
import os

import pytest

from gguf_tiny import write_tiny_model_dir
from starsd import cli

if not os.environ.get("STARSD_REQUIRE_REAL"):  # make test builds it: missing is a failure there
    pytest.importorskip("llama_cpp")


def test_bench_streams_serves_the_requests_both_ways_and_compares_them(tmp_path):
    model = write_tiny_model_dir(tmp_path)
    out = tmp_path / "streams.json"
    code = cli.main(["bench", "streams", "--streams", "2", "--max-tokens", "16", "--rounds", "1", "--prompts",
                     "humaneval", "--offset", "0", "--target", str(model), "--target-context", "1024",
                     "--json-out", str(out)])
    result = json.loads(out.read_text())
    modes = result["modes"]
    assert set(modes) == {"one at a time", "together"}
    assert all(m["tokens_per_s"] > 0 and len(m["runs"]) == 1 for m in modes.values())
    assert all(run["tokens"] == 2 * 16 for m in modes.values() for run in m["runs"])  # ignore_eos: every token
    assert {"1 x 1", "2 x 1", "2 x 4"} <= set(result["pass_ms"]) and result["bound_tokens_per_s"] > 0
    # against greedy decoding alone in the benchmark's own process: served one at a time, one token a
    # pass, it is that; together, every divergence is audited and must be a near-tie
    assert modes["one at a time"]["equal_share"] == 1.0
    assert all(d["ok"] for d in result["divergences"]) and code == 0
    assert (tmp_path / "streams.png").stat().st_size > 0
