"""Typed settings, one dataclass per concern. Each field's `help` metadata is its documentation and
the text of the CLI flag generated from it (see `cli.add_dataclass_args`), so defaults cannot drift."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from starsd.weights import DEFAULT_DRAFT, DEFAULT_TARGET


def setting(default, help: str, **kw):
    """A dataclass field with its documentation (the CLI flag's help)."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelConfig:
    """Where a model comes from and how it runs."""

    path: str = setting("", "pinned name (see `starsd models list`), a local HF model directory, or a hub id")
    device: str = setting("cpu", "torch device: cpu, cuda, cuda:1, ...")
    dtype: str = setting("bfloat16", "float32 (bit-exact tests) or bfloat16 (fast)", choices=("float32", "bfloat16", "float16"))
    quantize: str = setting("none", "int8: dynamic int8 weights for every linear layer (CPU only; a draft "
                            "stays lossless, since the target verifies it)", choices=("none", "int8"))

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, not {self.dtype!r}")
        if self.quantize not in ("none", "int8"):
            raise ValueError(f"quantize must be none or int8, not {self.quantize!r}")
        if self.quantize == "int8" and not self.device.startswith("cpu"):
            raise ValueError("int8 dynamic quantisation runs on the CPU only")


def target_config(**kw) -> ModelConfig:
    return ModelConfig(**{"path": DEFAULT_TARGET, **kw})


def draft_config(**kw) -> ModelConfig:
    return ModelConfig(**{"path": DEFAULT_DRAFT, **kw})


@dataclass(frozen=True)
class DraftConfig:
    """The shape of one draft. A chain is a tree with top_k = 1 and total_tokens = depth.

    Tree drafting is EAGLE-2 style: expand the top_k best frontier nodes by their top_k children for
    `depth` levels, scoring every node by its path's cumulative draft log-probability, then keep the
    best `total_tokens` nodes (always a valid tree: a child never outscores its parent).
    """

    depth: int = setting(10, "draft depth d: tokens per chain, levels per tree (at most)")
    top_k: int = setting(1, "children expanded per node; 1 drafts a chain")
    total_tokens: int = setting(0, "tree nodes kept after re-ranking (0: depth * top_k)")
    sample: bool = setting(False, "chains only: sample draft tokens from the draft distribution q instead of taking its argmax")
    min_path_prob: float = setting(0.3, "stop deepening once the best frontier path's draft probability falls below this (0: draft the full depth)")

    def __post_init__(self):
        if self.depth < 1:
            raise ValueError(f"draft depth must be >= 1, not {self.depth}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, not {self.top_k}")
        if self.total_tokens < 0:
            raise ValueError(f"total_tokens must be >= 0, not {self.total_tokens}")
        if not 0 <= self.min_path_prob < 1:
            raise ValueError(f"min_path_prob must be in [0, 1), not {self.min_path_prob}")
        if self.sample and self.top_k != 1:
            raise ValueError("sampled drafts are chains: use top_k = 1 with sample")

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1

    @property
    def max_nodes(self) -> int:
        return self.total_tokens or self.depth * self.top_k


@dataclass(frozen=True)
class SamplingConfig:
    """How the target samples. Speculative decoding reproduces exactly this distribution."""

    temperature: float = setting(0.0, "0 is greedy (argmax); > 0 samples")
    top_k: int = setting(0, "keep only the k most likely tokens (0: off)")
    top_p: float = setting(1.0, "keep the smallest set of tokens whose probability reaches top_p (1: off)")
    seed: int = setting(0, "seed of this request's random generator; a seeded run is reproducible")

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def fields_of(cls) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls))
