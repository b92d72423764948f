"""A tiny Qwen2 model with the pinned pair's tokenizer, for vLLM tests: vLLM loads it in seconds, and a
draft server drafts for it with a perturbed copy (same vocabulary, so the same fingerprint). With the
vLLM tests' fixtures (the vLLM environment, the pair) and runs (vLLM alone, vLLM with StarSD's drafts)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from preloaded import start_server
from starsd.bench.vllm_runs import run_engine, vllm_python
from starsd.config import DEFAULT_TARGET, PairConfig, ProposerSettings, ServerConfig
from starsd.models import pinned

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def write_tiny_qwen2(root: Path, seed: int = 0, noise: float = 0.0, base: Path | None = None) -> Path:
    """A 2-layer Qwen2 (hidden 128, head 64: a size vLLM's CPU attention takes) with the pinned target's
    151,936-token vocabulary, its weights drawn wide so its greedy choices are clear; with `base`, that
    model's weights plus Gaussian `noise` (a draft that agrees with it often, not always)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    source = pinned.model_dir(DEFAULT_TARGET)
    config = Qwen2Config(vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         tie_word_embeddings=True, initializer_range=0.3, eos_token_id=151645,
                         bos_token_id=151643, torch_dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config) if base is None else Qwen2ForCausalLM.from_pretrained(base)
    if noise:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * torch.randn_like(p))
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, root / name)
    return root


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


def engine_run(model, speculative: dict | None = None, **changes) -> dict:
    """An in-process engine's run (bench/vllm_engine.py), eager: vLLM's start takes 20 s where compiling
    the model's graph takes 38 (measured on the tiny target), and the plug-in runs outside that graph.
    vLLM as a person starts it, compiled: tests/test_vllm_serve.py."""
    return {"model": str(model), "dtype": "float32", "prompts": PROMPTS, "max_tokens": TOKENS, "temperature": 0.0,
            "speculative": speculative, "max_num_seqs": 4, "enforce_eager": True, **changes}


def star_run(models, python, tmp_path, during=None, vllm_repair: bool = True, server: ServerConfig = ServerConfig(),
             **changes) -> tuple[dict, dict]:
    """vLLM with StarSD's drafts from a draft server drafting with the perturbed copy, k = 4 asked every
    step (not adaptive: against a model this fast no draft pays, and the adaptive policy asks none);
    `during(server, stats_file)` runs beside it; `server`: the draft server's settings; `changes` to the
engine's run (engine_run). Returns vLLM's
result and the plug-in's counters."""
    target, draft = models
    pair = PairConfig(target=str(target), draft=str(draft), dtype="float32", draft_quantize="none",
                      target_engine="transformers", threads=1)
    tmp_path.mkdir(parents=True, exist_ok=True)
    star = start_server(pair, server, log=str(tmp_path / "server.log"))
    stats = tmp_path / "proposer.json"
    proposer = ProposerSettings(connect=star.address, timeout_s=10.0, stats_file=str(stats), adaptive=False,
                                cohosted_drafts=True,
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
