"""A llama.cpp target, as a person who runs llama.cpp would meet StarSD: against llama.cpp decoding
alone and against llama.cpp's own draft-model speculation, side by side in one run.

Modes, each per prompt, in an order rotated per prompt (drift in the machine's speed hits all):
- `alone`: the target decoding one token a pass, on both cores;
- `colocated`: StarSD with the draft model in the target's process, its defaults, both cores;
- `alone-1core`, `star-1core`: two one-core hosts by CPU affinity: the target on core 0 alone, and
  with drafts from a draft-server process pinned to core 1, over loopback;
- `star-remote`: the target on both cores, drafts from a draft host of its own, emulated
  (emulate/draft_host.py); `emulated-1core`: `star-1core` with that emulation, to check it;
- `llama-speculative` (with --llama-speculative): llama.cpp's own `llama-speculative-simple`.
The bound `star-remote` is judged by: over fixed depths d, a greedy decode of each prompt with the
recorded chains cut to d, drafts free, at the engine's cost of scoring k tokens (measured here).
Each StarSD mode's greedy output is compared with the engine's target-only output on the same
cores, and every divergence audited (spec_decode/audit.py). Tokens/s are the decoding's, after the
prompt's prefill; each runner first decodes the set's first prompt unmeasured, in each mode.
Method, figures and how earlier runs were counted: docs/benchmarks.md#a-llamacpp-target.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import re
import statistics
import subprocess
import tempfile
import time

from starsd import config as C
from starsd.prompts import load as load_prompts
from starsd.bench.recorded import bound, record_drafts, wait_for
from starsd.results import Steps, bar_panels, cpu_kind, summary, write_json

def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default="chat", help="prompt set: humaneval or chat")
    p.add_argument("--offset", type=int, default=8, help="first prompt of the set (the depth policy was tuned "
                   "on the first ones)")
    p.add_argument("--limit", type=int, default=4, help="number of prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt at most")
    p.add_argument("--modes", default="alone,colocated,star-remote,alone-1core,star-1core,emulated-1core",
                   help="comma-separated: alone, colocated, star-remote, alone-1core, star-1core, emulated-1core")
    p.add_argument("--llama-speculative", default="", help="llama.cpp's llama-speculative-simple binary: run it too")
    p.add_argument("--llama-draft-max", type=int, default=3, help="its --draft-max (tokens drafted a step)")
    p.add_argument("--json-out", default="results/llamacpp.json", help="results as JSON here, the plot beside it")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.DraftConfig, prefix="draft-")  # StarSD's drafts in every mode (the defaults: as a person gets them)
    p.set_defaults(target_engine="llamacpp", threads=0)


RUNNERS = {"alone": "both", "colocated": "both", "star-remote": "remote", "alone-1core": "core0",
           "star-1core": "core0", "emulated-1core": "core0-emulated"}
BASELINE = {"colocated": "alone", "star-remote": "alone", "star-1core": "alone-1core", "emulated-1core": "alone-1core"}
WIDTHS = tuple(range(1, 12))  # tokens a pass scores, for the bound: the root and up to the default depth


def _runner(conn, cores: set[int], pair: C.PairConfig, draft: C.DraftConfig, with_draft: bool, server: str) -> None:
    """A child process on `cores` (its threads inherit the affinity): a llama.cpp target, and the
    draft model or a draft server's drafts; it decodes what the parent sends."""
    os.sched_setaffinity(0, cores)
    import torch

    from starsd.models.loading import vocab_fingerprint
    from starsd.models.pair import Pair
    from starsd.spec_decode.audit import audit
    from starsd.spec_decode.decode import measure_verify, speculative, target_only
    from starsd.spec_decode.depth import DepthPolicy
    from starsd.star.client import DraftClient
    from starsd.star.remote_drafter import RemoteDrafter

    torch.set_num_threads(len(cores))
    loaded = Pair.load(pair.target_model(), pair.draft_model() if with_draft else None, pair.cache, len(cores))
    drafter = loaded.drafter
    if server:
        client = DraftClient(server, vocab_fingerprint(loaded.tokenizer, loaded.target.width), "bench")
        client.hello()
        drafter = RemoteDrafter(client, cohosted=False)  # the server has a core of its own (star-1core)
    policy = DepthPolicy(draft.depth)  # one for the process, as a target process keeps: it carries over
    if drafter is not None:
        measure_verify(loaded.target, policy)  # as a target process does before its first stream
    conn.send("ready")
    while (job := conn.recv()) is not None:
        kind, ids, n = job
        if kind == "audit":
            prompt_ids, emitted = ids
            conn.send(audit(loaded.target, prompt_ids, emitted, draft.max_nodes + 1, n, loaded.eos_ids))
            continue
        if kind == "costs":
            conn.send(verify_costs(loaded.target, ids))
            continue
        greedy = C.SamplingConfig(temperature=0.0)
        if kind == "alone":
            gen = target_only(loaded.target, ids, n, greedy, loaded.eos_ids)
        else:
            gen = speculative(loaded.target, drafter, ids, n, draft, greedy, loaded.eos_ids, policy=policy)
        conn.send({"token_ids": gen.token_ids, "decoded": len(gen.token_ids),
                   "decode_s": gen.decoding_s, "steps": gen.num_steps,
                   "mean_accepted": gen.mean_accepted, "drafted_steps": sum(1 for d in gen.depths if d)})


