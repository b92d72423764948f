"""`starsd bench fuzz` run tiny, and the checks it makes shown to catch what they are for."""

import json
import random

import pytest
import torch

from starsd.bench import fuzz as F
from starsd.cli import main
from starsd.star import protocol as P


def test_bench_fuzz_runs_every_kind_and_breaks_nothing(tmp_path):
    out = tmp_path / "fuzz.json"
    assert main(["bench", "fuzz", "--decode-inputs", "300", "--live-inputs", "110", "--seed", "3",
                 "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    decode, live = result["decode"], result["live"]
    assert result["broke"] == 0 and decode["broke"] == [] and live["broke"] == []
    assert {k: v["inputs"] for k, v in decode["by_kind"].items()} == {k: 30 for k in F.DECODE_KINDS}
    assert decode["by_kind"]["valid"]["outcomes"] == {"ok": 30}
    assert {k: v["inputs"] for k, v in live["by_kind"].items()} == {**{k: 10 for k in F.LIVE_KINDS},
                                                                    "over_frame_limit": 1}
    assert live["by_kind"]["over_frame_limit"]["outcomes"] == {"dropped": 1}
    assert live["by_kind"]["foreign_tag"]["outcomes"] == {"unknown_session": 10}
    assert live["counted_match"] and sum(live["errors_counted"].values()) == 110 and live["server_alive"]
    for h in live["honest"].values():
        assert h["drafts"] > 0 and h["error"] is None and h["differ_from_local"] == 0
    assert out.with_suffix(".png").stat().st_size > 1000


def test_a_decode_that_raises_anything_else_is_caught_with_its_input(monkeypatch):
    real = P.decode

    def flawed(frames):
        if frames and len(frames[0]) > 40:
            raise KeyError("a bug")
        return real(frames)

    monkeypatch.setattr(P, "decode", flawed)
    tally = F.fuzz_decode(90, random.Random(0))
    assert tally.broke and all("KeyError: 'a bug'" in b["why"] for b in tally.broke)
    assert all(len(F.from_corpus(b["frames"])[0]) > 40 for b in tally.broke)  # the input, as the corpus stores it


def test_corpus_frames_round_trip_and_stay_small():
    frames = [b"\x03abc", bytes(100_000), b"", b"\x01" * 65]
    stored = F.corpus_frames(frames)
    assert F.from_corpus(json.loads(json.dumps(stored))) == frames
    assert len(json.dumps(stored)) < 300


def test_a_wrong_answer_from_the_server_is_caught():
    probe = F.Probe([b"x"], "bad_step", tag=5, step=3)
    assert F.judge(probe, (P.Error("bad_step", "m", 5, 3), ())) == "bad_step"
    wrong = (P.Pong(5, 1.0), P.Error("bad_tokens", "m", 5, 3), P.Error("bad_step", "m", 5, 4),
             P.Error("bad_step", "m", 0, 3))  # another code, step or tag
    for answer in (None, *((msg, ()) for msg in wrong)):
        with pytest.raises(F.Broken):
            F.judge(probe, answer)


def test_a_draft_that_differs_from_the_local_drafter_is_counted(tiny_drafters):
    drafter = tiny_drafters["good"]
    cfg = F.HONEST["chain"]
    want = drafter.propose(drafter.start([5, 6, 7]), [], cfg, F.GREEDY, max_depth=9)
    good = F.Exchange(True, [5, 6, 7], 10, want.tokens.tolist(), want.parents.tolist())
    bad = F.Exchange(True, [5, 6, 7], 10, [(t + 1) % F.VOCAB for t in good.drafted], good.parents)
    assert F.replay_locally(drafter, cfg, [good]) == 0
    assert F.replay_locally(drafter, cfg, [good, bad]) == 1


def test_accepted_paths_follow_the_tree():
    tokens, parents = [10, 11, 12, 13], [-1, -1, 0, 2]  # 10 -> 12 -> 13, and 11
    paths = {tuple(F.accepted_path(tokens, parents, random.Random(s))) for s in range(200)}
    assert paths == {(), (10,), (11,), (10, 12), (10, 12, 13)}
    assert torch.equal(F.token_tensor(random.Random(0), 3), F.token_tensor(random.Random(0), 3))
