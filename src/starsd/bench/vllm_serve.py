"""vLLM as a person serves it: `vllm serve` behind its OpenAI endpoint, alone and with StarSD's drafts
from a draft server started with its defaults, the requests sent by a client and timed there.

Each run starts every mode afresh and sends each the same requests: one request, then `--requests`'
other counts at once, greedy, `--max-tokens` each (EOS ignored). Every mode is up at once and each set
goes `--repeats` times to each mode, a pass to each in turn, its figure the median pass: this host's
speed drifts by 10% and more within minutes, and in turn every mode meets the drift alike
(`--one-at-a-time`: one mode up at a time, all its passes in a row).
Modes:
- `alone`: `vllm serve MODEL`, in the environment the README gives vLLM's CPU build; `alone-sync`: the
  same with `--no-async-scheduling`, as vLLM runs with any `custom_class` proposer (StarSD's among them);
- `star`: `starsd draft-server` with its defaults on this host, and `vllm serve` with the plug-in
  (the README's command); `star-drafting`: the same, the plug-in told to draft from a server that
  shares vLLM's cores (STARSD_COHOSTED_DRAFTS=1; with --draft-cores: STARSD_COHOSTED=no);
- `vllm-draft-K`: vLLM's own speculation, the draft model in its process, K tokens a step.
With `--vllm-cores` and `--draft-cores`, vLLM (every mode) runs on the first set and the draft server
on the second: a draft host of its own, by core partition.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from starsd import config as C
from starsd.bench.rss import available, group_peak
from starsd.bench.vllm_runs import bound_to, engine_env, taskset, vllm_python
from starsd.prompts import load as load_prompts
from starsd.results import bar_panels, cpu_kind, summary, write_json
from starsd.star.processes import free_port, stop_group

MODES = ("alone", "alone-sync", "star", "star-drafting", "vllm-draft-4")
PLUGIN = {"method": "custom_class", "model": "starsd.vllm.Proposer", "num_speculative_tokens": 4}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default="alone,star", help=f"comma-separated, of {', '.join(MODES)} (vllm-draft-K: any K)")
    p.add_argument("--requests", default="1,3", help="comma-separated: how many requests are sent at once, in turn")
    p.add_argument("--repeats", type=int, default=3, help="passes of each request set to each mode, the modes in "
                   "turn; a set's tokens/s is its median pass (one slow pass of a noisy host weighs on no ratio)")
    p.add_argument("--runs", type=int, default=3, help="runs; each starts every mode afresh (every other run in the "
                   "reverse order)")
    p.add_argument("--one-at-a-time", action="store_true", help="start one mode's servers at a time and send it "
                   "all its passes (by default every mode is up at once and the passes alternate between them: "
                   "the host's drift, 10%% and more within minutes here, weighs on every mode alike; the idle "
                   "modes' servers sit beside the one that runs)")
    p.add_argument("--prompts", default="humaneval", help="prompt set: humaneval or chat")
    p.add_argument("--offset", type=int, default=20, help="first prompt of the set")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each request decodes (EOS ignored)")
    p.add_argument("--vllm-cores", default="", help="cores vLLM runs on (e.g. 0); empty: all, shared with the server")
    p.add_argument("--draft-cores", default="", help="cores the draft server runs on (e.g. 1); empty: all")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE), GiB")
    p.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set in every vllm serve's environment, e.g. KMP_BLOCKTIME=0")
    p.add_argument("--vllm-python", default="", help="the vLLM environment's python (default: make vllm's)")
    p.add_argument("--json-out", default="results/vllm-serve.json", help="results as JSON here, the plot beside it")
    C.add_flags(p, C.PairConfig)


class VllmServe:
    """One `vllm serve` process (with its engine core and worker, in a process group of their own)."""

    def __init__(self, python: str, model: str, dtype: str, speculative: dict | None, env: dict[str, str],
                 cores: str, log: str, flags: tuple[str, ...] = ()):
        self.port = free_port()
        self.model = model
        args = [str(Path(python).parent / "vllm"), "serve", model, "--port", str(self.port), "--host", "127.0.0.1",
                "--dtype", dtype, "--seed", "0", "--max-num-seqs", "8"]
        if speculative:
            args += ["--speculative-config", json.dumps(speculative)]
        args += flags
        with open(log, "a") as err:
            self.proc = subprocess.Popen([*taskset(cores), *args], stdout=err, stderr=err,
                                         env={**env, **bound_to(cores)}, start_new_session=True)
        self._wait_up(900)

    def _wait_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with status {self.proc.returncode} before it answered")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        raise RuntimeError(f"vllm serve did not answer within {timeout_s:.0f} s")

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=1800) as r:
            choice = json.loads(r.read())["choices"][0]
        return {"text": choice["text"], "token_ids": choice.get("token_ids")}

    def at_once(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """`prompts` sent at once; the wall time from the first sent to the last answered, at the client."""
        answers: list[dict] = [{} for _ in prompts]

        def one(i: int) -> None:
            answers[i] = self.complete(prompts[i], max_tokens)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        if not all(answers):
            raise RuntimeError("a request to vllm serve failed (its log has the error)")
        tokens = sum(len(a["token_ids"] or []) or max_tokens for a in answers)
        return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                "texts": [a["text"] for a in answers], "token_ids": [a["token_ids"] for a in answers]}

    def close(self) -> None:
        stop_group(self.proc)


class Mode:
    """One mode's servers, up: `vllm serve` (and its draft server, for a star mode), and where its plug-in
    writes its counters."""

    def __init__(self, mode: str, args, pair: C.PairConfig, python: str, target: str, draft: str, log: str):
        from starsd.star.launch import start_server

        self.name = mode
        self.star = None
        self.stats = None
        self.server: VllmServe | None = None
        speculative = proposer = None
        if mode.startswith("star"):
            with open(log, "a") as err:
                # cores of its own: it pre-drafts while vLLM verifies (by default it waits for a co-hosted target)
                self.star = start_server(pair, C.ServerConfig(predraft_cohosted=bool(args.draft_cores)),
                                         prefix=taskset(args.draft_cores), stderr=err)
            self.stats = os.path.join(tempfile.mkdtemp(prefix="starsd-vllm-serve-"), "proposer.json")
            told = {} if mode == "star" else {"cohosted": "no"} if args.draft_cores else {"cohosted_drafts": True}
            proposer = C.ProposerSettings(connect=self.star.address, stats_file=self.stats, **told)
            speculative = PLUGIN
        elif mode.startswith("vllm-draft-"):
            speculative = {"method": "draft_model", "model": draft, "num_speculative_tokens": int(mode.split("-")[-1])}
        env = engine_env(python, proposer, kv_cache_gib=args.kv_cache_gib,
                         extra=dict(kv.split("=", 1) for kv in args.engine_env))
        try:
            self.server = VllmServe(python, target, C.resolve_dtype(pair.dtype, "cpu"), speculative, env,
                                    args.vllm_cores, log, ("--no-async-scheduling",) if mode == "alone-sync" else ())
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.star is not None:
            self.star.close()
        if self.stats and os.path.exists(self.stats):
            os.unlink(self.stats)


def run(modes: list[str], args, pair: C.PairConfig, python: str, target: str, draft: str,
        prompts: list[list[int]], counts: list[int], log: str, order: int) -> dict:
    """One run: every mode's servers started (one mode at a time with `--one-at-a-time`, else all of them, in
    turn), then each request set sent `--repeats` times, a pass to each mode in turn (`order` 1 reverses the
    modes, and each repeat reverses them again), so that every mode meets the host's drifts alike."""
    modes = modes if order % 2 == 0 else modes[::-1]
    groups = [[m] for m in modes] if args.one_at_a_time else [modes]
    results = {}
    for group in groups:
        up: list[Mode] = []
        try:
            for mode in group:
                room(up, mode)
                up.append(Mode(mode, args, pair, python, target, draft, log))
                up[-1].server.at_once(prompts[:1], 4)  # warm-up: the first request's compile and allocation
            results.update(passes(up, prompts, counts, args.max_tokens, args.repeats))
            for mode in up:
                if mode.stats:
                    results[mode.name]["plugin"] = counters(mode.stats)
        finally:
            for mode in up:
                mode.close()
    return results