def verify_costs(target, ids: list[int], rounds: int = 9) -> dict[int, float]:
    """ms of one pass scoring k tokens (the root and a chain of k - 1) after `ids`, for k in WIDTHS:
    the median of `rounds` after an untimed one, each committing one token."""
    from starsd.spec_decode.tree import DraftTree
    from starsd.spec_decode.verify import Verdict

    costs = {}
    for k in WIDTHS:
        seq = target.start(ids)
        times = []
        for r in range(rounds + 1):
            start = time.perf_counter()
            target.score(seq, DraftTree.chain(ids[:k - 1]))
            times.append((time.perf_counter() - start) * 1e3)
            target.commit(seq, Verdict([], [ids[r]]))
        costs[k] = round(statistics.median(times[1:]), 1)
    return costs


class Runner:
    def __init__(self, cores: set[int], pair: C.PairConfig, draft: C.DraftConfig, with_draft: bool, server: str = ""):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_runner, args=(child, cores, pair, draft, with_draft, server), daemon=True)
        self.proc.start()
        wait_for(self.conn, self.proc, 600, "a benchmark runner's start")
        if self.conn.recv() != "ready":
            raise RuntimeError("a benchmark runner did not start")

    def ask(self, kind: str, ids: list[int], n: int = 0):
        self.conn.send((kind, ids, n))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(30)


