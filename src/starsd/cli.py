"""The `starsd` command. Nothing imports this module.

Flags for typed settings are generated from their dataclasses (config.py). A command's module is
imported only when that command runs, so arithmetic commands (`model`, `simulate`) never load
torch, transformers or ZeroMQ, and `starsd --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import threading

from starsd import config as C
from starsd.errors import StarsdError


class Parser(argparse.ArgumentParser):
    """A flag that cannot be parsed is refused in one line, like every other refusal (errors.py),
    not with argparse's usage block: the line names the command whose --help lists its flags."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but a flag no command knows is refused by the command it was given to."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            words = [getattr(parsed, "command", None), getattr(parsed, "bench", None)]
            prog = " ".join([self.prog, *filter(None, words)])
            self.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(unknown)} (see `{prog} --help`)\n")
        return parsed


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every flag's default, unless its help already says it (flags made from typed
    settings do: config.add_flags) or there is none worth showing (a switch, an empty value)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        default = action.default
        if "default:" in help_ or default is None or default is False or default is argparse.SUPPRESS:
            return help_
        if isinstance(default, (str, list, dict)) and not default:
            return help_
        return super()._get_help_string(action)


# ------------------------------------------------------------------------------------- commands
def args_models(p: argparse.ArgumentParser) -> None:
    from starsd.models import pinned

    p.add_argument("action", choices=("fetch", "list"))
    p.add_argument("names", nargs="*", help=f"pinned names (default: all): {', '.join(pinned.PINNED)}")
    p.add_argument("--cache-dir", default="", help="model cache (default: $STARSD_CACHE or ~/.cache/starsd)")


def cmd_models(args) -> int:
    from starsd.models import pinned

    if args.action == "list":
        for name, spec in pinned.PINNED.items():
            state = "cached" if pinned.is_cached(name, args.cache_dir) else "not fetched"
            print(f"{name:32s} {state:12s} {spec.description}")
        return 0
    for name in args.names or list(pinned.PINNED):
        path = pinned.fetch(name, args.cache_dir, log=lambda m: print(m, file=sys.stderr))
        print(f"{name}: {path}")
    return 0


def args_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--no-spec", action="store_true", help="target-only decoding (no draft model)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.SamplingConfig)
    C.add_flags(p, C.DraftConfig, prefix="draft-")


def cmd_generate(args) -> int:
    from starsd.prompts import Prompt

    cfg = C.from_args(C.PairConfig, args)  # every refusal before torch and the models load
    sampling = C.from_args(C.SamplingConfig, args)
    draft = None if args.no_spec else C.from_args(C.DraftConfig, args, prefix="draft-")

    from starsd.models.pair import Pair

    pair = Pair.load(cfg.target_model(), None if args.no_spec else cfg.draft_model(), cfg.cache, cfg.threads,
                     None if args.no_spec or not cfg.eagle else cfg.eagle_model())
    prompt = Prompt("cli", args.prompt, chat=args.chat)
    gen = pair.generate(prompt, args.max_new_tokens, sampling, draft)
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


def args_draft_server(p: argparse.ArgumentParser) -> None:
    C.add_flags(p, C.PairConfig)  # --target: with --eagle, the head holds the target's embedding and LM head
    C.add_flags(p, C.ServerConfig)
    p.add_argument("--recording", default="", help="answer from this recording of the draft model's drafts, each "
                   "after its measured service time (emulate/draft_host.py: a draft host emulated beside a target "
                   "that needs this machine's cores; benchmarks only)")


