"""StarSD as the drafter of an unmodified vLLM (starsd.vllm.Proposer, vLLM's custom_class method), on
vLLM's released CPU build in its own environment (`make vllm`), with a real draft server: vLLM's greedy
output with StarSD's drafts is its own target-only output, bit for bit in fp32, for 16 requests at once
on one connection to a server whose draft KV holds 8 of them, and stays so when that draft server is
killed mid-run (no request fails). The target is a tiny Qwen2 with the pinned pair's vocabulary
(tests/vllm_tiny.py), its draft a perturbed copy, so that drafts are accepted in part; sampled:
tests/test_vllm_sampled.py."""

import json
import time

import pytest

from starsd.bench.vllm_runs import run_engine
from starsd.config import ServerConfig
from starsd.star.client import query_stats
from vllm_tiny import engine_run, models, python, star_run  # noqa: F401 (models, python: fixtures)

pytestmark = pytest.mark.real

REQUESTS = [[(101 * p + 37 * i) % 150000 + 200 for i in range(4 + p % 5)] for p in range(16)]
TOKENS = 64
RUN = {"prompts": REQUESTS, "max_tokens": TOKENS, "max_num_seqs": len(REQUESTS), "warm_up": False}  # (a warm-up
# request would be a 17th, of one step)
COLUMN_BYTES = 2 * 2 * 1 * 64 * 4  # the tiny draft's KV per token: 2 layers x keys and values x 1 head x 64 x fp32
HOLDS_8 = ServerConfig(kv_budget_gib=8 * 80 * COLUMN_BYTES / (1 << 30),  # 8 sessions of 80 tokens (a prompt, 64
                       max_sessions=len(REQUESTS))  # tokens and a draft); 16 sessions (by default 10: 64 tokens each)


@pytest.fixture(scope="module")
def target_only(python, models):
    return run_engine(engine_run(models[0], **RUN), python)


class Watch:
    """Beside vLLM: the draft server's counters, read every 0.2 s (the most sessions and connections it
    held at once, its last figures) until every request has drafted, drafts were accepted and it has
    evicted a session; then kill -9 of the draft server, with the plug-in's counters at that moment."""

    def __init__(self):
        self.sessions = self.connections = 0
        self.last: dict = {}
        self.at_kill: dict = {}

    def __call__(self, star, stats_file):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            snap = query_stats(star.address, timeout_s=2.0)
            if snap is None:
                return
            self.sessions = max(self.sessions, snap["sessions_open"])
            self.connections = max(self.connections, snap["connections"])
            self.last = snap
            try:
                counters = json.loads(stats_file.read_text())
            except (OSError, ValueError):
                counters = {}
            if (counters.get("requests_drafted") == len(REQUESTS) and counters.get("accepted", 0) >= len(REQUESTS)
                    and snap["sessions_evicted"]):
                self.at_kill = counters
                star.server.kill()
                return
            time.sleep(0.2)


def test_16_requests_on_one_connection_to_a_server_holding_8_are_drafted_and_survive_its_kill(
        python, models, target_only, tmp_path):
    """16 requests at once, one session each, on one connection to a draft server whose KV budget holds
    8 of them: it evicts idle sessions and refuses none, and every request drafts. Then the server is
    killed (kill -9): every request ends, with vLLM's own output, bit for bit."""
    watch = Watch()
    got, counters = star_run(models, python, tmp_path, during=watch, server=HOLDS_8, **RUN)
    assert got["token_ids"] == target_only["token_ids"]
    assert all(len(ids) == TOKENS for ids in got["token_ids"])
    assert watch.at_kill, watch.last  # every request drafted, a session evicted, before the kill
    assert watch.at_kill["requests"] == watch.at_kill["requests_drafted"] == len(REQUESTS)
    assert 0 < watch.at_kill["accepted"] < watch.at_kill["proposed"]  # drafts in part accepted
    assert watch.sessions >= len(REQUESTS) and watch.connections == 1  # one connection, whatever the requests
    assert watch.last["sessions_evicted"] > 0 and not watch.last["errors"]  # the budget bound: evicted, not refused
    assert counters["calls"] > watch.at_kill["calls"]  # vLLM went on after the kill
    log = [line for line in (tmp_path / "vllm.log").read_text().splitlines() if line.strip()]
    assert len(log) < counters["calls"], log[-10:]  # nothing said at every step: the engine's whole log
    # (vLLM's warnings, the plug-in's lines, a line a request for the kill) is shorter than its steps
