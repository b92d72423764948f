"""The `starsd` command. Flags for typed settings are generated from their dataclasses (config.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from starsd import config as C
from starsd import weights
from starsd.draft_client import DraftServerError
from starsd.models.loading import ModelLoadError


def add_dataclass_args(parser: argparse.ArgumentParser, cls, prefix: str = "", skip=()) -> None:
    """One flag per field of `cls`: --{prefix}{field-name}, typed, with its default and help."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        dest = (prefix + f.name).replace("-", "_")
        help_ = f"{f.metadata.get('help', '')} (default: {f.default})"
        if f.type in ("bool", bool):
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(flag, dest=dest, type=kind, default=f.default, help=help_,
                                choices=f.metadata.get("choices"))


def from_args(cls, args: argparse.Namespace, prefix: str = "", **overrides):
    values = {f.name: getattr(args, (prefix + f.name).replace("-", "_"))
              for f in dataclasses.fields(cls) if f.name not in overrides}
    return cls(**values, **overrides)


QUANTIZE_HELP = ("draft weights: int8 (dynamic int8 linear layers, ~3x faster draft passes on a CPU; lossless, "
                 "the target verifies every draft), none, or auto: int8 on a CPU, none elsewhere")


def draft_quantize(choice: str, device: str) -> str:
    if choice == "auto":
        return "int8" if device.startswith("cpu") else "none"
    return choice


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=weights.DEFAULT_TARGET, help="target model (pinned name, directory or hub id)")
    p.add_argument("--draft", default=weights.DEFAULT_DRAFT, help="draft model (pinned name, directory or hub id)")
    add_dataclass_args(p, C.ModelConfig, skip=("path", "quantize"))
    p.add_argument("--draft-quantize", default="auto", choices=("auto", "none", "int8"), help=QUANTIZE_HELP)
    p.add_argument("--cache-dir", default=None, help=f"model cache (default: ${weights.CACHE_ENV} or ~/.cache/starsd)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def model_configs(args) -> tuple[C.ModelConfig, C.ModelConfig]:
    """The target is always the model as given; only the draft may be quantised."""
    return (from_args(C.ModelConfig, args, path=args.target, quantize="none"),
            from_args(C.ModelConfig, args, path=args.draft, quantize=draft_quantize(args.draft_quantize, args.device)))


def cmd_models(args) -> int:
    if args.action == "list":
        for name, spec in weights.PINNED.items():
            state = "cached" if weights.is_cached(name, args.cache_dir) else "not fetched"
            print(f"{name:32s} {state:12s} {spec.description}")
        return 0
    names = args.names or list(weights.PINNED)
    for name in names:
        path = weights.fetch(name, args.cache_dir, log=lambda m: print(m, file=sys.stderr))
        print(f"{name}: {path}")
    return 0


def cmd_generate(args) -> int:
    from starsd.colocated import Pair
    from starsd.prompts import Prompt

    target_cfg, draft_cfg = model_configs(args)
    pair = Pair.load(target_cfg, None if args.no_spec else draft_cfg, args.cache_dir, args.threads)
    prompt = Prompt("cli", args.prompt, chat=args.chat)
    sampling = from_args(C.SamplingConfig, args)
    draft = from_args(C.DraftConfig, args, prefix="draft-")
    gen = pair.generate(prompt, args.max_new_tokens, sampling, None if args.no_spec else draft)
    text = pair.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({
            "prompt": args.prompt, "token_ids": gen.token_ids, "text": text, "num_steps": gen.num_steps,
            "mean_accepted": gen.mean_accepted, "seconds": round(gen.seconds, 4),
            "tokens_per_s": round(gen.tokens_per_s, 3), "speculative": not args.no_spec,
        }))
    else:
        print(text)
        mode = "target-only" if args.no_spec else f"speculative, {gen.mean_accepted:.2f} accepted/step"
        print(f"[{len(gen.token_ids)} tokens, {gen.num_steps} steps, {gen.tokens_per_s:.2f} tok/s, {mode}]",
              file=sys.stderr)
    return 0


