"""Sessions: one draft server holding many sessions in a bounded draft KV budget, and new streams
that share a prefix (docs/scaling.md#a-draft-service-for-a-fleet).

Three parts, each against a real `starsd draft-server` process over ZeroMQ:
  churn   the tiny pair (random weights, built here; fp32), a budget of --churn-room sessions at 64
          tokens each (what the server's default bound counts a session at). --churn-live targets
          decode at once, each a prompt through a session of its own and then another, pausing
          --churn-step-s after each step, until --churn-total sessions were opened, over
          --churn-duration-s at least. Every output is compared with the target's own
          decoding; the hellos refused, the evictions and restorations, the draft KV the server
          counts (about once a second) and its RSS are recorded: above what it held before the first
          session (what a batch's passes take comes in too), and after a tenth of the sessions
          (what grows once the working set is there).
  prefix  the pinned pair: --prefix-sessions streams, one after another, whose prompts share
          --prefix-tokens tokens and end in tokens of their own, each one's first draft timed at the
          client; then the first stream, 16 steps on, comes back as a new session with its whole
          sequence (a vLLM request preempted and resumed) after its own session has ended.
  held    the pinned pair: --held sessions opened and drafted once each, all held at once, at the
          server's default budget: evictions, draft KV held and RSS.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import threading
import time
from pathlib import Path

from starsd import config as C
from starsd.bench.rss import Watch, read_status
from starsd.errors import SettingError
from starsd.prompts import load as load_prompts
from starsd.results import bar_panels, write_json
from starsd.star.client import DraftClient, DraftServerError, query_stats
from starsd.star.launch import start_server

PARTS = ("churn", "prefix", "held")
CHAIN = C.DraftConfig(depth=4, min_path_prob=0.0, adaptive=False)  # every step asks a draft
GREEDY = C.SamplingConfig()
SESSION_COLUMNS = 64  # star/sessions.py: the default bound counts a session at this many tokens


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS))
    p.add_argument("--churn-total", type=int, default=1000, help="sessions opened in all")
    p.add_argument("--churn-live", type=int, default=50, help="targets decoding at once")
    p.add_argument("--churn-duration-s", type=float, default=600.0, help="the sessions' openings are spread "
                   "over this long at least (session i opens no sooner than i / total of it)")
    p.add_argument("--churn-step-s", type=float, default=0.6, help="each target's pause after a step, as a real "
                   "target's verify pass (its session idle on the server meanwhile)")
    p.add_argument("--churn-room", type=int, default=100, help="the draft KV budget, in sessions of 64 tokens")
    p.add_argument("--churn-tokens", type=int, default=48, help="tokens each churn target generates")
    p.add_argument("--prefix-sessions", type=int, default=16)
    p.add_argument("--prefix-tokens", type=int, default=1000, help="tokens the prefix streams share")
    p.add_argument("--held", type=int, default=256, help="sessions held at once")
    p.add_argument("--sample-s", type=float, default=0.5, help="seconds between reads of the server's RSS")
    p.add_argument("--json-out", default="results/sessions.json")
    C.add_flags(p, C.PairConfig)


# --------------------------------------------------------------------------------------- churn
def churn(args) -> dict:
    """Many short sessions through a small budget, on the tiny pair: refusals, losses, memory."""
    from starsd.models.kv import KV
    from starsd.models.loading import logits_width, vocab_fingerprint
    from starsd.models.pair import Pair
    from starsd.models.tiny import save_pair
    from starsd.spec_decode.decode import collect, speculative_steps, target_only
    from starsd.star.remote_drafter import RemoteDrafter

    root = Path(tempfile.mkdtemp(prefix="starsd-sessions-"))
    target_dir, draft_dir = save_pair(root)
    draft = Pair.load(C.ModelConfig(draft_dir, dtype="float32"), None)  # read for its shapes and tokenizer
    column = KV.bytes_per_column(draft.target.model)
    budget = args.churn_room * SESSION_COLUMNS * column
    fingerprint = vocab_fingerprint(draft.tokenizer, logits_width(draft.target.model))
    prompts = [draft.tokenizer(p.text[:160])["input_ids"] for p in load_prompts("humaneval")]
    reference = {}  # prompt index -> the target's own greedy tokens
    pair = C.PairConfig(target=target_dir, draft=draft_dir, dtype="float32", threads=1, draft_quantize="none")
    star = start_server(pair, C.ServerConfig(kv_budget_gib=budget / (1 << 30)))
    watch = Watch(star.servers[0].pid, args.sample_s)
    before = read_status(star.servers[0].pid)["VmRSS"]
    lock = threading.Lock()
    tally = {"opened": 0, "refused_hellos": 0, "outputs_differ": 0, "tokens": 0, "drafted_steps": 0, "steps": 0,
             "accepted": 0, "failures": []}

    def target_loop() -> None:
        target = Pair.load(C.ModelConfig(target_dir, dtype="float32"), None).target
        while True:
            with lock:
                if tally["opened"] >= args.churn_total:
                    return
                i = tally["opened"]
                tally["opened"] += 1
            time.sleep(max(0.0, t0 + i * args.churn_duration_s / args.churn_total - time.monotonic()))
            k = i % len(prompts)
            client = DraftClient(star.address, fingerprint, f"churn-{i}", timeout_s=30)
            try:
                client.hello()
            except DraftServerError as e:
                with lock:
                    tally["refused_hellos"] += 1
                    tally["failures"].append(f"hello {i}: {e}")
            try:
                steps = speculative_steps(target, RemoteDrafter(client), prompts[k], args.churn_tokens, CHAIN, GREEDY)
                gen = collect(paced(steps, args.churn_step_s))
            finally:
                client.close()
            with lock:
                if k not in reference:
                    reference[k] = target_only(target, prompts[k], args.churn_tokens, GREEDY).token_ids
                tally["outputs_differ"] += gen.token_ids != reference[k]
                tally["tokens"] += len(gen.token_ids)
                tally["steps"] += len(gen.depths)
                tally["drafted_steps"] += sum(d > 0 for d in gen.depths)
                tally["accepted"] += sum(gen.accepted)

    held = []  # (opened so far, the draft KV the server counted) about once a second
    warm = {}  # the server's RSS once a tenth of the sessions were opened: its working set is there

    def monitor() -> None:
        while any(t.is_alive() for t in threads):
            stats = query_stats(star.address, timeout_s=5) or {}
            held.append((tally["opened"], stats.get("kv_bytes", 0), stats.get("sessions_open", 0)))
            if not warm and tally["opened"] >= args.churn_total // 10:
                warm.update(at=time.monotonic(), rss=read_status(star.servers[0].pid)["VmRSS"])
            time.sleep(1.0)

    t0 = time.monotonic()
    try:
        threads = [threading.Thread(target=target_loop, daemon=True) for _ in range(args.churn_live)]
        for t in threads:
            t.start()
        watcher = threading.Thread(target=monitor, daemon=True)
        watcher.start()
        for t in threads:
            t.join()
        watcher.join()
        wall = time.monotonic() - t0
        stats = query_stats(star.address) or {}
    finally:
        watch.stop()
        star.close()
    peak = max(s[1] for s in watch.samples)
    late = [s[1] for s in watch.samples if s[0] >= warm.get("at", 0.0)]
    return {**{k: v for k, v in tally.items() if k != "failures"}, "failures": tally["failures"][:20],
            "wall_s": wall, "budget_bytes": budget, "column_bytes": column,
            "rss_before_bytes": before, "rss_peak_bytes": peak, "rss_growth_bytes": peak - before,
            "rss_warm_bytes": warm.get("rss"), "rss_growth_after_warm_bytes": max(late) - warm["rss"] if warm else None,
            "kv_bytes_max": max((b for _, b, _ in held), default=0), "kv_bytes_samples": held,
            "sessions_open_mean": statistics.fmean(n for *_, n in held) if held else 0.0,
            "server": {k: stats.get(k) for k in ("sessions_opened", "sessions_freed", "sessions_evicted",
                                                 "sessions_restored", "kv_bytes", "kv_budget_bytes", "errors",
                                                 "requests", "replies", "prefix")},
            "live": args.churn_live, "total": args.churn_total, "room": args.churn_room,
            "tokens_per_target": args.churn_tokens}


def paced(steps, pause_s: float):
    """The steps of a stream, each followed by a pause (a target's verify pass, emulated)."""
    for step in steps:
        yield step
        time.sleep(pause_s)


# ------------------------------------------------------------------------------- the real pair
def fingerprint_of(pair: C.PairConfig) -> tuple[str, object]:
    """The pinned draft's vocabulary fingerprint, and its tokenizer, without loading its weights."""
    from transformers import AutoConfig, AutoTokenizer

    from starsd.models.loading import resolve, vocab_fingerprint

    path = resolve(pair.draft_model().path, pair.cache)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return vocab_fingerprint(tokenizer, AutoConfig.from_pretrained(path).vocab_size), tokenizer


def first_draft(address: str, fingerprint: str, name: str, tokens: list[int]) -> tuple[DraftClient, dict]:
    """A new session's first draft of `tokens`, timed at the client: its client (still open) and times."""
    client = DraftClient(address, fingerprint, name, timeout_s=600, heartbeat_s=2.0, dead_after_s=30.0)
    client.hello()
    t0 = time.perf_counter()
    reply, tensors = client.draft(tokens, 8, CHAIN, GREEDY)
    wall = (time.perf_counter() - t0) * 1e3
    return client, {"tokens": len(tokens), "wall_ms": wall, "service_ms": reply.service_ms,
                    "queue_ms": reply.queue_ms, "drafted": tensors[0].tolist()}


def prefix(args, pair: C.PairConfig) -> dict:
    """Streams sharing a long prefix, one after another, then a stream back with its whole sequence."""
    fingerprint, tokenizer = fingerprint_of(pair)
    humaneval = load_prompts("humaneval")
    shared: list[int] = []
    for p in humaneval:  # a file's worth of context: HumanEval's prompts one after another
        shared += tokenizer(p.text)["input_ids"]
        if len(shared) >= args.prefix_tokens:
            break
    shared = shared[:args.prefix_tokens]
    own = [tokenizer(p.text)["input_ids"][:24] for p in humaneval[-args.prefix_sessions:]]
    star = start_server(pair)
    try:
        streams = []
        for i, tail in enumerate(own):
            client, timing = first_draft(star.address, fingerprint, f"prefix-{i}", shared + tail)
            streams.append(timing)
            if i:
                client.close()
            else:
                first = client
        sequence = shared + own[0]
        for j in range(16):  # the first stream goes on, a token a step
            first.draft([100 + j], 8)
            sequence.append(100 + j)
        first.close()
        time.sleep(1.0)  # its Bye handled: its state retired
        client, back = first_draft(star.address, fingerprint, "prefix-back", sequence)
        client.close()
        stats = query_stats(star.address) or {}
    finally:
        star.close()
    later = [s["wall_ms"] / streams[0]["wall_ms"] for s in streams[1:]]
    return {"streams": streams, "back": back, "prefix_tokens": len(shared), "later_vs_first": later,
            "later_vs_first_max": max(later), "back_vs_first": back["wall_ms"] / streams[0]["wall_ms"],
            "server": {k: stats.get(k) for k in ("prefix", "sessions_evicted", "errors", "kv_bytes")}}


def held(args, pair: C.PairConfig) -> dict:
    """--held sessions, each drafted once, all held at once at the default budget."""
    fingerprint, tokenizer = fingerprint_of(pair)
    prompts = [tokenizer(p.text)["input_ids"] for p in load_prompts("humaneval")]
    star = start_server(pair)
    pid = star.servers[0].pid
    before = read_status(pid)["VmRSS"]
    clients, times = [], []
    try:
        for i in range(args.held):
            client, timing = first_draft(star.address, fingerprint, f"held-{i}",
                                         prompts[i % len(prompts)] + tokenizer(f"# request {i}\n")["input_ids"])
            clients.append(client)
            times.append(timing["wall_ms"])
        time.sleep(1.5)  # the server counts its draft KV about once a second
        stats = query_stats(star.address) or {}
        after = read_status(pid)
        for client in clients:  # each still held: it drafts on
            client.draft([11], 8)
        stats_end = query_stats(star.address) or {}
    finally:
        for client in clients:
            client.close()
        star.close()
    return {"sessions": args.held, "sessions_open": stats.get("sessions_open"),
            "sessions_evicted": stats_end.get("sessions_evicted"), "errors": stats_end.get("errors"),
            "kv_bytes": stats.get("kv_bytes"), "kv_budget_bytes": stats.get("kv_budget_bytes"),
            "rss_before_bytes": before, "rss_after_bytes": after.get("VmRSS"), "prefix": stats.get("prefix"),
            "first_draft_ms_median": statistics.median(times)}


# -------------------------------------------------------------------------------------- report
def main(args) -> int:
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SettingError(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    pair = C.from_args(C.PairConfig, args)
    result = {"benchmark": "sessions", "pair": dataclasses.asdict(pair)}
    if "churn" in parts:
        result["churn"] = c = churn(args)
        print(f"churn: {c['opened']} sessions, {c['live']} at once, budget {c['budget_bytes'] >> 10} KiB: "
              f"{c['refused_hellos']} hellos refused, {c['outputs_differ']} outputs differ, "
              f"{c['server']['sessions_evicted']} evictions, RSS +{c['rss_growth_bytes'] >> 10} KiB, "
              f"{c['wall_s']:.0f} s", flush=True)
    if "prefix" in parts:
        result["prefix"] = p = prefix(args, pair)
        print(f"prefix: first {p['streams'][0]['wall_ms']:.0f} ms; later ones at most "
              f"{p['later_vs_first_max']:.2f}x of it; back {p['back_vs_first']:.2f}x", flush=True)
    if "held" in parts:
        result["held"] = h = held(args, pair)
        print(f"held: {h['sessions_open']} sessions, {h['sessions_evicted']} evicted, draft KV "
              f"{(h['kv_bytes'] or 0) / (1 << 30):.2f} of {(h['kv_budget_bytes'] or 0) / (1 << 30):.0f} GiB", flush=True)
    write_json(args.json_out, result)
    panels = []
    if "prefix" in result:
        panels.append({"labels": [f"{i}" for i in range(len(result["prefix"]["streams"]))] + ["back"],
                       "values": [round(s["wall_ms"]) for s in result["prefix"]["streams"]] +
                                 [round(result["prefix"]["back"]["wall_ms"])],
                       "ylabel": "first draft (ms, at the client)",
                       "title": f"{result['prefix']['prefix_tokens']} shared tokens: each stream's first draft"})
    if "churn" in result:
        c = result["churn"]
        panels.append({"labels": ["budget", "KV held (end)", "RSS growth"],
                       "values": [round(c["budget_bytes"] / 1024), round((c["server"]["kv_bytes"] or 0) / 1024),
                                  round(c["rss_growth_bytes"] / 1024)],
                       "ylabel": "KiB", "title": f"churn: {c['opened']} sessions, {c['live']} at once"})
    if panels:
        bar_panels(str(args.json_out).rsplit(".", 1)[0] + ".png", panels)
    return 0
