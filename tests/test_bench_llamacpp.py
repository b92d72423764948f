"""`starsd bench llamacpp` end to end on a tiny GGUF: the llama.cpp target alone and with StarSD
drafts, co-located, from a draft-server process on a core of its own, and from emulated draft hosts
(recordings of the real drafter), with the greedy outputs compared and the bound computed."""

import json
import os

import pytest

from gguf_tiny import write_tiny_model_dir
from starsd import cli

if not os.environ.get("STARSD_REQUIRE_REAL"):  # make test builds it: missing is a failure there
    pytest.importorskip("llama_cpp")


def test_bench_llamacpp_runs_every_mode_and_compares_outputs(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the one-core modes need two cores")
    model = write_tiny_model_dir(tmp_path)  # the tokenizer and the draft (transformers) beside the GGUF (the target)
    out = tmp_path / "llamacpp.json"
    code = cli.main(["bench", "llamacpp", "--prompts", "humaneval", "--offset", "0", "--limit", "2",
                     "--max-new-tokens", "12", "--json-out", str(out), "--target", str(model), "--draft", str(model),
                     "--dtype", "float32", "--draft-quantize", "none"])
    result = json.loads(out.read_text())
    modes = result["modes"]
    assert set(modes) == {"alone", "colocated", "star-remote", "alone-1core", "star-1core", "emulated-1core"}
    assert all(m["tokens_per_s"] > 0 and len(m["runs"]) == 2 for m in modes.values())
    for mode in ("colocated", "star-remote", "star-1core", "emulated-1core"):
        assert 0 <= modes[mode]["equal_share"] <= 1 and modes[mode]["vs_alone"] > 0
    # the emulated draft hosts answered from recordings of the real drafter, timed on their cores
    for name in ("2core", "1core"):
        assert result["recordings"][name]["cost_ms"]["per_level"] > 0
    bound = result["bound"]
    assert bound["speedup"] > 0 and set(bound["by_depth"]) == {str(d) for d in range(1, 11)}
    assert all(modes[m]["mean_accepted"] >= 0 and 0 <= modes[m]["drafted_share"] <= 1 for m in ("star-remote", "colocated"))
    # the draft is the target's own weights: its drafts are taken, and every divergence is a near-tie
    assert all(d["ok"] for d in result["divergences"]) and code == 0
    assert (tmp_path / "llamacpp.png").stat().st_size > 0
