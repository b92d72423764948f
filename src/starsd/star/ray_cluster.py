"""A star placed on a Ray cluster: the draft server and the target servers run as Ray actors on the
nodes their resources choose, then talk ZeroMQ to each other and to the gateway directly. Ray only
places and stops them: it stays off the data path (its calls measured 5-20x slower than ZeroMQ).

Each actor starts the same `starsd draft-server` / `starsd target-server` process a local star
runs, bound to its node's IP, and supervises it as a local star does (star/supervise.py): a process
that exits is started again with the same command line, so at the same address, where its peers
find it again. The process dies with its actor; an actor that dies (its node lost) is not replaced.
Resources are Ray's: custom ones ({"draft_host": 1}) or GPUs ({"GPU": 1}); none means anywhere.

Every link is CurveZMQ-authenticated and encrypted: `StarKeys` makes a fresh set of key pairs for
each star (the draft server's, one its targets share, the target servers' serving pair and the
gateway's), each actor gets the files its process needs through its start call (Ray's control
plane, once) and writes them into a private directory on its node (mode 700, secrets 600), and the
gateway in the driver gets its own. So the nodes' addresses are bound with keys, not `--insecure`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import tempfile
from pathlib import Path

from starsd.config import ClientKeys, DraftConfig, GatewayKeys, PairConfig, ServerConfig, ServingKeys, to_flags
from starsd.errors import StarsdError, Unavailable
from starsd.star.client import for_target
from starsd.star.launch import server_command, target_server_command
from starsd.star.processes import free_port, read_json_line, spawn
from starsd.star.security import make_keys
from starsd.star.supervise import Supervisor


BIND = "tcp://0.0.0.0:0"  # in a command line: the address the actor picks on its node
KEYS = "@KEYS@"  # in a command line: the directory the actor wrote its key files to


class StarKeys:
    """One star's key pairs, made in a private directory of the driver: `files(role)` is what a
    role's process needs, as relative path -> text; `gateway` and `draft_stats` are the driver's."""

    ROLES = {"draft": ("server/server.key_secret", "draft-clients/target.key", "draft-clients/gateway.key"),
             "target": ("targets/target.key_secret", "server/server.key", "serving/serving.key_secret",
                        "gateways/gateway.key")}

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="starsd-keys-"))
        for role, name in (("server", "server"), ("targets", "target"), ("serving", "serving"), ("gateways", "gateway")):
            make_keys(str(self.dir / role), name)
        for who in ("targets/target.key", "gateways/gateway.key"):  # the draft server's allowed clients
            (self.dir / "draft-clients").mkdir(exist_ok=True)
            shutil.copy(self.dir / who, self.dir / "draft-clients" / Path(who).name)

    def files(self, role: str) -> dict[str, str]:
        return {f: (self.dir / f).read_text() for f in self.ROLES[role]}

    @property
    def gateway(self) -> GatewayKeys:
        return GatewayKeys(str(self.dir / "gateways/gateway.key_secret"), str(self.dir / "serving/serving.key"))

    @property
    def draft_stats(self) -> ClientKeys:
        return ClientKeys(str(self.dir / "gateways/gateway.key_secret"), str(self.dir / "server/server.key"))

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _write_keys(files: dict[str, str]) -> str:
    """An actor's key files in a private directory of its node; returns the directory."""
    root = tempfile.mkdtemp(prefix="starsd-keys-")  # mode 700
    for name, text in files.items():
        path = Path(root) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        os.chmod(path, 0o600)
    return root


def _ray():
    try:
        import ray
    except ImportError:
        raise StarsdError("Ray is not installed: pip install 'starsd[ray]'") from None
    return ray


