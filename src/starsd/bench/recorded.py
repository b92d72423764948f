"""Drafts recorded on cores of their own, and the bound they give.

A recording (emulate/draft_host.py) holds the real drafter's chain below every prefix of a set of
greedy outputs, timed on the cores it was made on: an emulated draft host serves from it. Its
*bound* is what these drafts would give with drafting free: for each fixed depth, a greedy decode of
each output with the recorded chains cut to that depth, each step's tokens for one target pass of
its chain and root, over one token a pass. `starsd bench llamacpp` and `starsd bench vllm` share it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time

from starsd import config as C
from starsd.results import cpu_kind


def _record(conn, cores: set[int], pair: C.PairConfig, draft: C.DraftConfig, paths: list, out: str) -> None:
    """A child process on `cores`: the real drafter's drafts below every prefix of `paths`, timed
    (emulate/draft_host.py), saved to `out`; sends the fitted cost."""
    os.sched_setaffinity(0, cores)
    import torch

    from starsd.emulate.draft_host import record
    from starsd.models.pair import load_drafter

    torch.set_num_threads(len(cores))
    drafter, _ = load_drafter(pair)
    # whole chains, each level's path probability kept: a stream's policy chooses where each of its chains stops
    rec = record(drafter, paths, dataclasses.replace(draft, min_path_prob=0.0), f"{len(cores)} core(s), {cpu_kind()}")
    rec.save(out)
    conn.send(dataclasses.asdict(rec.cost))


def record_drafts(cores: set[int], pair: C.PairConfig, draft: C.DraftConfig, paths: list, out: str) -> dict:
    """The real drafter's drafts below every prefix of `paths`, recorded and timed by a child process on
    `cores` into `out`; the cost fitted to its times (ms: per level, fixed)."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_record, args=(child, cores, dataclasses.replace(pair, threads=len(cores)), draft, paths,
                                             out), daemon=True)
    proc.start()
    wait_for(conn, proc, 1800, "recording the drafts")
    cost = conn.recv()
    proc.join(30)
    return cost


def bound(recording: str, paths: list, costs: dict[int, float]) -> dict:
    """For each fixed depth d: a greedy decode of each path with the recorded chains cut to d, each
    step's tokens for one pass of its chain and root (drafts free); its speed-up over one token a
    pass, and the accepted tokens a step. The bound is the best d's."""
    from starsd.emulate.draft_host import Recording

    rec = Recording.load(recording)
    by_depth = {}
    for d in range(1, max(costs)):
        tokens = steps = accepted = 0
        ms = 0.0
        for prompt, output in paths:
            pos = 0
            while pos < len(output):
                got = rec.chain(prompt + output[:pos], d)
                chain = got[0] if got else []
                a = next((j for j, (x, y) in enumerate(zip(chain, output[pos:])) if x != y),
                         min(len(chain), len(output) - pos))
                ms += costs[len(chain) + 1]
                pos += a + 1
                steps += 1
                accepted += a
            tokens += len(output)
        by_depth[d] = {"speedup": tokens / ms * costs[1], "accepted_per_step": accepted / steps}
    best = max(by_depth, key=lambda d: by_depth[d]["speedup"])
    return {"speedup": by_depth[best]["speedup"], "depth": best, "by_depth": by_depth, "pass_ms": costs}


def wait_for(conn, proc, seconds: float, what: str) -> None:
    """Until a child process has something to say; it must not die or take longer than `seconds`."""
    deadline = time.monotonic() + seconds
    while not conn.poll(1):
        if not proc.is_alive():
            raise RuntimeError(f"{what} failed: its process exited ({proc.exitcode})")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{what} took more than {seconds:.0f} s")
