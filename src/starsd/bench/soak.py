"""Soak: real draft servers and many replay targets for a long run, with faults injected on the way.

N replay targets (replay.py) run in --hosts processes (`starsd replay-targets`), each decoding the
recorded prompts in a loop against --draft-servers `starsd draft-server` processes (every target
lists them all: star/placement.py) for --duration-s. After --warmup-s, faults come one at a time,
evenly spaced, each checked within --recover-s before the next (one that would come too late to
be checked is not injected, and the run fails):
- server_kill: a draft server killed (SIGKILL) and a new one started at its address;
- target_kill: a replay host process killed (SIGKILL): its targets never say goodbye;
- bad_message: a round of malformed and foreign messages from raw ZeroMQ DEALER sockets;
- slow_target: a replay target stalls --stall-s between two steps, past the session timeout.
A run passes when every fault asked for was injected and survived, every output equals the
recording (`tally`), no token is lost, no target failed, the servers are up at the end and every
session was freed. Writes JSON (with requests served, bad inputs and Error replies, each server's
VmRSS at start and end), a plot and a summary; exit code 1 when the run did not pass.
What each fault must survive, and figures: docs/reliability.md#soak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgspec
import torch
import zmq

from starsd import config as C
from starsd.bench import harness
from starsd.errors import SettingError
from starsd.results import Steps, panel_plot, summary, write_json
from starsd.star import protocol as P
from starsd.star.client import query_stats
from starsd.star.connection import Heartbeat
from starsd.star.launch import Star, start_server
from starsd.star.processes import free_port, read_json_line, spawn

KINDS = ("server_kill", "target_kill", "slow_target", "bad_message")  # the order faults take turns in
OWNER = "owner"  # the prober's connection that holds a session
INTRUDER = "intruder"  # its other connection, which holds none


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", type=int, default=64, help="replay targets N, in all")
    p.add_argument("--hosts", type=int, default=8, help="replay host processes the targets are shared out over "
                                                         "(a target kill kills one)")
    p.add_argument("--duration-s", type=float, default=600.0, help="length of the run, from the targets' release")
    p.add_argument("--warmup-s", type=float, default=20.0, help="seconds before the first fault")
    p.add_argument("--recover-s", type=float, default=120.0, help="how long a fault's check waits for recovery; "
                   "faults are spread over the run but this long before its end, and no kill comes later")
    p.add_argument("--draft-servers", type=int, default=1, help="draft servers K; every target lists them all")
    p.add_argument("--server-kills", type=int, default=2, help="draft server kills (each followed by a restart; with "
                   "several servers, each in turn)")
    p.add_argument("--target-kills", type=int, default=2, help="replay host processes killed")
    p.add_argument("--bad-rounds", type=int, default=4, help="rounds of malformed and foreign messages")
    p.add_argument("--slow-targets", type=int, default=2, help="targets that stall once between two steps")
    p.add_argument("--stall-s", type=float, default=15.0, help="how long a slow target stalls")
    p.add_argument("--session-timeout-s", type=float, default=10.0,
                   help="the draft server frees a session silent this long")
    p.add_argument("--sample-s", type=float, default=2.0, help="seconds between reads of the server's counters and RSS")
    harness.add_replay_args(p, "results/soak.json")  # the draft server's log goes beside the JSON too


# ------------------------------------------------------------------------------------ arithmetic
def schedule(counts: dict[str, int], first_s: float, last_s: float) -> list[tuple[float, str]]:
    """The faults (seconds after the release, kind): kinds take turns in KINDS order while any
    are left, evenly spaced from first_s to last_s."""
    left = {k: counts.get(k, 0) for k in KINDS}
    order = []
    while any(left.values()):
        for k in KINDS:
            if left[k] > 0:
                order.append(k)
                left[k] -= 1
    if order and last_s < first_s:
        raise SettingError(f"no time for faults: the warm-up ends at {first_s:g} s, the last fault must come by "
                         f"{last_s:g} s (raise --duration-s, or lower --warmup-s or --recover-s)")
    step = (last_s - first_s) / (len(order) - 1) if len(order) > 1 else 0.0
    return [(first_s + i * step, kind) for i, kind in enumerate(order)]


def shares(n: int, hosts: int) -> list[int]:
    """n targets shared out over `hosts` processes as evenly as can be."""
    if not 1 <= hosts <= n:
        raise SettingError(f"--hosts must be in 1..{n} (the targets), not {hosts}")
    return [n // hosts + (i < n % hosts) for i in range(hosts)]


def tally(rows: list[dict], expected: dict[str, list[int]]) -> dict[str, int]:
    """What the targets produced against the recording (`expected`: prompt id -> the continuation,
    cut at the run's max new tokens). Rows are a replay host's prompt rows, each with its host's
    `deadline` (unix s). Counts:
      differing   outputs that are not a prefix of their recording;
      tokens_lost tokens missing from outputs that are a prefix but shorter, and were not cut by
                  the end of the run (their last step ended before the deadline);
      cut         outputs cut short by the end of the run (no loss: the run ended);
      failed      targets that stopped with an error."""
    out = dict.fromkeys(("prompts", "complete", "cut", "tokens", "differing", "tokens_lost", "failed"), 0)
    for r in rows:
        if "error" in r:
            out["failed"] += 1
        if "token_ids" not in r:
            continue
        want = expected[r["prompt_id"]]
        got = r["token_ids"]
        out["prompts"] += 1
        out["tokens"] += len(got)
        if got != want[:len(got)]:
            out["differing"] += 1
        elif len(got) == len(want):
            out["complete"] += 1
        elif r["trace"] and r["trace"][-1][0] > r["deadline"]:
            out["cut"] += 1
        else:
            out["tokens_lost"] += len(want) - len(got)
    return out


def throughput(rows: list[dict], t0: float, end_s: float, bin_s: float) -> tuple[list[float], list[float]]:
    """System tokens/s in bins of bin_s seconds after t0 (unix s), from the rows' step traces."""
    bins = [0.0] * max(1, int(end_s // bin_s) + 1)
    for r in rows:
        for at, tokens in r.get("trace", ()):
            k = int((at - t0) // bin_s)
            if 0 <= k < len(bins):
                bins[k] += tokens
    return [(k + 0.5) * bin_s for k in range(len(bins))], [b / bin_s for b in bins]


def vm_rss(pid: int) -> int | None:
    """A process's resident memory in bytes (VmRSS of /proc/PID/status); None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return None


def wait_for(ok: Callable[[], bool], timeout_s: float, every_s: float = 1.0) -> float | None:
    """Seconds until ok() held, checking every every_s; None if it did not within timeout_s."""
    t0 = time.monotonic()
    while True:
        if ok():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            return None
        time.sleep(every_s)


# ------------------------------------------------------------------------------------- processes
class Server:
    """The draft server process across its lives: a kill ends a life, a restart at the same address
    begins the next. `lives` holds each life's RSS at start and end and its last counters."""

    def __init__(self, pair: C.PairConfig, cfg: C.ServerConfig, log_path: Path):
        self.pair = pair
        self.cfg = cfg
        self.port = free_port()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "w")
        self.star: Star | None = None
        self.lives: list[dict] = []

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self) -> float:
        """Begin a life; the seconds until the server was ready."""
        t0 = time.monotonic()
        self.star = start_server(self.pair, self.cfg, port=self.port, stderr=self.log)
        self.lives.append({"started": time.time(), "rss_start_bytes": self.rss(), "rss_end_bytes": None, "stats": None})
        return time.monotonic() - t0

    def stats(self, timeout_s: float = 10.0) -> dict | None:
        """The running life's counters; None when it does not answer."""
        return query_stats(self.address, "soak", timeout_s)

    def sessions(self, timeout_s: float = 10.0) -> int:
        """Sessions open now (-1: no answer)."""
        stats = self.stats(timeout_s)
        return -1 if stats is None else stats["sessions_open"]

    def rss(self) -> int | None:
        star = self.star
        return None if star is None else vm_rss(star.server.pid)

    def end_life(self) -> None:
        """Keep the running life's last counters and RSS (before a kill, or at the end)."""
        life = self.lives[-1]
        stats = self.stats()
        if stats is not None:
            stats.pop("timeline")  # one entry per batch: the run's own samples are enough here
        life["stats"] = stats
        life["rss_end_bytes"] = self.rss()

    def kill(self) -> None:
        self.end_life()
        star = self.star
        self.star = None
        star.server.kill()
        star.server.wait()

    def up(self) -> bool:
        return self.star is not None and self.star.server.poll() is None and self.stats() is not None

    def close(self) -> None:
        if self.star is not None:
            self.star.close()
        self.log.close()


class Host:
    """One replay host process: `size` targets, released by `go`, its JSON lines read on a thread
    into `rows`, each marked with the host's slot, life and deadline."""

    def __init__(self, slot: int, life: int, size: int, duration_s: float, argv: list[str]):
        self.slot = slot
        self.life = life
        self.size = size
        self.duration_s = duration_s  # decoding time from `go` (its --duration-s)
        self.failure: str | None = None  # why it did not start
        self.deadline = float("inf")
        self.rows: list[dict] = []
        self.proc = spawn(argv)
        self._reader = threading.Thread(target=self._read, name=f"soak-host-{slot}", daemon=True)
        self._starter: threading.Thread | None = None

    def ready(self) -> None:
        read_json_line(self.proc, "ready", 300)

    @property
    def released(self) -> bool:
        return self._reader.ident is not None

    def go(self) -> None:
        """Release the targets (they decode for duration_s from now)."""
        self.deadline = time.time() + self.duration_s  # the host's own: it reads `go` after this
        self._send("go")
        self._reader.start()

    def release_later(self) -> None:
        """ready() and go() on a thread of their own (the run goes on while the host starts)."""

        def run():
            try:
                self.ready()
                self.go()
            except (RuntimeError, OSError) as e:
                self.failure = str(e)

        self._starter = threading.Thread(target=run, name=f"soak-start-{self.slot}", daemon=True)
        self._starter.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.rows.append({**json.loads(line), "host": self.slot, "life": self.life, "deadline": self.deadline})

    def _send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stall(self, target: int, seconds: float) -> None:
        if not self.released:  # before `go`, the host would take the line for it
            raise RuntimeError(f"host {self.slot} is not released yet")
        self._send(f"stall {target} {seconds}")

    def stalled(self, target: int) -> dict | None:
        """Target's report of its stall (its index; `resumed`: unix s, `session`: its tag then)."""
        return next((r for r in list(self.rows) if r.get("stalled") == f"replay-{target}"), None)

    def row_after(self, target: int, t: float) -> dict | None:
        """Target's first prompt row with a step that ended after t (unix s)."""
        name = f"replay-{target}"
        return next((r for r in list(self.rows)
                     if r.get("target") == name and any(at > t for at, _ in r.get("trace", ()))), None)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def finish(self, timeout_s: float) -> int:
        """Wait for the host to end (it stops at its deadline); its exit code."""
        if self._starter is not None:
            self._starter.join(timeout=timeout_s)
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if self.released:
            self._reader.join(timeout=10)
        return code


# ---------------------------------------------------------------------------------------- prober
@dataclass(frozen=True)
class Line:
    """One message of a bad-message round: sent on a connection (OWNER or INTRUDER), answered by
    the type `expect` names, or by an Error with that code."""

    name: str
    conn: str
    frames: list
    expect: str

    @property
    def bad(self) -> bool:
        return self.expect != "DraftReply"


def request(tag: int, step: int, tokens: list[int], budget: int = 8, reset: bool = False) -> list:
    """A DraftRequest's frames (a reset carries settings: a 4-deep chain, greedy)."""
    settings = (C.DraftConfig(depth=4, adaptive=False), C.SamplingConfig()) if reset else ()
    return P.encode(*P.draft_request(tag, step, torch.tensor(tokens, dtype=torch.int32), budget, *settings))


def script(tag: int, fingerprint: str, vocab_size: int, prompt: list[int]) -> list[Line]:
    """One round: the OWNER holds session `tag` (just opened) and the INTRUDER, another connection,
    holds none. The owner's reset and its next step must be drafted whatever came between."""
    nothing = [prompt[-1]]
    bad_settings = bytes([P.MsgType.DRAFT_REQUEST]) + msgspec.msgpack.encode(
        [tag, 2, True, {"depth": -3}, {}, 8, [["int32", [1]]]])
    return [
        Line("a draft before any reset", OWNER, request(tag, 0, nothing), "reset_required"),
        Line("the owner's reset", OWNER, request(tag, 1, prompt, reset=True), "DraftReply"),
        Line("garbage frame", INTRUDER, [b"\xee" + os.urandom(15)], "unknown_type"),
        Line("empty frame", INTRUDER, [b""], "empty"),
        Line("undecodable header", INTRUDER, [bytes([P.MsgType.DRAFT_REQUEST]) + b"\xc1\xc1\xc1"], "bad_header"),
        Line("tensor frame missing", INTRUDER, request(tag, 2, nothing)[:1], "bad_frames"),
        Line("tensor frame of the wrong size", INTRUDER, [request(tag, 2, nothing)[0], b"\x00\x00\x00"], "bad_tensor"),
        Line("invalid draft settings", INTRUDER, [bad_settings, b"\x01\x00\x00\x00"], "bad_settings"),
        Line("a Welcome sent to the server", INTRUDER, P.encode(P.Welcome(tag, "soak", 8)), "unexpected"),
        Line("a Pong sent to the server", INTRUDER, P.encode(P.Pong(tag, 0.0)), "unexpected"),
        Line("hello in another protocol version", INTRUDER,
             P.encode(P.Hello(P.PROTOCOL_VERSION + 1, fingerprint, "soak-intruder")), "version"),
        Line("hello with another vocabulary", INTRUDER,
             P.encode(P.Hello(P.PROTOCOL_VERSION, "f" * 16, "soak-intruder")), "vocab_mismatch"),
        Line("another connection's session tag", INTRUDER, request(tag, 2, nothing), "unknown_session"),
        Line("goodbye to another connection's session", INTRUDER, P.encode(P.Bye(tag)), "unknown_session"),
        Line("a step from the future", OWNER, request(tag, 9, nothing), "bad_step"),
        Line("a step repeated", OWNER, request(tag, 1, nothing), "bad_step"),
        Line("a token outside the vocabulary", OWNER, request(tag, 2, [vocab_size]), "bad_tokens"),
        Line("no budget", OWNER, request(tag, 2, nothing, budget=0), "bad_request"),
        Line("the owner's next step", OWNER, request(tag, 2, nothing), "DraftReply"),
    ]


def name_of(msg) -> str | None:
    """What a reply is: an Error's code, else the message type's name (None: no reply)."""
    if msg is None:
        return None
    return msg.code if isinstance(msg, P.Error) else type(msg).__name__


class Prober:
    """Sends one bad-message round to a draft server from two raw DEALER connections and records
    what came back for each message. The owner's session has a heartbeat, as a target's has, so a
    server slow to reach its requests does not free it. A message that gets no answer within
    timeout_s ends the round: answers to later ones could not be told apart."""

    def __init__(self, address: str, fingerprint: str, vocab_size: int, prompt: list[int], timeout_s: float):
        self.address = address
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.prompt = prompt
        self.timeout_s = timeout_s
        ctx = zmq.Context.instance()
        self.socks = {name: ctx.socket(zmq.DEALER) for name in (OWNER, INTRUDER)}
        for sock in self.socks.values():
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        self.heartbeat: Heartbeat | None = None

    def exchange(self, conn: str, frames: list):
        """Send one message; the message that answered it (None: nothing within timeout_s)."""
        sock = self.socks[conn]
        sock.send_multipart(frames, copy=False)
        if not sock.poll(int(self.timeout_s * 1e3)):
            return None
        return P.decode(sock.recv_multipart())[0]

    def round(self) -> list[dict]:
        """Open the owner's session, send the script, say goodbye; one outcome per message sent."""
        hello = P.encode(P.Hello(P.PROTOCOL_VERSION, self.fingerprint, "soak-owner"))
        welcome = self.exchange(OWNER, hello)
        if not isinstance(welcome, P.Welcome):  # no session to aim at: the round cannot be played
            return [{"name": "the owner's hello", "expect": "Welcome", "got": name_of(welcome), "bad": False}]
        tag = welcome.tag
        self.heartbeat = Heartbeat(self.address, lambda: (tag,), 0.25)
        self.heartbeat.start()
        out = []
        for line in script(tag, self.fingerprint, self.vocab_size, self.prompt):
            answer = self.exchange(line.conn, line.frames)
            out.append({"name": line.name, "expect": line.expect, "got": name_of(answer), "bad": line.bad})
            if out[-1]["got"] is None:
                break
        self.socks[OWNER].send_multipart(P.encode(P.Bye(tag)))
        return out

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        for sock in self.socks.values():
            sock.close(linger=100)


# ------------------------------------------------------------------------------------------ run
@dataclass
class Fault:
    """One injected fault: its kind, when (seconds after the release), whether it was survived, and
    its figures (recovery times, messages answered...)."""

    kind: str
    at_s: float
    survived: bool = False
    figures: dict = field(default_factory=dict)


class Soak:
    def __init__(self, args, inputs: harness.Inputs):
        self.args = args
        self.inputs = inputs
        self.sizes = shares(args.targets, args.hosts)
        cfg = C.ServerConfig(max_batch=args.max_batch, max_sessions=2 * args.targets + 8,
                             session_timeout_s=args.session_timeout_s)
        if args.draft_servers < 1:
            raise SettingError(f"--draft-servers must be at least 1, not {args.draft_servers}")
        self.servers = [Server(C.from_args(C.PairConfig, args), cfg, Path(log)) for log in server_logs(args)]
        self.hosts: list[Host] = []
        self.retired: list[Host] = []  # hosts killed
        self.t0 = 0.0  # the release (unix s)
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="soak-sampler", daemon=True)
        self.counts = {"server_kill": args.server_kills, "target_kill": args.target_kills,
                       "slow_target": args.slow_targets, "bad_message": args.bad_rounds}

    @property
    def end(self) -> float:
        return self.t0 + self.args.duration_s

    @property
    def address(self) -> str:
        """Every server's address, comma-separated: what each target is given."""
        return ",".join(server.address for server in self.servers)

    def held(self, servers: list[Server] | None = None, timeout_s: float = 10.0) -> list[int]:
        """The sessions each server holds (of `servers`, default all; -1: no answer)."""
        return [server.sessions(timeout_s) for server in (self.servers if servers is None else servers)]

    def sessions(self) -> int:
        """Sessions open on all the servers together (-1: one did not answer)."""
        held = self.held()
        return -1 if -1 in held else sum(held)

    def host(self, slot: int, life: int, duration_s: float) -> Host:
        argv = harness.replay_command(self.inputs, self.address, self.sizes[slot], self.args.max_new_tokens,
                                      duration_s, self.args.seed + 1000 * slot + life)
        return Host(slot, life, self.sizes[slot], duration_s, argv)

    def release(self) -> None:
        """Start every host and the servers (the hosts' hellos wait for them), then release the
        targets together."""
        self.hosts = [self.host(slot, 0, self.args.duration_s) for slot in range(len(self.sizes))]
        for server in self.servers:
            server.start()
        for h in self.hosts:
            h.ready()
        self.t0 = time.time()
        for h in self.hosts:
            h.go()
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.args.sample_s):
            t = round(time.time() - self.t0, 3)
            every = [server.stats(timeout_s=self.args.sample_s) for server in self.servers]  # None: down
            self.samples.append({"t": t, "lives": [len(server.lives) - 1 for server in self.servers],
                                 "sessions_open": [None if x is None else x["sessions_open"] for x in every],
                                 "replies": [None if x is None else x["replies"] for x in every],
                                 "rss_bytes": [server.rss() for server in self.servers]})

    def run(self, steps: Steps) -> list[Fault]:
        faults = []
        plan = schedule(self.counts, self.args.warmup_s, self.args.duration_s - self.args.recover_s)
        seen = dict.fromkeys(KINDS, 0)
        for at, kind in plan:
            time.sleep(max(0.0, self.t0 + at - time.time()))
            if time.time() > self.end - self.time_needed(kind):
                steps.line(f"{kind}: no time left to inject it and check it (the faults before took long)")
                continue
            steps.begin(f"{kind} {seen[kind] + 1} at {time.time() - self.t0:.0f} s")
            fault = Fault(kind, round(time.time() - self.t0, 2))
            inject = {"server_kill": self.server_kill, "target_kill": self.target_kill,
                      "slow_target": self.slow_target, "bad_message": self.bad_message}[kind]
            inject(fault, seen[kind])
            seen[kind] += 1
            faults.append(fault)
            figures = {k: v for k, v in fault.figures.items() if k != "lines"}
            steps.end(f"{kind} at {fault.at_s:.0f} s: {'survived' if fault.survived else 'NOT SURVIVED'} {figures}")
        return faults

    def time_needed(self, kind: str) -> float:
        """How long before the end of the run a fault must come at the latest, for its check to
        have live targets: a server kill's check waits for the restart, then up to --recover-s for
        them, a target kill's for the session timeout, a slow target's for its stall; bad messages
        need only the server, which outlives the targets."""
        return {"server_kill": self.args.recover_s, "target_kill": self.args.session_timeout_s + 2.0,
                "slow_target": self.args.stall_s + 1.0, "bad_message": 0.0}[kind]

    def server_kill(self, fault: Fault, k: int) -> None:
        victim = self.servers[k % len(self.servers)]
        others = [server for server in self.servers if server is not victim]
        whole = self.whole()
        victim.kill()
        took = None
        if others:  # every live target holds a session on the others
            took = wait_for(lambda: covered(self.held(others, 2.0), self.args.targets), self.args.recover_s, 0.1)
            fault.figures.update(server=k % len(self.servers), whole_before=whole,
                                 takeover_s=None if took is None else round(took, 2))
        fault.figures["restart_s"] = round(victim.start(), 2)
        if others:  # and once it is back, the sessions spread out again
            spread = wait_for(lambda: even(self.held(timeout_s=2.0), self.args.targets), self.args.recover_s, 0.5)
            fault.figures.update(rebalanced_s=None if spread is None else round(spread, 2),
                                 sessions_after=self.held())
            fault.survived = whole and took is not None and spread is not None
            return
        took = wait_for(lambda: self.sessions() == self.args.targets, self.args.recover_s)
        fault.figures["reconnect_s"] = None if took is None else round(took, 2)
        fault.survived = took is not None

    def target_kill(self, fault: Fault, k: int) -> None:
        slot = k % len(self.hosts)
        old = self.hosts[slot]
        whole = self.whole()
        old.kill()
        took = wait_for(lambda: self.sessions() == self.args.targets - old.size,
                        self.args.session_timeout_s + self.args.recover_s)
        new = self.host(slot, old.life + 1, self.end - time.time())
        new.release_later()  # it joins once started, and ends later than the others by as much
        self.hosts[slot] = new
        self.retired.append(old)
        fault.figures.update(host=slot, sessions_killed=old.size, whole_before=whole,
                             reaped_s=None if took is None else round(took, 2))
        fault.survived = whole and took is not None

    def whole(self) -> bool:
        """Whether the servers hold a session for every target (waiting up to --recover-s): what a
        target kill's check counts from."""
        return wait_for(lambda: self.sessions() == self.args.targets, self.args.recover_s) is not None

    def slow_target(self, fault: Fault, k: int) -> None:
        running = [h for h in reversed(self.hosts) if h.released]  # the last first: target kills take the first
        host = running[k % len(running)]
        target = k % host.size
        host.stall(target, self.args.stall_s)
        wait_for(lambda: host.stalled(target) is not None, self.args.stall_s + self.args.recover_s)
        stall = host.stalled(target)
        if stall is not None:
            wait_for(lambda: host.row_after(target, stall["resumed"]) is not None, self.args.recover_s)
        after = None if stall is None else host.row_after(target, stall["resumed"])
        kept = after is not None and stall["session"] != 0 and after["session"] == stall["session"]
        # with several servers the session may move meanwhile to even out their sessions: a move, not a loss
        lost = after is None or stall["session"] == 0 or after["outages"] > stall["outages"]
        fault.figures.update(host=host.slot, target=target, stall_s=self.args.stall_s, stalled=stall is not None,
                             decoded_after=after is not None, session_kept=kept, session_lost=lost)
        fault.survived = not lost

    def bad_message(self, fault: Fault, k: int) -> None:
        rec = self.inputs.recording
        prompt = next(iter(rec.prompts.values()))["prompt_ids"]
        prober = Prober(self.servers[0].address, rec.fingerprint, rec.vocab_size, prompt, self.args.recover_s)
        try:
            lines = prober.round()
        finally:
            prober.close()
        bad = [x for x in lines if x["bad"]]
        played = lines[-1]["name"] == "the owner's next step"  # the script's last line: the round was not cut short
        fault.figures.update(sent=len(bad), error_replies=sum(x["got"] not in (None, "DraftReply") for x in bad),
                             as_expected=sum(x["got"] == x["expect"] for x in bad),
                             owner_intact=played and all(x["got"] == x["expect"] for x in lines if not x["bad"]),
                             lines=lines)
        fault.survived = fault.figures["error_replies"] == len(bad) and fault.figures["owner_intact"]

    def finish(self) -> dict:
        """Wait for the hosts to end; the servers' state at the end."""
        codes = [h.finish(max(0.0, self.end - time.time()) + 120) for h in self.hosts]
        for h in self.retired:
            h.finish(1)
        left = wait_for(lambda: self.sessions() == 0, self.args.session_timeout_s + 5)
        self._stop.set()
        self._sampler.join(timeout=self.args.sample_s + 15)
        up = all(server.up() for server in self.servers)
        for server in self.servers:
            server.end_life()
        failures = sum(c != 0 or h.failure is not None for c, h in zip(codes, self.hosts))
        return {"host_failures": failures, "up_at_end": up,
                "sessions_open_at_end": [(server.lives[-1]["stats"] or {}).get("sessions_open")
                                         for server in self.servers],
                "sessions_freed_at_end": left is not None}

    def rows(self) -> list[dict]:
        return [r for h in (*self.retired, *self.hosts) for r in h.rows]

    def close(self) -> None:
        self._stop.set()
        for h in (*self.hosts, *self.retired):
            if h.proc.poll() is None:
                h.kill()
        for server in self.servers:
            server.close()


