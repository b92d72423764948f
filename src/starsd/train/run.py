"""A training run's directory: everything needed to continue it, and what it produced.

    <run dir>/
      corpus.json     the files in reading order, train and held out (data.Corpus)
      heldout.pt      the held-out chunks with the target's features and argmax tokens, computed once
      checkpoint.pt   the head's and the optimiser's state, Progress, the random generator's state
      log.jsonl       one JSON object per step and per evaluation
      head/           the latest head in the published EAGLE-1 layout (models.eagle.save / load)

Files are written to a temporary name and renamed into place: a run killed mid-write leaves the
previous checkpoint and head whole.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch

from starsd.models import eagle, pinned
from starsd.train.data import Position


def default_run_dir(target: str, cache_dir: str = "") -> Path:
    """<cache>/eagle/<target name>: the pinned name, or the model directory's name."""
    name = target if target in pinned.PINNED else Path(target.rstrip("/")).name
    return pinned.cache_root(cache_dir or None) / "eagle" / name


@dataclasses.dataclass
class Progress:
    """How far training has come, over all runs in this directory."""

    step: int = 0
    tokens: int = 0  # text tokens consumed (chunks x seq_len)
    position: Position = Position(0, 0)  # where the next chunk starts
    seconds: float = 0.0  # time spent in training steps

    def to_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "position": list(self.position), "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: dict) -> Progress:
        return cls(d["step"], d["tokens"], Position(*d["position"]), d["seconds"])


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.corpus = self.path / "corpus.json"
        self.heldout = self.path / "heldout.pt"
        self.checkpoint = self.path / "checkpoint.pt"
        self.head = self.path / "head"

    def save_checkpoint(self, head: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: Progress,
                        rng: torch.Generator, target: str) -> None:
        state = {"head": head.state_dict(), "optimizer": optimizer.state_dict(), "progress": progress.to_dict(),
                 "rng": rng.get_state(), "target": target}
        tmp = self.checkpoint.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.checkpoint)

    def load_checkpoint(self) -> dict | None:
        if not self.checkpoint.exists():
            return None
        return torch.load(self.checkpoint, map_location="cpu", weights_only=True)

    def save_head(self, head: eagle.EagleHead) -> Path:
        tmp = self.path / "head.tmp"
        old = self.path / "head.old"
        for stale in (tmp, old):
            shutil.rmtree(stale, ignore_errors=True)
        eagle.save(head, tmp)
        if self.head.exists():
            self.head.rename(old)
        tmp.rename(self.head)
        shutil.rmtree(old, ignore_errors=True)
        return self.head

    def log(self, record: dict) -> None:
        with open(self.path / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