def cmd_draft_server(args) -> int:
    import logging
    import signal

    from starsd.star import security

    pair = C.from_args(C.PairConfig, args)  # every refusal before torch and the model load
    cfg = C.from_args(C.ServerConfig, args)
    security.check_listen(cfg.bind, cfg.curve_key, cfg.curve_clients, cfg.insecure)

    import torch

    from starsd.models.loading import logits_width, vocab_fingerprint
    from starsd.models.pair import load_drafter
    from starsd.star.server import DraftServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if pair.threads:
        torch.set_num_threads(pair.threads)
    recording = None
    if args.recording:  # before the model loads: a file that cannot be read is refused at once
        from starsd.emulate.draft_host import RecordedDrafter, Recording

        recording = Recording.load(args.recording)
    drafter, tokenizer = load_drafter(pair)
    if recording:
        drafter = RecordedDrafter(drafter.model, recording)
    width = logits_width(drafter.model)
    server = DraftServer(drafter, vocab_fingerprint(tokenizer, width), width, cfg,
                         name=f"starsd-draft:{pair.eagle or pair.draft}{' (recorded)' if args.recording else ''}")
    if args.recording:  # its warm-up drafts nothing it recorded: what a level costs, from the recording
        server.stats.level(drafter.recording.cost.ms(1, 4), 4, 1)
    if server.cfg.metrics_port:
        from starsd.serve.metrics import DraftServerCollector, serve_metrics

        serve_metrics(server.cfg.metrics_port, DraftServerCollector(
            lambda: [server.stats.snapshot(len(server.sessions), server.q_in.qsize())]))
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    server.serve(on_ready=lambda: print(json.dumps({"ready": args.bind}), flush=True))
    return 0


def args_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", required=True, help="the draft server's address, e.g. tcp://127.0.0.1:5555; "
                   "several, comma-separated: the session moves to the next when its server dies or has no room")
    p.add_argument("--prompt", default=None, help="one prompt (instead of a prompt set)")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    p.add_argument("--prompts", default="humaneval", help="prompt set: humaneval or chat")
    p.add_argument("--limit", type=int, default=0, help="use the first LIMIT prompts of the set (0: all)")
    p.add_argument("--offset", type=int, default=0, help="first prompt of the set to take (an index)")
    p.add_argument("--stride", type=int, default=1, help="take every stride-th prompt (shares a set among targets)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt at most")
    p.add_argument("--ignore-eos", action="store_true", help="always decode --max-new-tokens (load tests)")
    p.add_argument("--name", default="target", help="this target's name in the draft server's sessions and logs")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument("--no-spec", action="store_true", help="target-only decoding (no draft server traffic)")
    p.add_argument("--wait-go", action="store_true", help="after the handshake, wait for a line on stdin")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the draft server's reply")
    C.add_flags(p, C.PairConfig, skip=C.DRAFT_SIDE)
    C.add_flags(p, C.SamplingConfig)
    C.add_flags(p, C.ClientKeys)
    C.add_flags(p, C.DraftConfig, prefix="draft-")


def cmd_target(args) -> int:
    from starsd.prompts import Prompt, load
    from starsd.star import worker

    if args.prompt is not None:
        prompts = [Prompt("cli", args.prompt, chat=args.chat)]
    else:
        prompts = load(args.prompts, args.limit or None)[args.offset::args.stride]
    return worker.run(args.connect, C.from_args(C.PairConfig, args), prompts, args.max_new_tokens,
                      C.from_args(C.SamplingConfig, args), C.from_args(C.DraftConfig, args, prefix="draft-"),
                      name=args.name, as_json=args.json, no_spec=args.no_spec, ignore_eos=args.ignore_eos,
                      wait_go=args.wait_go, timeout_s=args.timeout, keys=C.from_args(C.ClientKeys, args))