def server_logs(args) -> list[str]:
    """Each draft server's log, beside the JSON."""
    stem = str(args.json_out).rsplit(".", 1)[0]
    k = args.draft_servers
    return [f"{stem}-server.log"] if k == 1 else [f"{stem}-server-{j}.log" for j in range(k)]


def covered(held: list[int], targets: int) -> bool:
    """Whether these servers answered and hold a session for every target between them."""
    return -1 not in held and sum(held) == targets


def even(held: list[int], targets: int) -> bool:
    """Whether every target holds a session and no server holds two more than another.

    >>> even([4, 4], 8), even([3, 5], 8), even([4, 3], 8), even([-1, 8], 8)
    (True, False, False, False)
    """
    return covered(held, targets) and max(held) - min(held) <= 1


# ---------------------------------------------------------------------------------------- report
def bad_inputs(faults: list[Fault]) -> dict:
    """The bad-message rounds together: messages sent, Error replies, codes as expected, by code."""
    lines = [x for f in faults if f.kind == "bad_message" for x in f.figures["lines"] if x["bad"]]
    by_code: dict[str, int] = {}
    for x in lines:
        by_code[str(x["got"])] = by_code.get(str(x["got"]), 0) + 1
    return {"sent": len(lines), "error_replies": sum(x["got"] not in (None, "DraftReply") for x in lines),
            "as_expected": sum(x["got"] == x["expect"] for x in lines), "by_reply": by_code}


