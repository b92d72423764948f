"""Replay targets: they accept exactly what the real target accepts and wait its verify latency."""

import json
import random
import subprocess
import sys
import time

import pytest

import tiny
from starsd.config import DraftConfig, ModelConfig, PairConfig, SamplingConfig
from starsd.emulate.replay import LatencyProfile, Recording, ReplayTarget, measure_latency, record, recording_path
from starsd.models.pair import Pair
from starsd.prompts import humaneval
from starsd.spec_decode.decode import speculative
from starsd.star.launch import start_server

MAX_NEW = 40


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    target, draft = tiny.save_pair(root)
    return {"target": target, "draft": draft, "cache": str(root / "cache")}


@pytest.fixture(scope="module")
def recording(dirs):
    return record(ModelConfig(dirs["target"], dtype="float32"), humaneval()[:4], MAX_NEW, dirs["cache"],
                  log=lambda m: None)


@pytest.fixture(scope="module")
def pair(dirs):
    return Pair.load(ModelConfig(dirs["target"], dtype="float32"), ModelConfig(dirs["draft"], dtype="float32"))


def flat(ms: float) -> LatencyProfile:
    return LatencyProfile({1: (ms,), 16: (ms,)}, "test")


def test_latency_profile_interpolates_and_draws():
    p = LatencyProfile({1: (100.0, 120.0), 5: (150.0,), 9: (170.0,)})
    assert p.mean(1) == 110 and p.mean(3) == pytest.approx(130) and p.mean(13) == pytest.approx(190)
    rng = random.Random(0)
    draws = {round(p.draw(1, rng), 6) for _ in range(50)}
    assert draws == {100.0, 120.0}
    assert p.draw(2, rng) in (pytest.approx(100 * 120 / 110), pytest.approx(120 * 120 / 110))
    assert LatencyProfile.from_json(p.to_json()) == p
    assert LatencyProfile.from_json({"verify_ms": {"1": 80, "4": 90}}).mean(4) == 90  # means only
    assert LatencyProfile.from_json({"verify_ms": {"1": 80}, "prefill_ms": {"100": 50}}).prefill(200) == 50
    with pytest.raises(ValueError, match="latency profile"):
        LatencyProfile.from_json({"bogus": 1})
    with pytest.raises(ValueError):
        LatencyProfile({1: (-1.0,)})


def test_recording_is_the_greedy_continuation_and_cached(dirs, recording, pair):
    assert len(recording.prompts) == 4 and recording.max_new_tokens == MAX_NEW
    for prompt in humaneval()[:4]:
        ref = pair.generate(prompt, MAX_NEW, SamplingConfig(), None)
        assert recording.prompts[prompt.id]["continuation"] == ref.token_ids
    path = recording_path(ModelConfig(dirs["target"], dtype="float32"), humaneval()[:4], MAX_NEW, dirs["cache"])
    assert Recording.load(path).prompts == recording.prompts
    again = record(ModelConfig(dirs["target"], dtype="float32"), humaneval()[:4], MAX_NEW, dirs["cache"],
                   log=lambda m: pytest.fail("recorded twice"))
    assert again.prompts == recording.prompts


@pytest.mark.parametrize("shape", [DraftConfig(depth=5, min_path_prob=0.0, adaptive=False),
                                   DraftConfig(depth=4, top_k=2, total_tokens=8, adaptive=False)])
def test_replay_accepts_what_the_real_target_accepts(recording, pair, shape):
    replay = ReplayTarget(recording, flat(0.1))
    for p in recording.prompts.values():
        real = speculative(pair.target, pair.drafter, p["prompt_ids"], MAX_NEW, shape, SamplingConfig(), pair.eos_ids)
        rep = speculative(replay, pair.drafter, p["prompt_ids"], MAX_NEW, shape, SamplingConfig(), pair.eos_ids)
        assert rep.token_ids == real.token_ids == p["continuation"]
        assert rep.accepted == real.accepted


def test_replay_waits_the_profile_latency(recording, pair):
    replay = ReplayTarget(recording, flat(30.0))
    p = next(iter(recording.prompts.values()))
    gen = speculative(replay, pair.drafter, p["prompt_ids"], 12, DraftConfig(depth=3), SamplingConfig())
    assert gen.seconds >= 0.03 * gen.num_steps
    assert replay.verify_ms == [pytest.approx(30.0)] * gen.num_steps


