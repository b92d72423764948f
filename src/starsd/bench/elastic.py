"""Draft capacity that follows load: replay targets ramp up and down against draft servers on a local
Ray cluster, and the elastic controller adds and retires servers as it would under `starsd serve --ray`.

What is real: the draft servers (Ray actors each holding a `starsd draft-server` process, one CPU of
the cluster each, as RayStar starts them), the controller (star/elastic.py, its defaults, reading the
servers' counters), and its /metrics (the gateway's ElasticCollector, served and scraped over HTTP).
What stands in: the targets are replay targets (emulated hosts of their own, as in `bench servers`),
in one process, each told the star's servers on its stdin (`servers A,B`: DraftClient.relist, as a
target server told by the gateway's protocol.DraftServers); the controller runs in this process.

The ramp, `--phases N:S,...`: N targets decode for S seconds, then the next phase's N (targets
0..N-1; the others wait at their next prompt boundary, their sessions idle). Reported:
- each phase's window (from `--settle-s` after it begins): every active target's tokens/s against
  target-only (replay targets decoding alone, the same process, measured first), and the servers;
- the servers over time, every decision with its time and reason, /metrics at the end, and any
  retired server still answering (its process left running);
- tokens lost: a replay target stops at the first token that differs from the recording, so a
  result means none; each answer's rows (every step's depths, its draft timing) in NAME.rows.gz.
Figures: docs/scaling.md#capacity-that-follows-load-on-ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import threading
import time
import urllib.request

from starsd import config as C
from starsd.bench import harness, metrics
from starsd.results import Steps, panel_plot, summary, write_json
from starsd.serve.metrics import ElasticCollector, serve_metrics
from starsd.star.client import query_stats
from starsd.star.elastic import Controller, Decision
from starsd.star.processes import free_port, read_json_line, spawn
from starsd.star.ray_cluster import RayStar

NICE = ["nice", "-n", "-10"]  # the replay host before the servers: it stands for hosts of their own


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_replay_args(p, "results/elastic.json")
    p.add_argument("--phases", default="2:60,32:150,2:150",
                   help="the ramp: N:SECONDS per phase, comma-separated (N targets decode for that long)")
    p.add_argument("--settle-s", type=float, default=20.0,
                   help="seconds into a phase before its window opens (the targets leaving finish their prompt)")
    p.add_argument("--baseline-s", type=float, default=40.0, help="seconds of target-only decoding measured first")
    C.add_flags(p, C.ElasticConfig, prefix="elastic-")
    p.set_defaults(elastic_max_servers=2)  # a server per core of this machine


def phases(text: str) -> list[tuple[int, float]]:
    """"2:60,32:150" -> [(2, 60.0), (32, 150.0)]."""
    out = []
    for item in text.split(","):
        n, _, seconds = item.partition(":")
        out.append((int(n), float(seconds)))
    return out


class Recorded(Controller):
    """The controller as it runs, each step's reading and decision kept with its time."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.steps: list[dict] = []

    def step(self) -> Decision:
        decision = super().step()
        reading = [dataclasses.asdict(x) for x in self.readings[-1]] if self.readings else None
        self.steps.append({"t": time.time(), "reading": reading, "action": decision.action, "why": decision.why,
                           "servers": len(self.servers.draft_servers())})
        return decision