def verdict(requested: dict[str, int], faults: list[Fault], outputs: dict, end: dict) -> dict[str, bool]:
    """The checks a passing run meets, each by name."""
    injected = {k: sum(f.kind == k for f in faults) for k in KINDS}
    return {"every fault injected": injected == {k: requested[k] for k in KINDS},
            "every fault survived": all(f.survived for f in faults),
            "no output differs": outputs["differing"] == 0, "no token lost": outputs["tokens_lost"] == 0,
            "no target failed": outputs["failed"] == 0 and end["host_failures"] == 0,
            "server up at the end": end["up_at_end"], "every session freed": end["sessions_freed_at_end"]}


def served(lives: list[dict]) -> int:
    """Draft replies sent over all of a server's lives (as last counted in each)."""
    return sum((life["stats"] or {}).get("replies", 0) for life in lives)


def per_server(servers: list[Server]) -> list[dict]:
    return [{"address": server.address, "lives": server.lives, "draft_replies": served(server.lives),
             "rss_start_bytes": server.lives[0]["rss_start_bytes"], "rss_end_bytes": server.lives[-1]["rss_end_bytes"]}
            for server in servers]


def plot(path: str, soak: Soak, faults: list[Fault], rows: list[dict]) -> None:
    """Three panels over the run: system tokens/s with the faults marked, sessions open and RSS of each server."""
    x, y = throughput(rows, soak.t0, soak.args.duration_s, max(1.0, soak.args.duration_s / 120))
    marks = {"server_kill": "v", "target_kill": "x", "slow_target": "s", "bad_message": "^"}
    faults_at = []
    for kind, marker in marks.items():
        at = [f.at_s for f in faults if f.kind == kind]
        faults_at.append({"label": kind, "x": at, "y": [0.0] * len(at), "ls": "none", "marker": marker, "ms": 9})
    t = [s["t"] for s in soak.samples]
    names = ["draft server"] if len(soak.servers) == 1 else [f"server {j}" for j in range(len(soak.servers))]

    def each(key: str, scale: float = 1.0) -> list[dict]:
        return [{"label": name, "x": t, "y": [(s[key][j] or 0) / scale for s in soak.samples]}
                for j, name in enumerate(names)]

    panel_plot(path, [
        {"series": [{"label": "tokens/s", "x": x, "y": y}, *faults_at], "xlabel": "seconds",
         "ylabel": "system tokens / s", "title": f"{soak.args.targets} replay targets, faults marked"},
        {"series": each("sessions_open"), "xlabel": "seconds", "ylabel": "sessions", "title": "Sessions open"},
        {"series": each("rss_bytes", 2**20), "xlabel": "seconds", "ylabel": "MiB", "title": "Draft server resident memory"},
    ])


