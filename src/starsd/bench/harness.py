"""What the star benchmarks share (scale, replay-check, multihost): their common flags, the inputs of
replay targets (a recording and a latency profile), a runner for one measured point, and small
measurements. No benchmark imports another; they all import this.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from starsd import config as C
from starsd.bench import metrics
from starsd.emulate import netns
from starsd.emulate.replay import (LatencyProfile, Recording, ReplayTarget, measure_latency, record, record_features,
                                   recording_path)
from starsd.errors import SettingError
from starsd.models import forward as fw
from starsd.models.drafter import DraftJob, Drafter, Pass
from starsd.models.eagle import EagleHead
from starsd.models.kv import KV
from starsd.models.loading import load_eagle
from starsd.models.pair import Pair
from starsd.prompts import load as load_prompts
from starsd.results import Steps, summary, write_json
from starsd.spec_decode.verify import verify_greedy
from starsd.star import protocol as P
from starsd.star.client import DraftClient
from starsd.star.launch import start_server
from starsd.star.processes import read_json_line, spawn

WIDTHS = [1, 2, 3, 4, 6, 8, 11, 16]  # scored tokens per verify pass, for the measured latency profile


def add_star_args(p: argparse.ArgumentParser, json_out: str) -> None:
    """The flags of a benchmark that measures replay targets against a real draft server, point by
    point: N values, and a warm-up and a window per point."""
    p.add_argument("--targets", default="1,2,4,8,16,32,64", help="numbers of targets N, comma-separated")
    p.add_argument("--warmup-s", type=float, default=20.0, help="seconds before the window opens (every "
                   "target's first request prefills its prompt: at large N a serial server needs a while)")
    p.add_argument("--measure-s", type=float, default=30.0, help="length of the measuring window (seconds)")
    add_replay_args(p, json_out)


def add_replay_args(p: argparse.ArgumentParser, json_out: str) -> None:
    """The flags of any benchmark that runs replay targets: what they replay, the models, the draft
    server's batch limit, the seed and the output file."""
    p.add_argument("--prompts", default="humaneval", help="prompt set: humaneval or chat")
    p.add_argument("--limit", type=int, default=16, help="prompts recorded and cycled through")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens recorded per prompt (a continuation's length)")
    p.add_argument("--latency", default=None, help="a verify latency profile (JSON) for other target hardware; "
                                                   "default: measured here on the real target")
    p.add_argument("--max-batch", type=int, default=32, help="the draft server's batch limit (sessions)")
    p.add_argument("--seed", type=int, default=0, help="seeds the replay targets' latency draws (and the simulator's)")
    p.add_argument("--json-out", default=json_out, help="results as JSON here, plots (PNG) beside it")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.DraftConfig, prefix="draft-")
    p.set_defaults(threads=2, target_engine="transformers")  # the figures in docs/ were measured so


