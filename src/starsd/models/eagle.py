"""EAGLE heads: drafts that read the target's features instead of keeping a copy of the text.

A head is one decoder layer of the target's architecture. It takes the embedding of a token with a
*feature* of the position before it and predicts the feature of the token's own position; an LM
head turns a feature into next-token logits. The two published layouts:
- EAGLE-1 (`fc.*`, `layers.0.*`): the feature is the target's last hidden state, after its final
  norm; x = fc([embed(t); f]) goes through the layer (its input norm dropped), whose output is the
  next feature, read by the target's own LM head as it is.
- EAGLE-3 (`fc.*`, `midlayer.*`, `norm.*`, `lm_head.*`, `d2t`, `t2d`): the feature is the outputs
  of three of the target's layers (low, middle, high) side by side, fused by fc (3H -> H); the
  layer's attention reads [input_layernorm(embed(t)); hidden_norm(f)] (2H wide); logits come from
  lm_head(norm(out)) over a reduced draft vocabulary, draft id i being target id i + d2t[i].
Alignment: column i holds token i + 1 of a stream with the target's feature at position i; a
stream's first token is never fed. In a draft tree a node's feature is its parent's output (`lift`
is the identity for those: only the target's features go through EAGLE-3's fc). The embedding and
the target's LM head belong to the target: a head holds them (`attach`) but does not own them, so
its state dict is the checkpoint's and nothing more.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import torch
from torch import nn

from starsd.errors import StarsdError

KINDS = ("eagle1", "eagle3")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class EagleLoadError(StarsdError, ValueError):
    """A head checkpoint that cannot serve this target."""


def _parts(config):
    """The target architecture's decoder layer, RMS norm and rotary embedding classes."""
    kind = config.model_type
    try:
        module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    except ImportError as e:
        raise EagleLoadError(f"no transformers implementation of model type {kind!r} for an EAGLE head") from e
    found = {}
    for suffix in ("DecoderLayer", "RMSNorm", "RotaryEmbedding"):
        names = [n for n in dir(module) if n.endswith(suffix) and not n.startswith("_")]
        if not names:
            raise EagleLoadError(f"transformers' {kind} has no {suffix}: an EAGLE head needs one")
        found[suffix] = getattr(module, min(names, key=len))  # Qwen2DecoderLayer, not a variant
    return found["DecoderLayer"], found["RMSNorm"], found["RotaryEmbedding"]


def head_config(target_config):
    """The target's config reduced to one layer: the shape of a head's decoder layer."""
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = ["full_attention"]
    cfg.use_sliding_window = False
    cfg._attn_implementation = "sdpa"
    return cfg


