"""The analytical model's inputs from measured points (theory/sysmodel.py's Profile).

In sample, as the paper takes them: S(b), the draft server's batch time by batch size, from the
measured points; R (a draft's return time) and tau (tokens per iteration) from the single pair.
Out of sample: the shape of S(b) from a service sweep with no targets beside the server, scaled to
its S(1) at one target. `starsd bench scale` and `starsd bench servers` share them.
"""

from __future__ import annotations

import dataclasses
import statistics

from starsd.bench import metrics
from starsd.theory import sysmodel


def work_figures(before: dict, after: dict) -> dict:
    """The draft server's rows and ingested tokens by kind over one point (warm-up and window):
    resets (whole sequences) and steps, and the share of the ingested tokens that were resets'."""
    d = {k: after["work"].get(k, 0) - before["work"].get(k, 0) for k in
         ("reset_rows", "reset_tokens", "step_rows", "step_tokens")}
    ingested = d["reset_tokens"] + d["step_tokens"]
    return d | {"reset_token_share": d["reset_tokens"] / ingested if ingested else 0.0}


def build_profile(points: list[dict], alone: list[metrics.Iteration], target_only: dict,
                  max_batch: int, modes: tuple[str, ...] = ("serial", "batched")) -> sysmodel.Profile:
    """The model's inputs, as the paper takes them: S(b) is the draft server's own mean batch time by
    batch size, pooled over every point's window of `modes` (prompt prefills, the IO thread and the
    targets' share of the cores included); R and tau come from the single-pair point (`alone`)."""
    drafted = [it for it in alone if it.batch]
    pairs = [tuple(x) for p in points if p["mode"] in modes for x in p["batch_times"]]
    # R: an iteration's time outside the server. An iteration can take less than its draft's queue
    # and service time (a draft asked before the iteration began): no time outside, for the model
    outside = [round(max(0.0, it.ms - it.queue_ms - it.service_ms), 3) for it in drafted]
    return sysmodel.Profile(
        service_ms=metrics.service_table(pairs),
        return_ms=statistics.fmean(outside),
        tokens_per_iteration=statistics.fmean(it.tokens for it in drafted),
        target_only_ms_per_token=1e3 / target_only["per_target_tokens_per_s"],
        max_batch=max_batch,
        return_samples_ms=tuple(outside[:2000]),
        tokens_samples=tuple(it.tokens for it in drafted[:2000]))


def calibrated_profile(points: list[dict], sweep: dict, in_sample: sysmodel.Profile,
                       tokens: list[int] | None = None,
                       reset_ms_per_token: float | None = None,
                       levels: list[int] | None = None) -> sysmodel.Profile | None:
    """The model's inputs from separate runs only, for an out-of-sample prediction: the shape of
    S(b) from the service sweep (this process, no targets beside it), scaled to the draft server's
    own S(1) at the batched N = 1 point; R from that point (as in-sample); tau from `tokens`, the
    tokens per iteration over the whole recording (`harness.measure_acceptance`), else from that
    point. No other point is used. None without a sweep or a batched N = 1 point. `levels`, paired
    with `tokens` (`harness.measure_drafts`), let the simulator cut batches short as the server does.

    The sweep's batches are steady steps; a server also ingests each new prompt (a reset), row by
    row. With `reset_ms_per_token` (`harness.reset_cost` of the sweep), each of a batch's b requests
    also carries the prompt tokens the N = 1 point's server ingested per request on average, at
    that cost: S(b) = k (S_sweep(b) + b r), with k making S(1) the N = 1 point's."""
    one = next((p for p in points if p["mode"] == "batched" and p["n"] == 1), None)
    sweep = {int(b): statistics.fmean(v) for b, v in (sweep or {}).items() if v}
    s1 = [ms for b, ms in (one or {}).get("batch_times", []) if b == 1]
    if not s1 or 1 not in sweep:
        return None
    work = one.get("server_work") or {}
    rows = work.get("reset_rows", 0) + work.get("step_rows", 0)
    r = (reset_ms_per_token or 0.0) * work.get("reset_tokens", 0) / rows if rows else 0.0
    shape = {b: v + b * r for b, v in sorted(sweep.items())}
    scale = statistics.fmean(s1) / shape[1]
    out = dataclasses.replace(in_sample, service_ms={b: v * scale for b, v in shape.items()})
    if tokens:
        out = dataclasses.replace(out, tokens_per_iteration=statistics.fmean(tokens), tokens_samples=tuple(tokens),
                                  levels_samples=tuple(levels or ()))
    return out
