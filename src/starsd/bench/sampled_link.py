"""Sampled drafts across a slow link: a real target process and a real draft server on emulated hosts.

A sampled draft's reply carries q over its support (spec_decode/sparse_q.py): a few hundred bytes a node,
where the whole warped distribution took 4 V bytes (608 KB a node for V = 151,936: about 6 MB for a
depth-10 reply). Here the draft server runs in one network namespace and a real target (`starsd
target`) in another, joined by a veth pair shaped with `tc tbf`, with a delay proxy adding the round
trip in user space (as in `bench multihost`). Per network, the same prompts are decoded three ways,
every step drafting --draft-depth deep (the depth policy off: the figures are a draft's costs on the
link, not the policy's choice of whether to pay them):
- greedy: temperature 0, argmax drafts (nothing but token ids on the wire);
- argmax drafts: the target samples at --temperature, the draft proposes its argmax (the default:
  q is one-hot, so no q travels);
- sampled drafts: the target samples, the draft samples its tokens (`--draft-sample`) and its reply
  carries q over the support.
Reported for each: tokens/s, a draft request's round trip, its overhead beyond the server's queue
and compute (what the link and the transport add), the drafted nodes a reply and the tokens accepted
a step. Beside the sampled drafts, what the full q would put on the same link: its bytes a reply over
the link's rate (computed: replies with the full q are no longer part of the protocol).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from starsd import config as C
from starsd.bench import harness
from starsd.emulate import netns
from starsd.errors import Unavailable
from starsd.results import Steps, bar_panels, summary, write_json
from starsd.star.launch import target_command
from starsd.star.processes import describe, spawn


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--network", default="0.2@0,1@100", help="RTT_MS@MBIT emulated links, comma-separated (MBIT 0: "
                   "unshaped)")
    p.add_argument("--temperature", type=float, default=0.7, help="the sampled runs' temperature")
    p.add_argument("--prompts", default="chat", help="prompt set: humaneval or chat")
    p.add_argument("--limit", type=int, default=4, help="number of prompts")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per prompt at most")
    p.add_argument("--json-out", default="results/sampled-link.json", help="results as JSON here, the plot beside it")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.DraftConfig, prefix="draft-")
    p.set_defaults(threads=1)  # the target and the draft server share this machine's cores


RUNS = {"greedy": (False, False), "argmax drafts": (True, False), "sampled drafts": (True, True)}  # name:
# (the target samples, the draft samples)


def decode(link: netns.Link, address: str, args, temperature: float, sample: bool) -> list[dict]:
    """The prompts decoded by one `starsd target` process in the link's target namespace, drafting
    through `address` at every step (sampling its drafts if `sample`); its JSON rows, one per prompt."""
    pair = C.from_args(C.PairConfig, args)
    draft = dataclasses.replace(C.from_args(C.DraftConfig, args, prefix="draft-"), adaptive=False, sample=sample)
    argv = [*target_command(pair), "--connect", address, "--json", "--prompts", args.prompts, "--limit",
            str(args.limit), "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(temperature),
            *C.to_flags(draft, prefix="draft-")]
    proc = spawn(argv, link.exec_argv(link.target_ns))
    out, _ = proc.communicate(timeout=3600)
    if proc.returncode:
        raise Unavailable(f"{describe(proc)} failed with exit status {proc.returncode} (its own error is above)")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def figures(rows: list[dict], rate_mbit: float | None, carries_q: bool) -> dict:
    """One (network, run) point from a target's rows; where its replies carry q, what the full q
    would have taken: its bytes a reply, and their time over the link's rate."""
    drafted = [d for r in rows for d in r["depths"] if d]
    answered = [r["draft"] for r in rows if r["draft"].get("requests")]
    requests = sum(d["requests"] for d in answered)

    def mean(key: str) -> float:  # over every answered request of every prompt
        return sum(d[key] * d["requests"] for d in answered) / requests if requests else 0.0

    nodes = statistics.fmean(drafted) if drafted else 0.0
    full_q_bytes = 4 * rows[0]["vocab"] * nodes if carries_q else None
    tokens = sum(len(r["token_ids"]) for r in rows)
    return {"prompts": len(rows), "tokens": tokens, "tokens_per_s": tokens / sum(r["seconds"] for r in rows),
            "mean_accepted": statistics.fmean(r["mean_accepted"] for r in rows), "requests": requests,
            "nodes_per_reply": nodes, "wall_ms": mean("wall_ms"), "service_ms": mean("service_ms"),
            "queue_ms": mean("queue_ms"), "overhead_ms": mean("overhead_ms"),
            "full_q_bytes_per_reply": full_q_bytes,
            "full_q_wire_ms": full_q_bytes * 8 / (rate_mbit * 1e3) if carries_q and rate_mbit else None,
            "token_ids": [r["token_ids"] for r in rows]}


