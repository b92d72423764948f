"""Start a local star: one draft server and N target workers as separate processes on this machine
(star/processes.py starts each; star/supervise.py can keep them running).

The launcher feeds each target its share of the prompts, starts their decoding at the same moment,
collects their JSON, prints per-target and system throughput, and shuts everything down, also on
Ctrl-C or SIGTERM: children die with the launcher (PR_SET_PDEATHSIG), so none is left behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from starsd.config import DRAFT_SIDE, DraftConfig, PairConfig, ServerConfig, to_flags
from starsd.errors import SettingError, Unavailable
from starsd.models import pinned
from starsd.prompts import load as load_prompts
from starsd.results import bar_plot, write_json
from starsd.results import summary as print_summary  # `summary` is the launch's figures here
from starsd.star.client import DraftClient, for_target
from starsd.star.processes import describe, free_port, read_json_line, spawn
from starsd.star.stats import busy_fraction
from starsd.star.supervise import Supervisor


@dataclass
class Star:
    """Handles to a running local star; `close()` stops every process."""

    servers: list[subprocess.Popen]  # the draft servers (none: targets that decode alone)
    addresses: list[str]  # theirs, in the same order
    metrics_ports: list[int] = field(default_factory=list)  # theirs, where they serve metrics (0: none)
    targets: list[subprocess.Popen] = field(default_factory=list)
    supervisor: Supervisor | None = None  # starts again whichever of them exits (supervise)

    @property
    def server(self) -> subprocess.Popen | None:
        """The first draft server (None: none)."""
        return self.servers[0] if self.servers else None

    @property
    def address(self) -> str:
        """Every draft server's address, comma-separated, as DraftClient takes them ("": none)."""
        return ",".join(self.addresses)

    def connect(self, i: int) -> str:
        """What target i connects to: every draft server, the (i mod K)th first (client.for_target)."""
        return for_target(self.address, i)

    def supervise(self, supervisor: Supervisor) -> None:
        """From now on every process of the star that exits is started again, until close()."""
        for j, proc in enumerate(self.servers):
            supervisor.watch("draft-server" if len(self.servers) == 1 else f"draft-server-{j}", "draft-server", proc)
        for i, proc in enumerate(self.targets):
            supervisor.watch(f"target-{i}", "target-server", proc)
        self.supervisor = supervisor
        supervisor.start()

    def close(self) -> None:
        if self.supervisor:
            self.supervisor.halt()  # no process is started again from here on
        procs = self.supervisor.procs() if self.supervisor else [*self.targets, *self.servers]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.supervisor:
            self.supervisor.join()


def server_command(pair: PairConfig, server: ServerConfig) -> list[str]:
    """The `starsd draft-server` command line for these settings: the one place it is assembled."""
    return ["draft-server", *to_flags(pair), *to_flags(server)]  # the target's too: an EAGLE head holds its ends


def target_server_command(pair: PairConfig, draft: DraftConfig, name: str, bind: str, connect: str = "",
                          model_name: str = "", metrics_port: int = 0, insecure: bool = False) -> list[str]:
    """The `starsd target-server` command line (connect empty: it decodes alone)."""
    args = ["target-server", "--bind", bind, "--name", name, *to_flags(pair, skip=DRAFT_SIDE),
            *to_flags(draft, prefix="draft-"), "--served-model-name", model_name or pair.target,
            "--metrics-port", str(metrics_port), *(["--insecure"] if insecure else [])]
    return args + ["--connect", connect] if connect else args


def check_models(pair: PairConfig) -> None:
    """Before a local star starts its children: fetch the pinned models once (not once per child),
    and refuse a model that is neither pinned, nor a directory, nor a hub id, in one line here
    rather than once in every child."""
    names = [pair.target, pair.draft, *([pair.eagle] if pair.eagle else [])]
    for name in names:
        if name in pinned.PINNED:
            pinned.fetch(name, pair.cache, log=lambda m: print(m, file=sys.stderr))
            if name == pair.target and pair.engine == "llamacpp":  # a cache from before it was kept
                pinned.gguf(name, pair.cache, log=lambda m: print(m, file=sys.stderr))
        elif not os.path.isdir(name) and not HUB_ID.fullmatch(name):
            raise SettingError(f"model {name!r} is not a pinned name ({', '.join(pinned.PINNED)}), a local model "
                               "directory, or a hub id")


HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # org/name


def share_cores(pair: PairConfig, targets: int, servers: int) -> tuple[PairConfig, PairConfig]:
    """A local star's settings for its target processes and for its draft servers, sharing this
    machine's cores: with `threads` left at 0, the targets split the cores between them (at least one
    each), and each draft server gets all of them. Two targets at all of the cores each make each
    other's parallel passes wait for threads the other has taken; a draft server on a target's host
    takes turns with it instead (the target asks no draft ahead, the server pre-drafts nothing while
    it is connected: docs/benchmarks.md), so it idles while the targets compute, and a target whose
    drafts do not pay keeps every core it was given (on 2 cores one target at one thread decoded at
    0.55x of the same target at two). A `threads` given is kept for all."""
    if pair.threads or not pair.device.startswith("cpu"):
        return pair, pair
    cores = len(os.sched_getaffinity(0))
    return (dataclasses.replace(pair, threads=max(1, cores // targets)),
            dataclasses.replace(pair, threads=cores) if servers else pair)


def start_server(pair: PairConfig, server: ServerConfig = ServerConfig(), host: str = "127.0.0.1", port: int = 0,
                 prefix: list[str] = (), stderr=None, count: int = 1, extra: list[str] = ()) -> Star:
    """`count` draft-server processes, the first on tcp://host:port (port 0: a free one), the others on
    free ports, once all are ready; their logs go to `stderr` (a file; default: this process's
    stderr). With a metrics port, the first serves its metrics there and the others on free ports.
    `extra`: more of `starsd draft-server`'s arguments (not settings: --recording)."""
    star = Star([], [])
    try:
        for j in range(count):
            address = f"tcp://{host}:{port if port and not j else free_port()}"
            metrics = 0 if not server.metrics_port else server.metrics_port if not j else free_port()
            cfg = dataclasses.replace(server, bind=address, metrics_port=metrics)
            star.servers.append(spawn(server_command(pair, cfg) + list(extra), prefix, stderr=stderr))
            star.addresses.append(address)
            star.metrics_ports.append(metrics)
        for proc in star.servers:
            read_json_line(proc, "ready", 300)
    except BaseException:
        for proc in star.servers:
            proc.kill()
        raise
    return star


def run_targets(star: Star, n: int, target_args: list[str], num_prompts: int) -> list[dict]:
    """Start n targets on a round-robin share of the prompts, release them together, collect JSON."""
    for i in range(n):
        share = ["--offset", str(i), "--stride", str(n), "--limit", str(num_prompts)]
        star.targets.append(spawn(["target", "--connect", star.connect(i), "--name", f"target-{i}", "--json",
                                   "--wait-go", *share, *target_args]))
    for t in star.targets:
        read_json_line(t, "ready", 300)
    go = time.time()
    for t in star.targets:
        t.stdin.write("go\n")
        t.stdin.flush()
    print(f"{n} targets released: decoding", file=sys.stderr, flush=True)
    results = []
    for t in star.targets:
        out, _ = t.communicate()
        if t.returncode != 0:
            raise Unavailable(f"{describe(t)} failed with exit status {t.returncode} (its own error is above)")
        results += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for r in results:
        r["go"] = go
    return results


def summarize(results: list[dict], n: int) -> dict:
    go = min(r["go"] for r in results)
    end = max(r["finished"] for r in results)
    per_target = {}
    for r in results:
        t = per_target.setdefault(r["target"], {"tokens": 0, "seconds": 0.0, "accepted": []})
        t["tokens"] += len(r["token_ids"])
        t["seconds"] += r["seconds"]
        t["accepted"].append(r["mean_accepted"])
    targets = {name: {"tokens": v["tokens"], "tokens_per_s": v["tokens"] / v["seconds"],
                      "mean_accepted": sum(v["accepted"]) / len(v["accepted"])} for name, v in sorted(per_target.items())}
    tokens = sum(v["tokens"] for v in per_target.values())
    return {"targets": n, "prompts": len(results), "tokens": tokens, "wall_s": end - go,
            "system_tokens_per_s": tokens / (end - go), "per_target": targets}


def target_command(pair: PairConfig) -> list[str]:
    """The start of a `starsd target` command line for these models (add --connect, prompts...)."""
    return ["target", *to_flags(pair, skip=DRAFT_SIDE)]


def run_local_star(pair: PairConfig, server: ServerConfig, n: int, prompt_set: str, num_prompts: int,
                   max_new_tokens: int, target_extra: list[str] = (), port: int = 0,
                   json_out: str | None = None, draft_servers: int = 1) -> int:
    """`starsd launch`: `draft_servers` draft servers and n targets sharing num_prompts prompts; prints
    per-target and system throughput, writes JSON and a bar plot; 130 when interrupted (Ctrl-C, SIGTERM)."""
    load_prompts(prompt_set)  # an unknown set is refused here, not in every target
    check_models(pair)
    pair, server_pair = share_cores(pair, n, draft_servers)
    target_args = [*target_command(pair)[1:], "--prompts", prompt_set, "--max-new-tokens", str(max_new_tokens),
                   *target_extra]
    star = None

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)  # also when started with SIGINT ignored (a background job inherits that)
    try:
        star = start_server(server_pair, server, port=port, count=draft_servers)
        print(f"draft server{'s' if draft_servers > 1 else ''} up at {star.address}; starting {n} targets",
              file=sys.stderr, flush=True)
        results = run_targets(star, n, target_args, num_prompts)
        summary = summarize(results, n)
        summary["draft_servers"] = []
        for address in star.addresses:
            client = DraftClient(address, "", "launcher", timeout_s=10)
            stats = client.stats()
            client.close()
            figures = {k: stats[k] for k in ("batch_sizes", "errors", "replies", "requests", "predraft")}
            figures["utilization"] = busy_fraction(stats["timeline"], results[0]["go"],
                                                   results[0]["go"] + summary["wall_s"])
            summary["draft_servers"].append({"address": address, **figures})
        summary["draft_server"] = summary["draft_servers"][0]
    except KeyboardInterrupt:
        print("interrupted: stopping the star", file=sys.stderr)
        return 130
    finally:
        if star is not None:
            star.close()
    png = None
    if json_out:
        names = list(summary["per_target"])
        png = str(json_out).rsplit(".", 1)[0] + ".png"
        bar_plot(png, [*names, "system"],
                 [*(summary["per_target"][k]["tokens_per_s"] for k in names), summary["system_tokens_per_s"]],
                 ylabel="tokens / s", title=f"Local star: {draft_servers} draft server(s), {n} targets "
                                             f"({pair.target_model().dtype})")
        settings = {"pair": dataclasses.asdict(pair), "server": dataclasses.asdict(server), "targets": n,
                    "draft_servers": draft_servers,
                    "prompts": prompt_set, "limit": num_prompts, "max_new_tokens": max_new_tokens,
                    "target_extra": list(target_extra)}
        write_json(json_out, {"launch": settings, **summary, "results": results})
    show_star(summary, n, pair.target_model().dtype, json_out, png)
    return 0


def show_star(summary: dict, n: int, dtype: str, json_out: str | None, png: str | None) -> None:
    """The launch's summary on the terminal: a row per target, the system, the draft server's figures."""
    rows = [[name, t["tokens"], f"{t['tokens_per_s']:.2f}", f"{t['mean_accepted']:.2f}"]
            for name, t in summary["per_target"].items()]
    rows += [None, ["system", summary["tokens"], f"{summary['system_tokens_per_s']:.2f}", None]]
    facts = {"system": f"{summary['tokens']} tokens in {summary['wall_s']:.1f} s = "
                       f"{summary['system_tokens_per_s']:.2f} tok/s over {n} targets"}
    servers = summary["draft_servers"]
    for server in servers:
        ahead = server["predraft"]
        sizes = ", ".join(f"{b}: {count}" for b, count in server["batch_sizes"].items())
        name = "draft server" if len(servers) == 1 else f"draft server {server['address']}"
        facts[name] = (f"utilisation {server['utilization']:.0%}; batches by size {{{sizes}}}; pre-drafting: "
                       f"{ahead['hits']} of {server['requests']} draft requests answered from a draft made in idle "
                       f"time ({ahead['outcomes']} outcomes drafted, {ahead['yields']} cut short for a request)")
    many = f"{len(servers)} draft servers" if len(servers) > 1 else "1 draft server"
    print_summary(f"starsd launch: {many}, {n} targets ({dtype})", ["target", "tokens", "tokens/s",
                  "accepted/step"], rows, facts, {"JSON": json_out, "plot": png})
