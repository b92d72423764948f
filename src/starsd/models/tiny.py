"""Tiny random-weight models with a real (character-level) tokenizer, built in seconds: for tests,
and for benchmarks whose figures are about the star, not the models (bench fuzz, bench sessions)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

VOCAB = 128


def char_tokenizer(alphabet: str | None = None) -> PreTrainedTokenizerFast:
    chars = alphabet or "".join(chr(i) for i in range(32, 127)) + "\n"
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_model(seed: int, layers: int = 2, hidden: int = 64, vocab: int = VOCAB) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, initializer_range=0.3, eos_token_id=0, bos_token_id=0,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def perturbed(model: Qwen2ForCausalLM, seed: int, scale: float) -> Qwen2ForCausalLM:
    """A copy of `model` with Gaussian noise on every weight: a good but imperfect draft."""
    clone = Qwen2ForCausalLM(model.config).eval()
    clone.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return clone


def save(model: Qwen2ForCausalLM, tokenizer, path: Path) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def save_pair(root: Path, chat: bool = False) -> tuple[str, str]:
    """A tiny target and a good tiny draft of it (same tokenizer) saved under root: their dirs. With
    `chat`, the tokenizer has a chat template (for the chat prompt set)."""
    tok = char_tokenizer()
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    target = tiny_model(1)
    return save(target, tok, root / "target"), save(perturbed(target, seed=7, scale=0.1), tok, root / "draft")