def test_replay_waits_the_prefill_of_each_prompt(recording):
    replay = ReplayTarget(recording, LatencyProfile({1: (0.1,)}, prefill_ms={10: (10.0,), 110: (110.0,)}))
    ids = next(iter(recording.prompts.values()))["prompt_ids"]
    t0 = time.perf_counter()
    replay.start(ids)
    assert time.perf_counter() - t0 >= (len(ids) if len(ids) <= 110 else 110) / 1e3
    assert replay.latency.prefill(60) == pytest.approx(60.0)
    assert LatencyProfile({1: (1.0,)}).prefill(500) == 0.0  # a profile without prefill times: free


def test_replay_refuses_what_it_cannot_replay(recording):
    replay = ReplayTarget(recording, flat(0.1))
    with pytest.raises(ValueError, match="not in the recording"):
        replay.start([1, 2, 3])


def test_measured_latency_grows_with_width(pair):
    prof = measure_latency(pair.target, [list(range(1, 30)), list(range(1, 90))], [1, 8, 32], reps=3)
    assert all(1 <= len(v) <= 3 for v in prof.verify_ms.values())
    assert prof.mean(32) > 0 and prof.mean(1) > 0
    assert sorted(prof.prefill_ms) == [29, 89] and all(len(v) == 2 for v in prof.prefill_ms.values())
    assert LatencyProfile.from_json(prof.to_json()) == prof


def test_replay_host_against_a_real_draft_server(dirs, recording, tmp_path):
    rec_file = recording_path(ModelConfig(dirs["target"], dtype="float32"), humaneval()[:4], MAX_NEW, dirs["cache"])
    lat_file = tmp_path / "latency.json"
    lat_file.write_text(json.dumps(flat(20.0).to_json()))
    star = start_server(PairConfig(draft=dirs["draft"], dtype="float32", threads=1, draft_quantize="none"))
    try:
        base = [sys.executable, "-m", "starsd.cli", "replay-targets", "--connect", star.address, "--recording",
                str(rec_file), "--latency", str(lat_file), "--max-new-tokens", str(MAX_NEW), "--draft-depth", "4"]
        out = subprocess.run([*base, "--targets", "3"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        rows = [json.loads(line) for line in out.stdout.splitlines()]
        assert sorted(r["prompt_id"] for r in rows) == sorted(recording.prompts)  # each prompt once
        for r in rows:
            assert r["replay"] is True
            assert r["token_ids"] == recording.prompts[r["prompt_id"]]["continuation"]
            assert len(r["trace"]) == r["num_steps"] == len(r["asked"])
            assert len(r["requests"]["wall"]) == sum(d > 0 for d in r["asked"])  # one request per draft asked
            assert sum(k for _, k in r["trace"]) == len(r["token_ids"])
        timed = subprocess.run([*base, "--targets", "2", "--duration-s", "2"], capture_output=True, text=True,
                               timeout=120)
        assert timed.returncode == 0, timed.stderr
        rows = [json.loads(line) for line in timed.stdout.splitlines()]
        assert {r["target"] for r in rows} == {"replay-0", "replay-1"}
        # the targets' own window: they go round the prompts and stop at the first step past 2 s. The
        # process's start is no part of it (its imports take ~4 s of CPU, the more on a loaded host)
        assert max(r["finished"] for r in rows) - min(r["started"] for r in rows) < 4
    finally:
        star.close()


def test_replay_host_reports_a_vocabulary_mismatch(dirs, recording, tmp_path):
    bad = Recording(**{**recording.__dict__, "fingerprint": "not-the-draft-vocabulary"})
    bad.save(tmp_path / "bad.json")
    lat_file = tmp_path / "latency.json"
    lat_file.write_text(json.dumps(flat(1.0).to_json()))
    star = start_server(PairConfig(draft=dirs["draft"], dtype="float32", threads=1, draft_quantize="none"))
    try:
        out = subprocess.run([sys.executable, "-m", "starsd.cli", "replay-targets", "--connect", star.address,
                              "--recording", str(tmp_path / "bad.json"), "--latency", str(lat_file), "--max-new-tokens", "8"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1
        assert "vocab" in json.loads(out.stdout.splitlines()[0])["error"]
    finally:
        star.close()