def show(result: dict, args, png: str) -> None:
    rows = []
    for kind in KINDS:
        mine = [f for f in result["faults"] if f["kind"] == kind]
        rows.append([kind, f"{len(mine)} of {result['requested'][kind]}", sum(f["survived"] for f in mine),
                     recovery(kind, mine)])
    out = result["outputs"]
    bad = result["bad_inputs"]
    servers = result["draft_servers"]
    facts = {
        "served": f"{sum(x['draft_replies'] for x in servers)} draft requests, {out['prompts']} prompts "
                  f"({out['complete']} whole, {out['cut']} cut by the end), {out['tokens']} tokens",
        "outputs": f"{out['differing']} differ from target-only greedy, {out['tokens_lost']} tokens lost, "
                   f"{out['failed']} targets failed",
        "bad inputs": f"{bad['sent']} sent, {bad['error_replies']} Error replies ({bad['as_expected']} with the "
                      f"expected code)",
        **{("draft server" if len(servers) == 1 else f"draft server {j}"):
           f"RSS {mib(x['rss_start_bytes'])} at start, {mib(x['rss_end_bytes'])} at end; {len(x['lives'])} lives"
           for j, x in enumerate(servers)},
        "at the end": f"servers up: {result['end']['up_at_end']}; sessions open: {result['end']['sessions_open_at_end']}",
        "verdict": "PASSED" if result["passed"] else
                   "FAILED: " + ", ".join(k for k, v in result["checks"].items() if not v),
    }
    summary(f"bench soak: {args.targets} replay targets in {args.hosts} hosts, {args.draft_servers} draft server(s), "
            f"{args.duration_s:g} s, faults injected", ["fault", "injected", "survived", "recovery"], rows, facts,
            {"JSON": args.json_out, "plot": png, "server logs": ", ".join(server_logs(args))})


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.0f} MiB"


