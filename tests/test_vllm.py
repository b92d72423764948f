"""StarSD as the drafter of an unmodified vLLM (starsd.vllm.Proposer, vLLM's custom_class method), on
vLLM's released CPU build in its own environment (`make vllm`), with a real draft server: vLLM's greedy
output with StarSD's drafts is its own target-only output, bit for bit in fp32, and stays so when the
draft server is killed mid-run (no request fails). The target is a tiny Qwen2 with the pinned pair's
vocabulary (tests/vllm_tiny.py), its draft a perturbed copy, so that drafts are accepted in part;
sampled: tests/test_vllm_sampled.py."""

import json
import time

import pytest

from starsd.bench.vllm_runs import run_engine
from vllm_tiny import PROMPTS, TOKENS, engine_run, models, python, star_run  # noqa: F401 (models, python: fixtures)

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def target_only(python, models):
    return run_engine(engine_run(models[0]), python)


def test_greedy_with_star_drafts_is_vllms_own_output(python, models, target_only, tmp_path):
    got, counters = star_run(models, python, tmp_path)
    assert got["token_ids"] == target_only["token_ids"]
    assert all(len(ids) == TOKENS for ids in got["token_ids"])
    assert counters["drafted"] > 0 and 0 < counters["accepted"] < counters["proposed"]  # drafts in part accepted
    assert counters["sessions"] <= len(PROMPTS) + 1  # and the warm-up's request (bench/vllm_engine.py), at most


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

    got, counters = star_run(models, python, tmp_path, during=kill)
    assert got["token_ids"] == target_only["token_ids"]
    assert killed and counters["calls"] > killed["counters"]["calls"]  # vLLM went on after the kill
