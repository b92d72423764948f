"""One forward pass of a transformers causal LM over arbitrary token positions, and KV-cache surgery.

Both the target (scoring a tree) and the drafter (expanding a tree) feed tokens that attend to an
arbitrary subset of the cached positions; this module is the only place that knows how transformers
takes a custom 4D mask and how its DynamicCache stores keys and values.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_len(cache: DynamicCache) -> int:
    return cache.get_seq_length()


@torch.inference_mode()
def forward(model, cache: DynamicCache, tokens: torch.Tensor, positions: torch.Tensor,
            attend: torch.Tensor, want_hidden: bool = False):
    """Run `tokens` through `model`, appending their keys/values to `cache`.

    tokens:    [B, m] int64 (or [m]: a batch of one)
    positions: [B, m] int64 rotary positions
    attend:    [B, m, past + m] bool, True where a new token may attend to a cached/new position
    Returns (logits [B, m, V] float32, hidden [B, m, H] or None): hidden is the final-norm output
    that the LM head reads, the feature a feature-level (EAGLE) drafter consumes.
    """
    squeeze = tokens.ndim == 1
    if squeeze:
        tokens, positions, attend = tokens[None], positions[None], attend[None]
    device = model.get_output_embeddings().weight.device
    dtype = model.get_output_embeddings().weight.dtype
    mask = torch.zeros(attend.shape, dtype=dtype, device=device)
    mask.masked_fill_(~attend.to(device), torch.finfo(dtype).min)
    out = model.get_decoder()(
        input_ids=tokens.to(device), position_ids=positions.to(device), attention_mask=mask[:, None],
        cache=cache, use_cache=True,
    )
    hidden = out.last_hidden_state
    logits = model.get_output_embeddings()(hidden).float()
    if squeeze:
        logits, hidden = logits[0], hidden[0]
    return logits, (hidden if want_hidden else None)


def truncate(cache: DynamicCache, length: int) -> None:
    """Drop every cached position from `length` on."""
    extra = cache_len(cache) - length
    if extra > 0:
        cache.crop(-extra)


@torch.inference_mode()
def keep_positions(cache: DynamicCache, start: int, kept: torch.Tensor) -> None:
    """Keep positions [0, start) and then the positions `kept` (absolute, ascending), drop the rest.

    Used after a tree is verified: the accepted path's entries move down to follow the prefix."""
    kept = kept.to(torch.long)
    contiguous = torch.arange(start, start + kept.shape[0])
    if not torch.equal(kept, contiguous):
        for layer in cache.layers:
            idx = kept.to(layer.keys.device)
            layer.keys[:, :, start:start + idx.shape[0]] = layer.keys[:, :, idx]
            layer.values[:, :, start:start + idx.shape[0]] = layer.values[:, :, idx]
    truncate(cache, start + kept.shape[0])
