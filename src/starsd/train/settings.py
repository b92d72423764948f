"""The settings of `starsd train-eagle`, one typed dataclass (the CLI's flags are made from it).
Imports nothing heavy, so `starsd train-eagle --help` is instant."""

from __future__ import annotations

import math
from dataclasses import dataclass

from starsd.errors import SettingError

from starsd.config import DEFAULT_TARGET, DTYPES, setting


@dataclass(frozen=True)
class EagleTrainConfig:
    """An EAGLE-1 head trained on the target's features (loss and defaults as in the EAGLE-1 paper,
    with a shorter warmup and a higher learning rate for a CPU-sized budget)."""

    target: str = setting(DEFAULT_TARGET, "target model: a pinned name, a local Hugging Face model directory, "
                          "or a hub id")
    device: str = setting("cpu", "torch device: cpu, cuda, cuda:1, ...")
    dtype: str = setting("auto", "the target's dtype; auto: bfloat16 where the hardware computes it natively, "
                         "else float32 (the head's own weights are always trained in float32)",
                         choices=("auto", *DTYPES))
    cache_dir: str = setting("", "model cache (empty: $STARSD_CACHE or ~/.cache/starsd)")
    threads: int = setting(0, "torch CPU threads (0: torch's default)")
    run_dir: str = setting("", "checkpoints, log and the trained head (empty: <cache>/eagle/<target name>); "
                           "a run started again in the same directory continues where it stopped")
    text: str = setting("", "directories of Python files to train on, comma-separated (empty: the standard "
                        "library and the installed packages; HumanEval is always left out)")
    hours: float = setting(0.0, "wall-clock budget of this run in hours (0: none); it stops before a step "
                           "that would overrun it, checkpoints and saves the head")
    tokens: int = setting(0, "total training tokens over all runs (0: no limit)")
    seq_len: int = setting(512, "tokens per chunk of text")
    batch: int = setting(1, "chunks per optimiser step")
    lr: float = setting(1e-4, "peak learning rate of AdamW")
    warmup_steps: int = setting(20, "steps of linear learning-rate warmup")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    grad_clip: float = setting(0.5, "clip the gradient's global norm to this (0: off)")
    noise: float = setting(0.1, "uniform noise U(-noise, noise) added to the input features")
    ce_weight: float = setting(0.1, "weight of the cross-entropy against the target's next-token distribution "
                               "(the feature regression's weight is 1)")
    ce_positions: int = setting(128, "positions per chunk, drawn at random, that the cross-entropy scores "
                                "(0: all): the LM head over 150k tokens costs more than the head's layer")
    init: str = setting("target", "start the head from the target's last decoder layer with fc passing the "
                        "feature through (target), or from random weights (random)", choices=("target", "random"))
    checkpoint_minutes: float = setting(5.0, "minutes between checkpoints")
    eval_every: int = setting(25, "steps between held-out evaluations (top-1 agreement with the target)")
    eval_chunks: int = setting(4, "held-out chunks evaluated (their target features are computed once)")
    seed: int = setting(0, "seed of the file order, the head's random init, the noise and the drawn positions")

    def __post_init__(self):
        for name in ("batch", "eval_every", "eval_chunks"):
            if getattr(self, name) < 1:
                raise SettingError(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.seq_len < 2:
            raise SettingError(f"seq_len must be >= 2, not {self.seq_len}")
        for name in ("hours", "lr", "weight_decay", "grad_clip", "noise", "ce_weight", "checkpoint_minutes"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise SettingError(f"{name} must be a finite number >= 0, not {value}")
        for name in ("threads", "tokens", "warmup_steps", "ce_positions", "seed"):
            if getattr(self, name) < 0:
                raise SettingError(f"{name} must be >= 0, not {getattr(self, name)}")
        if self.dtype not in ("auto", *DTYPES):
            raise SettingError(f"dtype must be auto or one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.init not in ("target", "random"):
            raise SettingError(f"init must be target or random, not {self.init!r}")
        if not self.hours and not self.tokens:
            raise SettingError("give a budget: --hours (this run's wall clock) and/or --tokens (the total)")
