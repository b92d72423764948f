"""The scaling benchmark across emulated hosts: the draft server and the targets in separate
network namespaces joined by a veth cable, at several round-trip times and bandwidths.

Bandwidth is shaped with `tc tbf` on both ends of the cable; delay is added in user space by a
delay proxy in the target namespace (this kernel has no netem), half of the round trip each way.
Each point separates the target-side overhead of a draft request (wall - queue - service) into
serialisation (encode + decode of that request and reply, timed in-process) and network (the rest:
transport, proxy, the server's IO hop); the measured Ping round trip through the same path is
reported beside it. Skips with a message where namespaces cannot be made (needs root and iproute2).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import torch

from starsd import config as C
from starsd.bench import harness
from starsd.results import Steps, line_plot, summary, write_json


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_star_args(p, json_out="results/multihost.json")
    p.add_argument("--network", default="0.2@1000,1@1000,5@1000,1@100,1@10",
                   help="RTT_MS@MBIT emulated networks, comma-separated (MBIT 0: unshaped)")
    p.set_defaults(targets="1,8", warmup_s=8.0, measure_s=20.0)


def run_network(runner_inputs, args, ns: list[int], rtt_ms: float, rate: float | None, steps: Steps) -> list[dict]:
    steps.say(f"RTT {rtt_ms} ms @ {rate or 'unshaped'} Mbit: starting the draft server")
    pair = C.from_args(C.PairConfig, args)
    with harness.across_link(pair, harness.server_config(args, serial=False), rtt_ms, rate) as (link, proxy):
        runner = harness.Runner(runner_inputs, args, prefix=link.exec_argv(link.target_ns))
        # every step drafts: the figures are a draft request's overheads, not the depth policy's
        # choice (which, with tiny models and a slow link, is rightly to decode alone)
        fixed = dataclasses.replace(runner_inputs.draft, adaptive=False)
        ping = harness.server_stats(proxy.address, runner.prefix, ping=50)["ping_ms"]["median"]
        points = []
        for n in ns:
            steps.begin(f"RTT {rtt_ms} ms @ {rate or 'unshaped'} Mbit, N={n}")
            pt, its = runner.point(proxy.address, n, draft=fixed)
            drafted = [it for it in its if it.batch]
            mean_len = statistics.fmean(it.tokens for it in drafted)
            ser = harness.serialisation_ms(depth=max(1, round(pt["tokens_per_iteration"] * 2)), new_tokens=round(mean_len))
            pt.update(mode="batched", rtt_ms=rtt_ms, rate_mbit=rate, ping_rtt_ms=ping, serialisation_ms=ser,
                      network_ms=pt["overhead_ms"] - ser)
            pt.pop("utilization_over_time", None)
            points.append(pt)
            steps.end(f"RTT {rtt_ms} ms @ {rate or 'unshaped'} Mbit, N={n}: {pt['system_tokens_per_s']:.1f} tok/s, "
                      f"overhead {pt['overhead_ms']:.2f} ms (network {pt['network_ms']:.2f}, serialisation "
                      f"{ser:.3f}), ping {ping:.2f} ms")
        return points


def main(args) -> int:
    if harness.no_namespaces("bench multihost", args.json_out):
        return 0
    ns = harness.numbers(args.targets)
    torch.set_num_threads(args.threads)
    inputs = harness.prepare(args)
    points = []
    nets = harness.networks(args.network)
    with Steps("bench multihost", len(nets) * len(ns), step_s=args.warmup_s + args.measure_s) as steps:
        for rtt, rate in nets:
            points += run_network(inputs, args, ns, rtt, rate, steps)
    write_json(args.json_out, {
        "replay": {"targets": "replay (remote targets emulated; the draft server is real)",
                   "latency_profile": inputs.latency.to_json()},
        "settings": {k: v for k, v in vars(args).items() if k != "func"}, "points": points})
    stem = str(args.json_out).rsplit(".", 1)[0]
    series = []
    rate = harness.networks(args.network)[0][1]  # the delay sweep is drawn at the first network's bandwidth
    for n in ns:
        mine = [p for p in points if p["n"] == n and p["rate_mbit"] == rate]
        series.append({"label": f"N={n}", "x": [p["ping_rtt_ms"] for p in mine],
                       "y": [p["system_tokens_per_s"] for p in mine], "marker": "o"})
    line_plot(f"{stem}.png", series, "measured round trip (ms)", "system tokens / s",
              "Star across emulated hosts (netns + veth, user-space delay)")
    summary("bench multihost: the star across emulated hosts (overheads per draft request, ms)",
            ["RTT ms", "Mbit/s", "N", "ping ms", "tokens/s", "overhead", "network", "serialisation"],
            [[f"{p['rtt_ms']:g}", f"{p['rate_mbit']:g}" if p["rate_mbit"] else "unshaped", p["n"],
              f"{p['ping_rtt_ms']:.2f}", f"{p['system_tokens_per_s']:.1f}", f"{p['overhead_ms']:.2f}",
              f"{p['network_ms']:.2f}", f"{p['serialisation_ms']:.3f}"] for p in points],
            files={"JSON": args.json_out, "plot": f"{stem}.png",
                   "latency profile": None if args.latency else inputs.latency_file})
    return 0
