"""vLLM as a person who serves with it would meet StarSD: vLLM decoding alone, vLLM's own
draft-model speculation, and vLLM with StarSD's drafts (starsd.vllm.Proposer), side by side in one
run, each a fresh vLLM engine (bench/vllm_engine.py, in the vLLM environment) on the same prompts.

Modes: `alone`; `vllm-draft-K` (vLLM's own speculation, the 0.5B draft in its process, K tokens a
step); `star-cohosted` (a real draft server on the same cores, the plug-in told to draft there);
`star-real` (a real draft server on `--draft-cores`, vLLM on `--vllm-cores`); `star-remote` (a
draft host of its own, emulated: emulate/draft_host.py; greedy only); `-x2`: two vLLM instances
at once; `-nopredraft`: the emulated host not pre-drafting; `no-server` (nothing answers the
plug-in: every step decodes alone); `oracle-K` (perfect drafts of K tokens, for the bound);
`hetero` (one real draft server serving a vLLM instance and a llama.cpp target at once).
Each mode's greedy output is compared with `alone`'s. The bound for `star-remote`: a greedy decode
of each prompt with the recorded chains cut to a fixed depth, drafts free, at vLLM's cost of a
pass of k tokens (`alone`, `oracle-K`): the most that these drafts allow on this engine.
Each mode in full, and figures: docs/vllm.md#bench-vllm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from starsd import config as C
from starsd.bench.vllm_runs import run_engine, taskset, vllm_python
from starsd.prompts import load as load_prompts
from starsd.results import bar_panels, cpu_kind, summary, write_json

MODES = ("alone", "vllm-draft-2", "vllm-draft-4", "star-cohosted", "star-real", "star-real-x2", "star-remote",
         "star-remote-x2",
         "star-remote-nopredraft", "star-remote-x2-nopredraft", "vllm-draft-4-x2", "oracle-2", "oracle-4", "hetero",
         "no-server")
REMOTE = ("star-remote", "star-remote-x2", "star-remote-nopredraft", "star-remote-x2-nopredraft")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default="humaneval", help="prompt set: humaneval or chat")
    p.add_argument("--offset", type=int, default=20, help="first prompt of the set (the depth policy was tuned "
                   "on the first 16 HumanEval prompts: these are others)")
    p.add_argument("--limit", type=int, default=3, help="prompts")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens each prompt decodes (EOS ignored)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the StarSD modes")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--temperatures", default="0,0.7", help="comma-separated; star-remote, the oracles and hetero "
                   "run greedy only")
    p.add_argument("--sampled-modes", default="alone,vllm-draft-4,star-cohosted",
                   help="the modes run at the temperatures above 0")
    p.add_argument("--fixed", action="store_true", help="the StarSD modes ask for k tokens every step (STARSD_ADAPTIVE=0): "
                   "a check of the output that drafts at every step, not a measure of speed")
    p.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set in every vLLM engine's environment, e.g. KMP_BLOCKTIME=0 (Intel OpenMP's threads sleep "
                   "at once after a parallel region instead of spinning 200 ms on cores a draft server shares)")
    p.add_argument("--vllm-cores", default="", help="cores every vLLM engine runs on, as taskset takes them (e.g. 0); "
                   "empty: all")
    p.add_argument("--draft-cores", default="", help="cores the draft servers run on and the emulated host stands "
                   "for (e.g. 1): with --vllm-cores, a draft host of its own by core partition; empty: all")
    p.add_argument("--vllm-python", default="", help="the vLLM environment's python (default: make vllm's)")
    p.add_argument("--json-out", default="results/vllm.json", help="results as JSON here, the plot (PNG) beside it")
    C.add_flags(p, C.PairConfig)


class Bench:
    def __init__(self, args, pair: C.PairConfig, python: str, log: str):
        from starsd.models import pinned
        from starsd.models.loading import load_tokenizer

        self.args = args
        self.pair = pair
        self.python = python
        self.log = log
        self.target = str(pinned.model_dir(pair.target, pair.cache)) if pair.target in pinned.PINNED else pair.target
        self.draft = str(pinned.model_dir(pair.draft, pair.cache)) if pair.draft in pinned.PINNED else pair.draft
        tokenizer = load_tokenizer(pair.target, pair.cache)
        prompts = load_prompts(args.prompts)[args.offset:args.offset + args.limit]
        self.prompt_ids = [p.encode(tokenizer) for p in prompts]
        self.prompt_names = [p.id for p in prompts]
        self.stats_files: list[str] = []  # the plug-in's counters, of the engines star() runs now

    def run(self, temperature: float, speculative: dict | None = None, proposer: C.ProposerSettings | None = None,
            env: dict[str, str] | None = None) -> dict:
        run = {"model": self.target, "dtype": C.resolve_dtype(self.pair.dtype, "cpu"), "prompts": self.prompt_ids,
               "max_tokens": self.args.max_tokens, "temperature": temperature, "seed": 0, "ignore_eos": True,
               "speculative": speculative, "max_num_seqs": max(4, len(self.prompt_ids)),
               "logprobs": 2 if speculative is None and temperature == 0 else 0}
        given = dict(kv.split("=", 1) for kv in self.args.engine_env)
        return run_engine(run, self.python, proposer, timeout_s=1800, log=self.log, env={**given, **(env or {})},
                          cores=self.args.vllm_cores)

    def star(self, temperature: float, address: str, instances: int = 1, cohosted: str = "auto",
             adaptive: bool | None = None) -> list[dict]:
        """`instances` vLLM engines at once, each with StarSD's drafts from `address`; each's result with
        the plug-in's counters and the server's figures from vLLM's first step on. `adaptive`: None, unless --fixed."""
        adaptive = not self.args.fixed if adaptive is None else adaptive
        from starsd.star.client import query_stats

        spec = {"method": "custom_class", "model": "starsd.vllm.Proposer", "num_speculative_tokens": self.args.k}
        results: list[dict] = [{} for _ in range(instances)]
        folder = tempfile.mkdtemp(prefix="starsd-vllm-")  # the plug-in writes each file once it is first called
        stats_files = [os.path.join(folder, f"proposer-{i}.json") for i in range(instances)]
        self.stats_files = stats_files

        def one(i: int) -> None:
            proposer = C.ProposerSettings(connect=address, stats_file=stats_files[i], cohosted=cohosted, adaptive=adaptive,
                                          cohosted_drafts=True)  # (its co-hosted modes measure drafting beside vLLM)
            results[i] = self.run(temperature, spec, proposer)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(instances)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads) and not self.drafting():  # the server's figures from vLLM's first
            time.sleep(0.1)  # step on, not over the engine's start-up
        before = query_stats(address) or {}
        for t in threads:
            t.join()
        after = query_stats(address) or {}
        busy = after.get("busy_s", 0.0) - before.get("busy_s", 0.0)
        wall = after.get("uptime_s", 0.0) - before.get("uptime_s", 0.0)
        pre, pre0 = after.get("predraft", {}), before.get("predraft", {})
        predraft = {k: pre.get(k, 0) - pre0.get(k, 0) for k in ("outcomes", "hits", "misses")}
        for r, f in zip(results, stats_files):
            r["plugin"] = json.loads(Path(f).read_text()) if Path(f).is_file() else {}
            r["server_utilisation"] = busy / wall if wall > 0 else None
            r["server_requests"] = after.get("requests", 0) - before.get("requests", 0)
            r["server_predraft"] = predraft  # pre-drafted outcomes, and requests answered from one or not
            r["server_batches"] = {k: v - before.get("batch_sizes", {}).get(k, 0)
                                   for k, v in after.get("batch_sizes", {}).items()}  # batches by size
            r["server_level_ms"] = level_ms(before, after)
            Path(f).unlink(missing_ok=True)
        os.rmdir(folder)
        return results

    def drafting(self) -> bool:
        """Whether the plug-in of the last star() has been called (vLLM decodes)."""
        return any(Path(f).is_file() for f in self.stats_files)

    def own(self, temperature: float, k: int, instances: int = 1) -> list[dict]:
        spec = {"method": "draft_model", "model": self.draft, "num_speculative_tokens": k}
        results: list[dict] = [{} for _ in range(instances)]

        def one(i: int) -> None:
            results[i] = self.run(temperature, spec)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(instances)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