class EagleHead(nn.Module):
    def __init__(self, target_config, kind: str = "eagle1", draft_vocab: int | None = None, fc_bias: bool = True):
        super().__init__()
        if kind not in KINDS:
            raise EagleLoadError(f"EAGLE kind must be one of {KINDS}, not {kind!r}")
        Layer, Norm, Rotary = _parts(target_config)
        cfg = head_config(target_config)
        h = cfg.hidden_size
        self.config = cfg
        self.kind = kind
        self.target_layers = target_config.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.rotary_emb = Rotary(config=cfg)  # buffers only, none persistent: not in the state dict
        if kind == "eagle1":
            self.fc = nn.Linear(2 * h, h, bias=fc_bias)
            layer = Layer(cfg, 0)
            layer.input_layernorm = nn.Identity()  # the fused input is not normed (EAGLE-1)
            self.layers = nn.ModuleList([layer])
        else:
            self.fc = nn.Linear(3 * h, h, bias=False)
            layer = Layer(cfg, 0)
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):  # attention reads [embedding; feature]
                old = getattr(attn, name)
                setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
            layer.hidden_norm = Norm(h, eps=cfg.rms_norm_eps)
            self.midlayer = layer
            self.norm = Norm(h, eps=cfg.rms_norm_eps)
            dv = draft_vocab or cfg.vocab_size
            self.lm_head = nn.Linear(h, dv, bias=False)
            self.register_buffer("d2t", torch.zeros(dv, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self._target: list[nn.Module] = []  # [embedding, LM head], the target's: held, not owned

    def _apply(self, fn, recurse=True):
        """As nn.Module's (`.to`, `.half`, ...), but the rotary frequencies stay float32: a cast to
        bf16 would round them, and positions a thousand tokens in would turn by radians."""
        super()._apply(fn, recurse)
        self.rotary_emb = type(self.rotary_emb)(config=self.config).to(self.rotary_emb.inv_freq.device)
        return self

    def attach(self, embed: nn.Module, lm_head: nn.Module) -> EagleHead:
        """Hold the target's embedding and LM head (kept out of the state dict)."""
        self._target = [embed, lm_head]
        return self

    def get_input_embeddings(self) -> nn.Module:
        return self._target[0]

    def get_output_embeddings(self) -> nn.Module:
        return self._target[1]

    @property
    def taps(self) -> tuple[int, ...]:
        """Which of the target's hidden states make the feature, as indices into transformers'
        `hidden_states` (0: the embeddings, i: layer i's output); () for the last hidden state
        after the final norm (EAGLE-1). EAGLE-3 takes the inputs of layers 2, L/2 and L-3."""
        if self.kind == "eagle1":
            return ()
        n = self.target_layers
        return (min(2, n - 1), n // 2, max(n - 3, 1))

    @property
    def feature_width(self) -> int:
        """Columns of the target's feature: H, or 3H for EAGLE-3."""
        return self.fc.in_features - (self.config.hidden_size if self.kind == "eagle1" else 0)

    def lift(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., F] -> the head's [..., H]."""
        features = features.to(self.get_input_embeddings().weight.dtype)  # fc may be int8: its input's dtype
        return self.fc(features) if self.kind == "eagle3" else features

    def decode(self, cache, tokens: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor,
               features: torch.Tensor) -> torch.Tensor:
        """One pass of the layer, appending its keys/values to `cache` (None: no cache).

        tokens [B, m] int64, positions [B, m] int64, attend [B, m, past + m] bool as in
        forward.forward, features [B, m, H] (lifted). Returns the predicted features [B, m, H]."""
        embed = self.get_input_embeddings()(tokens)
        mask = torch.zeros(attend.shape, dtype=embed.dtype, device=embed.device)
        mask.masked_fill_(~attend.to(embed.device), torch.finfo(embed.dtype).min)
        mask = mask[:, None]
        rotary = self.rotary_emb(embed, positions)
        use_cache = cache is not None
        if self.kind == "eagle1":
            x = self.fc(torch.cat([embed, features], dim=-1))
            return self.layers[0](x, attention_mask=mask, position_ids=positions, cache=cache, use_cache=use_cache,
                                  position_embeddings=rotary)
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embed), layer.hidden_norm(features)], dim=-1)
        x, _ = layer.self_attn(hidden_states=x, attention_mask=mask, position_ids=positions, cache=cache,
                               use_cache=use_cache, position_embeddings=rotary)
        x = features + x
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H] features -> [..., V] float32 logits over the target's vocabulary (EAGLE-3:
        -inf outside the draft vocabulary)."""
        if self.kind == "eagle1":
            head = self.get_output_embeddings()
            return (head(features[None])[0] if features.ndim == 1 else head(features)).float()
        small = self.lm_head(self.norm(features)).float()
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        full[..., torch.arange(small.shape[-1], device=small.device) + self.d2t] = small
        return full


def target_features(hidden_states: tuple[torch.Tensor, ...], last: torch.Tensor, taps: tuple[int, ...]) -> torch.Tensor:
    """What a target sends a head: its last hidden state (taps == ()), or the taps side by side."""
    if not taps:
        return last
    return torch.cat([hidden_states[i] for i in taps], dim=-1)


def save(head: EagleHead, path: str | Path) -> str:
    """A checkpoint in the published layout: config.json (the target's, one layer, plus the kind
    and the draft vocabulary) and model.safetensors with the head's own weights."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = head.config.to_dict()
    cfg["eagle"] = head.kind
    if head.kind == "eagle3":
        cfg["draft_vocab_size"] = head.lm_head.out_features
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(path / "model.safetensors"))
    return str(path)


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A head's weights from model.safetensors or pytorch_model.bin (tensors only: no code runs)."""
    path = Path(path)
    for name in WEIGHT_FILES:
        f = path / name
        if f.exists():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(f))
            return torch.load(f, map_location="cpu", weights_only=True)
    raise EagleLoadError(f"{path}: no EAGLE head weights ({' or '.join(WEIGHT_FILES)})")


def load(path: str | Path, target_config, embed: nn.Module, lm_head: nn.Module, dtype: torch.dtype,
         device: str | torch.device = "cpu") -> EagleHead:
    """A head from a checkpoint directory in the EAGLE-1 or EAGLE-3 layout, for this target."""
    state = read_weights(path)
    state.pop("embed_tokens.weight", None)  # EAGLE-1 releases carry the target's embedding: held, not owned
    if any(k.startswith("midlayer.") for k in state):
        kind = "eagle3"
    elif any(k.startswith("layers.0.") for k in state):
        kind = "eagle1"
    else:
        raise EagleLoadError(f"{path}: neither an EAGLE-1 (layers.0.*) nor an EAGLE-3 (midlayer.*) head")
    config_file = Path(path) / "config.json"
    if config_file.exists():
        hidden = json.loads(config_file.read_text()).get("hidden_size")
        if hidden is not None and hidden != target_config.hidden_size:
            raise EagleLoadError(f"{path}: the head is for hidden size {hidden}, the target's is "
                                 f"{target_config.hidden_size}")
    draft_vocab = state["lm_head.weight"].shape[0] if kind == "eagle3" and "lm_head.weight" in state else None
    head = EagleHead(target_config, kind, draft_vocab, fc_bias="fc.bias" in state)
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise EagleLoadError(f"{path}: the {kind} head does not fit this target: {e}") from e
    return head.attach(embed, lm_head).to(device=device, dtype=dtype).eval()
