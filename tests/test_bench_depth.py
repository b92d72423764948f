"""The co-located benchmarks end to end on tiny models: `bench depth` (the default depth policy
against fixed depths, co-located and through a draft-server process), `bench colocated` and `bench
sampled-q`."""

import json

import pytest

import tiny
from starsd import cli


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft = tiny.save_pair(tmp_path_factory.mktemp("pair"), chat=True)
    return ["--target", target, "--draft", draft, "--dtype", "float32", "--draft-quantize", "none", "--threads", "1"]


def test_bench_depth_compares_the_default_with_each_fixed_depth_in_both_placements(pair, tmp_path):
    out = tmp_path / "depth.json"
    assert cli.main(["bench", "depth", "--prompts", "chat", "--limit", "2", "--max-new-tokens", "12",
                     "--depths", "2,4", "--json-out", str(out), *pair]) == 0
    result = json.loads(out.read_text())
    points = {(p["placement"], p["temperature"]): p for p in result["points"]}
    assert set(points) == {(pl, t) for pl in ("colocated", "star") for t in (0.0, 0.7)}
    for p in points.values():
        rates = p["tokens_per_s"]
        assert set(rates) == {"target_only", "default", "fixed-2", "fixed-4"} and min(rates.values()) > 0
        assert p["best_fixed"] in ("fixed-2", "fixed-4")
        assert p["default_vs_best_fixed"] == pytest.approx(rates["default"] / rates[p["best_fixed"]])
        assert p["default_vs_target_only"] == pytest.approx(rates["default"] / rates["target_only"])
        answers = p["whole_answers"]["tokens_per_s"]  # prefill and first step included
        assert set(answers) == set(rates) and min(answers.values()) > 0
        assert p["whole_answers"]["default_vs_best_fixed"] == pytest.approx(
            answers["default"] / answers[p["whole_answers"]["best_fixed"]])
    assert (tmp_path / "depth.png").stat().st_size > 0


def test_bench_colocated_without_an_eagle_head_finishes(pair, tmp_path):
    """It crashed after writing its JSON (its `eagle` setting, None, was read as the EAGLE mode's figures)."""
    out = tmp_path / "colocated.json"
    assert cli.main(["bench", "colocated", "--prompts", "chat", "--limit", "1", "--max-new-tokens", "8", "--no-hf",
                     "--json-out", str(out), *pair]) == 0
    result = json.loads(out.read_text())
    assert result["eagle_head"] is None and result["spec_tokens_per_s"] > 0


def test_bench_sampled_q_weighs_the_support_the_full_q_and_the_argmax_draft(pair, tmp_path):
    out = tmp_path / "sampled-q.json"
    assert cli.main(["bench", "sampled-q", "--limit", "2", "--max-new-tokens", "12", "--temperatures", "0.7,1.0",
                     "--draft-sample-top-k", "8", "--json-out", str(out), *pair]) == 0
    result = json.loads(out.read_text())
    assert [p["temperature"] for p in result["points"]] == [0.7, 1.0]
    for p in result["points"]:
        assert p["positions"] > 0
        for key in ("acceptance_full_q", "acceptance_support", "acceptance_argmax_draft"):
            assert 0 < p[key] <= 1
    assert result["bytes_per_node_support_max"] == 6 * 8 and result["bytes_per_node_full_q"] == 4 * tiny.VOCAB
    assert (tmp_path / "sampled-q.png").stat().st_size > 0