def main(args) -> int:
    from starsd.bench.recorded import bound, record_drafts
    from starsd.star.launch import start_server

    pair = C.from_args(C.PairConfig, args)
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        raise C.SettingError(f"unknown mode(s) {', '.join(unknown)}: choose among {', '.join(MODES)}")
    base = str(Path(args.json_out).with_suffix(""))
    Path(base).parent.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, pair, vllm_python(args.vllm_python), f"{base}-vllm.log")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    draft_prefix = taskset(args.draft_cores)
    draft_cores = cores_of(args.draft_cores) if args.draft_cores else set(os.sched_getaffinity(0))
    if any(m.startswith("star-real") for m in modes) and not (args.draft_cores and args.vllm_cores):
        raise C.SettingError("star-real needs --vllm-cores and --draft-cores: a real draft server on cores of its own")
    server_pair = dataclasses.replace(pair, threads=0, target_engine="transformers")  # the server reads only
    # the target's tokenizer and width
    out: dict = {"settings": {k: v for k, v in vars(args).items() if k != "func"}, "cpu": cpu_kind(),
                 "prompts": bench.prompt_names, "runs": {}}
    runs = out["runs"]

    def record(name: str, t: float, results: list[dict]) -> None:
        key = f"{name}@{t:g}"
        runs[key] = results
        speed = ", ".join(f"{r['tokens_per_s']:.2f}" for r in results)
        print(f"{key}: {speed} tokens/s", flush=True)

    for t in temperatures:
        if t > 0:
            modes_now = [m for m in modes if m in args.sampled_modes.split(",")]
        else:
            modes_now = modes
        record("alone", t, [bench.run(t)])
        for k in (2, 4):
            if f"vllm-draft-{k}" in modes_now:
                record(f"vllm-draft-{k}", t, bench.own(t, k))
        if "vllm-draft-4-x2" in modes_now:
            record("vllm-draft-4-x2", t, bench.own(t, 4, instances=2))
        if "no-server" in modes_now:
            record("no-server", t, bench.star(t, "tcp://127.0.0.1:9"))
        if "star-cohosted" in modes_now:
            star = start_server(server_pair, C.ServerConfig())
            try:
                record("star-cohosted", t, bench.star(t, star.address))
            finally:
                star.close()
        for m in ("star-real", "star-real-x2"):
            if m in modes_now and t == 0:
                # cores of its own: it pre-drafts while vLLM verifies, and vLLM counts none of its compute
                star = start_server(server_pair, C.ServerConfig(predraft_cohosted=True), prefix=draft_prefix)
                try:
                    record(m, t, bench.star(t, star.address, instances=2 if m.endswith("-x2") else 1, cohosted="no"))
                finally:
                    star.close()
    greedy = runs.get("alone@0", [{}])[0]
    remote = [m for m in REMOTE if m in modes]
    if remote and greedy:
        paths = [(p, o) for p, o in zip(bench.prompt_ids, greedy["token_ids"])]
        draft = C.DraftConfig(depth=max(args.k, 8))
        rec_file = f"{base}-drafts.json"
        out["recording"] = {"file": rec_file, "cost_ms": record_drafts(draft_cores, pair, draft, paths, rec_file)}
        for m in remote:
            # a host of its own: its idle time is not vLLM's cores, so it pre-drafts while vLLM verifies, as a
            # real draft host does (on loopback the server would take vLLM for a target on its host)
            cfg = C.ServerConfig(predraft_cohosted=True, predraft=not m.endswith("-nopredraft"))
            star = start_server(server_pair, cfg, extra=["--recording", rec_file], prefix=draft_prefix)
            try:
                record(m, 0.0, bench.star(0.0, star.address, instances=2 if "-x2" in m else 1, cohosted="no"))
            finally:
                star.close()
        oracles = {int(m.split("-")[1]): m for m in modes if m.startswith("oracle-")}
        if oracles:
            costs = {1: 1e3 / greedy["tokens_per_s"]}
            for k, m in sorted(oracles.items()):
                result = oracle_run(bench, greedy["token_ids"], k)
                record(m, 0.0, [result])
                costs[k + 1] = (k + 1) * 1e3 / result["tokens_per_s"]
            out["bound"] = bound(rec_file, paths, fill(costs))
    if "hetero" in modes and greedy:
        star = start_server(server_pair, C.ServerConfig())
        try:
            out["hetero"] = hetero(bench, star.address, greedy)
        finally:
            star.close()
        print(f"hetero: {out['hetero']['summary']}", flush=True)
    out["checks"] = checks(runs)
    out["figures"] = figures(runs)
    write_json(args.json_out, out)
    plot(f"{base}.png", out["figures"])
    rows = [[key, f"{f['tokens_per_s']:.2f}", f"{f['vs_alone']:.2f}x", f.get("accepted_per_step"),
             f.get("plugin_ms_per_step"), f.get("server_utilisation")] for key, f in out["figures"].items()]
    summary("bench vllm", ["mode", "tokens/s", "vs alone", "accepted/step", "plug-in ms/step", "server busy"], rows,
            {"cpu": out["cpu"], "greedy equal to alone": str(out["checks"]),
             **({"bound (star-remote)": f"{out['bound']['speedup']:.2f}x alone"} if "bound" in out else {})},
            {"json": args.json_out, "plot": f"{base}.png"})
    return 0


