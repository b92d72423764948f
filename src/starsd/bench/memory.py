"""Memory: what one target instance costs when it holds its own draft model (co-located) and when it
drafts on a shared draft server, and how many instances fit a memory budget either way.

Real processes, one set at a time, each decoding the same prompt:
  target only   `starsd generate --no-spec`: the target alone, for reference;
  co-located    `starsd generate`: target and draft in one process (models/pair.py);
  remote draft  `starsd target --connect ADDR`: the target alone, drafting on a `starsd draft-server`.

Figures per process, read from /proc/PID/status while it runs (sampled every --sample-s):
  peak RSS      VmHWM, the kernel's high-water mark of the process's resident memory. It includes
                transient load-time peaks: an int8 draft is loaded in float32 before its linear
                layers are quantised.
  decode RSS    the largest VmRSS sampled in the last second before the process printed its
                result: what stays resident while it decodes.
The draft server's figures are read once its target has finished, just before it is stopped.

Instances that fit a budget B (`fit`): co-located, floor(B / pair); remote draft, one draft server
plus floor((B - server) / target) targets.
"""

from __future__ import annotations

import argparse
import json
import dataclasses
import math
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from starsd import config as C
from starsd.bench.rss import Watch, read_status
from starsd.prompts import load as load_prompts
from starsd.results import bar_plot, write_json
from starsd.star.launch import start_server, target_command
from starsd.star.processes import spawn

GIB = 1 << 30
MODES = ("target_only", "colocated", "remote_target")  # the target-side processes, in the order they run


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=None, help="the prompt decoded (default: HumanEval/0)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--budget-gib", type=float, default=24.0, help="memory budget for the instances-that-fit figures")
    p.add_argument("--sample-s", type=float, default=0.1, help="seconds between reads of /proc/PID/status")
    p.add_argument("--json-out", default="results/memory.json")
    p.add_argument("--plot-out", default=None, help="PNG path (default: the JSON path with .png)")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.DraftConfig, prefix="draft-")
    p.set_defaults(threads=2, target_engine="transformers")  # the figures in docs/ were measured so


# ------------------------------------------------------------------------------------ arithmetic
@dataclass(frozen=True)
class Fit:
    """Target instances that fit one memory budget."""

    colocated: int  # processes holding a target and its own draft
    remote: int  # target processes beside the one draft server they share


