"""A tiny Qwen2 model with the pinned pair's tokenizer, for vLLM tests: vLLM loads it in seconds, and a
draft server drafts for it with a perturbed copy (same vocabulary, so the same fingerprint)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from starsd.config import DEFAULT_TARGET
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