def cores_of(text: str) -> set[int]:
    """taskset's list (0,2-3) as a set of cores."""
    cores = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores |= set(range(int(lo), int(hi or lo) + 1))
    return cores


def oracle_run(bench: Bench, outputs: list[list[int]], k: int) -> dict:
    """vLLM with perfect drafts of k tokens a step (bench/vllm_oracle.py: alone's own output): its cost of a
    pass of k + 1 tokens."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([p + o for p, o in zip(bench.prompt_ids, outputs)], f)
    try:
        return bench.run(0.0, {"method": "custom_class", "model": "starsd.bench.vllm_oracle.Oracle",
                               "num_speculative_tokens": k}, env={"STARSD_ORACLE": f.name})
    finally:
        os.unlink(f.name)


def llama_target(args, address: str | None) -> subprocess.Popen:
    """A llama.cpp target (`starsd target`, one thread) on the bench's prompts, greedy, with drafts of a
    fixed depth 4 (on 2 shared cores the adaptive policy asks for none) from `address` once a line comes
    on its stdin (None: alone, at once)."""
    argv = [sys.executable, "-m", "starsd.cli", "target", "--prompts", args.prompts, "--offset", str(args.offset),
            "--limit", str(args.offset + args.limit), "--max-new-tokens", str(args.max_tokens), "--ignore-eos", "--json",
            "--target-engine", "llamacpp", "--threads", "1", "--name", "llamacpp",
            *(["--connect", address, "--wait-go", "--draft-depth", "4", "--no-draft-adaptive"] if address
              else ["--connect", "tcp://127.0.0.1:9", "--no-spec"])]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def outputs(proc: subprocess.Popen) -> list[dict]:
    out, _ = proc.communicate(timeout=3600)
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"target"')]


def hetero(bench: Bench, address: str, alone: dict) -> dict:
    """One draft server, a vLLM instance and a llama.cpp target drafting on it at once, both asking for
    4 tokens every step (their adaptive policies, on 2 shared cores, ask for few); then the llama.cpp
    target alone. Each engine's greedy output against its own decoding alone."""
    from starsd.spec_decode.audit import in_words

    llama = llama_target(bench.args, address)
    vllm: list[dict] = []
    engine = threading.Thread(target=lambda: vllm.extend(bench.star(0.0, address, adaptive=False)))
    engine.start()
    while engine.is_alive() and not bench.drafting():  # both decode at once: llama.cpp starts with vLLM's first step
        time.sleep(0.2)
    llama.stdin.write("go\n")
    llama.stdin.flush()
    engine.join()
    vllm = vllm[0]
    spec = outputs(llama)
    plain = outputs(llama_target(bench.args, None))
    same_llama = [a["token_ids"] == b["token_ids"] for a, b in zip(spec, plain)]
    same_vllm = [a == b for a, b in zip(vllm["token_ids"], alone["token_ids"])]
    divergences = []  # llama.cpp's: where its batched and single-token kernels may round a near-tie apart
    for i, (a, b) in enumerate(zip(spec, plain)):
        if a["token_ids"] != b["token_ids"]:
            found = llama_audit(bench.pair, bench.prompt_ids[i], a["token_ids"], bench.args.max_tokens)
            divergences.append({"mode": "llama.cpp", "prompt": i, "ok": found["ok"], "allowance": found["allowance"],
                                "parts": found["divergences"]})
    return {"vllm": {"equal": same_vllm, "tokens_per_s": vllm["tokens_per_s"], "plugin": vllm.get("plugin")},
            "llamacpp": {"equal": same_llama, "divergences": divergences,
                         "drafted_steps": [r.get("drafted_steps") for r in spec],
                         "tokens_per_s": [r["tokens_per_s"] for r in spec],
                         "alone_tokens_per_s": [r["tokens_per_s"] for r in plain]},
            "summary": f"vLLM {sum(same_vllm)}/{len(same_vllm)} equal to vLLM alone, llama.cpp "
                       f"{sum(same_llama)}/{len(same_llama)} equal to llama.cpp alone"
                       + "".join(f"; {in_words(d)}" for d in divergences)}