def cmd_draft_server(args) -> int:
    import logging
    import signal

    import torch

    from starsd.draft_server import DraftServer, ServerConfig
    from starsd.models.drafter import Drafter
    from starsd.models.loading import load_model, load_tokenizer, logits_width, vocab_fingerprint

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = from_args(C.ModelConfig, args, path=args.draft, quantize=draft_quantize(args.draft_quantize, args.device))
    tokenizer = load_tokenizer(cfg.path, args.cache_dir)
    model = load_model(cfg, args.cache_dir)
    server = DraftServer(Drafter(model), vocab_fingerprint(tokenizer, logits_width(model)), logits_width(model),
                         from_args(ServerConfig, args), name=f"starsd-draft:{cfg.path}")
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    server.serve(on_ready=lambda: print(json.dumps({"ready": args.bind}), flush=True))
    return 0


def cmd_target(args) -> int:
    from starsd.prompts import Prompt, load
    from starsd.target_worker import run

    if args.prompt is not None:
        prompts = [Prompt("cli", args.prompt, chat=args.chat)]
    else:
        prompts = load(args.prompts, args.limit or None)[args.offset::args.stride]
    target_cfg = from_args(C.ModelConfig, args, path=args.target, quantize="none")
    return run(args.connect, target_cfg, prompts, args.max_new_tokens, from_args(C.SamplingConfig, args),
               from_args(C.DraftConfig, args, prefix="draft-"), args.name, args.json, args.no_spec,
               args.cache_dir, args.threads, args.wait_go, args.timeout)


def cmd_replay_targets(args) -> int:
    import torch

    from starsd.replay import LatencyProfile, Recording
    from starsd.replay_host import Host

    torch.set_num_threads(1)  # replay targets only sleep; leave the cores to the draft server
    host = Host(args.connect, Recording.load(args.recording), LatencyProfile.load(args.latency), args.targets,
                args.max_new_tokens, from_args(C.DraftConfig, args, prefix="draft-"), args.no_spec,
                args.duration_s, args.seed, args.timeout)
    return host.run(args.wait_go)


def cmd_model(args) -> int:
    from starsd import sysmodel

    print(sysmodel.report(sysmodel.Profile.load(args.from_file), [int(n) for n in args.targets.split(",")]))
    return 0


def cmd_stats(args) -> int:
    import statistics

    from starsd.draft_client import DraftClient

    client = DraftClient(args.connect, "", "stats", timeout_s=args.timeout)
    try:
        stats = client.stats()
        if args.ping:
            rtts = [client.ping() for _ in range(args.ping)]
            stats["ping_ms"] = {"median": statistics.median(rtts), "min": min(rtts), "max": max(rtts), "n": len(rtts)}
    finally:
        client.close()
    print(json.dumps(stats))
    return 0