class Ramp:
    """The replay host of the run, told the ramp's `active N` and the star's `servers` on its stdin."""

    def __init__(self, inputs: harness.Inputs, args, address: str, keys: C.ClientKeys, n: int, first: int,
                 duration_s: float, no_spec: bool = False):
        argv = harness.replay_command(inputs, address, n, args.max_new_tokens, duration_s, args.seed, no_spec=no_spec)
        self.log = str(args.json_out).rsplit(".", 1)[0] + ("-alone" if no_spec else "") + "-replay.log"
        with open(self.log, "w") as log:  # its log, beside the JSON (the child holds the file)
            self.proc = spawn([*argv, "--active", str(first), *C.to_flags(keys)], NICE, stderr=log)
        self.lock = threading.Lock()
        read_json_line(self.proc, "ready", 300)
        self.reader, self.lines = harness.read_lines(self.proc)

    def say(self, line: str) -> None:
        with self.lock:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def rows(self, timeout_s: float) -> list[dict]:
        """Its rows, once it ends (within timeout_s)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=timeout_s)
            self.reader.join(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return [r for r in harness.replay_rows(self.proc, self.lines) if r.get("replay")]


def per_target(its: list[metrics.Iteration], names: list[str], w0: float, w1: float) -> dict[str, float]:
    """Tokens/s of each named target over [w0, w1] (the iterations ending in it)."""
    tokens = {name: 0 for name in names}
    for it in its:
        if it.target in tokens and w0 <= it.end <= w1:
            tokens[it.target] += it.tokens
    return {name: t / (w1 - w0) for name, t in tokens.items()}


def baseline(inputs: harness.Inputs, args, n: int) -> dict:
    """n replay targets decoding alone: each one's tokens/s over the window after a warm-up of 10 s."""
    ramp = Ramp(inputs, args, "tcp://127.0.0.1:9", C.ClientKeys(), n, n, args.baseline_s + 10, no_spec=True)
    go = time.time()
    ramp.say("go")
    rows = ramp.rows(args.baseline_s + 300)
    rates = per_target(metrics.iterations(rows), [f"replay-{i}" for i in range(n)], go + 10, go + 10 + args.baseline_s)
    return {"targets": n, "per_target_tokens_per_s": sum(rates.values()) / n, "min": min(rates.values()),
            "max": max(rates.values())}