def parts_at(got: list[int], want: list[int]) -> int | None:
    """The first position where two outputs differ (None: none within the shorter)."""
    return next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)


def llama_audit(pair: C.PairConfig, prompt_ids: list[int], emitted: list[int], n: int) -> dict:
    """llama.cpp's output audited against its own one-token passes (spec_decode/audit.py), as the hetero
    target runs it (one thread, 4 tokens drafted a step)."""
    from starsd.models.pair import Pair
    from starsd.spec_decode.audit import audit

    llama = dataclasses.replace(pair, target_engine="llamacpp", threads=1)
    target = Pair.load(llama.target_model(), None, pair.cache, 1).target
    return audit(target, prompt_ids, emitted, 5, n)  # EOS ignored: n tokens each


def fill(costs: dict[int, float]) -> dict[int, float]:
    """Costs at every width from 1 to the widest measured, by straight lines between the measured ones."""
    known = sorted(costs)
    filled = {}
    for w in range(1, known[-1] + 1):
        lo = max(k for k in known if k <= w)
        hi = min(k for k in known if k >= w)
        filled[w] = costs[lo] if lo == hi else costs[lo] + (costs[hi] - costs[lo]) * (w - lo) / (hi - lo)
    return filled


def checks(runs: dict) -> dict:
    """Each greedy mode's outputs against alone's: equal prompts, and each divergence's position with
    alone's top-2 logprob margin there (a near-tie may round either way between vLLM's kernels)."""
    ref = runs.get("alone@0", [{}])[0]
    found = {}
    for key, results in runs.items():
        if not key.endswith("@0") or key == "alone@0" or key.startswith("oracle"):
            continue
        parts = []
        for r in results:
            for i, (got, want) in enumerate(zip(r["token_ids"], ref["token_ids"])):
                at = parts_at(got, want)
                if at is not None:
                    top = ref["logprobs"][i][at]
                    parts.append({"prompt": i, "at": at, "margin": top[0][1] - top[1][1] if len(top) > 1 else None})
        found[key] = {"equal": sum(len(r["token_ids"]) for r in results) - len(parts), "divergences": parts}
    return found