def run_network(args, rtt_ms: float, rate: float | None, steps: Steps) -> list[dict]:
    server = C.ServerConfig(predraft=False)  # the target is on this machine's cores, whatever its namespace
    with harness.across_link(C.from_args(C.PairConfig, args), server, rtt_ms, rate) as (link, proxy):
        points = []
        for run, (sampled, sample) in RUNS.items():
            where = f"RTT {rtt_ms:g} ms @ {rate or 'unshaped'} Mbit, {run}"
            steps.begin(where)
            t = args.temperature if sampled else 0.0
            pt = {"rtt_ms": rtt_ms, "rate_mbit": rate, "run": run, "temperature": t, "draft_sample": sample,
                  **figures(decode(link, proxy.address, args, t, sample), rate, carries_q=sample)}
            points.append(pt)
            steps.end(f"{where}: {pt['tokens_per_s']:.2f} tok/s, a draft's overhead {pt['overhead_ms']:.2f} ms")
        return points


def main(args) -> int:
    if harness.no_namespaces("bench sampled-link", args.json_out):
        return 0
    nets = harness.networks(args.network)
    points = []
    with Steps("bench sampled-link", len(nets) * len(RUNS)) as steps:
        for rtt, rate in nets:
            points += run_network(args, rtt, rate, steps)
    greedy = [p["token_ids"] for p in points if p["run"] == "greedy"]
    result = {"benchmark": "sampled-link", "settings": {k: v for k, v in vars(args).items() if k != "func"},
              "points": points, "greedy_same_on_every_link": all(g == greedy[0] for g in greedy)}
    write_json(args.json_out, result)
    png = str(args.json_out).rsplit(".", 1)[0] + ".png"

    def label(p: dict) -> str:
        return f"{p['rtt_ms']:g} ms, {p['rate_mbit'] or 'unshaped'} Mbit"

    bar_panels(png, [{"labels": [label(p) for p in points if p["run"] == run],
                      "values": [round(p["overhead_ms"], 2) for p in points if p["run"] == run],
                      "ylabel": "a draft's overhead beyond queue + service (ms)",
                      "title": run if run == "greedy" else f"{run}, temperature {args.temperature:g}"} for run in RUNS])
    summary("bench sampled-link: a real target and draft server across emulated hosts, every step drafted",
            ["RTT ms", "Mbit/s", "run", "tok/s", "accepted/step", "nodes/reply", "draft RTT ms",
             "overhead ms", "full q on this link (ms, computed)"],
            [[f"{p['rtt_ms']:g}", f"{p['rate_mbit']:g}" if p["rate_mbit"] else "unshaped", p["run"],
              f"{p['tokens_per_s']:.2f}", f"{p['mean_accepted']:.2f}", f"{p['nodes_per_reply']:.1f}",
              f"{p['wall_ms']:.1f}", f"{p['overhead_ms']:.2f}",
              "" if p["full_q_wire_ms"] is None else f"{p['full_q_wire_ms']:.0f}"]
             for p in points],
            {"greedy output the same on every link": str(result["greedy_same_on_every_link"])},
            files={"JSON": args.json_out, "plot": png})
    return 0