def args_target_server(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bind", required=True, help="ZeroMQ address for generation requests, e.g. tcp://127.0.0.1:6000")
    p.add_argument("--connect", default="", help="the draft server's address (empty: decode alone, no speculation); "
                   "several, comma-separated: the session moves to the next when its server dies or has no room")
    p.add_argument("--name", default="target", help="this target's name in the draft server's sessions and logs")
    p.add_argument("--served-model-name", default="", help="the model's name for clients (default: --target)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the draft server's reply")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this HTTP port (0: off)")
    p.add_argument("--insecure", action="store_true", help="allow binding a non-loopback address without "
                   "--serve-key: anyone who reaches it can send generation requests")
    C.add_flags(p, C.PairConfig, skip=C.DRAFT_SIDE)
    C.add_flags(p, C.DraftConfig, prefix="draft-")
    C.add_flags(p, C.ClientKeys)
    C.add_flags(p, C.ServingKeys)


def cmd_target_server(args) -> int:
    import logging
    import signal

    from starsd.star import security

    cfg = C.from_args(C.PairConfig, args)  # every refusal before torch and the model load
    draft = C.from_args(C.DraftConfig, args, prefix="draft-")
    client_keys = C.from_args(C.ClientKeys, args)
    serving_keys = C.from_args(C.ServingKeys, args)
    security.check_listen(args.bind, serving_keys.serve_key, serving_keys.serve_clients, args.insecure)
    leaves = C.LLAMACPP_SEQUENCES // cfg.target_streams  # llama.cpp: the sequence ids each stream's tree may use
    if args.connect and cfg.engine == "llamacpp" and draft.top_k > 1 and draft.max_nodes > leaves:
        raise C.SettingError(f"on llama.cpp, {cfg.target_streams} streams leave each stream's draft tree {leaves} "
                             f"leaves, and a tree of {draft.max_nodes} nodes may have more: lower --draft-total-tokens "
                             "or --target-streams")

    from starsd.models.loading import vocab_fingerprint
    from starsd.models.pair import Pair
    from starsd.star.client import DraftClient
    from starsd.star.target_server import TargetServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    pair = Pair.load(cfg.target_model(), None, cfg.cache, cfg.threads)
    clients = None
    if args.connect:  # a draft session for each stream served at once, each opened before the next
        streams = len(pair.target.slots)  # is placed (by the sessions each of several servers holds)
        names = [args.name] if streams == 1 else [f"{args.name}/{i}" for i in range(streams)]
        clients = []
        for name in names:
            clients.append(DraftClient(args.connect, vocab_fingerprint(pair.tokenizer, pair.target.width), name,
                                       args.timeout, keys=client_keys))
            clients[-1].try_hello()
    server = TargetServer(pair, args.bind, clients, draft, args.name, args.served_model_name or cfg.target,
                          insecure=args.insecure, keys=serving_keys)
    if args.metrics_port:
        from starsd.serve.metrics import TargetCollector, serve_metrics

        serve_metrics(args.metrics_port, TargetCollector(server.counters))
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    try:
        server.serve(on_ready=lambda: print(json.dumps({"ready": args.bind}), flush=True))
    finally:
        for client in clients or ():
            client.close()
    return 0


DRAFT_SERVERS_HELP = ("draft servers of a local star (1 to 64): target i connects to all of them, the (i mod K)th "
                      "first, and its session moves to the next when its server dies or has no room")


def draft_servers(args) -> int:
    if not 1 <= args.draft_servers <= 64:
        raise C.SettingError(f"--draft-servers must be 1 to 64, not {args.draft_servers}")
    return args.draft_servers


def args_launch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", type=int, default=2, help="number of target processes N")
    p.add_argument("--prompts", default="humaneval", help="prompt set: humaneval or chat")
    p.add_argument("--limit", type=int, default=4, help="prompts in all, shared round-robin among the targets")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt at most")
    p.add_argument("--port", type=int, default=0, help="draft server port (0: a free one)")
    p.add_argument("--draft-servers", type=int, default=1, metavar="K", help=DRAFT_SERVERS_HELP)
    p.add_argument("--json-out", default=None, help="write the results as JSON here (and a PNG beside it)")
    p.add_argument("target_extra", nargs=argparse.REMAINDER, help="after --: more flags for every target")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.ServerConfig, skip=C.LOCAL_STAR_SKIPS)


def cmd_launch(args) -> int:
    from starsd.star.launch import run_local_star

    return run_local_star(C.from_args(C.PairConfig, args), C.from_args(C.ServerConfig, args), args.targets,
                          args.prompts, args.limit, args.max_new_tokens, [a for a in args.target_extra if a != "--"],
                          args.port, args.json_out, draft_servers(args))