def level_ms(before: dict, after: dict) -> dict:
    """A drafted level's time over a run, by batch size: the server's step batches (no prompt ingested)
    between two readings of its counters, each batch's time over its deepest chain's levels."""
    out = {}
    for size, now in after.get("step_batches", {}).items():
        was = before.get("step_batches", {}).get(size, {})
        levels = now["levels"] - was.get("levels", 0)
        if levels:
            out[size] = {"batches": now["batches"] - was.get("batches", 0), "levels": levels,
                         "ms_per_level": round((now["ms"] - was.get("ms", 0.0)) / levels, 1)}
    return out


def figures(runs: dict) -> dict:
    out = {}
    for key, results in runs.items():
        t = key.split("@")[1]
        alone = runs.get(f"alone@{t}", [{}])[0].get("tokens_per_s")
        tps = sum(r["tokens_per_s"] for r in results) / len(results)  # per instance
        f = {"tokens_per_s": tps, "vs_alone": tps / alone if alone else float("nan"), "instances": len(results)}
        spec = [r.get("spec", {}) for r in results]
        drafts = sum(s.get("spec_decode_num_drafts", 0) for s in spec)
        if drafts:
            f["accepted_per_step"] = round(sum(s.get("spec_decode_num_accepted_tokens", 0) for s in spec) / drafts, 2)
        plugin = [r["plugin"] for r in results if r.get("plugin")]
        if plugin:
            calls = sum(p["calls"] for p in plugin)
            f["plugin_ms_per_step"] = round(sum(p["ms"] for p in plugin) / max(1, calls), 1)
            f["accepted_per_step"] = round(sum(p["accepted"] for p in plugin) / max(1, sum(p["rows"] for p in plugin)), 2)
            f["drafted_share"] = round(sum(p["drafted"] for p in plugin) / max(1, sum(p["rows"] for p in plugin)), 2)
            util = results[0].get("server_utilisation")
            f["server_utilisation"] = None if util is None else round(util, 2)
            f["server_predraft"] = results[0].get("server_predraft")
            f["server_batches"] = results[0].get("server_batches")
            f["server_level_ms"] = results[0].get("server_level_ms")
        out[key] = f
    return out


def plot(path: str, figs: dict) -> None:
    bar_panels(path, [{"labels": list(figs), "values": [round(f["vs_alone"], 2) for f in figs.values()],
                       "ylabel": "tokens/s per instance, x vLLM alone", "title": "vLLM with StarSD drafts"}])
