"""One forward pass of a transformers causal LM over arbitrary token positions, and KV-cache surgery.

Both the target (scoring a tree) and the drafter (expanding trees for many sequences) feed tokens
that attend to an arbitrary subset of the cached positions; this module is the only place that
knows how transformers takes a custom 4D mask and how its DynamicCache stores keys and values.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def device_of(model) -> torch.device:
    """Where the model computes: the device of its input embeddings (never quantised)."""
    return model.get_input_embeddings().weight.device


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_len(cache: DynamicCache) -> int:
    return cache.get_seq_length()


@torch.inference_mode()
def forward(model, cache: DynamicCache, tokens: torch.Tensor, positions: torch.Tensor,
            attend: torch.Tensor, taps: tuple[int, ...] = ()):
    """Run `tokens` through the model's decoder, appending their keys/values to `cache`.

    tokens:    [B, m] int64 (or [m]: a batch of one)
    positions: [B, m] int64 rotary positions
    attend:    [B, m, past + m] bool, True where a new token may attend to a cached/new column
    Returns the final-norm hidden states [B, m, H] (or [m, H]): what the LM head reads, and the
    feature an EAGLE-1 head consumes. Apply `lm_head` only to the rows you need: for a small draft
    model the head is a quarter of the work. With `taps` (indices into transformers' hidden_states:
    0 the embeddings, i layer i's output), returns (final hidden states, the tapped ones side by
    side [.., len(taps) x H]): an EAGLE-3 head's feature.
    """
    squeeze = tokens.ndim == 1
    if squeeze:
        tokens, positions, attend = tokens[None], positions[None], attend[None]
    head = model.get_input_embeddings().weight  # device and dtype (the LM head may be quantised)
    mask = torch.zeros(attend.shape, dtype=head.dtype, device=head.device)
    mask.masked_fill_(~attend.to(head.device), torch.finfo(head.dtype).min)
    out = model.get_decoder()(
        input_ids=tokens.to(head.device), position_ids=positions.to(head.device), attention_mask=mask[:, None],
        cache=cache, use_cache=True, output_hidden_states=bool(taps),
    )
    hidden = out.last_hidden_state
    if not taps:
        return hidden[0] if squeeze else hidden
    tapped = torch.cat([out.hidden_states[i] for i in taps], dim=-1)
    return (hidden[0], tapped[0]) if squeeze else (hidden, tapped)


@torch.inference_mode()
def lm_head(model, hidden: torch.Tensor) -> torch.Tensor:
    """[..., H] hidden states -> [..., V] float32 logits."""
    if hidden.ndim == 1:  # quantised linear layers want a batch dimension
        return model.get_output_embeddings()(hidden[None])[0].float()
    return model.get_output_embeddings()(hidden).float()


def truncate(cache: DynamicCache, length: int) -> None:
    """Drop every cached position from `length` on, in every layer on its own (after a failure
    part-way through a pass, layers can differ in length)."""
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


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
