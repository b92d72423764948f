"""Loading a target or draft model and its tokenizer, and checking that a pair can work together."""

from __future__ import annotations

import gc
import hashlib
import json
import warnings
from pathlib import Path

import torch

from starsd.models import pinned
from starsd.config import ModelConfig
from starsd.errors import StarsdError


class ModelLoadError(StarsdError, RuntimeError):
    """The model could not be found or loaded."""


class VocabMismatch(StarsdError, ValueError):
    """Target and draft do not share one tokenizer: their token ids would mean different things."""


def resolve(path: str, cache: str | None = None) -> str:
    """A pinned name becomes its cached directory (fetched on first use); anything else is kept."""
    if path in pinned.PINNED:
        return str(pinned.fetch(path, cache))
    return path


def load_tokenizer(path: str, cache: str | None = None):
    from transformers import AutoTokenizer

    where = resolve(path, cache)
    try:
        if where.endswith(".gguf"):  # a bare GGUF file carries its tokenizer
            return AutoTokenizer.from_pretrained(str(Path(where).parent), gguf_file=Path(where).name)
        return AutoTokenizer.from_pretrained(where)
    except Exception as e:  # transformers raises OSError, ValueError, HF hub errors ...
        raise ModelLoadError(_not_found(path, e)) from e


def load_model(cfg: ModelConfig, cache: str | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    where = resolve(cfg.path, cache)
    dtype = torch.float32 if cfg.quantize == "int8" else getattr(torch, cfg.dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation="sdpa")
    except Exception as e:
        raise ModelLoadError(_not_found(cfg.path, e)) from e
    model = model.to(cfg.device).eval()
    if cfg.quantize == "int8":
        model = quantize_int8(model)
        gc.collect()  # the float32 layers replaced sit in reference cycles: ~1.8 GiB for the 0.5B draft
    return model


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 weights (float32 activations) for every linear layer, a scale per output channel:
    ~3x faster draft passes on a CPU, and lossless for a draft, since the target verifies every token.
    One scale for a whole layer, as before, cost the 0.5B draft a tenth of its accepted tokens, at
    the same speed: tokens accepted a step of 4 drafted, per layer / per channel / float32, 2.79 /
    3.07 / 3.01 against the llama.cpp target (HumanEval 30-35, chat 8-11, 96 tokens each) and
    2.59 / 2.78 / 2.93 against vLLM's bf16 one (HumanEval 20-22).

    torch 2.13 marks torch.ao.quantization deprecated in favour of torchao. torchao 0.18 measured
    5-9x slower than this path for the 0.5B draft on this CPU (AVX2, eager: one decode step 467 ms
    for int8 dynamic activations + int8 weights, 398-721 ms for int8 weight-only, against 82 ms
    here), so this path stays, its deprecation warnings silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.ao\.quantization is deprecated")
        warnings.filterwarnings("ignore", message=r".*quantize_per_tensor.*")
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        # in place: each float32 layer is dropped as soon as its int8 twin exists (2 GiB less peak for the 0.5B draft)
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear: qconfig}, dtype=torch.qint8,
                                                      inplace=True)


def _not_found(path: str, e: Exception) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    kind = "directory" if Path(path).is_dir() else "name"
    return (f"cannot load model {path!r} ({kind}): {first}. Use a pinned name "
            f"({', '.join(pinned.PINNED)}), a local Hugging Face model directory, or a hub id with hub access.")


def vocab_fingerprint(tokenizer, vocab_size: int) -> str:
    """sha256 over the token -> id map, the special tokens and the model's logits width.
    Two models may draft for each other exactly when their fingerprints agree."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
        "eos": tokenizer.eos_token_id,
        "logits": vocab_size,
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


def check_pair(target_tok, target_vocab: int, draft_tok, draft_vocab: int) -> str:
    """Refuse a target/draft pair whose vocabularies differ; return the shared fingerprint."""
    a = vocab_fingerprint(target_tok, target_vocab)
    b = vocab_fingerprint(draft_tok, draft_vocab)
    if a != b:
        raise VocabMismatch(
            f"target and draft vocabularies differ (target: {len(target_tok)} tokens, logits {target_vocab}, "
            f"fingerprint {a[:12]}; draft: {len(draft_tok)} tokens, logits {draft_vocab}, fingerprint {b[:12]}). "
            "Speculative decoding needs one shared tokenizer."
        )
    return a


def logits_width(model: torch.nn.Module) -> int:
    return model.config.vocab_size


def load_eagle(head: ModelConfig, target: ModelConfig, cache: str | None = None,
               target_model: torch.nn.Module | None = None):
    """An EAGLE head (models/eagle.py) for `target`, holding the target's embedding and LM head:
    those of `target_model` when it is loaded in this process, else read from the target's
    weights alone (a draft server has no use for the rest of the target). With head.quantize int8
    (a draft server's on a CPU), its linear layers and its copy of the LM head are int8; a target's
    own LM head, shared co-located, stays as the target runs it."""
    from starsd.models import eagle

    if target_model is None:
        config, embed, lm_head = _target_ends(target, cache)
    else:
        config, embed, lm_head = target_model.config, target_model.get_input_embeddings(), target_model.get_output_embeddings()
    int8 = head.quantize == "int8" and target_model is None
    dtype = torch.float32 if int8 else getattr(torch, head.dtype)
    h = eagle.load(head.path, config, embed.to(head.device, dtype), lm_head.to(head.device, dtype), dtype, head.device)
    if int8:
        quantize_int8(h)
        h.attach(h.get_input_embeddings(), quantize_int8(torch.nn.Sequential(h.get_output_embeddings()))[0])
    return h


def _target_ends(target: ModelConfig, cache: str | None):
    """The target's config, embedding and LM head, read from its safetensors without the layers."""
    from safetensors import safe_open
    from transformers import AutoConfig

    where = Path(resolve(target.path, cache))
    try:
        config = AutoConfig.from_pretrained(where)
    except Exception as e:
        raise ModelLoadError(_not_found(target.path, e)) from e
    index = where / "model.safetensors.index.json"
    files = json.loads(index.read_text())["weight_map"] if index.exists() else None
    names = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight"}
    weights = {}
    for key, name in names.items():
        file = where / (files.get(name, "") if files else "model.safetensors")
        if files is not None and name not in files or not file.exists():
            continue
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():
                weights[key] = f.get_tensor(name)
    if "embed" not in weights:
        raise ModelLoadError(f"{target.path}: no {names['embed']} in its safetensors: an EAGLE head needs it")
    embed = torch.nn.Embedding.from_pretrained(weights["embed"], freeze=True)
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    head.weight = torch.nn.Parameter(weights.get("head", weights["embed"]), requires_grad=False)  # tied: the embedding
    return config, embed, head


def generation_config(path: str, cache: str | None = None):
    """The generation config beside a model's weights (None if it has none)."""
    from transformers import GenerationConfig

    where = Path(resolve(path, cache))
    try:
        return GenerationConfig.from_pretrained(where.parent if where.is_file() else where)
    except Exception:  # none there: the tokenizer's EOS alone
        return None


def eos_ids(generation, tokenizer) -> frozenset[int]:
    """Every token that ends a generation: the tokenizer's EOS and the generation config's."""
    ids = set()
    cfg_eos = generation.eos_token_id if generation is not None else None
    for e in (tokenizer.eos_token_id, cfg_eos):
        if isinstance(e, int):
            ids.add(e)
        elif e is not None:
            ids.update(e)
    return frozenset(ids)
