"""A star placed on a Ray cluster: the draft server and the target servers run as Ray actors on the
nodes their resources choose, then talk ZeroMQ to each other and to the gateway directly. Ray only
places and stops them: it stays off the data path.

Each actor starts the same `starsd draft-server` / `starsd target-server` process a local star
runs, bound to its node's IP, and supervises it as a local star does (star/supervise.py): a process
that exits is started again at the same address. The process dies with its actor. An actor lost
with its node is started again by Ray (`max_restarts`) on a node its resources allow, its process
at a new address; `RayStar.watch` tells the gateway, which then serves through a target server at
its new address, and tells every target of a draft server's (protocol.DraftMoved), targets that
join later included. Resources: custom ones ({"draft_host": 1}), GPUs ({"GPU": 1}), or none.
Every link is CurveZMQ-authenticated and encrypted: `StarKeys` makes a fresh key set per star (the
draft server's, one its targets share, the target servers' serving pair, the gateway's); each
actor gets its files through its start call and writes them to a private directory on its node
(mode 700, secrets 600). How it is tested: docs/deploying.md#on-ray-how-it-is-tested.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import threading
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

log = logging.getLogger("starsd.ray")


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
    def targets(self) -> ClientKeys:
        """A target's keys for the draft servers (a replay target's: bench/elastic.py)."""
        return ClientKeys(str(self.dir / "targets/target.key_secret"), str(self.dir / "server/server.key"))

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
    """A Ray actor holding one starsd process on its node, started again whenever it exits. Ray
    constructs it again on another node when its node is lost: the process then starts there."""

    def __init__(self, argv: list[str], keys: dict[str, str]):
        """Start `starsd ARGV` with BIND in it replaced by tcp://NODE_IP:PORT (a free port of this
        node) and KEYS by the directory of its `keys` (StarKeys.files), and wait until it is ready."""
        ray = _ray()
        self.address = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"
        self.keys = _write_keys(keys)
        argv = [self.address if a == BIND else a.replace(KEYS, self.keys) for a in argv]
        proc = spawn(argv)
        self.supervisor: Supervisor | None = None
        self.failed: StarsdError | None = None  # why its process did not start: where() says it, in one line
        try:
            read_json_line(proc, "ready", 900)
        except StarsdError as e:  # kept, not raised: Ray would report a constructor's error as a traceback
            proc.kill()
            shutil.rmtree(self.keys, ignore_errors=True)
            self.failed = e
            return
        self.supervisor = Supervisor()
        self.supervisor.watch(argv[0], argv[0], proc)  # by its command: draft-server or target-server
        self.supervisor.start()

    def where(self) -> str:
        """The address its process serves at; raises why it did not start."""
        if self.failed is not None:
            raise self.failed
        return self.address

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
    """Ray actor options for these resources ("GPU" and "CPU" are Ray's own arguments); an actor lost
    with its node is started again."""
    opts = {"num_cpus": resources.get("CPU", 0), "max_restarts": -1,  # (one whose process failed to start stays up,
            # with the reason: StarProcess.where)
            "resources": {k: v for k, v in resources.items() if k not in ("GPU", "CPU")}}
    if "GPU" in resources:
        opts["num_gpus"] = resources["GPU"]
    return opts


@dataclasses.dataclass
class RayStar:
    """The actors of one star on a Ray cluster; `close()` stops their processes."""

    draft_addresses: list[str]  # where each draft server runs now (watch keeps it so)
    target_addresses: list[str]  # where each target server runs now (ditto)
    actors: list  # the draft servers' actors, then the targets'
    keys: StarKeys
    draft_cmd: list[str] = dataclasses.field(default_factory=list)  # what a draft server actor runs (one added)
    draft_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    moves: dict[str, int] = dataclasses.field(default_factory=dict)  # actors started again elsewhere (their node
    # lost), by kind of process
    _stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # the lists above: the watch, and
    # draft servers added and stopped (star/elastic.py)

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
        draft_cmd = server_command(pair, dataclasses.replace(
            server, bind=BIND, curve_key=f"{KEYS}/server/server.key_secret", curve_clients=f"{KEYS}/draft-clients"))
        actors = [actor.options(**_options(draft_resources)).remote(draft_cmd, keys.files("draft"))
                  for _ in range(draft_servers)]
        try:
            drafts = ray.get([a.where.remote() for a in actors])
            target_keys = [*to_flags(ClientKeys(f"{KEYS}/targets/target.key_secret", f"{KEYS}/server/server.key")),
                           *to_flags(ServingKeys(f"{KEYS}/serving/serving.key_secret", f"{KEYS}/gateways"))]
            commands = [target_server_command(pair, draft, f"target-{i}", BIND, for_target(",".join(drafts), i),
                                              model_name) + target_keys for i in range(n)]
            actors += [actor.options(**_options(target_resources)).remote(c, keys.files("target")) for c in commands]
            addresses = ray.get([t.where.remote() for t in actors[draft_servers:]])
        except BaseException:
            cls([], [], actors, keys).close()
            raise
        return cls(drafts, addresses, actors, keys, draft_cmd, draft_resources)

    @property
    def draft_address(self) -> str:
        """Every draft server's address as it runs now, comma-separated."""
        return ",".join(self.draft_addresses)

    def draft_servers(self) -> list[str]:
        with self._lock:
            return list(self.draft_addresses)

    def add_draft_server(self, timeout_s: float = 900.0) -> str:
        """One more draft server actor, as the first were started; its address once it is ready. Raises
        Unavailable where none is ready within timeout_s (no node has the resources it asks for)."""
        ray = _ray()
        actor = ray.remote(StarProcess).options(**_options(self.draft_resources)).remote(self.draft_cmd,
                                                                                        self.keys.files("draft"))
        try:
            address = ray.get(actor.where.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor)
            raise Unavailable(f"no draft server actor was ready within {timeout_s:.0f} s: does a node have "
                              f"the resources it asks for ({self.draft_resources or 'none'})?") from None
        except BaseException:
            ray.kill(actor)
            raise
        with self._lock:
            closing = self._stop.is_set()
            if not closing:
                self.actors.insert(len(self.draft_addresses), actor)
                self.draft_addresses.append(address)
        if closing:  # close() ran while it started: it is not the star's
            ray.kill(actor)
            raise Unavailable("the star closed while a draft server was added")
        return address

    def stop_draft_server(self, address: str) -> None:
        """Stop the draft server at `address` and its actor (its sessions moved first: star/elastic.py)."""
        ray = _ray()
        with self._lock:
            i = self.draft_addresses.index(address)
            actor = self.actors.pop(i)
            del self.draft_addresses[i]
        try:
            ray.get(actor.stop.remote(), timeout=60)
        except (ray.exceptions.RayError, TimeoutError):
            pass
        ray.kill(actor)

    def watch(self, moved, interval_s: float = 2.0) -> None:
        """Every interval_s, on a thread of its own, ask the actors where their processes run, and
        call moved(kind, old, new) for each that runs elsewhere now (Ray started its actor again on
        another node, its node lost; kind "draft" or "target"). An actor still being started again
        does not answer in time: it is asked again the next round."""
        ray = _ray()

        def run():
            while not self._stop.wait(interval_s):
                with self._lock:  # the draft servers' actors, then the targets'
                    k = len(self.draft_addresses)
                    placed = ([("draft", a, at) for a, at in zip(self.actors, self.draft_addresses)]
                              + [("target", a, at) for a, at in zip(self.actors[k:], self.target_addresses)])
                for kind, actor, old in placed:
                    try:
                        now = ray.get(actor.where.remote(), timeout=interval_s)
                    except (ray.exceptions.RayError, TimeoutError):
                        continue
                    with self._lock:
                        addresses = self.draft_addresses if kind == "draft" else self.target_addresses
                        if now == old or old not in addresses:  # (a draft server retired meanwhile)
                            continue
                        addresses[addresses.index(old)] = now
                    name = f"{kind}-server"
                    log.warning("a %s was started again at %s (its node lost; it was at %s)", name, now, old)
                    moved(kind, old, now)
                    self.moves[name] = self.moves.get(name, 0) + 1  # (counted once the gateway is told)

        threading.Thread(target=run, name="starsd-ray-watch", daemon=True).start()

    def restarts(self) -> dict[str, int]:
        """Restarts of the star's processes by kind, summed over the actors that answer within a few
        seconds (/metrics), and each actor started again on another node counted as one."""
        ray = _ray()
        total = dict(self.moves)
        with self._lock:
            actors = list(self.actors)
        refs = [a.restarts.remote() for a in actors]
        for ref in ray.wait(refs, num_returns=len(refs), timeout=5)[0]:
            try:
                counts = ray.get(ref)
            except ray.exceptions.RayError:  # an actor lost with its node
                continue
            for kind, n in counts.items():
                total[kind] = total.get(kind, 0) + n
        return total

    def close(self) -> None:
        """Stop every process (a minute at most: an actor whose node is lost does not answer), then the actors."""
        with self._lock:  # (a draft server being added finds the star closing: add_draft_server)
            self._stop.set()
            actors = list(self.actors)
        ray = _ray()
        try:
            refs = [a.stop.remote() for a in reversed(actors)]
            ray.wait(refs, num_returns=len(refs), timeout=60)
        finally:
            for a in actors:
                ray.kill(a)
            self.keys.close()
