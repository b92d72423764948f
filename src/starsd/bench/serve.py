"""Load on the served star: M concurrent streaming clients against `starsd serve`, for targets that
decode alone and for speculative ones, side by side in one run.

Each mode starts its own `starsd serve` (same targets, same flags but --no-spec), then for each M
runs M clients (the official openai client, one thread each) that send streamed completions of
prompts from the set, back to back, for --duration-s; requests still running at the end finish and
count. Per (mode, M): requests/s, output tokens/s, time to first token and inter-token latency
(time between streamed chunks, a chunk being one target step) at p50 and p99, and time per
output token after the first (TPOT).
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from pathlib import Path

import openai
from starsd import config as C
from starsd.bench.metrics import percentile
from starsd.prompts import load as load_prompts
from starsd.results import Steps, panel_plot, summary, write_json
from starsd.star.processes import free_port, read_json_line, spawn

MODES = {"target-only": ["--no-spec"], "speculative": []}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", type=int, default=1, help="target servers behind the gateway (on 2 cores, one "
                   "target and the draft server already share the machine)")
    p.add_argument("--clients", default="1,2", help="concurrent streaming clients M, comma-separated")
    p.add_argument("--duration-s", type=float, default=60.0, help="seconds each M sends requests for")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request at most")
    p.add_argument("--prompts", default="humaneval")
    p.add_argument("--limit", type=int, default=16, help="prompts the clients cycle through")
    p.add_argument("--json-out", default="results/serve.json")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.DraftConfig, prefix="draft-")
    p.set_defaults(threads=1, target_engine="transformers")  # the target and the draft server share the cores


def one_request(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    chunks = []
    tokens = 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].text:
            chunks.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    first = chunks[0] if chunks else end
    return {"start": start, "end": end, "ttft": first - start, "tokens": tokens,
            "itl": [b - a for a, b in zip(chunks, chunks[1:])],
            "tpot": (end - first) / (tokens - 1) if tokens > 1 else 0.0}


def load_point(url: str, model: str, prompts: list[str], m: int, duration_s: float, max_tokens: int) -> dict:
    """M clients sending back to back for duration_s; the figures of every request they made."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    done: list[dict] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def run(k: int) -> None:
        i = k
        while time.perf_counter() - t0 < duration_s:
            r = one_request(client, model, prompts[i % len(prompts)], max_tokens)
            with lock:
                done.append(r)
            i += m

    threads = [threading.Thread(target=run, args=(k,)) for k in range(m)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["end"] for r in done) - t0
    tokens = sum(r["tokens"] for r in done)
    itl = [x for r in done for x in r["itl"]]
    return {"clients": m, "requests": len(done), "wall_s": wall, "requests_per_s": len(done) / wall,
            "output_tokens_per_s": tokens / wall, "tokens": tokens,
            "ttft_p50_s": percentile([r["ttft"] for r in done], 50), "ttft_p99_s": percentile([r["ttft"] for r in done], 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "tpot_p50_s": percentile([r["tpot"] for r in done], 50)}


def run_mode(steps: Steps, mode: str, args, prompts: list[str], clients: list[int], log) -> list[dict]:
    port = free_port()
    serve = ["serve", "--targets", str(args.targets), "--port", str(port), "--served-model-name", "bench",
             *MODES[mode], *C.to_flags(C.from_args(C.PairConfig, args)),
             *C.to_flags(C.from_args(C.DraftConfig, args, prefix="draft-"), prefix="draft-")]
    steps.say(f"{mode}: starting the star ({args.targets} targets)")
    proc = spawn(serve, stderr=log)
    try:
        read_json_line(proc, "ready", 900)
    except BaseException:
        proc.kill()
        raise
    points = []
    try:
        for m in clients:
            steps.begin(f"{mode}, M={m}")
            point = {"mode": mode, **load_point(f"http://127.0.0.1:{port}", "bench", prompts, m, args.duration_s,
                                                args.max_tokens)}
            points.append(point)
            steps.end(f"{mode}, M={m}: {point['output_tokens_per_s']:.2f} tok/s, {point['requests']} requests, "
                      f"TTFT p50 {point['ttft_p50_s']:.2f} s")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return points


def main(args) -> int:
    clients = [int(x) for x in args.clients.split(",")]
    prompts = [p.text for p in load_prompts(args.prompts, args.limit)]
    log_path = Path(args.json_out).with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    points = []
    with open(log_path, "w") as log, Steps("bench serve", len(MODES) * len(clients), args.duration_s) as steps:
        for mode in MODES:
            points += run_mode(steps, mode, args, prompts, clients, log)
    summary(f"bench serve: {args.targets} target servers, {args.max_tokens} tokens per request (latencies in s)",
            ["mode", "M", "req/s", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50"],
            [[p["mode"], p["clients"], f"{p['requests_per_s']:.3f}", f"{p['output_tokens_per_s']:.2f}",
              *(f"{p[k]:.2f}" for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "tpot_p50_s"))]
             for p in points],
            files={"JSON": args.json_out, "plot": Path(args.json_out).with_suffix(".png"), "log of the stars": log_path})
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    write_json(args.json_out, {"benchmark": "serve", "settings": settings, "points": points})
    series = [{"label": mode, "x": [p["clients"] for p in points if p["mode"] == mode],
               "y": [p[key] for p in points if p["mode"] == mode], "marker": "o"}
              for mode in MODES for key in ("output_tokens_per_s",)]
    ttft = [{"label": mode, "x": [p["clients"] for p in points if p["mode"] == mode],
             "y": [p["ttft_p50_s"] for p in points if p["mode"] == mode], "marker": "o"} for mode in MODES]
    panel_plot(Path(args.json_out).with_suffix(".png"), [
        {"series": series, "xlabel": "concurrent clients M", "ylabel": "output tokens / s", "title": "throughput"},
        {"series": ttft, "xlabel": "concurrent clients M", "ylabel": "s", "title": "time to first token, p50"}])
    return 0
