"""The GGUF -> safetensors conversion, on a tiny Qwen2 GGUF: seconds, where the real pair takes minutes.

It runs the same transformers code path as `starsd models fetch`, so a dependency that path needs
(`gguf`, `accelerate`) shows missing here rather than after a long download.
"""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from gguf_tiny import EOS_TOKEN_IDS, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, write_tiny_qwen2_gguf
from starsd.models.pinned import convert_gguf


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_convert_gguf_round_trip(tmp_path, tied):
    gguf_path = tmp_path / "gguf" / "model.gguf"
    gguf_path.parent.mkdir()
    written = write_tiny_qwen2_gguf(gguf_path, seed=3, tie_embeddings=tied)
    out = tmp_path / "converted"
    convert_gguf(gguf_path, out, EOS_TOKEN_IDS)

    # The file holds every weight, under its transformers name, as the bf16 rounding of what was written.
    saved = load_file(out / "model.safetensors")
    assert sorted(saved) == sorted(written)
    for name, tensor in written.items():
        assert saved[name].dtype == torch.bfloat16, name
        assert torch.equal(saved[name], tensor.to(torch.bfloat16)), name

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    c = model.config
    assert (c.model_type, c.hidden_size, c.num_hidden_layers) == ("qwen2", HIDDEN, LAYERS)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (HEADS, KV_HEADS, len(VOCAB))
    assert c.tie_word_embeddings == tied
    embed = written["model.embed_tokens.weight"].to(torch.bfloat16)
    assert torch.equal(model.lm_head.weight, embed if tied else written["lm_head.weight"].to(torch.bfloat16))
    assert model.dtype == torch.bfloat16
    assert model.generation_config.eos_token_id == list(EOS_TOKEN_IDS)

    tok = AutoTokenizer.from_pretrained(out)
    text = "hello world<|im_end|>"
    ids = tok(text).input_ids
    # merges applied, the space kept with the word after it, the control token whole, no BOS added
    assert ids == [VOCAB.index("hello"), VOCAB.index("Ġworld"), EOS_TOKEN_IDS[0]]
    assert tok.decode(ids) == text
    odd = "héllo,\twörld! 42\n"  # characters with no merge go byte by byte and come back intact
    assert tok.decode(tok(odd).input_ids) == odd
    assert tok.eos_token_id == EOS_TOKEN_IDS[0]

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(VOCAB))
    assert torch.isfinite(logits).all()