def numbers(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]."""
    return [int(x) for x in text.split(",")]


def server_config(args, serial: bool, predraft: bool = False) -> C.ServerConfig:
    """The draft server of a benchmark point: pre-drafting only where a mode asks for it, and no
    shared prefixes (replay targets cycle a few prompts: repeats that no fleet's prompts make)."""
    return C.ServerConfig(serial=serial, max_batch=args.max_batch, predraft=predraft, predraft_cohosted=True,
                          share_prefixes=False)  # replay targets stand for other hosts: they compute nothing here


@dataclasses.dataclass
class Inputs:
    """What every point needs: the recording, the latency profile, and the files that hold them."""

    recording: Recording
    recording_file: str
    latency: LatencyProfile
    latency_file: str
    draft: C.DraftConfig


def prepare(args) -> Inputs:
    """Record the real target's continuations (cached) and measure its verify latency here (or
    read --latency); the measured profile is written next to the JSON, as STEM-verify-latency.json."""
    pair = C.from_args(C.PairConfig, args)
    target_cfg = pair.target_model()
    draft = C.from_args(C.DraftConfig, args, prefix="draft-")
    rec, rec_file = recording(args)
    if pair.eagle:  # replay targets send the real target's features to a head
        record_features(target_cfg, rec, rec_file, eagle_taps(pair), pair.cache, pair.threads)
    if args.latency:
        return Inputs(rec, rec_file, LatencyProfile.load(args.latency), args.latency, draft)
    target = Pair.load(target_cfg, None, pair.cache, pair.threads).target
    prompt_ids = [p["prompt_ids"] for p in rec.prompts.values()]
    by_length = sorted(prompt_ids, key=len)
    spread = [by_length[0], by_length[len(by_length) // 2], by_length[-1]]  # short, median, long prompt
    latency = measure_latency(target, [prompt_ids[0], *spread], WIDTHS, reps=10,
                              source=f"measured: {target_cfg.path} {target_cfg.dtype}, {pair.threads} threads")
    lat_file = Path(str(args.json_out).rsplit(".", 1)[0] + "-verify-latency.json")
    lat_file.parent.mkdir(parents=True, exist_ok=True)
    lat_file.write_text(json.dumps(latency.to_json(), indent=1))
    return Inputs(rec, rec_file, latency, str(lat_file), draft)


def eagle_taps(pair: C.PairConfig) -> tuple[int, ...]:
    """The target features the pair's EAGLE head drafts from."""
    return load_eagle(pair.eagle_model(), pair.target_model(), pair.cache).taps


def recording(args) -> tuple[Recording, str]:
    """The real target's greedy continuations of the prompts (recorded once, then cached), and their file."""
    pair = C.from_args(C.PairConfig, args)
    prompts = load_prompts(args.prompts, args.limit)
    rec = record(pair.target_model(), prompts, args.max_new_tokens, pair.cache, pair.threads)
    return rec, str(recording_path(pair.target_model(), prompts, args.max_new_tokens, pair.cache))


def replay_command(inputs: Inputs, address: str, n: int, max_new_tokens: int, duration_s: float, seed: int,
                   draft: C.DraftConfig | None = None, no_spec: bool = False) -> list[str]:
    """The `starsd replay-targets` command line of n replay targets that wait for `go` on stdin,
    drafting as `draft` says (default: the inputs' settings)."""
    return ["replay-targets", "--connect", address, "--recording", inputs.recording_file,
            "--latency", inputs.latency_file, "--targets", str(n), "--max-new-tokens", str(max_new_tokens),
            "--duration-s", str(duration_s), "--wait-go", "--seed", str(seed),
            *C.to_flags(draft or inputs.draft, prefix="draft-"), *(["--no-spec"] if no_spec else [])]


class Runner:
    """Runs one point: a replay host with n targets against a draft server, over warm-up + window.
    `prefix` runs the host through a wrapper (`ip netns exec NS`: the targets on another host)."""

    def __init__(self, inputs: Inputs, args, prefix: list[str] = ()):
        self.inputs = inputs
        self.args = args
        self.prefix = list(prefix)

    def host(self, address: str, n: int, no_spec: bool = False, duration_s: float | None = None,
             draft: C.DraftConfig | None = None, during=None) -> tuple[list[dict], float]:
        """Run n replay targets (for duration_s, default warm-up + window; 0: each decodes its share
        of the prompts once) drafting as `draft` says (default: the flags); return their JSON rows
        and the unix time they were released. `during(go)`, if given, runs once they are released
        (a fault to inject mid-run)."""
        a = self.args
        duration_s = a.warmup_s + a.measure_s if duration_s is None else duration_s
        argv = replay_command(self.inputs, address, n, a.max_new_tokens, duration_s, a.seed, draft, no_spec)
        proc = spawn(argv, self.prefix)
        try:
            read_json_line(proc, "ready", 120)
            go = time.time()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            reader, lines = read_lines(proc)  # read while `during` runs: its targets print as they decode
            if during is not None:
                during(go)
            proc.stdin.close()
            proc.wait(timeout=(duration_s or 3600) + 300)
            reader.join(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
        rows = replay_rows(proc, lines)
        return rows, go

    def point(self, address: str | None, n: int, no_spec: bool = False, draft: C.DraftConfig | None = None
              ) -> tuple[dict, list[metrics.Iteration]]:
        """The figures of n targets over the window (address None: target-only, no server)."""
        rows, go = self.host(address or "tcp://127.0.0.1:9", n, no_spec, draft=draft)
        w0 = go + self.args.warmup_s
        w1 = w0 + self.args.measure_s
        timeline = None if address is None else server_stats(address, self.prefix)["timeline"]
        its = metrics.iterations(rows)
        return metrics.point(its, n, w0, w1, timeline), [it for it in its if w0 <= it.end <= w1]


def read_lines(proc: subprocess.Popen) -> tuple[threading.Thread, list[str]]:
    """The child's stdout, read as it comes on a thread of its own into the list returned. A child
    that prints more than a pipe holds (64 KiB) while nobody reads stops at its print: a replay host
    so stopped every target at once (its threads print under one lock)."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), name="stdout-reader", daemon=True)
    reader.start()
    return reader, lines


def replay_rows(proc: subprocess.Popen, lines: list[str]) -> list[dict]:
    """A finished replay host's JSON rows; raises where it failed or a target reported an error."""
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    errors = [r["error"] for r in rows if "error" in r]
    if proc.returncode or errors:
        raise RuntimeError(f"replay host failed ({proc.returncode}): {errors[:3]}")
    return rows


def networks(text: str) -> list[tuple[float, float | None]]:
    """"RTT_MS@MBIT,..." -> [(rtt_ms, mbit or None: unshaped), ...]."""
    out = []
    for item in text.split(","):
        rtt, _, rate = item.partition("@")
        mbit = float(rate) if rate else 0.0
        out.append((float(rtt), mbit or None))
    return out


def no_namespaces(title: str, json_out: str) -> bool:
    """Whether network namespaces cannot be made here (root and iproute2 are needed): then the
    benchmark's JSON says why and its summary says it is skipped. Else stale namespaces of dead runs
    are removed first."""
    reason = netns.available()
    if reason:
        write_json(json_out, {"skipped": reason})
        summary(f"{title}: skipped", ["reason"], [[reason]], files={"JSON": json_out})
        return True
    netns.cleanup_stale()
    return False


@contextlib.contextmanager
def across_link(pair: C.PairConfig, server: C.ServerConfig, rtt_ms: float, rate_mbit: float | None):
    """Two emulated hosts (netns.Link, shaped to rate_mbit): a draft server on the draft host, and a
    delay proxy to it on the target host adding half of rtt_ms each way; yields (link, proxy), the
    proxy's address being what the target host's targets connect to."""
    with netns.Link(rate_mbit) as link:
        star = start_server(pair, dataclasses.replace(server, insecure=True),  # a veth of namespaces made
                            host=link.draft_ip, prefix=link.exec_argv(link.draft_ns))  # here: no other host reaches it
        proxy = None
        try:
            proxy = LinkProxy(link, star.address, rtt_ms / 2)
            yield link, proxy
        finally:
            if proxy:
                proxy.close()
            star.close()


class LinkProxy:
    """The delay proxy (emulate/delay_proxy.py) as a process inside a link's target namespace: what
    the targets there connect to, `delay_ms` each way (this kernel has no netem)."""

    def __init__(self, link: netns.Link, upstream: str, delay_ms: float):
        argv = [*link.exec_argv(link.target_ns), sys.executable, "-m", "starsd.emulate.delay_proxy", "--listen",
                "127.0.0.1:0", "--upstream", upstream.removeprefix("tcp://"), "--delay-ms", str(delay_ms)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        self.address = "tcp://" + read_json_line(self.proc, "ready", 30)["ready"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def server_stats(address: str, prefix: list[str] = (), ping: int = 0) -> dict:
    """The draft server's counters, asked from where the targets are (`prefix`: another namespace)."""
    if prefix:
        argv = [*prefix, sys.executable, "-m", "starsd.cli", "stats", "--connect", address, "--ping", str(ping)]
        return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout)
    client = DraftClient(address, "", "bench", timeout_s=30)
    try:
        stats = client.stats()
        if ping:
            stats["ping_ms"] = {"median": statistics.median(client.ping() for _ in range(ping))}
        return stats
    finally:
        client.close()


def serialisation_ms(depth: int, new_tokens: int) -> float:
    """Encode + decode of one request and one chain reply of this size, both directions (ms)."""
    tok = torch.arange(new_tokens, dtype=torch.int32)
    tree = (torch.arange(depth, dtype=torch.int32), torch.arange(depth, dtype=torch.int32) - 1)
    req = P.DraftRequest(1, 1, False, None, None, 100, P.specs(tok))
    rep = P.DraftReply(1, 1, 0.0, 0.0, 1, P.specs(*tree))
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        P.decode([bytes(f) for f in P.encode(req, (tok,))])
        P.decode([bytes(f) for f in P.encode(rep, tree)])
    return (time.perf_counter() - t0) / n * 1e3


def measure_service(drafter: Drafter, rec: Recording, sizes: list[int], cfg: C.DraftConfig,
                    reps: int = 3, rows_per_size: int = 8,
                    features: dict | None = None) -> dict[int, dict[str, list[float]]]:
    """S(b) and its bound, in ms, for each batch size b. S(b) is the wall time of one batched draft
    of b sessions in steady state: each session is a recorded prompt fed its real accepted tokens
    (a replay target with no latency verifies; for an EAGLE head, with the recorded `features`).
    The bound is the bare model running the same passes right after (`bound_ms`). A batch drafts
    as deep as its deepest row needs, so small batches are measured on several disjoint groups of
    prompts (at least rows_per_size rows in all). Each group's first batch, where every row starts
    from its prompt (a reset), is timed apart: `reset_ms`, with the prompt tokens it ingested in
    `reset_tokens` (`reset_cost` makes a cost per token of it)."""
    prompts = [p["prompt_ids"] for p in rec.prompts.values() if len(p["continuation"]) == rec.max_new_tokens]
    if not prompts:
        raise SettingError("every recorded continuation ends early (EOS): the service sweep needs full-length ones")
    out = {}
    with Steps("service sweep", len(sizes)) as steps:
        for b in sizes:
            steps.begin(f"batch b={b}")
            out[b] = {}
            for g in range(max(1, -(-rows_per_size // b))):
                rows = [prompts[(g * b + i) % len(prompts)] for i in range(b)]
                for key, values in _time_group(drafter, rec, rows, cfg, reps, features).items():
                    out[b].setdefault(key, []).extend(values)
            steps.end(f"service sweep: batch {b}: {statistics.fmean(out[b]['service_ms']):.0f} ms, bound "
                      f"{statistics.fmean(out[b]['bound_ms']):.0f} ms")
    return out


class _Group:
    """Recorded prompts drafted together as one batch, each fed its real target's accepted tokens
    after every draft, as a replay target with no verify latency would (for an EAGLE head, with the
    recorded `features`)."""

    def __init__(self, drafter: Drafter, rec: Recording, rows: list[list[int]], features: dict | None):
        self.drafter, self.taps = drafter, drafter.taps
        self.judge = ReplayTarget(rec, LatencyProfile({1: (1e-6,)}), features=features)
        self.seqs = [drafter.start(r) for r in rows]
        self.judged = [self.judge.start(r, self.taps) for r in rows]
        self.new: list[list[int]] = [[] for _ in rows]
        self.feats = [j.features for j in self.judged]  # the new tokens' features (EAGLE), else None
        self.levels: list[int] = []  # each draft's levels, as verified, in the order of step's returns

    def left(self) -> list[int]:
        """Tokens left in each row's recording."""
        return [len(j.continuation) - j.position for j in self.judged]

    def step(self, rows: list[int], cfg: C.DraftConfig, timed: list[float] | None = None,
             bound: list[float] | None = None) -> list[int]:
        """Draft these rows in one batch (its wall time appended to `timed`, and the bare model's
        time for its passes to `bound`, if given), verify and commit each draft; the tokens each
        row committed (accepted + the target's own)."""
        left = self.left()
        jobs = [DraftJob(self.seqs[i], self.new[i], cfg, C.SamplingConfig(), None, left[i] - 1,
                         features=self.feats[i]) for i in rows]
        self.drafter.passes = [] if bound is not None else None
        t0 = time.perf_counter()
        trees = self.drafter.propose_batch(jobs)
        if timed is not None:
            timed.append((time.perf_counter() - t0) * 1e3)
        if bound is not None:
            bound.append(bound_ms(self.drafter.model, self.drafter.passes))
        self.drafter.passes = None
        committed = []
        for i, tree in zip(rows, trees):
            j, tree = self.judged[i], tree.truncate(left[i] - 1)
            self.levels.append(tree.depth())
            verdict = verify_greedy(tree, self.judge.score(j, tree, self.taps))
            if self.taps is not None:
                self.feats[i] = j.features[torch.tensor([0] + [p + 1 for p in verdict.path])]
            self.judge.commit(j, verdict)
            self.new[i] = verdict.tokens
            committed.append(len(verdict.tokens))
        return committed


def _time_group(drafter: Drafter, rec: Recording, rows: list[list[int]], cfg: C.DraftConfig,
                reps: int, features: dict | None) -> dict[str, list[float]]:
    group = _Group(drafter, rec, rows, features)
    out = {"service_ms": [], "bound_ms": [], "reset_ms": [], "reset_tokens": [sum(map(len, rows))]}
    for rep in range(reps + 1):  # the first pass ingests the prompts: not steady state, timed apart
        if min(group.left()) < 2:
            raise SettingError("recorded continuations too short for the service sweep: raise --max-new-tokens")
        if rep:
            group.step(list(range(len(rows))), cfg, out["service_ms"], out["bound_ms"])
        else:
            group.step(list(range(len(rows))), cfg, out["reset_ms"])
    return out


def reset_cost(sweep: dict[int, dict[str, list[float]]]) -> float | None:
    """What a reset adds to a batch, in ms per prompt token: over every batch size of a service
    sweep, the first batches' extra time over the steady ones, per prompt token they ingested
    (a prompt longer than drafter.SOLO_INGEST is ingested on its own, so the cost adds up row by
    row). None for a sweep without first batches timed."""
    sizes = [v for v in sweep.values() if v.get("reset_ms") and v.get("service_ms")]
    tokens = sum(statistics.fmean(v["reset_tokens"]) for v in sizes)
    extra = sum(statistics.fmean(v["reset_ms"]) - statistics.fmean(v["service_ms"]) for v in sizes)
    return max(0.0, extra / tokens) if tokens else None


def measure_acceptance(drafter: Drafter, rec: Recording, cfg: C.DraftConfig,
                       features: dict | None = None) -> list[int]:
    """Tokens a target commits per iteration (tau's samples) over the whole recorded continuation of
    every prompt, drafted as `cfg` says and verified greedily against the real target's tokens: the
    workload's acceptance, not that of the few prompts a short window at N = 1 reaches. The prompts
    are drafted together, a batch per step (drafts do not depend on the batch)."""
    return measure_drafts(drafter, rec, cfg, features)[0]


def measure_drafts(drafter: Drafter, rec: Recording, cfg: C.DraftConfig,
                   features: dict | None = None) -> tuple[list[int], list[int]]:
    """measure_acceptance's tokens per iteration, and beside each the levels its draft had (its chain's
    length: a batch cut short at level L commits min(tokens, L + 1) of it; theory/simulate.py)."""
    group = _Group(drafter, rec, [p["prompt_ids"] for p in rec.prompts.values()], features)
    out = []
    with Steps("acceptance over the recording", 1) as steps:
        steps.begin("every prompt to its end")
        while rows := [i for i, n in enumerate(group.left()) if n >= 2]:
            out += group.step(rows, cfg)
        steps.end(f"acceptance: {statistics.fmean(out):.2f} tokens per iteration over {len(out)} iterations, "
                  f"{statistics.fmean(group.levels):.2f} levels a draft")
    return out, group.levels


@torch.inference_mode()
def bound_ms(model, passes: list[Pass]) -> float:
    """The bare model doing these passes (ms): the same rows, tokens and attended columns, and one
    LM-head call per pass over as many hidden states; no masks built, nothing gathered or copied."""
    kvs = []
    for p in passes:  # allocated before the clock starts
        kv = KV.allocate(model, p.rows, p.past + p.tokens)
        kv.cut(p.past)
        kvs.append(kv)
    head = isinstance(model, EagleHead)
    feats = [model.get_input_embeddings().weight.new_zeros(p.rows, p.tokens, model.config.hidden_size)
             if head else None for p in passes]
    t0 = time.perf_counter()
    for p, kv, f in zip(passes, kvs, feats):
        tokens = torch.ones(p.rows, p.tokens, dtype=torch.long)
        positions = p.past + torch.arange(p.tokens).expand(p.rows, -1)
        attend = torch.ones(p.rows, p.tokens, p.past + p.tokens, dtype=torch.bool)
        if head:
            model.logits(model.decode(kv, tokens, positions, attend, f).reshape(-1, f.shape[-1])[: p.heads])
        else:
            hidden = fw.forward(model, kv, tokens, positions, attend)
            fw.lm_head(model, hidden.reshape(-1, hidden.shape[-1])[: p.heads])
    return (time.perf_counter() - t0) * 1e3
