"""Several streams per target server against one at a time, as a person serving meets it: `starsd
serve` with one llama.cpp target server (decoding alone: on one host a draft server would take the
target's cores), sent the same S requests at once, served one at a time (`--target-streams 1`: the
others wait in the gateway's queue) and together (`--target-streams S`: one batched pass a step).

Each mode, in an order rotated per round, starts its own `starsd serve`, warms it with one request,
then sends the S requests (greedy, `ignore_eos`: each decodes max_tokens) and times them from the
first sent to the last answered. The bound beside the result comes from the engine's own cost of
one pass of S streams' single tokens, measured in this process on the same cores (the target then
has them alone): S tokens per such pass. Each request's text is compared with the prompt's greedy
answer decoded alone in this process, one token a pass; a text that differs is audited token by
token (spec_decode/audit.py: the batched and single-stream kernels round differently, so every divergence
must be at a near-tie within the allowance measured on those tokens).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import signal
import statistics
import threading
import time
from pathlib import Path

import httpx2 as httpx

from starsd import config as C
from starsd.prompts import load as load_prompts
from starsd.results import Steps, bar_panels, cpu_kind, summary, write_json
from starsd.star.processes import free_port, read_json_line, spawn


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=4, help="S: requests sent at once, and the target's streams")
    p.add_argument("--prompts", default="chat", help="prompt set: humaneval or chat")
    p.add_argument("--offset", type=int, default=8, help="first prompt of the set")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each request decodes")
    p.add_argument("--rounds", type=int, default=2, help="times each mode serves the S requests")
    p.add_argument("--json-out", default="results/streams.json", help="results as JSON here, the plot beside it")
    C.add_flags(p, C.PairConfig, skip=C.DRAFT_SIDE)
    p.set_defaults(target_engine="llamacpp", threads=0)


def pass_costs(target, streams: int, widths: tuple[int, ...] = (1, 2, 4), context: int = 64,
               rounds: int = 9) -> dict[str, float]:
    """ms of one pass of s streams x k tokens each ("s x k"), for s up to `streams`: each slot's
    stream asks at once (a barrier), so the engine gathers them into one llama_decode; the median
    of `rounds` after one untimed pass."""
    from starsd.spec_decode.tree import DraftTree
    from starsd.spec_decode.verify import Verdict

    ids = [(100 + i) % target.width for i in range(context)]
    costs: dict[str, float] = {}
    for s in range(1, streams + 1):
        seqs = [target.slots[i].start(ids) for i in range(s)]
        for k in widths:
            times = []
            for r in range(rounds + 1):
                barrier = threading.Barrier(s + 1)

                def one(i: int) -> None:
                    barrier.wait()
                    target.slots[i].score(seqs[i], DraftTree.chain(ids[:k - 1]))
                    target.slots[i].commit(seqs[i], Verdict([], [ids[r]]))

                threads = [threading.Thread(target=one, args=(i,)) for i in range(s)]
                for t in threads:
                    t.start()
                barrier.wait()
                t0 = time.perf_counter()
                for t in threads:
                    t.join()
                if r:
                    times.append((time.perf_counter() - t0) * 1e3)
            costs[f"{s} x {k}"] = round(statistics.median(times), 1)
        for i in range(s):
            target.slots[i].end()
    return costs


def serve_round(pair: C.PairConfig, streams: int, prompts: list[str], max_tokens: int, log) -> dict:
    """One `starsd serve` of one target server with `streams` slots; the prompts sent at once."""
    port = free_port()
    pair = dataclasses.replace(pair, target_streams=streams)
    proc = spawn(["serve", "--targets", "1", "--no-spec", "--port", str(port), "--max-queue", str(len(prompts)),
                  "--served-model-name", "bench", *C.to_flags(pair)], stderr=log)
    try:
        read_json_line(proc, "ready", 900)
        url = f"http://127.0.0.1:{port}/v1/completions"

        def ask(prompt: str) -> dict:
            body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(url, json=body, timeout=900)
            reply.raise_for_status()
            return {"text": reply.json()["choices"][0]["text"], "tokens": reply.json()["usage"]["completion_tokens"],
                    "end": time.perf_counter()}

        ask(prompts[0])  # warm: the engine's first touch of its buffers
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, prompts))
        wall = max(a["end"] for a in answers) - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    tokens = sum(a["tokens"] for a in answers)
    return {"streams": streams, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "texts": [a["text"] for a in answers]}


def main(args) -> int:
    from starsd.models.llamacpp import LlamaCppTarget, gguf_file
    from starsd.models.loading import load_tokenizer
    from starsd.spec_decode.audit import audit, following, in_words
    from starsd.spec_decode.decode import target_only
    from starsd.star.launch import check_models

    if not 2 <= args.streams <= C.MAX_STREAMS:
        raise C.SettingError(f"--streams must be 2 to {C.MAX_STREAMS}, not {args.streams}")
    pair = C.from_args(C.PairConfig, args)
    if pair.engine != "llamacpp":
        raise C.SettingError("bench streams measures the llama.cpp engine's batched passes (--target-engine llamacpp)")
    check_models(pair)
    prompts = [p.text for p in load_prompts(args.prompts)[args.offset:args.offset + args.streams]]
    if len(prompts) < args.streams:
        raise C.SettingError(f"the {args.prompts} set has fewer than {args.offset + args.streams} prompts")
    log_path = Path(args.json_out).with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    modes = {"one at a time": 1, "together": args.streams}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with open(log_path, "w") as log, Steps("bench streams", 1 + args.rounds * len(modes)) as steps:
        steps.begin("the engine's batched pass costs")
        target = LlamaCppTarget(gguf_file(pair.target, pair.cache), pair.target_context, pair.threads, args.streams)
        costs = pass_costs(target, args.streams)
        target.close()
        steps.end(f"pass costs (ms): {costs}")
        for r in range(args.rounds):
            order = list(modes) if r % 2 == 0 else list(modes)[::-1]
            for mode in order:
                steps.begin(f"{mode}, round {r + 1}")
                run = serve_round(pair, modes[mode], prompts, args.max_tokens, log)
                runs[mode].append(run)
                steps.end(f"{mode}, round {r + 1}: {run['tokens_per_s']:.2f} tok/s")
    rate = {m: sum(r["tokens"] for r in rs) / sum(r["wall_s"] for r in rs) for m, rs in runs.items()}
    bound = args.streams / costs[f"{args.streams} x 1"] * 1e3
    tokenizer = load_tokenizer(pair.target, pair.cache)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)  # as the server decodes

    alone = LlamaCppTarget(gguf_file(pair.target, pair.cache), pair.target_context, pair.threads)
    greedy = C.SamplingConfig(temperature=0.0)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    reference = [decode(target_only(alone, x, args.max_tokens, greedy).token_ids) for x in ids]
    divergences = []
    for mode, rs in runs.items():
        for r, run in enumerate(rs):
            for i, text in enumerate(run["texts"]):
                if text != reference[i]:
                    found = audit(alone, ids[i], [], modes[mode], args.max_tokens, choose=following(text, decode))
                    divergences.append({"mode": f"{mode}, round {r + 1}", "prompt": i, "ok": found["ok"],
                                        "allowance": found["allowance"], "parts": found["divergences"]})
    alone.close()
    equal = {m: sum(t == reference[i] for run in rs for i, t in enumerate(run["texts"])) / (len(rs) * len(prompts))
             for m, rs in runs.items()}
    result = {"benchmark": "streams", "target": pair.target, "engine": pair.engine, "streams": args.streams,
              "prompts": args.prompts, "offset": args.offset, "max_tokens": args.max_tokens, "cpu_flags": cpu_kind(),
              "threads": pair.threads, "pass_ms": costs, "bound_tokens_per_s": bound,
              "modes": {m: {"tokens_per_s": rate[m], "equal_share": equal[m], "runs": runs[m]} for m in modes},
              "together_vs_one_at_a_time": rate["together"] / rate["one at a time"],
              "together_vs_bound": rate["together"] / bound, "divergences": divergences}
    write_json(args.json_out, result)
    png = str(args.json_out).rsplit(".", 1)[0] + ".png"
    bar_panels(png, [{"labels": [*modes, "bound"], "values": [round(rate[m], 2) for m in modes] + [round(bound, 2)],
                      "ylabel": "tokens / s",
                      "title": f"one llama.cpp target server, {args.streams} requests at once"}])
    summary(f"bench streams: {args.streams} {args.prompts} requests at once, {args.max_tokens} tokens each, greedy, "
            f"{cpu_kind()}; system tokens/s from the first request sent to the last answered",
            ["mode", "tokens/s", "vs one at a time", "vs bound", "text equal to decoding alone"],
            [[m, f"{rate[m]:.2f}", f"{rate[m] / rate['one at a time']:.2f}x", f"{rate[m] / bound:.0%}",
              f"{equal[m]:.0%}"] for m in modes],
            facts={"engine pass costs (ms), streams x tokens": ", ".join(f"{k}: {v}" for k, v in costs.items()),
                   "bound": f"{bound:.2f} tok/s ({args.streams} tokens per pass of {costs[f'{args.streams} x 1']} ms)",
                   "divergences": "; ".join(in_words(d) for d in divergences) or "none"},
            files={"JSON": args.json_out, "plot": png, "log of the stars": log_path})
    return 0 if all(d["ok"] for d in divergences) else 1

