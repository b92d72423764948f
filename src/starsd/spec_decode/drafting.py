"""The seam between the decode loop (spec_decode/decode.py) and a drafter: what the loop asks of one.

Two kinds implement it: models.drafter.Drafter, a draft model in this process, whose draft costs its
caller the time it takes (LocalDrafting's answers), and star.remote_drafter.RemoteDrafter, a draft
model on a draft server, which may be asked a draft without waiting and picked up at a later step.
A new engine's drafter implements DraftSource, and the loop needs nothing else of it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from starsd.config import DraftConfig, SamplingConfig
from starsd.spec_decode.tree import DraftTree


class DraftSource(Protocol):
    device: torch.device  # where a sampled draft's generator lives
    taps: tuple[int, ...] | None  # the target features a feature-level drafter needs (None: tokens only)
    asynchronous: bool  # a draft may be asked without waiting (deadline 0) and taken at a later step
    cohosted: bool  # its drafts are computed on this host's cores, even those nobody waits for
    neighbours: int  # cohosted: the other targets on those cores, whose compute each draft takes too
    level_ms: float  # what a drafted level has cost of late (0: not known): a new stream's prior
    ingest_ms: float  # what ingesting one token of a stream it does not hold costs it (0: not known)
    lateness: float  # asynchronous: tokens a stream commits between asking a draft and reading it
    server_ms: float  # asynchronous: the drafting side's queue before a request's draft begins
    pace_ms: float  # asynchronous: the drafting side's time per level of a draft (0: not known)
    moves: int  # sessions moved to another server so far: what was learnt of the last one's costs is void

    def start(self, prompt_ids: list[int], cfg: DraftConfig | None = None, sampling: SamplingConfig | None = None,
              max_depth: int = 0) -> Any:
        """A new stream's draft state (the drafter's sequence), given the prompt."""

    def propose(self, seq: Any, new_tokens: list[int], cfg: DraftConfig, sampling: SamplingConfig,
                generator: torch.Generator | None = None, max_depth: int = 1 << 30,
                deadline_ms: float | None = None, features: torch.Tensor | None = None) -> DraftTree:
        """A draft below the tokens committed so far (new_tokens: those since the last call)."""

    def keep_up(self, seq: Any, unsent: int = 0) -> None:
        """On a step that asks no draft: whatever keeps the drafter's side of the stream alive (`unsent`:
        tokens committed that seq does not hold yet)."""

    def holds(self, seq: Any) -> bool:
        """Whether the drafting side holds the stream, or will once its request in flight is read (a draft
        asked while it had no session went nowhere)."""


class LocalDrafting:
    """DraftSource's answers for a drafter in this process: its draft is computed when asked, on the
    caller's time, so it is never asked ahead, costs no compute beyond that wait, and has nothing to
    keep up between drafts."""

    asynchronous = False
    cohosted = False
    neighbours = 0
    level_ms = 0.0
    ingest_ms = 0.0
    lateness = 1.0
    server_ms = 0.0
    pace_ms = 0.0
    moves = 0

    def keep_up(self, seq: Any, unsent: int = 0) -> None:
        pass

    def holds(self, seq: Any) -> bool:
        return True
