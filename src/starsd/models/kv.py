"""Keys and values that a forward pass writes in place: preallocated, for one sequence or a batch.

transformers' DynamicCache grows by concatenation, which copies every layer's whole cache on every
pass. A KV here is allocated with room to spare: a pass writes its new columns in place and
attention reads a view of the columns written so far. This is the only module that knows how
transformers holds a cache. Both the drafter's sequences and the target's stream keep theirs here.

Shapes: every layer holds keys and values [rows, kv_heads, capacity, head_dim]; columns
[0, length) are written, the same `length` in every layer and row.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

GROWTH_MIN = 64  # columns a KV grows by at least


class Slab(CacheLayerMixin):
    """One layer's keys and values, written in place at the next free column."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.keys = keys  # [rows, kv_heads, capacity, head_dim]
        self.values = values
        self.length = length
        self.device = keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the pass's keys/values [rows, kv_heads, m, head_dim]; return every column so far."""
        end = self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            raise RuntimeError(f"KV full: {end} columns needed, {self.keys.shape[-2]} allocated")
        self.keys[:, :, self.length:end] = key_states
        self.values[:, :, self.length:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class KV(Cache):
    """Every layer's Slab; passed to the model as its cache."""

    def __init__(self, slabs: list[Slab]):
        super().__init__(layers=slabs)

    @classmethod
    def allocate(cls, model, rows: int, capacity: int) -> KV:
        """Zeros (padding that is masked out must still be finite) for `rows` rows of `capacity` columns."""
        c = model.config
        embed = model.get_input_embeddings().weight  # the activations' dtype, even for an int8 model
        shape = (rows, c.num_key_value_heads, capacity, _head_dim(c))
        return cls([Slab(embed.new_zeros(shape), embed.new_zeros(shape), 0) for _ in range(c.num_hidden_layers)])

    @staticmethod
    def bytes_per_column(model) -> int:
        """Bytes of keys and values one token takes in one row: 2 x layers x kv heads x head dim x element size."""
        c = model.config
        size = model.get_input_embeddings().weight.element_size()
        return 2 * c.num_hidden_layers * c.num_key_value_heads * _head_dim(c) * size

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def capacity(self) -> int:
        return self.layers[0].keys.shape[-2]

    @property
    def rows(self) -> int:
        return self.layers[0].keys.shape[0]

    def cut(self, length: int) -> None:
        """Forget every column from `length` on (they are overwritten by the next pass)."""
        for slab in self.layers:
            slab.length = length

    def reserve(self, capacity: int) -> None:
        """Room for at least `capacity` columns. The allocation grows geometrically, by a quarter
        (GROWTH_MIN columns at least): a column is copied a few times over a stream's life, not once
        a pass, and a long prompt's KV is not held twice over. Layer after layer, so growing costs
        one layer's worth of extra memory at a time."""
        if capacity <= self.capacity:
            return
        new = grown(self.capacity, capacity)
        for slab in self.layers:
            slab.keys, slab.values = _resized(slab.keys, slab.length, new), _resized(slab.values, slab.length, new)

    def gather(self, sources: list[KV], lengths: list[int]) -> None:
        """Row r := the first lengths[r] columns of sources[r] (a one-row KV); length := max(lengths).
        Raises where a length passes this KV's capacity or its source's: a slice would copy fewer
        columns without a word and the length would claim them."""
        if any(n > min(self.capacity, src.capacity) for src, n in zip(sources, lengths)):
            raise RuntimeError(f"KV gather of {max(lengths)} columns into {self.capacity} allocated "
                               f"(sources {[src.capacity for src in sources]})")
        for i, slab in enumerate(self.layers):
            for r, (src, n) in enumerate(zip(sources, lengths)):
                slab.keys[r, :, :n] = src.layers[i].keys[0, :, :n]
                slab.values[r, :, :n] = src.layers[i].values[0, :, :n]
            slab.length = max(lengths)

    def copy_columns(self, row: int, columns: torch.Tensor, dst: KV, dst_row: int, at: int) -> None:
        """dst[dst_row, :, at:at+len(columns)] := self[row, :, columns], in every layer."""
        n = columns.shape[0]
        for src, out in zip(self.layers, dst.layers):
            idx = columns.to(src.keys.device)
            out.keys[dst_row, :, at:at + n] = src.keys[row, :, idx]
            out.values[dst_row, :, at:at + n] = src.values[row, :, idx]

    def clone(self, spare: int = 64) -> KV:
        """A copy of the filled columns, with room for `spare` more."""
        n = self.length
        return KV([Slab(_resized(slab.keys, n, n + spare), _resized(slab.values, n, n + spare), n)
                   for slab in self.layers])

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only rows `rows`, in that order."""
        for slab in self.layers:
            idx = rows.to(slab.keys.device)
            slab.keys = slab.keys.index_select(0, idx)
            slab.values = slab.values.index_select(0, idx)


def grown(capacity: int, needed: int) -> int:
    """The columns a KV of `capacity` columns holds once it has room for `needed` (KV.reserve)."""
    return capacity if needed <= capacity else max(needed, capacity + max(capacity // 4, GROWTH_MIN))


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _resized(t: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
    """A new zeroed tensor of `capacity` columns holding t's first `length` columns."""
    out = t.new_zeros((*t.shape[:2], capacity, t.shape[3]))
    out[:, :, :length] = t[:, :, :length]
    return out