def args_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", type=int, default=2, help="target servers of a local star (ignored with --target-server)")
    p.add_argument("--host", default="127.0.0.1", help="the gateway's HTTP address")
    p.add_argument("--port", type=int, default=8000, help="the gateway's HTTP port")
    p.add_argument("--target-server", action="append", default=[], metavar="ADDR",
                   help="a running target server's ZeroMQ address (repeat); then no local star is started")
    p.add_argument("--draft-server", default="", metavar="ADDR[,ADDR...]",
                   help="with --target-server: the running draft servers' addresses, for /metrics")
    p.add_argument("--draft-servers", type=int, default=1, metavar="K", help=DRAFT_SERVERS_HELP)
    p.add_argument("--no-spec", action="store_true", help="local targets decode alone (a baseline; no draft server)")
    p.add_argument("--no-restart", action="store_true", help="a local star's draft server or target server that "
                   "exits stays down (default: started again, with backoff, at most 5 times in 10 minutes)")
    p.add_argument("--served-model-name", default="", help="the model's name for clients (default: --target)")
    p.add_argument("--max-queue", type=int, default=32, help="requests waiting for a free target at most; "
                   "beyond it a request gets HTTP 503")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens generated when a request names no max_tokens")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds every target server may take to "
                   "answer at start (local ones load their models first)")
    p.add_argument("--step-timeout", type=float, default=300.0, help="seconds a target may take for one step "
                   "(its prefill included) before it is taken out of service")
    p.add_argument("--api-key", default="", help="require `Authorization: Bearer KEY` on /v1 (empty: open, "
                   "allowed on a loopback --host only, unless --insecure)")
    p.add_argument("--api-key-file", default="", help="read the API key from this file's first line instead")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key: "
                   "anyone who reaches it can generate")
    p.add_argument("--ray", default="", metavar="ADDRESS", help="place the draft server and the target servers on "
                   "this Ray cluster (HOST:PORT or auto) as actors; needs `pip install 'starsd[ray]'`")
    p.add_argument("--ray-draft-resources", type=json.loads, default={}, metavar="JSON",
                   help='Ray resources the draft server needs, e.g. \'{"draft_host": 1}\' or \'{"GPU": 1}\' '
                        "(default: none, anywhere)")
    p.add_argument("--ray-target-resources", type=json.loads, default={}, metavar="JSON",
                   help="Ray resources each target server needs (default: none, anywhere)")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.ServerConfig, skip=C.LOCAL_STAR_SKIPS)
    C.add_flags(p, C.DraftConfig, prefix="draft-")
    C.add_flags(p, C.ElasticConfig, prefix="elastic-")  # with --ray
    C.add_flags(p, C.GatewayKeys)  # with --target-server: for target servers started with --serve-key


def cmd_serve(args) -> int:
    from starsd.serve import launch as serve_launch
    from starsd.serve.gateway import GatewayConfig, listen, read_api_key

    k = draft_servers(args)
    api_key = read_api_key(args.api_key, args.api_key_file)
    sock = listen(args.host, args.port, api_key, args.insecure)
    cfg = GatewayConfig(tuple(args.target_server), args.draft_server, args.max_queue, args.max_tokens,
                        args.step_timeout, args.start_timeout, api_key, C.from_args(C.GatewayKeys, args))
    if args.target_server:
        return serve_launch.serve_remote(cfg, sock)
    if args.ray:
        return serve_launch.serve_ray(args.ray, C.from_args(C.PairConfig, args), C.from_args(C.ServerConfig, args),
                                      C.from_args(C.DraftConfig, args, prefix="draft-"), args.targets, cfg,
                                      sock, args.ray_draft_resources, args.ray_target_resources,
                                      args.served_model_name, k, C.from_args(C.ElasticConfig, args, prefix="elastic-"))
    return serve_launch.serve_local(C.from_args(C.PairConfig, args), C.from_args(C.ServerConfig, args),
                             C.from_args(C.DraftConfig, args, prefix="draft-"), args.targets, cfg, sock,
                             spec=not args.no_spec, model_name=args.served_model_name, restart=not args.no_restart,
                             draft_servers=k)


