"""`starsd demo` (what `make demo` runs): a local star behind its OpenAI-compatible endpoint,
queried with the official `openai` client.

It starts `starsd serve` (a draft server, N target servers, the gateway), streams one chat answer
to the screen as the target accepts it, then sends a few requests at once, one per target, and
the same requests again decoded without drafts (the `speculate: false` extension: the same star,
the same processes, target-only decoding), each way twice (with, without, without, with), and
prints per request and for the system: tokens/s against target-only, the speculation (drafts,
mean acceptance length), whether the text is the same, and the draft server's utilisation, from
the gateway's /metrics. Writes JSON and a plot, and stops everything.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from pathlib import Path

import httpx2 as httpx
import openai
from rich import box
from rich.console import Console
from rich.table import Table

from starsd.prompts import humaneval
from starsd.results import bar_plot, write_json
from starsd.star.processes import free_port, read_json_line, spawn

CHAT = "Write a Python function that checks whether a string is a palindrome. Be brief."


def scrape(url: str) -> dict[str, float]:
    """The gateway's /metrics as {series: value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {name: float(v) for name, v in re.findall(r"^([^#\s][^ ]*) (\S+)$", text, re.M)}


def run(serve_args: list[str], targets: int, max_tokens: int, json_out: str) -> int:
    console = Console()
    port = free_port()
    log_path = Path(json_out).with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log, console.status(f"starting the star: a draft server, {targets} target servers "
                                                    "and the gateway (loading the models takes a minute)"):
        proc = spawn(["serve", "--targets", str(targets), "--port", str(port), *serve_args], stderr=log)
        try:
            ready = read_json_line(proc, "ready", 900)
        except BaseException:
            proc.kill()
            console.print(f"the star did not start; its log: {log_path}\n{log_path.read_text()[-3000:]}")
            raise
    url = f"http://127.0.0.1:{port}"
    console.print(f"[bold]serving[/bold] {url}/v1 (draft server {ready['draft_server']}, {targets} targets; "
                  f"their log: {log_path})")
    try:
        return _queries(console, url, targets, max_tokens, json_out)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        console.print("star stopped" if code == 0 else f"the star exited with {code}; see {log_path}")


def _queries(console: Console, url: str, targets: int, max_tokens: int, json_out: str) -> int:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    model = client.models.list().data[0].id
    console.print(f"\n[bold]1. one streamed chat request[/bold] (model {model}, temperature 0.7, seed 1)")
    console.print(f"> {CHAT}")
    t0 = time.perf_counter()
    first = None
    usage = None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT}],
                                                max_tokens=max_tokens, temperature=0.7, seed=1, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            console.print(chunk.choices[0].delta.content, end="", highlight=False, markup=False)
        if chunk.usage:
            usage = chunk
    streamed = {"tokens": usage.usage.completion_tokens, "seconds": time.perf_counter() - t0, "ttft_s": first,
                **usage.model_extra["spec_decode"]}
    console.print(f"\n[dim]{streamed['tokens']} tokens in {streamed['seconds']:.1f} s, first text after "
                  f"{first:.1f} s[/dim]")

    prompts = humaneval()[:targets]
    console.print(f"\n[bold]2. {len(prompts)} completions at once[/bold] (HumanEval prompts, greedy), one per target, "
                  "with StarSD, then the same requests decoded without drafts (`\"speculate\": false`)")
    # untimed, a few tokens of each first: a target's first long prompt pays for its engine's buffers
    # and the first touch of its weights (a second slower here), which neither timed pass should carry
    _at_once(client, model, prompts, 4, speculate=False)
    # each way twice, in the order with, without, without, with: the first timed pass still ran a few
    # percent slower than the later ones here (7.6 against 8.0 tokens/s, no step drafted in either),
    # and with one pass each way it always fell on the same side
    passes = []
    for speculate in (True, False, False, True):
        before = scrape(url)
        rows, system = _at_once(client, model, prompts, max_tokens, speculate=speculate)
        busy = (scrape(url).get("starsd:draft_server_busy_seconds_total", 0)
                - before.get("starsd:draft_server_busy_seconds_total", 0))
        passes.append((speculate, rows, {**system, "busy_seconds": busy}))
    rows, system = _both(p for p in passes if p[0])
    alone_rows, alone = _both(p for p in passes if not p[0])
    system["draft_server_utilization"] = system.pop("busy_seconds") / system["seconds"]
    for r, a in zip(rows, alone_rows):
        r["target_only_tokens_per_s"] = a["tokens_per_s"]
        r["same_text_as_target_only"] = r["text"] == a["text"]
    system["target_only_tokens_per_s"] = alone["tokens_per_s"]
    _print_summary(console, rows, system)
    write_json(json_out, {"model": model, "streamed_chat": streamed, "requests": rows, "system": system})
    bar_plot(Path(json_out).with_suffix(".png"), ["target-only", "StarSD"],
             [system["target_only_tokens_per_s"], system["tokens_per_s"]], ylabel="tokens / s",
             title=f"{len(rows)} requests at once on {len(rows)} targets: system throughput")
    return 0


