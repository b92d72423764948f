"""A tiny Qwen2 GGUF file, written in milliseconds, to test the GGUF -> safetensors conversion.

`write_tiny_qwen2_gguf` writes what llama.cpp writes for a Qwen2.5 model, at toy size:
- the `qwen2.*` hyperparameters transformers reads into a `Qwen2Config`;
- a byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2", pre-tokenizer "qwen2"): the 256 byte
  tokens, a few merges that spell "hello" and " world", and Qwen's three control tokens;
- every weight as F32, under its GGUF name, in PyTorch's (out_features, in_features) layout.
  Qwen2 uses NEOX rope, so neither llama.cpp nor transformers permutes q/k (Llama's files do).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64
HEAD_DIM = HIDDEN // HEADS


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level spelling: byte b as one printable character (printable bytes as themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    spelled, extra = [], 0
    for b in range(256):
        if b in printable:
            spelled.append(chr(b))
        else:
            spelled.append(chr(256 + extra))  # e.g. space (0x20) -> "Ġ"
            extra += 1
    return spelled


MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = byte_alphabet() + [m.replace(" ", "") for m in MERGES] + SPECIALS  # 256 + 9 + 3 = 268 tokens
EOS_TOKEN_IDS = (VOCAB.index("<|im_end|>"), VOCAB.index("<|endoftext|>"))  # as the pinned models'


def _tensor_table(vocab: int, tied: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, transformers name, shape) for every weight."""
    table = [
        ("token_embd.weight", "model.embed_tokens.weight", (vocab, HIDDEN)),
        ("output_norm.weight", "model.norm.weight", (HIDDEN,)),
    ]
    if not tied:  # transformers ties the embeddings exactly when a file has no output.weight
        table.append(("output.weight", "lm_head.weight", (vocab, HIDDEN)))
    kv = KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        g, h = f"blk.{i}.", f"model.layers.{i}."
        table += [
            (g + "attn_norm.weight", h + "input_layernorm.weight", (HIDDEN,)),
            (g + "attn_q.weight", h + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (g + "attn_q.bias", h + "self_attn.q_proj.bias", (HIDDEN,)),
            (g + "attn_k.weight", h + "self_attn.k_proj.weight", (kv, HIDDEN)),
            (g + "attn_k.bias", h + "self_attn.k_proj.bias", (kv,)),
            (g + "attn_v.weight", h + "self_attn.v_proj.weight", (kv, HIDDEN)),
            (g + "attn_v.bias", h + "self_attn.v_proj.bias", (kv,)),
            (g + "attn_output.weight", h + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (g + "ffn_norm.weight", h + "post_attention_layernorm.weight", (HIDDEN,)),
            (g + "ffn_gate.weight", h + "mlp.gate_proj.weight", (FFN, HIDDEN)),
            (g + "ffn_up.weight", h + "mlp.up_proj.weight", (FFN, HIDDEN)),
            (g + "ffn_down.weight", h + "mlp.down_proj.weight", (HIDDEN, FFN)),
        ]
    return table


def write_tiny_qwen2_gguf(path: Path, seed: int = 0, tie_embeddings: bool = False,
                          context: int = 128) -> dict[str, torch.Tensor]:
    """Write the file; return the F32 weights written, keyed by their transformers parameter names.

    `tie_embeddings` leaves out output.weight: transformers then ties lm_head to the embeddings.
    """
    w = gguf.GGUFWriter(path, "qwen2")  # also writes general.architecture
    w.add_name("tiny-qwen2")
    w.add_context_length(context)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(VOCAB)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in VOCAB])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(VOCAB.index("<|endoftext|>"))
    w.add_eos_token_id(EOS_TOKEN_IDS[0])  # a GGUF holds one eos id; the converter is told the rest
    w.add_pad_token_id(VOCAB.index("<|endoftext|>"))
    w.add_add_bos_token(False)

    g = torch.Generator().manual_seed(seed)
    written = {}
    for gguf_name, hf_name, shape in _tensor_table(len(VOCAB), tie_embeddings):
        if "norm" in gguf_name:  # around 1, so a loader that offset norms by one would show
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = 0.2 * torch.randn(shape, generator=g)
        w.add_tensor(gguf_name, t.numpy().astype(np.float32))
        written[hf_name] = t

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def write_tiny_model_dir(root: Path, seed: int = 3, context: int = 2048) -> Path:
    """A directory as a pinned target's: the tiny GGUF (root/model/model.gguf) beside its tokenizer
    and its transformers conversion (a draft, or a reference). Returns the directory."""
    from starsd.models.pinned import convert_gguf

    gguf_path = root / "src" / "model.gguf"
    gguf_path.parent.mkdir(parents=True)
    write_tiny_qwen2_gguf(gguf_path, seed=seed, context=context)
    model = root / "model"
    convert_gguf(gguf_path, model, EOS_TOKEN_IDS)
    gguf_path.rename(model / "model.gguf")
    return model
