"""StarSD as the drafter of an unmodified vLLM (starsd.vllm.Proposer, vLLM's custom_class method), on
vLLM's released CPU build in its own environment (`make vllm`), with a real draft server: vLLM's greedy
output with StarSD's drafts is its own target-only output, bit for bit in fp32, for 16 requests at once
on one connection to a server whose draft KV holds 8 of them, and stays so when the draft server is
killed mid-run (no request fails). The target is a tiny Qwen2 with the pinned pair's vocabulary
(tests/vllm_tiny.py), its draft a perturbed copy, so that drafts are accepted in part; sampled:
tests/test_vllm_sampled.py."""

import json
import threading
import time

import pytest

from starsd.bench.vllm_runs import run_engine
from starsd.config import ServerConfig
from starsd.star.client import query_stats
from vllm_tiny import engine_run, models, python, star_run  # noqa: F401 (models, python: fixtures)

pytestmark = pytest.mark.real

REQUESTS = [[(101 * p + 37 * i) % 150000 + 200 for i in range(4 + p % 5)] for p in range(16)]
TOKENS = 112
RUN = {"prompts": REQUESTS, "max_tokens": TOKENS, "max_num_seqs": len(REQUESTS), "warm_up": False}  # (a warm-up
# request would be a 17th, of one step)
COLUMN_BYTES = 2 * 2 * 1 * 64 * 4  # the tiny draft's KV per token: 2 layers x keys and values x 1 head x 64 x fp32
HOLDS_8 = ServerConfig(kv_budget_gib=8 * 128 * COLUMN_BYTES / (1 << 30))  # 8 sessions of 128 tokens (its default
# max_sessions: 16, at 64 tokens each)


@pytest.fixture(scope="module")
def target_only(python, models):
    return run_engine(engine_run(models[0], **RUN), python)


class Watch:
    """The draft server's counters, read every 0.2 s while vLLM runs: the most sessions and
    connections it held at once, and its last figures."""

    def __init__(self):
        self.sessions = self.connections = 0
        self.last: dict = {}
        self.done = threading.Event()

    def __call__(self, star, stats_file):
        while not self.done.is_set():
            snap = query_stats(star.address, timeout_s=2.0)
            if snap is None:
                return
            self.sessions = max(self.sessions, snap["sessions_open"])
            self.connections = max(self.connections, snap["connections"])
            self.last = snap
            time.sleep(0.2)


def test_16_requests_on_one_connection_to_a_server_holding_8_are_drafted_and_vllms_own_output(
        python, models, target_only, tmp_path):
    watch = Watch()
    try:
        got, counters = star_run(models, python, tmp_path, during=watch, server=HOLDS_8, **RUN)
    finally:
        watch.done.set()
    assert got["token_ids"] == target_only["token_ids"]
    assert all(len(ids) == TOKENS for ids in got["token_ids"])
    assert counters["drafted"] > 0 and 0 < counters["accepted"] < counters["proposed"]  # drafts in part accepted
    assert counters["requests"] == counters["requests_drafted"] == len(REQUESTS)
    assert watch.sessions >= len(REQUESTS) and watch.connections == 1  # one connection, whatever the requests
    assert watch.last["sessions_evicted"] > 0 and not watch.last["errors"]  # the budget bound: evicted, not refused
    log = (tmp_path / "vllm.log").read_text().splitlines()
    warnings = [line for line in log if "StarSD" in line or "starsd" in line]
    assert len(warnings) < 5, warnings[:10]  # nothing said at every step


def test_a_draft_server_killed_mid_run_loses_nothing(python, models, target_only, tmp_path):
    """kill -9 of the draft server once vLLM has drafted with it: every request ends, with vLLM's own output."""
    killed = {}

    def kill(star, stats):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if json.loads(stats.read_text())["drafted"] >= 3:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        killed["counters"] = json.loads(stats.read_text())
        star.server.kill()

    got, counters = star_run(models, python, tmp_path, during=kill, **RUN)
    assert got["token_ids"] == target_only["token_ids"]
    assert killed and counters["calls"] > killed["counters"]["calls"]  # vLLM went on after the kill