def _at_once(client, model: str, prompts, max_tokens: int, speculate: bool) -> tuple[list[dict], dict]:
    """The prompts sent together, one request each; per request and system figures."""
    def complete(prompt):
        start = time.perf_counter()
        r = client.completions.create(model=model, prompt=prompt.text, max_tokens=max_tokens, temperature=0,
                                      extra_body={"speculate": speculate})
        return prompt.id, r, time.perf_counter() - start

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(complete, prompts))
    wall = time.perf_counter() - t0
    rows = [{"request": pid, "tokens": r.usage.completion_tokens, "seconds": s,
             "tokens_per_s": r.usage.completion_tokens / s, "text": r.choices[0].text, **r.model_extra["spec_decode"]}
            for pid, r, s in answers]
    tokens = sum(r["tokens"] for r in rows)
    return rows, {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


def _both(passes) -> tuple[list[dict], dict]:
    """Two passes of the same requests as one: per request and for the system, tokens/s over both
    (tokens and seconds summed), the drafted and all steps of both; the tokens and the text of the
    first (a greedy request's are the same in both)."""
    (_, rows, system), (_, rows2, system2) = passes
    merged = []
    for r, r2 in zip(rows, rows2):
        m = {**r, "seconds": r["seconds"] + r2["seconds"], "drafts": r["drafts"] + r2["drafts"],
             "target_steps": r["target_steps"] + r2["target_steps"]}
        m["tokens_per_s"] = (r["tokens"] + r2["tokens"]) / m["seconds"]
        accepted = r["drafts"] * r["mean_acceptance_length"] + r2["drafts"] * r2["mean_acceptance_length"]
        m["mean_acceptance_length"] = accepted / m["drafts"] if m["drafts"] else 0.0
        merged.append(m)
    seconds = system["seconds"] + system2["seconds"]
    return merged, {"tokens": system["tokens"], "seconds": seconds, "busy_seconds": system["busy_seconds"] +
                    system2["busy_seconds"], "tokens_per_s": (system["tokens"] + system2["tokens"]) / seconds}


def _print_summary(console: Console, rows: list[dict], system: dict) -> None:
    # fits 80 columns, as a console that is not a terminal (a pipe, a CI log) is: no header cut to "target…"
    table = Table(title="requests served at once, each way twice", box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False,
                  caption="alone: the same requests decoded without drafts", caption_justify="left")
    for col in ("request", "tokens", "StarSD\ntok/s", "alone\ntok/s", "speed-\nup", "drafted\nsteps",
                "accept.\nlength", "same\ntext"):
        table.add_column(col, justify="right" if col != "request" else "left", no_wrap=True)
    for r in rows:
        table.add_row(r["request"], str(r["tokens"]), f"{r['tokens_per_s']:.2f}", f"{r['target_only_tokens_per_s']:.2f}",
                      f"{r['tokens_per_s'] / r['target_only_tokens_per_s']:.2f}x", f"{r['drafts']} of {r['target_steps']}",
                      f"{r['mean_acceptance_length']:.2f}", "yes" if r["same_text_as_target_only"] else "no")
    table.add_row("system", str(system["tokens"]), f"{system['tokens_per_s']:.2f}",
                  f"{system['target_only_tokens_per_s']:.2f}",
                  f"{system['tokens_per_s'] / system['target_only_tokens_per_s']:.2f}x", "", "", "", style="bold")
    console.print(table)
    console.print(f"draft server busy {system['draft_server_utilization']:.0%} of the time. A target drafts a step "
                  "only when its own measurements say the draft pays (docs/scheduler.md). Greedy output is the "
                  "target's own: the same text with and without drafts (bit-exact for a float32 transformers "
                  "target; llama.cpp and bfloat16 round a pass of several tokens differently from one token at "
                  "a time, so a near-tie may go the other way).")
    cores = len(os.sched_getaffinity(0))
    why = (f"The draft server and the targets share this host's {cores} cores, so each draft's compute is taken "
           "from a target's, and a CPU target verifies several tokens at several times the cost of one "
           "(docs/benchmarks.md#a-llamacpp-target). The star pays where the draft server has a host of its own.")
    if not any(r["drafts"] for r in rows):
        console.print("[bold]The targets decoded alone here.[/bold] Each measured at start what it costs to verify "
                      f"a draft, and by those figures no draft pays on this host. {why}")
    elif system["tokens_per_s"] < system["target_only_tokens_per_s"]:
        console.print(f"[bold]Slower than decoding alone here.[/bold] {why}")
    for r in rows:
        console.print(f"\n[bold]{r['request']}[/bold]:")
        console.print(r["text"], highlight=False, markup=False)
