"""`starsd serve`: the gateway in front of a star, local, on a Ray cluster, or already running.

Local: a draft server and N target servers start as child processes on free loopback ports (they
die with this process), then the gateway serves on HOST:PORT until SIGINT or SIGTERM, and stops
them. Ray: the same processes, placed on the cluster's nodes as actors (star/ray_cluster.py).
Remote: the gateway alone, in front of target servers (and a draft server) started elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from starsd.config import DraftConfig, PairConfig, ServerConfig
from starsd.serve import gateway
from starsd.star.launch import Star, free_port, read_json_line, spawn, start_server, target_server_command


def start_targets(star: Star, pair: PairConfig, draft: DraftConfig, n: int, spec: bool, model_name: str = "",
                  metrics_ports: list[int] = ()) -> list[str]:
    """n target servers on free loopback ports, ready; returns their addresses (kept in star.targets)."""
    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(n)]
    for i, address in enumerate(addresses):
        star.targets.append(spawn(target_server_command(pair, draft, f"target-{i}", address,
                                                        star.address if spec else "", model_name,
                                                        metrics_ports[i] if metrics_ports else 0)))
    for proc in star.targets:
        read_json_line(proc, "ready", 600)
    return addresses


def serve_local(pair: PairConfig, server: ServerConfig, draft: DraftConfig, n: int, cfg: gateway.GatewayConfig,
                host: str, port: int, spec: bool = True, model_name: str = "") -> int:
    server = dataclasses.replace(server, metrics_port=server.metrics_port or free_port())
    star = start_server(pair, server) if spec else Star(None, "")
    try:
        if spec:
            print(f"draft server up at {star.address}", file=sys.stderr, flush=True)
        print(f"loading {n} target servers", file=sys.stderr, flush=True)
        ports = [free_port() for _ in range(n)]
        targets = start_targets(star, pair, draft, n, spec, model_name, ports)
        cfg = dataclasses.replace(cfg, targets=tuple(targets), draft_server=star.address if spec else "")
        metrics = {"targets": [f"http://127.0.0.1:{p}/metrics" for p in ports]}
        if spec:
            metrics["draft_server"] = f"http://127.0.0.1:{server.metrics_port}/metrics"
        return serve_remote(cfg, host, port, metrics)
    finally:
        star.close()


def serve_ray(address: str, pair: PairConfig, server: ServerConfig, draft: DraftConfig, n: int,
              cfg: gateway.GatewayConfig, host: str, port: int, draft_resources: dict, target_resources: dict,
              model_name: str = "") -> int:
    from starsd.star.ray_cluster import RayStar

    print(f"placing a draft server and {n} target servers on the Ray cluster at {address}", file=sys.stderr,
          flush=True)
    star = RayStar.start(address, pair, server, draft, n, draft_resources, target_resources, model_name)
    try:
        cfg = dataclasses.replace(cfg, targets=tuple(star.target_addresses), draft_server=star.draft_address,
                                  keys=star.keys.gateway, draft_keys=star.keys.draft_stats)
        return serve_remote(cfg, host, port)
    finally:
        star.close()


def serve_remote(cfg: gateway.GatewayConfig, host: str, port: int, metrics: dict | None = None) -> int:
    """The gateway alone; `metrics`: the star's own metrics endpoints, announced in the ready line."""
    def ready():
        print(json.dumps({"ready": f"http://{host}:{port}", "targets": list(cfg.targets),
                          "draft_server": cfg.draft_server, "metrics": metrics or {}}), flush=True)
        print(f"serving the star on http://{host}:{port}/v1 ({len(cfg.targets)} targets); Ctrl-C stops it",
              file=sys.stderr, flush=True)

    gateway.run(cfg, host, port, on_ready=ready)
    return 0