def cmd_launch(args) -> int:
    from starsd.launch import main as launch_main

    return launch_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="starsd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("models", help="fetch or list the pinned offline model pair")
    p.add_argument("action", choices=("fetch", "list"))
    p.add_argument("names", nargs="*", help=f"pinned names (default: all): {', '.join(weights.PINNED)}")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("generate", help="co-located decoding in one process")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--no-spec", action="store_true", help="target-only decoding (no draft model)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(p)
    add_dataclass_args(p, C.SamplingConfig)
    add_dataclass_args(p, C.DraftConfig, prefix="draft-")
    p.set_defaults(func=cmd_generate)

    from starsd.draft_server import ServerConfig

    p = sub.add_parser("draft-server", help="serve one draft model to many target workers (ZeroMQ ROUTER)")
    p.add_argument("--draft", default=weights.DEFAULT_DRAFT, help="draft model (pinned name, directory or hub id)")
    add_dataclass_args(p, C.ModelConfig, skip=("path", "quantize"))
    p.add_argument("--draft-quantize", default="auto", choices=("auto", "none", "int8"), help=QUANTIZE_HELP)
    add_dataclass_args(p, ServerConfig)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.set_defaults(func=cmd_draft_server)

    p = sub.add_parser("target", help="a target worker: verify locally, draft on a draft server")
    p.add_argument("--connect", required=True, help="the draft server's address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--target", default=weights.DEFAULT_TARGET, help="target model (pinned name, directory or hub id)")
    add_dataclass_args(p, C.ModelConfig, skip=("path", "quantize"))
    p.add_argument("--prompt", default=None, help="one prompt (instead of a prompt set)")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    p.add_argument("--prompts", default="humaneval", help="prompt set: humaneval or chat")
    p.add_argument("--limit", type=int, default=0, help="use the first LIMIT prompts of the set (0: all)")
    p.add_argument("--offset", type=int, default=0, help="first prompt of the set to take")
    p.add_argument("--stride", type=int, default=1, help="take every stride-th prompt (shares a set among targets)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--name", default="target")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument("--no-spec", action="store_true", help="target-only decoding (no draft server traffic)")
    p.add_argument("--wait-go", action="store_true", help="after the handshake, wait for a line on stdin")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the draft server's reply")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    add_dataclass_args(p, C.SamplingConfig)
    add_dataclass_args(p, C.DraftConfig, prefix="draft-")
    p.set_defaults(func=cmd_target)

    p = sub.add_parser("replay-targets", help="N replay targets in one process (remote targets emulated; greedy)")
    p.add_argument("--connect", required=True, help="the draft server's address")
    p.add_argument("--recording", required=True, help="the real target's recorded continuations (JSON)")
    p.add_argument("--latency", required=True, help="latency profile (JSON: verify_ms by tokens scored, prefill_ms by prompt length)")
    p.add_argument("--targets", type=int, default=1, help="replay targets N, one thread and session each")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--duration-s", type=float, default=0.0,
                   help="decode in a loop over the prompts for this long (0: each target decodes its share once)")
    p.add_argument("--no-spec", action="store_true", help="target-only decoding (no draft server traffic)")
    p.add_argument("--wait-go", action="store_true", help="after the handshakes, wait for a line on stdin")
    p.add_argument("--seed", type=int, default=0, help="seeds the latency draws")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the draft server's reply")
    add_dataclass_args(p, C.DraftConfig, prefix="draft-")
    p.set_defaults(func=cmd_replay_targets)

    p = sub.add_parser("model", help="the analytical model's prediction for a measured profile")
    p.add_argument("--from", dest="from_file", required=True,
                   help="a profile JSON, or a benchmark JSON holding one (bench scale writes it)")
    p.add_argument("--targets", default="1,2,4,8,16,32,64", help="N values to predict, comma-separated")
    p.set_defaults(func=cmd_model)

    p = sub.add_parser("stats", help="print a draft server's counters (JSON): batches, utilisation, timeline")
    p.add_argument("--connect", required=True, help="the draft server's address")
    p.add_argument("--ping", type=int, default=0, help="also time this many Ping round trips")
    p.add_argument("--timeout", type=float, default=30.0)
    p.set_defaults(func=cmd_stats)

    from starsd import simulate

    p = sub.add_parser("simulate", help="discrete-event simulation of K draft servers and N targets on a profile")
    simulate.add_args(p)
    p.set_defaults(func=simulate.main)

    p = sub.add_parser("launch", help="a local star: one draft server and N targets on this machine")
    p.add_argument("--targets", type=int, default=2, help="number of target processes N")
    p.add_argument("--target", default=weights.DEFAULT_TARGET)
    p.add_argument("--draft", default=weights.DEFAULT_DRAFT)
    p.add_argument("--draft-device", default="cpu")
    p.add_argument("--target-device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--prompts", default="humaneval")
    p.add_argument("--limit", type=int, default=4, help="prompts in all, shared round-robin among the targets")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-quantize", default="auto", choices=("auto", "none", "int8"), help=QUANTIZE_HELP)
    p.add_argument("--serial", action="store_true", help="the draft server drafts one request at a time")
    p.add_argument("--port", type=int, default=0, help="draft server port (0: a free one)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--json-out", default=None, help="write the results as JSON here")
    p.add_argument("target_extra", nargs=argparse.REMAINDER, help="after --: more flags for every target")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("bench", help="benchmarks (write JSON and a PNG plot)")
    bench = p.add_subparsers(dest="bench", required=True)
    from starsd.bench import colocated, distributed, multihost, replay_check, scale

    for module, name, help_ in (
        (colocated, "colocated", "target-only vs speculative vs HF assisted, one process"),
        (distributed, "distributed", "one target: draft server over loopback vs co-located"),
        (scale, "scale", "throughput, utilisation and latency vs N targets (replay targets), with baselines"),
        (replay_check, "replay-check", "replay targets vs real target processes at small N (emulation check)"),
        (multihost, "multihost", "the scaling benchmark across emulated hosts (netns, veth, delay, bandwidth)"),
    ):
        q = bench.add_parser(name, help=help_)
        module.add_args(q)
        q.set_defaults(func=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, weights.WeightsError, ModelLoadError, DraftServerError) as e:  # clear: no traceback
        print(f"starsd: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