def fit(budget: int, colocated: int, remote_target: int, draft_server: int) -> Fit:
    """How many target instances fit `budget` bytes, given each process's resident bytes."""
    if min(colocated, remote_target, draft_server) <= 0:
        raise ValueError(f"resident sizes must be > 0, not {colocated}, {remote_target}, {draft_server}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, not {budget}")
    return Fit(colocated=budget // colocated, remote=max(0, budget - draft_server) // remote_target)


def safetensors_params(path: Path) -> dict[str, int]:
    """Parameters and their bytes as stored in a model's *.safetensors files, read from the headers
    alone (an untied LM head is a tensor of its own and counts)."""
    params = 0
    stored = 0
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, t in header.items():
            if name != "__metadata__":
                params += math.prod(t["shape"])
                stored += t["data_offsets"][1] - t["data_offsets"][0]
    return {"params": params, "checkpoint_bytes": stored}


# ----------------------------------------------------------------------------------- processes
def measure(argv: list[str], sample_s: float) -> dict:
    """Run `starsd ARGV` (it prints one JSON result line) to its end, watching its memory."""
    proc = spawn(argv)
    proc.stdin.close()
    watch = Watch(proc.pid, sample_s)
    t0 = time.monotonic()
    result = None
    printed = t0
    try:
        for line in proc.stdout:
            if line.startswith("{") and result is None:
                printed = time.monotonic()
                result = json.loads(line)
        proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        watch.stop()
    if proc.returncode != 0 or result is None:
        raise RuntimeError(f"starsd {argv[0]} failed with exit code {proc.returncode} (result line: {result is not None})")
    return {"peak_rss_bytes": watch.peak, "decode_rss_bytes": watch.resident_before(printed),
            "wall_s": time.monotonic() - t0, "tokens": len(result["token_ids"]),
            "tokens_per_s": result["tokens_per_s"], "samples": len(watch.samples)}


def run_modes(pair: C.PairConfig, draft: C.DraftConfig, prompt: str, max_new_tokens: int,
              sample_s: float) -> dict[str, dict]:
    """The three target-side processes, one after another, and the draft server of the third."""
    decode = ["--prompt", prompt, "--max-new-tokens", str(max_new_tokens), "--json", *C.to_flags(draft, prefix="draft-")]
    generate = ["generate", *decode, *C.to_flags(pair)]
    out = {}
    print("target only ...", flush=True)
    out["target_only"] = measure([*generate, "--no-spec"], sample_s)
    print("co-located target + draft ...", flush=True)
    out["colocated"] = measure(generate, sample_s)
    print("draft server + remote-draft target ...", flush=True)
    star = start_server(pair)
    try:
        out["remote_target"] = measure([*target_command(pair), "--connect", star.address, "--name", "memory", *decode],
                                       sample_s)
        server = read_status(star.server.pid)
    finally:
        star.close()
    out["draft_server"] = {"peak_rss_bytes": server["VmHWM"], "decode_rss_bytes": server["VmRSS"]}
    return out


def model_sizes(pair: C.PairConfig) -> dict[str, dict | None]:
    """Parameter counts and checkpoint bytes of both models, where they are local safetensors."""
    from starsd.models.loading import resolve

    out = {}
    for role, cfg in (("target", pair.target_model()), ("draft", pair.draft_model())):
        path = Path(resolve(cfg.path, pair.cache))
        sizes = safetensors_params(path) if path.is_dir() else {}
        out[role] = {**sizes, "dtype": cfg.dtype, "quantize": cfg.quantize} if sizes else None
    return out


# ------------------------------------------------------------------------------------- report
LABELS = {"target_only": "target only (no draft)", "colocated": "co-located (target + draft)",
          "remote_target": "target, remote draft", "draft_server": "draft server (1 session)"}
BARS = {"target_only": "target only", "colocated": "co-located\ntarget + draft", "remote_target": "target,\nremote draft",
        "draft_server": "draft server\n(1 session)"}


def summary(procs: dict[str, dict], fits: dict[str, Fit], budget_gib: float, title: str) -> str:
    lines = [title, f"{'process':30s} {'peak RSS':>10s} {'decode RSS':>11s}"]
    for key, label in LABELS.items():
        p = procs[key]
        lines.append(f"{label:30s} {p['peak_rss_bytes'] / GIB:6.2f} GiB {p['decode_rss_bytes'] / GIB:7.2f} GiB")
    lines.append(f"\ntarget instances in {budget_gib:g} GiB {'from peak':>13s} {'from decode':>12s}")
    lines.append(f"{'co-located pairs':30s} {fits['peak'].colocated:>10d} {fits['decode'].colocated:>11d}")
    lines.append(f"{'targets + 1 draft server':30s} {fits['peak'].remote:>10d} {fits['decode'].remote:>11d}")
    return "\n".join(lines)


def main(args) -> int:
    pair = C.from_args(C.PairConfig, args)
    draft = C.from_args(C.DraftConfig, args, prefix="draft-")
    first = load_prompts("humaneval", 1)[0]
    prompt = args.prompt if args.prompt is not None else first.text
    t0 = time.monotonic()
    procs = run_modes(pair, draft, prompt, args.max_new_tokens, args.sample_s)
    budget = int(args.budget_gib * GIB)
    fits = {which: fit(budget, procs["colocated"][key], procs["remote_target"][key], procs["draft_server"][key])
            for which, key in (("peak", "peak_rss_bytes"), ("decode", "decode_rss_bytes"))}
    target, drafter = pair.target_model(), pair.draft_model()
    title = (f"memory: target {target.path} ({target.dtype}), draft {drafter.path} ({drafter.dtype}, "
             f"quantize {drafter.quantize}); {args.max_new_tokens} new tokens, {pair.threads} threads")
    print(summary(procs, fits, args.budget_gib, title))
    result = {
        "benchmark": "memory", "pair": {**dataclasses.asdict(pair), "target_dtype": target.dtype, "draft_dtype": drafter.dtype,
                                        "draft_quantize_resolved": drafter.quantize},
        "draft_config": dataclasses.asdict(draft), "prompt_id": "cli" if args.prompt is not None else first.id,
        "max_new_tokens": args.max_new_tokens, "budget_gib": args.budget_gib, "sample_s": args.sample_s,
        "processes": procs, "fits_from_peak": dataclasses.asdict(fits["peak"]),
        "fits_from_decode": dataclasses.asdict(fits["decode"]),
        "models": model_sizes(pair), "wall_s": time.monotonic() - t0,
    }
    write_json(args.json_out, result)
    bar_plot(args.plot_out or str(args.json_out).rsplit(".", 1)[0] + ".png", list(BARS.values()),
             [procs[k]["peak_rss_bytes"] / GIB for k in BARS], ylabel="peak RSS (GiB)",
             title=f"Peak RSS per process ({target.dtype} target, {drafter.quantize} draft)\n{args.budget_gib:g} GiB holds "
                   f"{fits['peak'].colocated} pairs or {fits['peak'].remote} remote-draft targets "
                   f"({fits['decode'].colocated} or {fits['decode'].remote} from decode RSS)")
    return 0