def args_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", type=int, default=2, help="target servers (requests sent at once: one per target)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request at most")
    p.add_argument("--json-out", default="results/demo.json", help="results as JSON (and a PNG beside it)")
    p.add_argument("serve_extra", nargs=argparse.REMAINDER, help="after --: more flags for `starsd serve`")


def cmd_demo(args) -> int:
    from starsd.serve import demo

    return demo.run([a for a in args.serve_extra if a != "--"], args.targets, args.max_tokens, args.json_out)


def args_replay_targets(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", required=True, help="the draft server's address")
    p.add_argument("--recording", required=True, help="the real target's recorded continuations (JSON)")
    p.add_argument("--latency", required=True, help="latency profile (JSON: verify_ms by tokens scored, prefill_ms by prompt length)")
    p.add_argument("--targets", type=int, default=1, help="replay targets N, one thread and session each")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt at most")
    p.add_argument("--duration-s", type=float, default=0.0, help="decode in a loop over the prompts for this many "
                   "seconds (0: each target decodes its share once)")
    p.add_argument("--no-spec", action="store_true", help="target-only decoding (no draft server traffic)")
    p.add_argument("--wait-go", action="store_true", help="after the handshakes, wait for a line on stdin")
    p.add_argument("--active", type=int, default=None, help="targets decoding at the start (the others wait for "
                   "an `active N` line on stdin, with --wait-go); default: all")
    p.add_argument("--seed", type=int, default=0, help="seeds the latency draws")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the draft server's reply")
    C.add_flags(p, C.DraftConfig, prefix="draft-")
    C.add_flags(p, C.ClientKeys)


def cmd_replay_targets(args) -> int:
    import logging

    import torch

    from starsd.emulate.replay import LatencyProfile, Recording
    from starsd.emulate.replay_host import Host

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    torch.set_num_threads(1)  # replay targets only sleep; leave the cores to the draft server
    host = Host(args.connect, Recording.load(args.recording), LatencyProfile.load(args.latency), args.targets,
                args.max_new_tokens, C.from_args(C.DraftConfig, args, prefix="draft-"), args.no_spec,
                args.duration_s, args.seed, args.timeout, keys=C.from_args(C.ClientKeys, args),
                recording_file=args.recording, active=args.active)
    return host.run(args.wait_go)


def args_stats(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", required=True, help="the draft server's address")
    p.add_argument("--ping", type=int, default=0, help="also time this many Ping round trips (reported in ms)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the draft server's reply")
    C.add_flags(p, C.ClientKeys)


def cmd_stats(args) -> int:
    import statistics

    from starsd.star.client import DraftClient

    client = DraftClient(args.connect, "", "stats", timeout_s=args.timeout, keys=C.from_args(C.ClientKeys, args))
    try:
        stats = client.stats()
        if args.ping:
            rtts = [client.ping() for _ in range(args.ping)]
            stats["ping_ms"] = {"median": statistics.median(rtts), "min": min(rtts), "max": max(rtts), "n": len(rtts)}
    finally:
        client.close()
    print(json.dumps(stats))
    return 0


def args_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="from_file", required=True,
                   help="a profile JSON, or a benchmark JSON holding one (bench scale writes it)")
    p.add_argument("--targets", default="1,2,4,8,16,32,64", help="N values to predict, comma-separated")


def cmd_model(args) -> int:
    from starsd.theory import sysmodel

    print(sysmodel.report(sysmodel.Profile.load(args.from_file), [int(n) for n in args.targets.split(",")]))
    return 0


def args_simulate(p: argparse.ArgumentParser) -> None:
    from starsd.theory import simulate

    simulate.add_args(p)


def args_fleet(p: argparse.ArgumentParser) -> None:
    from starsd.theory import fleet

    fleet.add_args(p)


def cmd_fleet(args) -> int:
    from starsd.theory import fleet

    return fleet.main(args)


def args_keys(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="where to write the key files")
    p.add_argument("names", nargs="+", help="one key pair per name: NAME.key (public) and NAME.key_secret")


def cmd_keys(args) -> int:
    from starsd.star.security import make_keys

    for name in args.names:
        public, secret = make_keys(args.directory, name)
        print(json.dumps({"name": name, "public": public, "secret": secret}))
    return 0


def args_train_eagle(p: argparse.ArgumentParser) -> None:
    from starsd.train.settings import EagleTrainConfig

    C.add_flags(p, EagleTrainConfig)


def cmd_train_eagle(args) -> int:
    from starsd.train.eagle import train
    from starsd.train.settings import EagleTrainConfig

    head = train(C.from_args(EagleTrainConfig, args))
    print(head)
    return 0


def cmd_simulate(args) -> int:
    from starsd.theory import simulate

    return simulate.main(args)


COMMANDS = {  # name: (help, flags, run)
    "models": ("fetch or list the pinned offline model pair", args_models, cmd_models),
    "generate": ("co-located decoding in one process", args_generate, cmd_generate),
    "draft-server": ("serve one draft model to many target workers (ZeroMQ ROUTER)", args_draft_server,
                     cmd_draft_server),
    "target": ("a target worker: verify locally, draft on a draft server", args_target, cmd_target),
    "target-server": ("a target that serves generation requests (ZeroMQ) as long as it runs", args_target_server,
                      cmd_target_server),
    "launch": ("a local star: one draft server and N targets on this machine", args_launch, cmd_launch),
    "serve": ("an OpenAI-compatible endpoint in front of a star (local, on Ray, or running elsewhere)", args_serve,
              cmd_serve),
    "demo": ("start a local star with its OpenAI endpoint, query it with the openai client, stop it", args_demo,
             cmd_demo),
    "replay-targets": ("N replay targets in one process (remote targets emulated; greedy)", args_replay_targets,
                       cmd_replay_targets),
    "keys": ("make CurveZMQ key pairs: a draft server's, and one per target it allows", args_keys, cmd_keys),
    "stats": ("print a draft server's counters (JSON): batches, utilisation, timeline", args_stats, cmd_stats),
    "model": ("the analytical model's prediction for a measured profile", args_model, cmd_model),
    "simulate": ("discrete-event simulation of K draft servers and N targets on a profile", args_simulate,
                 cmd_simulate),
    "fleet": ("a fleet of vLLM instances on GPUs on paper: the draft servers they need and the tokens/s each gets, "
              "the simulator on published GPU costs", args_fleet, cmd_fleet),
    "train-eagle": ("train an EAGLE-1 head for a target on local Python source, resumably", args_train_eagle,
                    cmd_train_eagle),
}
BENCHES = {  # name: (help, module with add_args and main)
    "colocated": ("target-only vs speculative vs HF assisted, one process", "starsd.bench.colocated"),
    "distributed": ("one target: draft server over loopback vs co-located", "starsd.bench.distributed"),
    "depth": ("the default depth policy vs fixed depths, co-located and through a draft server, greedy and sampled",
              "starsd.bench.depth"),
    "depth-replay": ("the depth policy and fixed depths replayed over drafts recorded once with the real pair "
                     "(no run-to-run noise)", "starsd.bench.depth_replay"),
    "llamacpp": ("a llama.cpp target: alone, with StarSD co-located and from a draft server on a core of its own, "
                 "and llama.cpp's own speculation", "starsd.bench.llamacpp"),
    "streams": ("one llama.cpp target server given S requests at once: S streams batched vs one at a time",
                "starsd.bench.streams"),
    "sampled-q": ("a sampled draft's q on the wire: its support against the full distribution, bytes and acceptance",
                  "starsd.bench.sampled_q"),
    "sampled-link": ("sampled drafts across a slow link: a real target and draft server on emulated hosts (netns, "
                     "tc tbf), greedy and sampled", "starsd.bench.sampled_link"),
    "service": ("the draft server's batch time S(b) by batch size, against the bare model's passes",
                "starsd.bench.service"),
    "scale": ("throughput, utilisation and latency vs N targets (replay targets), with baselines",
              "starsd.bench.scale"),
    "replay-check": ("replay targets vs real target processes at small N (emulation check)",
                     "starsd.bench.replay_check"),
    "serve": ("M concurrent streaming clients against starsd serve: target-only vs speculative targets",
              "starsd.bench.serve"),
    "gateway": ("the gateway's added latency: a whole request, TTFT and the time per streamed chunk through it "
                "(kept alive) against its target server asked directly", "starsd.bench.gateway"),
    "vllm-serve": ("`vllm serve` with StarSD's drafts, as the README runs it, against `vllm serve` alone, timed at "
                   "the client over several runs", "starsd.bench.vllm_serve"),
    "vllm": ("vLLM with StarSD's drafts (its proposer plug-in) against vLLM alone and vLLM's own draft-model "
             "speculation, co-hosted and from a draft host of its own", "starsd.bench.vllm"),
    "multihost": ("the scaling benchmark across emulated hosts (netns, veth, delay, bandwidth)",
                  "starsd.bench.multihost"),
    "latency": ("the paper's latency claim: one pair alone against the same pair in a star of N (draft time per "
                "drafted token, per-token latency p50/p99 and variance)", "starsd.bench.latency"),
    "slow-server": ("a draft server slowed on purpose: targets waiting for every draft vs the draft deadline",
                    "starsd.bench.slow_server"),
    "servers": ("two draft servers against one past saturation (replay targets, a core each), and one killed",
                "starsd.bench.servers"),
    "elastic": ("replay targets ramping up and down against draft servers on a local Ray cluster, added and retired "
                "by the elastic controller", "starsd.bench.elastic"),
    "memory": ("peak RSS of co-located vs remote-draft targets; instances that fit a budget", "starsd.bench.memory"),
    "fuzz": ("bad inputs to protocol.decode and to a live draft server; honest sessions unchanged", "starsd.bench.fuzz"),
    "soak": ("many replay targets for a long run with faults injected; losses, errors, RSS", "starsd.bench.soak"),
    "sessions": ("one draft server, many sessions: a bounded draft KV budget under churn, streams sharing a "
                 "prefix, and many sessions held at once", "starsd.bench.sessions"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Every command is listed; only the one named in argv gets its flags (and imports its module)."""
    words = [a for a in argv if not a.startswith("-")][:2]
    parser = Parser(prog="starsd", description="One-for-many speculative decoding: one draft "
                                     "server, many target models.", formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter)
        if words[:1] == [name]:
            add_args(p)
            p.set_defaults(func=run)
    p = sub.add_parser("bench", help="benchmarks (each writes JSON and a PNG plot)",
                       description="benchmarks (each writes JSON and a PNG plot)", formatter_class=HelpFormatter)
    bench = p.add_subparsers(dest="bench", required=True)
    for name, (help_, module) in BENCHES.items():
        q = bench.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter)
        if words == ["bench", name]:
            chosen = importlib.import_module(module)
            chosen.add_args(q)
            q.set_defaults(func=chosen.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A refusal (StarsdError) is one line on stderr and exit status 2; any other
    exception is a bug and shows its traceback."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    if args.command == "bench" and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupted)  # a benchmark killed closes what it started (servers, engines)
    try:
        return args.func(args)
    except StarsdError as e:
        print(f"starsd: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("starsd: interrupted", file=sys.stderr)
        return 130


def _interrupted(*_) -> None:
    raise KeyboardInterrupt


def one_line(message: str) -> str:
    return " ".join(message.split()) or "refused (no reason given)"


if __name__ == "__main__":
    sys.exit(main())
