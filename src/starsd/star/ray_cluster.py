"""A star placed on a Ray cluster: the draft server and the target servers run as Ray actors on the
nodes their resources choose, then talk ZeroMQ to each other and to the gateway directly. Ray only
places and stops them: it stays off the data path (its calls measured 5-20x slower than ZeroMQ).

Each actor starts the same `starsd draft-server` / `starsd target-server` process a local star
runs, bound to its node's IP; the process dies with its actor. Resources are Ray's: custom ones
({"draft_host": 1}) or GPUs ({"GPU": 1}); none means anywhere.

The draft server and the target servers listen on their nodes' addresses without keys (`insecure`): the cluster's
network is taken as the trust boundary, as Ray's own ports are. Keys for a star on Ray would have
to reach every node first; that is not done yet.
"""

from __future__ import annotations

import dataclasses
import signal

from starsd.config import DraftConfig, PairConfig, ServerConfig
from starsd.star.launch import free_port, read_json_line, server_command, spawn, target_server_command


BIND = "tcp://0.0.0.0:0"  # in a command line: the address the actor picks on its node


def _ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError("Ray is not installed: pip install 'starsd[ray]'") from None
    return ray


class StarProcess:
    """A Ray actor holding one starsd process on its node."""

    def __init__(self):
        self.proc = None

    def start(self, argv: list[str]) -> str:
        """Start `starsd ARGV` with BIND in it replaced by tcp://NODE_IP:PORT (a free port of this
        node); return that address once the process is ready."""
        ray = _ray()
        address = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"
        argv = [address if a == BIND else a for a in argv]
        self.proc = spawn(argv)
        read_json_line(self.proc, "ready", 900)
        return address

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return -1
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


def _options(resources: dict[str, float]) -> dict:
    """Ray actor options for these resources ("GPU" and "CPU" are Ray's own arguments)."""
    opts = {"num_cpus": resources.get("CPU", 0), "resources": {k: v for k, v in resources.items()
                                                             if k not in ("GPU", "CPU")}}
    if "GPU" in resources:
        opts["num_gpus"] = resources["GPU"]
    return opts


@dataclasses.dataclass
class RayStar:
    """The actors of one star on a Ray cluster; `close()` stops their processes."""

    draft_address: str
    target_addresses: list[str]
    actors: list

    @classmethod
    def start(cls, address: str, pair: PairConfig, server: ServerConfig, draft: DraftConfig, n: int,
              draft_resources: dict[str, float], target_resources: dict[str, float], model_name: str = "") -> "RayStar":
        ray = _ray()
        ray.init(address=address, log_to_driver=False)
        actor = ray.remote(StarProcess)
        draft_actor = actor.options(**_options(draft_resources)).remote()
        actors = [draft_actor]
        try:
            draft_cmd = server_command(pair, dataclasses.replace(server, bind=BIND, insecure=True))
            draft_address = ray.get(draft_actor.start.remote(draft_cmd))
            targets = [actor.options(**_options(target_resources)).remote() for _ in range(n)]
            actors += targets
            commands = [target_server_command(pair, draft, f"target-{i}", BIND, draft_address, model_name,
                                              insecure=True) for i in range(n)]
            addresses = ray.get([t.start.remote(c) for t, c in zip(targets, commands)])
        except BaseException:
            cls(None, [], actors).close()
            raise
        return cls(draft_address, addresses, actors)

    def close(self) -> None:
        ray = _ray()
        try:
            ray.get([a.stop.remote() for a in reversed(self.actors)], timeout=60)
        finally:
            for a in self.actors:
                ray.kill(a)
