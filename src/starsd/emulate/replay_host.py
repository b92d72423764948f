"""Many replay targets in one process: each a thread with its own connection and session.

A replay target costs no compute (it sleeps through its verify latency), so one process can stand
in for N target machines. Each target runs the ordinary draft -> verify -> accept loop
(spec.decode.speculative) against the real draft server. Prints one JSON line per prompt decoded,
marked "replay": true, with the per-iteration trace a benchmark needs.

With --wait-go, stdin stays open after `go` for commands:
- `stall I S`: target I stalls for S seconds at its next step boundary (a slow target), then prints
  {"stalled": name, "seconds": S, "resumed": unix time, "session": its session tag};
- `active N`: targets 0..N-1 decode, the others wait at their next prompt boundary, their sessions
  open and idle (a fleet's load rising and falling; --active sets N at the start, default all);
- `servers A,B,...`: the star's draft servers are these now, as a target server is told by the
  gateway (protocol.DraftServers, star/elastic.py): each target's client is relisted.
Every row says the target's session tag at its end.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from typing import Callable

from starsd.config import ClientKeys, DraftConfig, SamplingConfig
from starsd.emulate.replay import LatencyProfile, Recording, ReplaySequence, ReplayTarget, load_features
from starsd.spec_decode.decode import speculative, target_only, verify_widths
from starsd.spec_decode.depth import DepthPolicy
from starsd.spec_decode.verify import Verdict
from starsd.star.client import DraftClient, for_target
from starsd.star.remote_drafter import RemoteDrafter, Timing


class Host:
    def __init__(self, connect: str, recording: Recording, latency: LatencyProfile, n: int,
                 max_new_tokens: int, draft: DraftConfig, no_spec: bool = False, duration_s: float = 0.0,
                 seed: int = 0, timeout_s: float = 120.0, keys: ClientKeys = ClientKeys(), recording_file: str = "",
                 active: int | None = None):
        if max_new_tokens > recording.max_new_tokens:
            raise ValueError(f"the recording holds {recording.max_new_tokens} tokens per prompt; "
                             f"cannot replay {max_new_tokens}")
        self.connect = connect
        self.recording = recording
        self.latency = latency
        self.n = n
        self.max_new_tokens = max_new_tokens
        self.draft = draft
        self.no_spec = no_spec
        self.duration_s = duration_s
        self.seed = seed
        self.timeout_s = timeout_s
        self.keys = keys
        self.recording_file = recording_file  # its recorded features, for a server that drafts with an EAGLE head
        self._features: dict[tuple[int, ...], dict] = {}
        self.prompts = list(recording.prompts.items())
        self.ready = threading.Barrier(n + 1)
        self.go = threading.Event()
        self.deadline = float("inf")
        self.lock = threading.Lock()
        self.failed = False
        self.stalls: dict[int, float] = {}  # target index -> seconds it stalls at its next step boundary
        self.active = n if active is None else active  # targets 0..active-1 decode (`active N`)
        self.turned = threading.Condition(self.lock)  # notified when `active` changes
        self.clients: dict[int, DraftClient] = {}

    def run(self, wait_go: bool) -> int:
        threads = [threading.Thread(target=self._target, args=(i,), name=f"replay-{i}", daemon=True)
                   for i in range(self.n)]
        for t in threads:
            t.start()
        self.ready.wait()
        if wait_go:
            print(json.dumps({"ready": f"{self.n} replay targets"}), flush=True)
            sys.stdin.readline()
            threading.Thread(target=self._commands, name="replay-commands", daemon=True).start()
        if self.duration_s:
            self.deadline = time.time() + self.duration_s
        self.go.set()
        for t in threads:
            t.join()
        return 1 if self.failed else 0

    def _commands(self) -> None:
        """Read `stall I S`, `active N` and `servers A,B` lines from stdin until it closes."""
        for line in sys.stdin:
            words = line.split()
            try:
                if not words or words[0] not in ("stall", "active", "servers"):
                    raise ValueError(f"unknown command {words[0] if words else ''!r}")
                if words[0] == "servers":
                    with self.lock:
                        clients = list(self.clients.values())
                    for client in clients:
                        client.relist(words[1].split(","))
                    continue
                with self.lock:
                    if words[0] == "stall":
                        self.stalls[int(words[1])] = float(words[2])
                    else:
                        self.active = int(words[1])
                        self.turned.notify_all()
            except (IndexError, ValueError) as e:
                self._emit({"ignored": line.strip(), "why": str(e)})

    def wait_active(self, i: int) -> None:
        """Target i is between two prompts: wait here while it is not active (or until the deadline)."""
        with self.lock:
            while i >= self.active and time.time() < self.deadline:
                self.turned.wait(timeout=min(1.0, max(0.0, self.deadline - time.time())))

    def stall_point(self, i: int, drafter: RemoteDrafter) -> None:
        """Target i is between two steps: stall here if told to."""
        with self.lock:
            seconds = self.stalls.pop(i, 0.0)
        if seconds > 0:
            time.sleep(seconds)
            self._emit({"stalled": f"replay-{i}", "seconds": seconds, "resumed": time.time(),
                        "session": drafter.client.tag, "outages": drafter.outages})

    def share(self, i: int) -> list[tuple[str, dict]]:
        """Target i's prompts: every n-th from i for a fixed run; for a timed run, all, starting at i."""
        if self.duration_s:
            k = i % len(self.prompts)
            return self.prompts[k:] + self.prompts[:k]
        return self.prompts[i::self.n]

    def _target(self, i: int) -> None:
        name = f"replay-{i}"
        client = DraftClient(for_target(self.connect, i), self.recording.fingerprint, name, self.timeout_s,
                             keys=self.keys)
        with self.lock:
            self.clients[i] = client
        try:
            if not self.no_spec:
                client.hello()
        except Exception as e:  # reported below, after the barrier, so the others are not held up
            self._emit({"target": name, "error": str(e)})
            self.failed = True
        self.ready.wait()
        self.go.wait()
        try:
            if not self.failed:
                self._decode(i, name, client)
        except Exception as e:
            self._emit({"target": name, "error": f"{type(e).__name__}: {e}"})
            self.failed = True
        finally:
            client.close()

    def _decode(self, i: int, name: str, client: DraftClient) -> None:
        drafter = RemoteDrafter(client, cohosted=False)  # a target of a host of its own: it computes nothing here
        target = StallingTarget(self.recording, self.latency, seed=self.seed * 100_003 + i,
                                stall=lambda: self.stall_point(i, drafter), features=self.features(client.taps))
        policy = DepthPolicy(self.draft.depth)  # one per target: what it learns carries over its prompts
        rng = random.Random(self.seed * 100_003 + i)
        for w in verify_widths(policy.max_depth):  # what a target process measures before its first stream
            for _ in range(3):  # (spec_decode/decode.py, measure_verify): here, what its passes would wait
                policy.verify_ms.add(w, self.latency.draw(w, rng))
        eos = frozenset(self.recording.eos_ids)
        while True:
            for prompt_id, p in self.share(i):
                self.wait_active(i)
                if time.time() >= self.deadline:
                    return
                drafter.timing = Timing()
                target.verify_ms = []
                started = time.time()
                if self.no_spec:
                    gen = target_only(target, p["prompt_ids"], self.max_new_tokens, SamplingConfig(), eos,
                                      self.deadline)
                else:
                    gen = speculative(target, drafter, p["prompt_ids"], self.max_new_tokens, self.draft,
                                      SamplingConfig(), eos, self.deadline, policy)
                t = drafter.timing
                self._emit({
                    "target": name, "replay": True, "prompt_id": prompt_id, "token_ids": gen.token_ids,
                    "num_steps": gen.num_steps, "mean_accepted": gen.mean_accepted, "seconds": gen.seconds,
                    "tokens_per_s": gen.tokens_per_s, "started": started, "finished": time.time(),
                    "trace": gen.trace, "asked": gen.asked, "depths": gen.depths, "verify_ms": target.verify_ms,
                    "draft": t.summary(), "session": client.tag, "server": client.address, "moves": drafter.moves,
                    "relocations": [list(m) for m in drafter.relocations],
                    "outages": drafter.outages,
                    "requests": {"wall": t.wall, "queue": t.queue, "service": t.service, "batch": t.batch}})
            if not self.duration_s:
                return

    def features(self, taps: tuple[int, ...] | None) -> dict | None:
        """The recorded features the server's EAGLE head needs (None: it needs none), read once."""
        if taps is None:
            return None
        with self.lock:
            if taps not in self._features:
                self._features[taps] = load_features(self.recording_file, taps)
            return self._features[taps]

    def _emit(self, obj: dict) -> None:
        with self.lock:
            print(json.dumps(obj), flush=True)


class StallingTarget(ReplayTarget):
    """A replay target that calls `stall` after each commit, between two steps (where a slow
    target would pause: a GC pause, a preempted VM)."""

    def __init__(self, recording: Recording, latency: LatencyProfile, seed: int, stall: Callable[[], None],
                 features: dict | None = None):
        super().__init__(recording, latency, seed, features)
        self.stall = stall

    def commit(self, seq: ReplaySequence, verdict: Verdict) -> None:
        super().commit(seq, verdict)
        self.stall()
