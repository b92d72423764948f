"""The latency the gateway adds: one target server asked directly, and the same one through it.

One `starsd serve --targets 1` runs as a person runs it; this process asks its target server each
way, turn about in every round, so that drift hits all alike: `direct` (serve/pool.py's Pool, the
gateway's own client of the target-server protocol, no HTTP), `httpx` (HTTP to the gateway on one
kept-alive connection) and `openai` (the official client, streamed requests only). Every request
asks for no drafts (`"speculate": false`), so each path does one target pass a step; greedy.
Terms (ms; p50 and p90 over every request of the rounds):
- whole: a one-token request (max_tokens=1), from its send until its reply is in;
- TTFT: a streamed request of --max-tokens tokens, to its first SSE chunk (directly: first Output);
- step gap: between two Outputs (one target step); chunk gap: between two SSE chunks (a step and
  its relay); health: GET /health kept alive, which touches no target;
- overhead: a gateway path's median less the direct one's; ratio: the same as a quotient; paired:
  the median difference over requests sent one after the other.
Goals: a whole request's overhead (httpx) at most OVERHEAD_GOAL_MS; the chunk gap within GAP_GOAL
of the step gap. Method and figures: docs/serving.md#the-gateways-latency.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx2 as httpx
import openai

from starsd import config as C
from starsd.bench.metrics import percentile
from starsd.errors import SettingError
from starsd.results import Steps, bar_panels, summary, write_json
from starsd.serve.pool import Pool
from starsd.star import protocol as P
from starsd.star.processes import free_port, read_json_line, spawn

OVERHEAD_GOAL_MS = 5.0
GAP_GOAL = 0.05  # |chunk gap / step gap - 1| at most
PROMPT = "def fibonacci(n):\n    "


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=20, help="rounds measured (Paths.round: whole requests, "
                   "streams and GET /health, direct and through the gateway turn about)")
    p.add_argument("--warmup", type=int, default=2, help="rounds first run and not counted")
    p.add_argument("--whole", type=int, default=5, help="whole requests per path in a round, turn about, and as "
                   "many GET /health (they are short: more of them cost little and steady their medians)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens of the streamed request")
    p.add_argument("--prompt", default=PROMPT, help="the prompt of every request")
    p.add_argument("--json-out", default="results/gateway.json")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.DraftConfig, prefix="draft-")


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


# ------------------------------------------------------------------------------------- the paths
# Each returns the arrival times (ms from the send) of a request's Outputs or SSE chunks.

async def direct(pool: Pool, prompt: str, max_tokens: int) -> list[float]:
    """One Generate on the pool's target, as the gateway sends it."""
    request = P.Generate(pool.new_id(), prompt, None, max_tokens, C.SamplingConfig(), ignore_eos=True,
                         speculate=False)
    t0 = time.perf_counter()
    link, _ = await pool.acquire()
    return [ms_since(t0) async for _ in pool.stream(link, request)]


def body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "speculate": False}


def whole_httpx(client: httpx.Client, model: str, prompt: str) -> list[float]:
    t0 = time.perf_counter()
    client.post("/v1/completions", json=body(model, prompt, 1)).raise_for_status()
    return [ms_since(t0)]


