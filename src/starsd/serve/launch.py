"""`starsd serve`: the gateway in front of a star, local, on a Ray cluster, or already running.

Local: a draft server and N target servers start as child processes on free loopback ports (they
die with this process), then the gateway serves on HOST:PORT until SIGINT or SIGTERM, and stops
them; meanwhile one that exits is started again at its address (star/supervise.py). Ray: the same processes, placed on the cluster's nodes as actors (star/ray_cluster.py).
Remote: the gateway alone, in front of target servers (and a draft server) started elsewhere.
In each case the gateway's socket is bound first (gateway.listen), so a refusal comes before any
model loads.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import sys

from starsd.config import DraftConfig, ElasticConfig, PairConfig, ServerConfig
from starsd.serve import gateway
from starsd.star.launch import Star, check_models, share_cores, start_server, target_server_command
from starsd.star.processes import free_port, read_json_line, spawn
from starsd.star.supervise import Supervisor


def start_targets(star: Star, pair: PairConfig, draft: DraftConfig, n: int, spec: bool, model_name: str = "",
                  metrics_ports: list[int] = ()) -> list[str]:
    """n target servers on free loopback ports, ready; returns their addresses (kept in star.targets)."""
    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(n)]
    for i, address in enumerate(addresses):
        star.targets.append(spawn(target_server_command(pair, draft, f"target-{i}", address,
                                                        star.connect(i) if spec else "", model_name,
                                                        metrics_ports[i] if metrics_ports else 0)))
    for proc in star.targets:
        read_json_line(proc, "ready", 600)
    return addresses


def serve_local(pair: PairConfig, server: ServerConfig, draft: DraftConfig, n: int, cfg: gateway.GatewayConfig,
                sock: socket.socket, spec: bool = True, model_name: str = "", restart: bool = True,
                draft_servers: int = 1) -> int:
    """`restart`: a draft server or target server that exits is started again (star/supervise.py).
    `draft_servers`: K of them; target i connects to all, the (i mod K)th first (Star.connect)."""
    check_models(pair)
    k = draft_servers if spec else 0
    pair, server_pair = share_cores(pair, n, k)
    server = dataclasses.replace(server, metrics_port=server.metrics_port or free_port())
    star = start_server(server_pair, server, count=k) if spec else Star([], [])
    try:
        if spec:
            print(f"draft server{'s' if k > 1 else ''} up at {star.address}", file=sys.stderr, flush=True)
        print(f"loading {n} target servers", file=sys.stderr, flush=True)
        ports = [free_port() for _ in range(n)]
        targets = start_targets(star, pair, draft, n, spec, model_name, ports)
        cfg = dataclasses.replace(cfg, targets=tuple(targets), draft_server=star.address)
        metrics = {"targets": [f"http://127.0.0.1:{p}/metrics" for p in ports]}
        if spec:
            metrics["draft_server"] = f"http://127.0.0.1:{star.metrics_ports[0]}/metrics"
            metrics["draft_servers"] = [f"http://127.0.0.1:{p}/metrics" for p in star.metrics_ports]
        restarts = None
        if restart:
            star.supervise(Supervisor())
            restarts = star.supervisor.counts
        return serve_remote(cfg, sock, metrics, restarts)
    finally:
        star.close()


def serve_ray(address: str, pair: PairConfig, server: ServerConfig, draft: DraftConfig, n: int,
              cfg: gateway.GatewayConfig, sock: socket.socket, draft_resources: dict, target_resources: dict,
              model_name: str = "", draft_servers: int = 1, elastic: ElasticConfig = ElasticConfig()) -> int:
    """`elastic`: with max_servers, a controller adds and retires draft servers by load (star/elastic.py)."""
    from starsd.star.elastic import Controller
    from starsd.star.ray_cluster import RayStar

    print(f"placing {draft_servers} draft server{'s' if draft_servers > 1 else ''} and {n} target servers on the "
          f"Ray cluster at {address}", file=sys.stderr, flush=True)
    star = RayStar.start(address, pair, server, draft, n, draft_resources, target_resources, model_name,
                         draft_servers)
    controller = None
    try:
        cfg = dataclasses.replace(cfg, targets=tuple(star.target_addresses), draft_server=star.draft_address,
                                  keys=star.keys.gateway, draft_keys=star.keys.draft_stats)

        def moves(tell) -> None:  # (called once the gateway listens)
            nonlocal controller
            star.watch(tell)
            if elastic.max_servers:
                controller = Controller(star, elastic, lambda addresses: tell("listed", None, addresses),
                                        star.keys.draft_stats)
                controller.start()

        return serve_remote(cfg, sock, restarts=star.restarts, moves=moves, elastic=lambda: controller)
    finally:
        if controller is not None:
            controller.stop()
        star.close()


def serve_remote(cfg: gateway.GatewayConfig, sock: socket.socket, metrics: dict | None = None,
                 restarts=None, moves=None, elastic=None) -> int:
    """The gateway alone, on `sock` (gateway.listen); `metrics`: the star's own metrics endpoints,
    announced in the ready line; `restarts`: the star's restart counts (local or on Ray), for /metrics;
    `moves`: what tells the gateway of target and draft servers at new addresses (RayStar.watch; gateway.run);
    `elastic`: the elastic controller, if any, for /metrics (a function: it starts with the gateway)."""
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host

    def ready():
        print(json.dumps({"ready": f"http://{host}:{port}", "targets": list(cfg.targets),
                          "draft_server": cfg.draft_server, "metrics": metrics or {}}), flush=True)
        print(f"serving the star on http://{host}:{port}/v1 ({len(cfg.targets)} targets); Ctrl-C stops it",
              file=sys.stderr, flush=True)

    gateway.run(cfg, sock, on_ready=ready, restarts=restarts, moves=moves, elastic=elastic)
    return 0
