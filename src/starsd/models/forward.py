"""One forward pass of a transformers causal LM over arbitrary token positions.

Both the target (scoring a tree) and the drafter (expanding trees for many sequences) feed tokens
that attend to an arbitrary subset of the cached positions; this module is the only place that
knows how transformers takes a custom 4D mask. A causal pass (a prompt's prefill) takes no custom
mask: transformers makes its own, and none at all while nothing is cached (SDPA's is_causal), so
that no dense [m, past + m] bias is built. The cache is a KV (models/kv.py), written in place.
"""

from __future__ import annotations

import torch

from starsd.models.kv import KV


def device_of(model) -> torch.device:
    """Where the model computes: the device of its input embeddings (never quantised)."""
    return model.get_input_embeddings().weight.device


@torch.inference_mode()
def forward(model, cache: KV, tokens: torch.Tensor, positions: torch.Tensor,
            attend: torch.Tensor | None, taps: tuple[int, ...] = ()):
    """Run `tokens` through the model's decoder, writing their keys/values into `cache`.

    tokens:    [B, m] int64 (or [m]: a batch of one)
    positions: [B, m] int64 rotary positions
    attend:    [B, m, past + m] bool, True where a new token may attend to a cached/new column;
               or None: causal, each new token attends to every cached column and to the new
               tokens up to itself (then positions must continue the cache: past + arange(m))
    Returns the final-norm hidden states [B, m, H] (or [m, H]): what the LM head reads, and the
    feature an EAGLE-1 head consumes. Apply `lm_head` only to the rows you need: for a small draft
    model the head is a quarter of the work. With `taps` (indices into transformers' hidden_states:
    0 the embeddings, i layer i's output), returns (final hidden states, the tapped ones side by
    side [.., len(taps) x H]): an EAGLE-3 head's feature.
    """
    squeeze = tokens.ndim == 1
    if squeeze:
        tokens, positions = tokens[None], positions[None]
        attend = None if attend is None else attend[None]
    head = model.get_input_embeddings().weight  # device and dtype (the LM head may be quantised)
    mask = None
    if attend is not None:
        mask = torch.zeros(attend.shape, dtype=head.dtype, device=head.device)
        mask.masked_fill_(~attend.to(head.device), torch.finfo(head.dtype).min)
        mask = mask[:, None]
    out = model.get_decoder()(
        input_ids=tokens.to(head.device), position_ids=positions.to(head.device), attention_mask=mask,
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

