"""Distributed vs co-located: one target drafting through a draft-server process over loopback,
against the same target drafting with an in-process draft model, side by side in one run.

The target model is one instance in this process; per prompt the order of the two modes rotates.
The protocol overhead of an iteration is what the target waits beyond the server's own queue and
service time: serialisation on both sides, the transport and the server's IO-thread hop. The
serialisation share is measured separately by encoding and decoding the same messages in-process.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import zmq

from starsd import config as C
from starsd.bench.harness import serialisation_ms
from starsd.models.loading import vocab_fingerprint
from starsd.models.pair import Pair
from starsd.prompts import load as load_prompts
from starsd.results import Steps, bar_plot, summary, write_json
from starsd.spec_decode.decode import speculative
from starsd.star.client import DraftClient
from starsd.star.remote_drafter import RemoteDrafter, Timing
from starsd.star.launch import start_server


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default="humaneval", help="prompt set: humaneval or chat")
    p.add_argument("--limit", type=int, default=8, help="number of prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt at most")
    p.add_argument("--json-out", default="results/distributed.json", help="results as JSON here")
    p.add_argument("--plot-out", default=None, help="PNG path (default: the JSON path with .png)")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.DraftConfig, prefix="draft-")
    p.set_defaults(threads=2, target_engine="transformers")  # the figures in docs/ were measured so


def zmq_echo_ms(rounds: int = 2000) -> float:
    """Round trip of a small two-frame message over loopback, DEALER <-> ROUTER echo: the floor."""
    ctx = zmq.Context.instance()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")

    def echo():
        for _ in range(rounds + 1):
            router.send_multipart(router.recv_multipart())

    t = threading.Thread(target=echo)
    t.start()
    payload = [b"h" * 40, b"t" * 40]
    dealer.send_multipart(payload)
    dealer.recv_multipart()
    t0 = time.perf_counter()
    for _ in range(rounds):
        dealer.send_multipart(payload)
        dealer.recv_multipart()
    elapsed = time.perf_counter() - t0
    t.join()
    router.close(0)
    dealer.close(0)
    return elapsed / rounds * 1e3


def main(args) -> int:
    cfg = C.from_args(C.PairConfig, args)
    draft = C.from_args(C.DraftConfig, args, prefix="draft-")
    greedy = C.SamplingConfig()
    star = start_server(cfg)
    try:
        pair = Pair.load(cfg.target_model(), cfg.draft_model(), cfg.cache, cfg.threads)
        client = DraftClient(star.address, vocab_fingerprint(pair.tokenizer, pair.target.width), "bench")
        client.hello()
        remote = RemoteDrafter(client)
        rows = []
        prompts = load_prompts(args.prompts, args.limit)
        with Steps("bench distributed", 2 * len(prompts)) as steps:
            steps.say("warm-up")
            warm = prompts[0].encode(pair.tokenizer)  # first passes allocate and pick kernels: not measured
            for drafter in (pair.drafter, remote):
                speculative(pair.target, drafter, warm, 16, draft, greedy, pair.eos_ids)
            remote.timing = Timing()
            for i, prompt in enumerate(prompts):
                ids = prompt.encode(pair.tokenizer)
                row = {"id": prompt.id}
                for mode in (["colocated", "distributed"] if i % 2 == 0 else ["distributed", "colocated"]):
                    steps.begin(f"{mode}, prompt {i + 1}/{len(prompts)} ({prompt.id})")
                    drafter = remote if mode == "distributed" else pair.drafter
                    gen = speculative(pair.target, drafter, ids, args.max_new_tokens, draft, greedy, pair.eos_ids)
                    row[mode] = {"tokens": len(gen.token_ids), "seconds": gen.seconds, "steps": gen.num_steps,
                                 "token_ids": gen.token_ids}
                    steps.end()
                rows.append(row)
                steps.line(f"[{i + 1}/{len(prompts)}] {prompt.id}: " + "  ".join(
                    f"{m} {row[m]['tokens'] / row[m]['seconds']:.2f} tok/s" for m in ("colocated", "distributed")))
        server_stats = client.stats()
        client.close()
    finally:
        star.close()
    rate = {m: sum(r[m]["tokens"] for r in rows) / sum(r[m]["seconds"] for r in rows) for m in ("colocated", "distributed")}
    t = remote.timing
    overhead = t.overheads()  # requests waited for from their asking (not a prompt's first, asked before its prefill)
    steps = sum(r["distributed"]["steps"] for r in rows)
    mean_new = sum(r["distributed"]["tokens"] for r in rows) / steps
    ser = serialisation_ms(draft.depth, round(mean_new))
    result = {
        "benchmark": "distributed", "target": args.target, "draft": args.draft, "dtype": cfg.target_model().dtype,
        "threads": args.threads, "num_prompts": len(rows), "max_new_tokens": args.max_new_tokens,
        "draft_config": {"depth": draft.depth, "top_k": draft.top_k, "min_path_prob": draft.min_path_prob},
        "colocated_tokens_per_s": rate["colocated"], "distributed_tokens_per_s": rate["distributed"],
        "throughput_ratio": rate["distributed"] / rate["colocated"],
        "overhead_ms_per_iteration": statistics.mean(overhead),
        "overhead_ms_p50": statistics.median(overhead),
        "overhead_ms_p99": sorted(overhead)[int(0.99 * (len(overhead) - 1))],
        "serialisation_ms_per_iteration": ser,
        "transport_ms_per_iteration": statistics.mean(overhead) - ser,
        "server_reply_hop_ms": server_stats["reply_hop_ms"],
        "zmq_loopback_echo_ms": zmq_echo_ms(),
        "draft_service_ms_per_iteration": statistics.mean(t.service),
        "draft_wall_ms_per_iteration": statistics.mean(t.wall),
        "iterations": len(t.wall),
        "overhead_iterations": len(overhead),
        "outputs_identical": sum(r["colocated"]["token_ids"] == r["distributed"]["token_ids"] for r in rows),
        "prompts": rows,
    }
    write_json(args.json_out, result)
    png = args.plot_out or str(args.json_out).rsplit(".", 1)[0] + ".png"
    bar_plot(png, ["co-located spec", "distributed spec (loopback)"], [rate["colocated"], rate["distributed"]],
             ylabel="tokens / s", title=f"One target: co-located vs draft server over loopback ({cfg.target_model().dtype})")
    r = result
    summary(f"bench distributed: one target, {len(rows)} prompts, {cfg.target_model().dtype}, threads={args.threads}",
            ["speculative decoding", "tokens/s", "vs co-located"],
            [["co-located draft", f"{rate['colocated']:.2f}", "1.00x"],
             ["draft server over loopback", f"{rate['distributed']:.2f}", f"{r['throughput_ratio']:.2f}x"]],
            {"overhead per iteration": f"{r['overhead_ms_per_iteration']:.2f} ms mean (p50 {r['overhead_ms_p50']:.2f}, "
                                       f"p99 {r['overhead_ms_p99']:.2f}) over the {r['overhead_iterations']} of {r['iterations']} "
                                       "iterations that waited for their draft from its asking",
             "overhead split": f"serialisation {r['serialisation_ms_per_iteration']:.3f} ms, transport "
                               f"{r['transport_ms_per_iteration']:.2f} ms (server reply hop "
                               f"{r['server_reply_hop_ms']:.2f} ms, ZeroMQ loopback echo "
                               f"{r['zmq_loopback_echo_ms']:.3f} ms)",
             "draft per iteration": f"{r['draft_service_ms_per_iteration']:.1f} ms service, "
                                    f"{r['draft_wall_ms_per_iteration']:.1f} ms wall",
             "outputs identical": f"{r['outputs_identical']} of {len(rows)} prompts"},
            {"JSON": args.json_out, "plot": png})
    return 0