def room(up: list[Mode], mode: str) -> None:
    """Refuses to start `mode` beside the modes `up` where the host lacks the memory the largest of them
    has held: the kernel would kill a worker halfway through the run."""
    if not up:
        return
    need = max(group_peak(m.server.proc.pid) for m in up)
    free = available()
    if free < need * 1.1:
        raise SystemExit(f"bench vllm-serve: {free / 2**30:.1f} GiB free, and {mode} would need about "
                         f"{need / 2**30:.1f} GiB beside the {len(up)} mode(s) up: use --one-at-a-time, fewer modes "
                         "or a smaller --kv-cache-gib")


def passes(up: list[Mode], prompts: list[list[int]], counts: list[int], max_tokens: int, repeats: int) -> dict:
    """Each request set sent `repeats` times to every mode, a pass to each in turn (the order reversed each
    repeat): per mode and set, the median pass and the plug-in's counters over that set."""
    results: dict = {mode.name: {"mode": mode.name, "sets": {}} for mode in up}
    for n in counts:
        before = {mode.name: counters(mode.stats) for mode in up}
        done: dict[str, list[dict]] = {mode.name: [] for mode in up}
        for r in range(max(1, repeats)):
            for mode in (up if r % 2 == 0 else up[::-1]):
                done[mode.name].append(mode.server.at_once(prompts[:n], max_tokens))
        for mode in up:
            got = results[mode.name]["sets"][str(n)] = median(done[mode.name])
            after = counters(mode.stats)
            if after:  # the plug-in's counters over this set alone
                got["plugin"] = {k: v - before[mode.name].get(k, 0) for k, v in after.items()
                                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return results


def median(passes: list[dict]) -> dict:
    """The median pass's figures, every pass's tokens/s, and whether every pass gave the same tokens."""
    middle = sorted(passes, key=lambda p: p["tokens_per_s"])[len(passes) // 2]
    return {**middle, "passes_tokens_per_s": [p["tokens_per_s"] for p in passes],
            "passes_equal": all(p["token_ids"] == passes[0]["token_ids"] for p in passes)}


def counters(stats: str | None) -> dict:
    """The plug-in's counters so far (ProposerSettings.stats_file; empty before its first call)."""
    try:
        return json.loads(Path(stats).read_text()) if stats else {}
    except (OSError, ValueError):
        return {}


def main(args) -> int:
    from starsd.models import pinned
    from starsd.models.loading import load_tokenizer

    pair = C.from_args(C.PairConfig, args)
    python = vllm_python(args.vllm_python)
    target = str(pinned.model_dir(pair.target, pair.cache)) if pair.target in pinned.PINNED else pair.target
    draft = str(pinned.model_dir(pair.draft, pair.cache)) if pair.draft in pinned.PINNED else pair.draft
    counts = [int(n) for n in args.requests.split(",")]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES and not re.fullmatch(r"vllm-draft-[1-9][0-9]*", m)]
    if unknown:
        raise SystemExit(f"bench vllm-serve: no mode {', '.join(unknown)} (modes: {', '.join(MODES)}, vllm-draft-K)")
    tokenizer = load_tokenizer(pair.target, pair.cache)
    prompts = [p.encode(tokenizer) for p in load_prompts(args.prompts)[args.offset:args.offset + max(counts)]]
    base = os.path.splitext(args.json_out)[0]
    log = f"{base}.log"
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for r in range(args.runs):
        results = run(modes, args, pair, python, target, draft, prompts, counts, log, r)
        for mode in modes:
            speeds = ", ".join(f"{n}: {s['tokens_per_s']:.2f}" for n, s in results[mode]["sets"].items())
            print(f"run {r + 1}, {mode}: tokens/s {speeds}", flush=True)
        runs.append({mode: results[mode] for mode in modes})
    out = {"benchmark": "vllm-serve", "cpu": cpu_kind(), "dtype": C.resolve_dtype(pair.dtype, "cpu"),
           "vllm_cores": args.vllm_cores or "all", "draft_cores": args.draft_cores or "all",
           "what_is_real": "every part: vllm serve, a real draft server, requests over HTTP",
           "runs": runs, "figures": figures(runs, modes, counts)}
    write_json(args.json_out, out)
    plot(f"{base}.png", out["figures"], out)
    ref = reference(modes)
    rows = [[f"{mode}, {n} at once", f"{f['tokens_per_s']}", f"{f[f'vs_{ref}']}", f.get("equal"),
             f.get("drafted_tokens"), f.get("accepted_tokens")]
            for mode, by_n in out["figures"].items() for n, f in by_n.items()]
    summary("bench vllm-serve", ["mode", "tokens/s per run", f"vs {ref} per run", f"texts equal {ref}'s",
                                 "drafted", "accepted"], rows,
            {"cpu": out["cpu"], "dtype": out["dtype"], "cores": f"vLLM {out['vllm_cores']}, draft server "
             f"{out['draft_cores']}"}, {"json": args.json_out, "plot": f"{base}.png"})
    return 0


def reference(modes: list[str]) -> str:
    """The mode every other is compared with: alone where it runs, else the first."""
    return "alone" if "alone" in modes else modes[0]


def figures(runs: list[dict], modes: list[str], counts: list[int]) -> dict:
    """Per mode and request count: tokens/s in each run, its ratio to the reference mode's in the same
    run (`vs_alone`, or `vs_` the first mode where alone did not run), and whether its texts equal the
    reference's."""
    ref = reference(modes)
    out: dict = {}
    for mode in modes:
        for n in map(str, counts):
            speeds = [run[mode]["sets"][n]["tokens_per_s"] for run in runs]
            f = {"tokens_per_s": [round(s, 2) for s in speeds]}
            f[f"vs_{ref}"] = [round(run[mode]["sets"][n]["tokens_per_s"] / run[ref]["sets"][n]["tokens_per_s"], 3)
                              for run in runs]
            f["equal"] = all(run[mode]["sets"][n]["token_ids"] == run[ref]["sets"][n]["token_ids"]
                             and run[mode]["sets"][n].get("passes_equal", True) for run in runs)
            plugin = [run[mode]["sets"][n].get("plugin") for run in runs]
            if all(plugin):
                f["drafted_tokens"] = [p["proposed"] for p in plugin]
                f["accepted_tokens"] = [p["accepted"] for p in plugin]
            out.setdefault(mode, {})[n] = f
    return out


def plot(path: str, figures: dict, out: dict) -> None:
    panels = []
    for n in next(iter(figures.values())):
        labels = [f"{mode} r{r + 1}" for mode in figures for r in range(len(figures[mode][n]["tokens_per_s"]))]
        values = [v for mode in figures for v in figures[mode][n]["tokens_per_s"]]
        panels.append({"labels": labels, "values": values, "ylabel": "tokens / s (client)",
                       "title": f"vllm serve, {n} request(s) at once, {out['dtype']}, {out['cpu']}"})
    bar_panels(path, panels)