class StarProcess:
    """A Ray actor holding one starsd process on its node, started again whenever it exits."""

    def __init__(self):
        self.supervisor: Supervisor | None = None
        self.keys = ""

    def start(self, argv: list[str], keys: dict[str, str]) -> str:
        """Start `starsd ARGV` with BIND in it replaced by tcp://NODE_IP:PORT (a free port of this
        node) and KEYS by the directory of its `keys` (StarKeys.files); return that address once
        the process is ready."""
        ray = _ray()
        address = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"
        self.keys = _write_keys(keys)
        argv = [address if a == BIND else a.replace(KEYS, self.keys) for a in argv]
        proc = spawn(argv)
        read_json_line(proc, "ready", 900)
        self.supervisor = Supervisor()
        self.supervisor.watch(argv[0], argv[0], proc)  # by its command: draft-server or target-server
        self.supervisor.start()
        return address

    def restarts(self) -> dict[str, int]:
        """Its process's restarts, by kind (Supervisor.counts)."""
        return {} if self.supervisor is None else self.supervisor.counts()

    def stop(self) -> int:
        if self.supervisor is None:
            return -1
        self.supervisor.halt()
        proc = self.supervisor.procs()[0]
        code = -1
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
        self.supervisor.join()
        if self.keys:  # read by the process at each start
            shutil.rmtree(self.keys, ignore_errors=True)
        return code


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

    draft_address: str  # every draft server's, comma-separated
    target_addresses: list[str]
    actors: list
    keys: StarKeys

    @classmethod
    def start(cls, address: str, pair: PairConfig, server: ServerConfig, draft: DraftConfig, n: int,
              draft_resources: dict[str, float], target_resources: dict[str, float], model_name: str = "",
              draft_servers: int = 1) -> "RayStar":
        """`draft_servers`: K draft server actors (one key pair for all); target i connects to all of
        them, the (i mod K)th first (client.for_target)."""
        ray = _ray()
        try:
            ray.init(address=address, log_to_driver=False)
        except ConnectionError as e:
            raise Unavailable(f"no Ray cluster answers at {address}: {e}") from None
        actor = ray.remote(StarProcess)
        keys = StarKeys()
        actors = [actor.options(**_options(draft_resources)).remote() for _ in range(draft_servers)]
        try:
            draft_cmd = server_command(pair, dataclasses.replace(
                server, bind=BIND, curve_key=f"{KEYS}/server/server.key_secret", curve_clients=f"{KEYS}/draft-clients"))
            drafts = ray.get([a.start.remote(draft_cmd, keys.files("draft")) for a in actors])
            targets = [actor.options(**_options(target_resources)).remote() for _ in range(n)]
            actors += targets
            target_keys = [*to_flags(ClientKeys(f"{KEYS}/targets/target.key_secret", f"{KEYS}/server/server.key")),
                           *to_flags(ServingKeys(f"{KEYS}/serving/serving.key_secret", f"{KEYS}/gateways"))]
            draft_address = ",".join(drafts)
            commands = [target_server_command(pair, draft, f"target-{i}", BIND, for_target(draft_address, i),
                                              model_name) + target_keys for i in range(n)]
            addresses = ray.get([t.start.remote(c, keys.files("target")) for t, c in zip(targets, commands)])
        except BaseException:
            cls(None, [], actors, keys).close()
            raise
        return cls(draft_address, addresses, actors, keys)

    def restarts(self) -> dict[str, int]:
        """Restarts of the star's processes by kind, summed over the actors (/metrics); {} if they do
        not answer within a few seconds."""
        ray = _ray()
        total: dict[str, int] = {}
        try:
            for counts in ray.get([a.restarts.remote() for a in self.actors], timeout=5):
                for kind, n in counts.items():
                    total[kind] = total.get(kind, 0) + n
        except (ray.exceptions.RayError, TimeoutError):
            return {}
        return total

    def close(self) -> None:
        ray = _ray()
        try:
            ray.get([a.stop.remote() for a in reversed(self.actors)], timeout=60)
        finally:
            for a in self.actors:
                ray.kill(a)
            self.keys.close()