def recovery(kind: str, faults: list[dict]) -> str:
    """One kind's recovery figures, the worst of its faults."""
    if not faults:
        return "-"
    if kind == "server_kill" and "takeover_s" in faults[0]["figures"]:
        return (f"takeover {longest(faults, 'takeover_s')}, restart {longest(faults, 'restart_s')}, "
                f"spread again {longest(faults, 'rebalanced_s')}")
    if kind == "server_kill":
        return f"restart {longest(faults, 'restart_s')}, reconnect {longest(faults, 'reconnect_s')}"
    if kind == "target_kill":
        return f"sessions reaped in {longest(faults, 'reaped_s')}"
    if kind == "slow_target":
        kept = all(f["figures"]["session_kept"] for f in faults)
        return f"stalled {faults[0]['figures']['stall_s']:g} s, session kept: {kept}"
    answered = sum(f["figures"]["error_replies"] for f in faults)
    return f"{answered} of {sum(f['figures']['sent'] for f in faults)} answered"


def longest(faults: list[dict], key: str) -> str:
    """The longest of a figure in seconds over faults, or "never" where one never came."""
    values = [f["figures"].get(key) for f in faults]
    return "never" if None in values else f"{max(values):.1f} s"


def main(args) -> int:
    inputs = harness.prepare(args)
    expected = {pid: p["continuation"][:args.max_new_tokens] for pid, p in inputs.recording.prompts.items()}
    soak = Soak(args, inputs)
    total = sum(soak.counts.values())
    try:
        with Steps("bench soak", total + 2) as steps:
            steps.begin(f"starting {args.draft_servers} draft server(s) and {args.hosts} replay hosts")
            soak.release()
            steps.end(f"{args.targets} targets released")
            faults = soak.run(steps)
            steps.begin("waiting for the run to end")
            end = soak.finish()
            steps.end()
    finally:
        soak.close()
    rows = soak.rows()
    outputs = tally(rows, expected)
    checks = verdict(soak.counts, faults, outputs, end)
    result = {
        "benchmark": "soak",
        "replay": {"recording": inputs.recording_file, "latency_profile": inputs.latency.to_json()},
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "requested": soak.counts, "faults": [dataclasses.asdict(f) for f in faults],
        "outputs": outputs, "bad_inputs": bad_inputs(faults),
        "draft_servers": per_server(soak.servers), "end": end,
        "timeline": soak.samples, "checks": checks, "passed": all(checks.values()),
    }
    write_json(args.json_out, result)
    png = str(args.json_out).rsplit(".", 1)[0] + ".png"
    plot(png, soak, faults, rows)
    show(result, args, png)
    return 0 if result["passed"] else 1