def stream_httpx(client: httpx.Client, model: str, prompt: str, max_tokens: int) -> list[float]:
    t0 = time.perf_counter()
    arrivals = []
    with client.stream("POST", "/v1/completions", json={**body(model, prompt, max_tokens), "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(ms_since(t0))
                if line.startswith('data: {"error"'):
                    raise RuntimeError(f"the gateway failed the stream: {line[6:]}")
    return arrivals


def stream_openai(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> list[float]:
    t0 = time.perf_counter()
    extra = {k: v for k, v in body(model, prompt, max_tokens).items() if k in ("ignore_eos", "speculate")}
    return [ms_since(t0) for _ in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                            temperature=0, stream=True, extra_body=extra)]


def health(client: httpx.Client) -> list[float]:
    t0 = time.perf_counter()
    client.get("/health").raise_for_status()
    return [ms_since(t0)]


# ------------------------------------------------------------------------------------- a run

class Paths:
    """The open clients of one run: the Pool (on an asyncio loop of its own, run for each direct
    request), the httpx Client and the openai client (on an httpx Client of its own), each kept
    alive across requests. `ports`: the local port of each response of each HTTP client (one port,
    one connection); `fresh`: the measured requests that went on a new connection (0 expected)."""

    def __init__(self, url: str, target: str):
        self.url = url
        self.runner = asyncio.Runner()
        self.pool = Pool([target], max_queue=1, step_timeout_s=300.0)
        self.runner.run(self.pool.start(60.0))
        self.model = self.pool.models[0]
        self.ports: dict[str, list] = {"httpx": [], "openai": []}
        self.fresh = {"httpx": 0, "openai": 0}
        self.http = httpx.Client(base_url=url, timeout=300, event_hooks={"response": [self._seen("httpx")]})
        self.openai_http = openai.DefaultHttpxClient(event_hooks={"response": [self._seen("openai")]})
        self.openai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300,
                                    http_client=self.openai_http)

    def _seen(self, client: str):
        def seen(response: httpx.Response) -> None:
            stream = response.extensions.get("network_stream")
            self.ports[client].append(stream.get_extra_info("client_addr") if stream else None)
        return seen

    def round(self, prompt: str, max_tokens: int, whole: int) -> dict[str, list[float]]:
        """`whole` whole requests each way, turn about; a stream on each path; `whole` GET /health. By
        `what/path`: whole and health, each request's time; stream, the arrival times of its chunks."""
        model = self.model
        r = {"whole/direct": [], "whole/httpx": []}
        for _ in range(whole):
            r["whole/direct"] += self.runner.run(direct(self.pool, prompt, 1))[-1:]
            r["whole/httpx"] += self.kept("httpx", lambda: whole_httpx(self.http, model, prompt))
        r["stream/direct"] = self.runner.run(direct(self.pool, prompt, max_tokens))
        r["stream/httpx"] = self.kept("httpx", lambda: stream_httpx(self.http, model, prompt, max_tokens))
        r["stream/openai"] = self.kept("openai", lambda: stream_openai(self.openai, model, prompt, max_tokens))
        r["health/httpx"] = [x for _ in range(whole) for x in self.kept("httpx", lambda: health(self.http))]
        return r

    def kept(self, client: str, request: Callable[[], list[float]]) -> list[float]:
        """`request()` right after an untimed GET /health on the same client, so that it goes on a
        connection just used, however long the requests between (uvicorn closes one idle for 5 s)."""
        http = self.http if client == "httpx" else self.openai_http
        http.get(self.url + "/health").raise_for_status()
        times = request()
        ports = self.ports[client]
        self.fresh[client] += ports[-1] != ports[-2]
        return times

    def connections(self) -> dict:
        """Connections each HTTP client opened, and measured requests that went on a new one."""
        return {"opened": {c: len(set(ports)) for c, ports in self.ports.items()}, "fresh": self.fresh}

    def close(self) -> None:
        self.http.close()
        self.openai.close()
        self.runner.run(self._close_pool())
        self.runner.close()

    async def _close_pool(self) -> None:
        """Inside its loop, as the gateway closes its own."""
        self.pool.close()


def start_star(args, log) -> tuple[subprocess.Popen, str, str]:
    """`starsd serve --targets 1` on a free port, ready: (process, its URL, its target server's address)."""
    port = free_port()
    proc = spawn(["serve", "--targets", "1", "--port", str(port), *C.to_flags(C.from_args(C.PairConfig, args)),
                  *C.to_flags(C.from_args(C.DraftConfig, args, prefix="draft-"), prefix="draft-")], stderr=log)
    try:
        ready = read_json_line(proc, "ready", 900)
    except BaseException:
        proc.kill()
        raise
    return proc, ready["ready"], ready["targets"][0]


def measure(args, url: str, target: str, steps: Steps) -> tuple[list[dict], dict]:
    """--warmup rounds, then --rounds rounds kept (Paths.round); and the HTTP clients' connections
    (Paths.connections)."""
    paths = Paths(url, target)
    kept = []
    try:
        for i in range(args.warmup + args.rounds):
            steps.begin(f"round {i + 1 - args.warmup}" if i >= args.warmup else f"warm-up {i + 1}")
            r = paths.round(args.prompt, args.max_tokens, args.whole)
            if i >= args.warmup:
                kept.append(r)
            steps.end()
    finally:
        paths.close()
    return kept, paths.connections()


# ------------------------------------------------------------------------------------- figures

def spread(xs: list[float]) -> dict:
    return {"p50_ms": statistics.median(xs), "p90_ms": percentile(xs, 90), "n": len(xs)}


def compare(samples: dict[str, list[float]], paired: bool = False) -> dict:
    """Each path's spread, and each gateway path's median against the direct one's (overhead_ms,
    ratio). `paired`: the i-th samples of the paths were sent one after the other; then also the
    median of their differences (paired_overhead_ms), which slow drift does not reach."""
    out = {path: spread(xs) for path, xs in samples.items()}
    base = out["direct"]["p50_ms"]
    for path, xs in samples.items():
        if path != "direct":
            out[path]["overhead_ms"] = out[path]["p50_ms"] - base
            out[path]["ratio"] = out[path]["p50_ms"] / base
            if paired:
                out[path]["paired_overhead_ms"] = statistics.median(x - d for x, d in zip(xs, samples["direct"]))
    return out


def by_path(rounds: list[dict], what: str) -> dict[str, list]:
    """The rounds' entries for `what` (whole, stream, health) by path, in the order sent."""
    return {key.split("/")[1]: [r[key] for r in rounds] for key in rounds[0] if key.startswith(what + "/")}


def figures(rounds: list[dict]) -> dict:
    """whole, ttft, gap (the step gap directly, the chunk gap through the gateway) and health, from
    the rounds (Paths.round); with the chunks (Outputs directly) per stream."""
    whole = {p: [x for r in xs for x in r] for p, xs in by_path(rounds, "whole").items()}
    streams = by_path(rounds, "stream")
    return {"whole": compare(whole, paired=True),
            "ttft": compare({p: [s[0] for s in xs] for p, xs in streams.items()}, paired=True),
            "gap": compare({p: [b - a for s in xs for a, b in zip(s, s[1:])] for p, xs in streams.items()}),
            "health": spread([x for r in by_path(rounds, "health")["httpx"] for x in r]),
            "chunks_per_stream": {p: statistics.median(len(s) for s in xs) for p, xs in streams.items()}}


def goals(f: dict) -> dict:
    return {"overhead_ms_at_most": OVERHEAD_GOAL_MS, "gap_ratio_within": GAP_GOAL,
            "overhead_met": f["whole"]["httpx"]["overhead_ms"] <= OVERHEAD_GOAL_MS,
            "gap_met": all(abs(f["gap"][p]["ratio"] - 1) <= GAP_GOAL for p in f["gap"] if p != "direct")}


# ------------------------------------------------------------------------------------- output

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def report(f: dict, met: dict, connections: dict, args, png: Path, log_path: Path) -> None:
    rows = []
    for what, label in (("whole", "whole request (1 token)"), ("ttft", "TTFT"), ("gap", "gap per chunk / step")):
        for path, s in f[what].items():
            vs = "" if path == "direct" else f"{s['overhead_ms']:+.2f} ms, x{s['ratio']:.3f}"
            if "paired_overhead_ms" in s:
                vs += f" (paired {s['paired_overhead_ms']:+.2f})"
            rows.append([label, path, f"{s['p50_ms']:.2f}", f"{s['p90_ms']:.2f}", vs])
        rows.append(None)
    rows.append(["GET /health", "httpx", f"{f['health']['p50_ms']:.2f}", f"{f['health']['p90_ms']:.2f}", ""])
    summary(f"bench gateway: {args.rounds} rounds of {args.whole} whole requests each way and a {args.max_tokens}-"
            f"token stream each way, no drafts, {cpu_model()} "
            "(ms; vs: the median against the direct path's)", ["measure", "path", "p50", "p90", "vs direct"], rows,
            facts={f"goal, whole request overhead <= {OVERHEAD_GOAL_MS:g} ms": verdict(met["overhead_met"]),
                   f"goal, chunk gap within {GAP_GOAL:.0%} of the step gap": verdict(met["gap_met"]),
                   "chunks per stream (direct: Outputs)": listing(f["chunks_per_stream"]),
                   "measured requests on a new connection": listing(connections["fresh"])},
            files={"JSON": args.json_out, "plot": png, "log of the star": log_path})


def verdict(met: bool) -> str:
    return "met" if met else "missed"


def listing(counts: dict) -> str:
    return ", ".join(f"{name} {n:g}" for name, n in counts.items())


def plot(png: Path, f: dict) -> None:
    """What the gateway adds (each gateway path's median less the direct one's, and /health), then the
    medians of each measure, a bar per path."""
    def panel(spreads: dict, title: str) -> dict:
        return {"labels": list(spreads), "values": [round(s["p50_ms"], 2) for s in spreads.values()],
                "ylabel": "ms (median)", "title": title}

    added = {f"{what} {path}": s["overhead_ms"] for what in ("whole", "ttft", "gap")
             for path, s in f[what].items() if path != "direct"}
    added["GET /health"] = f["health"]["p50_ms"]
    bar_panels(png, [{"labels": list(added), "values": [round(v, 2) for v in added.values()], "ylabel": "ms",
                      "title": f"added by the gateway (median less direct; goal <= {OVERHEAD_GOAL_MS:g} ms)"},
                     panel(f["whole"], "whole request, max_tokens=1"), panel(f["ttft"], "time to first token"),
                     panel(f["gap"], "gap per step (direct) / chunk (gateway)")])


def main(args) -> int:
    if args.rounds < 1 or args.warmup < 0 or args.whole < 1 or args.max_tokens < 2:
        raise SettingError("--rounds and --whole must be >= 1, --warmup >= 0 and --max-tokens >= 2 (a gap needs "
                           "two chunks)")
    png = Path(args.json_out).with_suffix(".png")
    log_path = Path(args.json_out).with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log, Steps("bench gateway", args.warmup + args.rounds) as steps:
        steps.say("starting the star (1 target)")
        proc, url, target = start_star(args, log)
        try:
            rounds, connections = measure(args, url, target, steps)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    f = figures(rounds)
    met = goals(f)
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    write_json(args.json_out, {"benchmark": "gateway", "settings": settings, "cpu": cpu_model(), "figures": f,
                               "connections": connections, "goals": met, "rounds": rounds})
    plot(png, f)
    report(f, met, connections, args, png, log_path)
    return 0