def llama_speculative(binary: str, target: str, draft: str, text: str, n: int, draft_max: int) -> dict:
    """One prompt through llama.cpp's llama-speculative-simple (greedy, both cores): its own figures."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        cmd = [binary, "-m", target, "-md", draft, "--spec-type", "draft-simple", "-f", f.name, "-n", str(n), "--temp", "0", "-t", "2", "-td", "2",
               "-c", "4096", "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    log = out.stdout + out.stderr
    speed = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    accept = re.search(r"accept\s*=\s*([\d.]+)%", log)
    if out.returncode != 0 or not speed:
        raise RuntimeError(f"{binary} failed ({out.returncode}): {log.strip().splitlines()[-3:]}")
    return {"decoded": int(speed.group(1)), "decode_s": float(speed.group(2)),
            "accepted_share": float(accept.group(1)) / 100 if accept else None, "command": " ".join(cmd[:1] + cmd[3:4])}


def main(args) -> int:
    from starsd.models.llamacpp import gguf_file
    from starsd.models.loading import load_tokenizer
    from starsd.spec_decode.audit import in_words
    from starsd.star.launch import start_server

    pair = C.from_args(C.PairConfig, args)
    draft = C.from_args(C.DraftConfig, args, prefix="draft-")
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in RUNNERS]:
        raise C.SettingError(f"unknown mode(s) {', '.join(unknown)}: choose among {', '.join(RUNNERS)}")
    prompts = load_prompts(args.prompts)[args.offset:args.offset + args.limit]
    tokenizer = load_tokenizer(pair.target, pair.cache)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 and any(RUNNERS[m] != "both" for m in modes):
        raise C.SettingError("the one-core and remote modes need two cores")
    remote = [m for m in modes if m in ("star-remote", "emulated-1core")]
    runners: dict[str, Runner] = {}
    servers = []
    recordings = {}
    bounds = None
    warm = load_prompts(args.prompts)[0].encode(tokenizer)  # not measured: first calls, first policy steps
    base = str(args.json_out).rsplit(".", 1)[0]
    try:
        runners["both"] = Runner(set(cores[:2]), dataclasses.replace(pair, threads=2), draft, "colocated" in modes)
        if remote:  # the drafts of a draft host of its own, recorded below each prompt's target-only output
            paths = [(ids, runners["both"].ask("alone", ids, args.max_new_tokens)["token_ids"])
                     for ids in [warm] + [p.encode(tokenizer) for p in prompts]]
            for name, where in (("2core", set(cores[:2])), ("1core", {cores[1]})):
                if name == "2core" and "star-remote" in modes or name == "1core" and "emulated-1core" in modes:
                    recordings[name] = {"file": f"{base}-drafts-{name}.json",
                                        "cost_ms": record_drafts(where, pair, draft, paths, f"{base}-drafts-{name}.json")}
            if "star-remote" in modes:
                bounds = bound(recordings["2core"]["file"], paths[1:], runners["both"].ask("costs", paths[1][0]))
        for runner, cpu, recording in (("remote", None, "2core"), ("core0-emulated", cores[1], "1core")):
            if runner in (RUNNERS[m] for m in modes):  # the emulated draft host; loopback stands for its link
                star = start_server(dataclasses.replace(pair, threads=1), C.ServerConfig(predraft_cohosted=True),
                                    prefix=["taskset", "-c", str(cpu)] if cpu is not None else [],
                                    extra=["--recording", recordings[recording]["file"]])
                servers.append(star)
                runners[runner] = Runner(set(cores[:2]) if cpu is None else {cores[0]},
                                         dataclasses.replace(pair, threads=2 if cpu is None else 1), draft, False,
                                         star.address)
        if any(RUNNERS[m] == "core0" for m in modes):
            star = None
            if "star-1core" in modes:  # a draft host of its own: its one core, pre-drafting as on any other host
                star = start_server(dataclasses.replace(pair, threads=1), C.ServerConfig(predraft_cohosted=True),
                                    prefix=["taskset", "-c", str(cores[1])])
                servers.append(star)
            runners["core0"] = Runner({cores[0]}, dataclasses.replace(pair, threads=1), draft, False,
                                      star.address if star else "")
        order = list(modes) + (["llama-speculative"] if args.llama_speculative else [])
        runs: dict[str, list[dict]] = {m: [] for m in order}
        for mode in modes:
            runners[RUNNERS[mode]].ask("alone" if mode.startswith("alone") else "spec", warm, args.max_new_tokens)
        with Steps("bench llamacpp", len(prompts) * len(order)) as steps:
            for i, prompt in enumerate(prompts):
                ids = prompt.encode(tokenizer)
                k = i % len(order)
                for mode in order[k:] + order[:k]:
                    steps.begin(f"{mode}, prompt {i + 1}/{len(prompts)}")
                    if mode == "llama-speculative":
                        r = llama_speculative(args.llama_speculative, str(gguf_file(pair.target, pair.cache)),
                                              str(gguf_file(pair.draft, pair.cache)),
                                              tokenizer.decode(ids), args.max_new_tokens, args.llama_draft_max)
                    else:
                        r = runners[RUNNERS[mode]].ask("alone" if mode.startswith("alone") else "spec", ids,
                                                       args.max_new_tokens)
                    r["prompt"] = prompt.id
                    runs[mode].append(r)
                    steps.end(f"{mode}, prompt {i + 1}: {r['decoded'] / r['decode_s']:.2f} tok/s")
            divergences = []
            for mode, base_mode in BASELINE.items():
                if mode not in runs or base_mode not in runs:
                    continue
                for i, (r, b) in enumerate(zip(runs[mode], runs[base_mode])):
                    at = next((j for j, (x, y) in enumerate(zip(r["token_ids"], b["token_ids"])) if x != y), None)
                    if at is None and len(r["token_ids"]) != len(b["token_ids"]):
                        at = min(len(r["token_ids"]), len(b["token_ids"]))
                    r["equal"] = at is None
                    if at is not None:
                        found = runners[RUNNERS[mode]].ask("audit", (prompts[i].encode(tokenizer), r["token_ids"]),
                                                           args.max_new_tokens)
                        divergences.append({"mode": mode, "prompt": r["prompt"], "ok": found["ok"],
                                            "allowance": found["allowance"], "parts": found["divergences"]})
    finally:
        for r in runners.values():
            r.close()
        for star in servers:
            star.close()
    rate = {m: sum(r["decoded"] for r in rs) / sum(r["decode_s"] for r in rs) for m, rs in runs.items()}
    points = {m: {"tokens_per_s": rate[m], "runs": rs} for m, rs in runs.items()}
    for mode, base_mode in BASELINE.items():
        if mode in rate and base_mode in rate:
            points[mode]["vs_alone"] = rate[mode] / rate[base_mode]
            points[mode]["equal_share"] = sum(r["equal"] for r in runs[mode]) / len(runs[mode])
    for mode in rate:
        if mode in BASELINE:
            rs = runs[mode]
            points[mode]["mean_accepted"] = (sum(r["mean_accepted"] * r["drafted_steps"] for r in rs)
                                             / max(1, sum(r["drafted_steps"] for r in rs)))  # a drafted step
            points[mode]["drafted_share"] = sum(r["drafted_steps"] for r in rs) / max(1, sum(r["steps"] for r in rs))
    if "llama-speculative" in rate and "alone" in rate:
        points["llama-speculative"]["vs_alone"] = rate["llama-speculative"] / rate["alone"]
    facts = {}
    if bounds:
        facts["bound (star-remote)"] = (f"{bounds['speedup']:.2f}x at depth {bounds['depth']} "
                                        f"({bounds['by_depth'][bounds['depth']]['accepted_per_step']:.2f} accepted a step)")
        if "vs_alone" in points.get("star-remote", {}):
            facts["star-remote, share of the bound"] = f"{points['star-remote']['vs_alone'] / bounds['speedup']:.0%}"
        if "llama-speculative" in rate and "star-remote" in rate:
            facts["star-remote vs llama.cpp's own speculation"] = f"{rate['star-remote'] / rate['llama-speculative']:.2f}x"
    if "emulated-1core" in rate and "star-1core" in rate:
        facts["emulated-1core vs star-1core (the emulation's error)"] = f"{rate['emulated-1core'] / rate['star-1core']:.3f}"
    result = {"benchmark": "llamacpp", "target": pair.target, "draft": pair.draft, "prompts": args.prompts,
              "offset": args.offset, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "cpu_flags": cpu_kind(), "llama_draft_max": args.llama_draft_max, "draft_config": dataclasses.asdict(draft),
              "modes": points,
              "recordings": recordings, "bound": bounds, "divergences": divergences}
    write_json(args.json_out, result)
    png = base + ".png"
    bar_panels(png, [{"labels": list(rate), "values": [round(v, 2) for v in rate.values()], "ylabel": "tokens / s",
                      "title": f"llama.cpp target, {len(prompts)} {args.prompts} prompts, greedy"}])
    rows = []
    for m, p in points.items():
        vs = p.get("vs_alone")
        rows.append([m, f"{p['tokens_per_s']:.2f}", f"{vs:.2f}x" if vs else "",
                     f"{p['mean_accepted']:.2f}" if "mean_accepted" in p else "",
                     f"{p['equal_share']:.0%}" if "equal_share" in p else ""])
    facts["divergences"] = "; ".join(in_words(d) for d in divergences) or "none"
    summary(f"bench llamacpp: {len(prompts)} {args.prompts} prompts from #{args.offset}, {args.max_new_tokens} tokens, "
            f"greedy, {cpu_kind()}; decoding tokens/s after the prefill",
            ["mode", "tokens/s", "vs alone on the same cores", "accepted a drafted step", "greedy output equal"], rows,
            facts=facts, files={"JSON": args.json_out, "plot": png})
    return 0 if all(d["ok"] for d in divergences) else 1