def scrape(port: int) -> dict[str, float]:
    """The elastic controller's samples in /metrics, by name and labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("starsd:elastic"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def run(args, steps: Steps) -> dict:
    ramp_spec = phases(args.phases)
    most = max(n for n, _ in ramp_spec)
    inputs = harness.prepare(args)
    steps.begin(f"target-only: {most} replay targets decoding alone")
    alone = baseline(inputs, args, most)
    steps.end(f"target-only: {alone['per_target_tokens_per_s']:.2f} tok/s per target")

    steps.begin("a local Ray cluster and its first draft server")
    bounds = C.from_args(C.ElasticConfig, args, prefix="elastic-")
    pair = dataclasses.replace(C.from_args(C.PairConfig, args), threads=1)
    star = RayStar.start("local", pair, harness.server_config(args, serial=False, predraft=True), inputs.draft, 0,
                         {"CPU": 1}, {})
    steps.end(f"draft server at {star.draft_servers()[0]}")
    try:
        return ramp_run(args, steps, inputs, star, bounds, ramp_spec, alone)
    finally:
        star.close()
        import ray

        ray.shutdown()


def ramp_run(args, steps: Steps, inputs: harness.Inputs, star: RayStar, bounds: C.ElasticConfig,
             ramp_spec: list[tuple[int, float]], alone: dict) -> dict:
    most = max(n for n, _ in ramp_spec)
    total_s = sum(s for _, s in ramp_spec)
    ramp = Ramp(inputs, args, star.draft_address, star.keys.targets, most, ramp_spec[0][0], total_s)
    listed: list[dict] = []

    def tell(addresses: list[str]) -> None:  # what the gateway does on DraftServers (serve/pool.py)
        listed.append({"t": time.time(), "servers": list(addresses)})
        ramp.say("servers " + ",".join(addresses))

    controller = Recorded(star, bounds, tell, keys=star.keys.draft_stats)
    port = free_port()
    serve_metrics(port, ElasticCollector(lambda: controller))
    go = time.time()
    ramp.say("go")
    controller.start()
    starts = []
    try:
        at = go
        for k, (n, seconds) in enumerate(ramp_spec):
            steps.begin(f"phase {k + 1}: {n} targets for {seconds:.0f} s")
            if k:
                ramp.say(f"active {n}")
            starts.append(time.time())
            at += seconds
            time.sleep(max(0.0, at - time.time()))
            steps.end(f"phase {k + 1}: {n} targets; {len(star.draft_servers())} draft servers at its end")
        scraped = scrape(port)
        rows = ramp.rows(300)
    finally:
        controller.stop()
    retired = sorted({a for x in listed for a in x["servers"]} - set(star.draft_servers()))
    answering = [a for a in retired if query_stats(a, timeout_s=2.0, keys=star.keys.draft_stats) is not None]
    result = figures(args, ramp_spec, starts, go + total_s, rows, alone, controller, listed, scraped, answering)
    save_rows(str(args.json_out).rsplit(".", 1)[0] + ".rows.gz", starts, rows)
    return result


def save_rows(path: str, starts: list[float], rows: list[dict]) -> None:
    """Each answer's rows (every step's depth asked and verified, its draft timing) and the phases' starts,
    gzipped beside the JSON: what `drafting` counts, kept to be read again."""
    with gzip.open(path, "wt") as f:
        json.dump({"starts": starts, "rows": rows}, f)


def figures(args, ramp_spec, starts, end, rows, alone, controller: Recorded, listed, scraped,
            retired_answering: list[str]) -> dict:
    its = metrics.iterations(rows)
    base = alone["per_target_tokens_per_s"]
    out = []
    for k, ((n, _), t0) in enumerate(zip(ramp_spec, starts)):
        t1 = starts[k + 1] if k + 1 < len(starts) else end
        w0 = t0 + args.settle_s
        rates = per_target(its, [f"replay-{i}" for i in range(n)], w0, t1)
        servers = [s["servers"] for s in controller.steps if w0 <= s["t"] <= t1]
        out.append({"targets": n, "window": [w0 - starts[0], t1 - starts[0]],
                    "per_target_over_alone": {name: r / base for name, r in rates.items()},
                    "min_over_alone": min(rates.values()) / base if n else None,  # (a phase of none: an idle star)
                    "mean_over_alone": sum(rates.values()) / n / base if n else None,
                    "servers": {"least": min(servers, default=None), "most": max(servers, default=None),
                                "at_end": servers[-1] if servers else None},
                    "drafting": drafting(rows, w0, t1)})
    timeline = bins(its, controller, starts[0], end, base)
    decisions = [{"t": s["t"] - starts[0], "action": s["action"], "why": s["why"], "servers": s["servers"]}
                 for s in controller.steps if s["action"] != "hold"]
    counts = dict(controller.counts.decisions)
    follows = [p["servers"] for p in out]
    metric = 'starsd:elastic_decisions_total{{action="{}"}}'
    checks = {"each_target_at_least_0_97x_alone_in_every_phase": all(p["min_over_alone"] >= 0.97 for p in out
                                                                     if p["targets"]),
              "servers_follow_the_load": (len(out) == 3 and follows[0]["most"] == 1 and (follows[1]["most"] or 0) >= 2
                                          and follows[2]["at_end"] == 1),
              "decisions_in_metrics": all(scraped.get(metric.format(a)) == counts.get(a, 0)
                                          for a in ("add", "retire", "add_failed")),
              "retired_servers_answering": retired_answering,  # a retired server left running: none
              "tokens_lost": 0}  # replay targets verify every token against the recording: a lost or changed
    # token fails the run, so a result means none was
    return {"replay": {"targets": "replay (remote targets emulated; the draft servers are real, Ray actors on a "
                                  "local one-node cluster)", "recording": args.prompts,
                       "controller": "in the benchmark's process; targets told the servers on their stdin"},
            "settings": {k: v for k, v in vars(args).items() if k != "func"}, "target_only": alone,
            "phases": out, "decisions": decisions, "decision_counts": counts, "metrics": scraped,
            "listed": [{"t": x["t"] - starts[0], "servers": x["servers"]} for x in listed],
            "controller_steps": [{**s, "t": s["t"] - starts[0]} for s in controller.steps],
            "timeline": timeline, "checks": checks}


def drafting(rows: list[dict], t0: float, t1: float) -> dict:
    """What the answers begun in [t0, t1) (unix s) did with drafts, summed: their steps, those that verified
    a draft, those that asked one ahead or looked for one asked earlier and verified none, the drafts
    taken at a later step than asked, and the drafts waited for that missed their deadline."""
    now = [r for r in rows if t0 <= r["started"] < t1]
    steps = [(d, a) for r in now for d, a in zip(r["depths"], r["asked"])]
    return {"answers": len(now), "steps": len(steps), "drafted": sum(1 for d, _ in steps if d),
            "asking_ahead": sum(1 for d, a in steps if a and not d),
            "taken_late": sum(r["draft"].get("taken_late", 0) for r in now),
            "missed": sum(r["draft"].get("late", 0) for r in now)}


def bins(its, controller: Recorded, t0: float, end: float, base: float, bin_s: float = 10.0) -> list[dict]:
    """Per bin of the run: the targets that decoded in it, their tokens/s against target-only (mean and
    least) and the servers running."""
    out = []
    t = t0
    while t + bin_s <= end:
        names = sorted({it.target for it in its if t <= it.end <= t + bin_s})
        rates = per_target(its, names, t, t + bin_s) if names else {}
        servers = [s["servers"] for s in controller.steps if t <= s["t"] <= t + bin_s]
        out.append({"t": t + bin_s / 2 - t0, "targets": len(names),
                    "mean_over_alone": sum(rates.values()) / len(rates) / base if rates else None,
                    "min_over_alone": min(rates.values()) / base if rates else None,
                    "servers": max(servers, default=None)})
        t += bin_s
    return out


def main(args) -> int:
    ramp_spec = phases(args.phases)
    with Steps("bench elastic", 2 + len(ramp_spec), step_s=max(s for _, s in ramp_spec)) as steps:
        result = run(args, steps)
    write_json(args.json_out, result)
    png = str(args.json_out).rsplit(".", 1)[0] + ".png"
    tl = result["timeline"]
    xs = [b["t"] for b in tl]
    panel_plot(png, [
        {"series": [{"label": "targets decoding", "x": xs, "y": [b["targets"] for b in tl]}],
         "xlabel": "seconds", "ylabel": "targets", "title": "the ramp (replay targets)"},
        {"series": [{"label": "draft servers", "x": xs, "y": [b["servers"] for b in tl], "drawstyle": "steps-mid"}],
         "xlabel": "seconds", "ylabel": "draft servers", "title": "the elastic controller's servers (Ray actors)"},
        {"series": [{"label": "mean", "x": xs, "y": [b["mean_over_alone"] for b in tl]},
                    {"label": "least", "x": xs, "y": [b["min_over_alone"] for b in tl]},
                    {"label": "0.97x", "x": xs, "y": [0.97] * len(xs), "ls": ":"}],
         "xlabel": "seconds", "ylabel": "tokens/s over target-only", "title": "per target, 10 s bins"}])
    facts = {k: str(v) for k, v in result["checks"].items()}
    facts["decisions"] = "; ".join(f"{d['t']:.0f} s {d['action']} ({d['why']})" for d in result["decisions"]) or "none"
    summary("Elastic draft servers on a local Ray cluster", ["phase", "targets", "servers", "mean", "least"],
            [[str(k + 1), str(p["targets"]), f"{p['servers']['least']}-{p['servers']['most']}",
              *(f"{p[key]:.3f}x" if p["targets"] else "-" for key in ("mean_over_alone", "min_over_alone"))]
             for k, p in enumerate(result["phases"])],
            facts, {"results": args.json_out, "plot": png})
    return 0
