"""bench sampled-link end to end on tiny models: a real draft server and a real target process in
network namespaces of their own, joined by a shaped veth, greedy and sampled."""

import json
import subprocess
import sys

import pytest

import tiny
from starsd.emulate import netns


def test_sampled_link_benchmark_across_namespaces(tmp_path):
    reason = netns.available()
    if reason:
        pytest.skip(reason)
    before = set(netns.list_namespaces())
    t, d = tiny.save_pair(tmp_path, chat=True)
    out = tmp_path / "sampled-link.json"
    cmd = [sys.executable, "-m", "starsd.cli", "bench", "sampled-link", "--target", t, "--draft", d, "--dtype",
           "float32", "--draft-quantize", "none", "--target-engine", "transformers", "--limit", "2",
           "--max-new-tokens", "16", "--network", "0@0,4@10", "--draft-depth", "4", "--cache-dir",
           str(tmp_path / "cache"), "--json-out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    points = result["points"]
    runs = ["greedy", "argmax drafts", "sampled drafts"]
    assert [(p["rtt_ms"], p["rate_mbit"], p["run"]) for p in points] == [(0.0, None, r) for r in runs] + [
        (4.0, 10.0, r) for r in runs]
    assert [(p["temperature"], p["draft_sample"]) for p in points[:3]] == [(0.0, False), (0.7, False), (0.7, True)]
    assert result["greedy_same_on_every_link"]  # float32: greedy output is the target's on any link
    for p in points:
        assert p["prompts"] == 2 and p["requests"] > 0 and 0 < p["nodes_per_reply"] <= 4 and p["tokens_per_s"] > 0
        if p["rate_mbit"]:  # the proxy holds every message 2 ms each way: a floor under every draft's overhead
            assert p["overhead_ms"] >= 4
        if p["draft_sample"] and p["rate_mbit"]:  # what the full q would have taken on this link
            assert p["full_q_wire_ms"] == pytest.approx(p["full_q_bytes_per_reply"] * 8 / 10e3)
        else:
            assert p["full_q_wire_ms"] is None
    assert (tmp_path / "sampled-link.png").stat().st_size > 1000
    assert set(netns.list_namespaces()) == before  # the benchmark removed its namespaces
