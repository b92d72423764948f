"""Draft capacity that follows load (star/elastic.py): the rule, sessions that follow the servers the
star lists (one added: they spread onto it; one retired: they move off it, losing nothing), and the
controller adding a server under load and retiring it idle, on real draft servers; on a local Ray
cluster, draft server actors started and stopped, and `starsd bench elastic` end to end."""

import gzip
import json
import subprocess
import sys
import threading
import time

import pytest

import tiny
from starsd.bench.elastic import drafting
from starsd.config import DraftConfig, ElasticConfig, SamplingConfig, ServerConfig
from starsd.emulate.replay import LatencyProfile
from starsd.errors import SettingError
from starsd.models.drafter import Drafter
from starsd.star.client import DraftClient, query_stats
from starsd.star.elastic import QUIET_S, Controller, Load, decide
from starsd.star.processes import free_port
from starsd.star.remote_drafter import RemoteDrafter
from starsd.star.server import DraftServer

FP = "f" * 64
CFG = DraftConfig(depth=4)
GREEDY = SamplingConfig()
RULE = ElasticConfig(max_servers=3, min_servers=1, high=0.8, low=0.4, high_sessions=3.0, low_sessions=2.0, window=2,
                     retire_window=3, cooldown_s=10.0)


def loads(*servers: tuple[float, float]) -> list[Load]:
    """One reading: (busy, sessions at once) of each server."""
    return [Load(busy, sessions) for busy, sessions in servers]


def test_the_rule_adds_only_when_every_server_is_saturated_and_retires_only_what_the_rest_can_carry():
    full, room = (0.95, 4.0), (0.5, 1.0)

    def action(readings, servers, since_s=60):
        return decide([loads(*r) for r in readings], servers, RULE, since_s).action

    assert action([[full], [(0.9, 3.5)]], 1) == "add"
    assert action([[full, full], [(0.85, 3.0), full]], 2) == "add"
    assert action([[full, room], [full, room]], 2) == "hold"  # one server has room
    assert action([[(0.95, 1.2)], [(1.0, 1.5)]], 1) == "hold"  # busy, but for one or two targets: a server
    # that adapts its depth to its targets keeps itself busy; their drafts do not queue
    assert action([[full]], 1) == "hold"  # one reading of two
    assert action([[full], [full]], 1, since_s=5) == "hold"  # cooling down
    assert action([[full] * 3, [full] * 3], 3) == "hold"  # at the most servers
    idle, pair = [(0.2, 0.2), (0.1, 0.1)], [(0.9, 1.0), (0.95, 1.0)]
    assert action([idle] * 3, 2) == "retire"  # 0.3 busy on one
    assert action([idle] * 2, 2) == "hold"  # a dip two readings long: a retirement looks at three
    assert action([[full, full], idle, idle], 2) == "hold"
    assert action([pair] * 3, 2) == "retire"  # two targets, a server each: one server would draft for 2 at once
    assert action([[(0.9, 1.5), (0.9, 1.5)]] * 3, 2) == "hold"  # 3 at once on one: too many
    assert action([[(0.0, 0.0)]] * 3, 1) == "hold"  # at the fewest
    assert action([[full], idle, idle, idle], 2) == "retire"  # (the 1-server reading: not judged)
    with pytest.raises(SettingError):
        ElasticConfig(max_servers=2, min_servers=3)
    with pytest.raises(SettingError):
        ElasticConfig(low=0.9, high=0.8)
    with pytest.raises(SettingError):
        ElasticConfig(low_sessions=3.0, high_sessions=2.0)


class InProcess:
    """Real draft servers on threads of this process, started and stopped as the controller says."""

    def __init__(self):
        self.running: dict[str, tuple[DraftServer, threading.Thread]] = {}

    def draft_servers(self) -> list[str]:
        return list(self.running)

    def add_draft_server(self) -> str:
        address = f"tcp://127.0.0.1:{free_port()}"
        # conftest's "good" drafter, a server's own
        drafter = Drafter(tiny.perturbed(tiny.tiny_model(seed=1), seed=7, scale=0.1))
        server = DraftServer(drafter, FP, 128, ServerConfig(bind=address, session_timeout_s=30))
        self.running[address] = (server, server.start())
        return address

    def stop_draft_server(self, address: str) -> None:
        server, thread = self.running.pop(address)
        server.stop()
        thread.join(timeout=5)

    def close(self) -> None:
        for address in list(self.running):
            self.stop_draft_server(address)


class Target(threading.Thread):
    """A stream drafting with a RemoteDrafter as a target does, each step committing the draft's first
    token (or a token of its own); `drafts` holds each step's draft for a check against the drafter."""

    def __init__(self, address: str, i: int):
        super().__init__(daemon=True)
        self.client = DraftClient(address, FP, f"t{i}", timeout_s=10, heartbeat_s=0.1)
        self.client.try_hello()
        self.drafter = RemoteDrafter(self.client, cohosted=False)
        self.prompt = [(5 * i + j) % 120 + 1 for j in range(8)]
        self.steps: list[tuple[list[int], list[int]]] = []  # (the tokens, the chain drafted after them)
        self.go = threading.Event()
        self.go.set()
        self.done = threading.Event()
        self.pause_s = 0.0

    def run(self) -> None:
        seq = self.drafter.start(self.prompt)
        new: list[int] = []
        while not self.done.is_set():
            self.go.wait()
            tree = self.drafter.propose(seq, new, CFG, GREEDY, max_depth=4, deadline_ms=5000)
            chain = tree.tokens.tolist()[:1] if len(tree) else []
            if chain:
                self.steps.append((list(seq.tokens), tree.tokens.tolist()))
            new = chain or [(seq.tokens[-1] * 7 + 3) % 120 + 1]
            if len(seq.tokens) > 200:  # a new stream
                seq, new = self.drafter.start(self.prompt), []
            time.sleep(self.pause_s)

    def stop(self) -> None:
        self.done.set()
        self.go.set()
        self.join(timeout=10)
        self.client.close()


def chains_agree(targets: list[Target], drafter) -> int:
    """Each recorded draft equals the drafter's own greedy chain after the same tokens: a session that
    moved (to a server added, or off a retired one) drafts from its whole prefix. Returns the drafts checked."""
    checked = 0
    for target in targets:
        for tokens, chain in target.steps[-5:]:
            seq = drafter.start(tokens[:-1])
            want = drafter.propose(seq, tokens[-1:], CFG, GREEDY).tokens.tolist()
            assert chain == want[:len(chain)]
            checked += 1
    return checked


def wait_for(condition, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_sessions_spread_onto_a_server_listed_and_move_off_one_retired(tiny_drafters):
    servers = InProcess()
    a, b = servers.add_draft_server(), servers.add_draft_server()
    targets = [Target(a, i) for i in range(4)]
    try:
        for t in targets:
            t.pause_s = 0.02
            t.start()
        assert wait_for(lambda: all(len(t.steps) >= 3 for t in targets), 20)
        for t in targets:
            t.client.relist([a, b])  # a server added: the sessions spread (star/placement.py)
        assert wait_for(lambda: (query_stats(b) or {}).get("sessions_open", 0) >= 1, 20)
        for t in targets:
            t.client.relist([b])  # a retired: every session on it moves, with its whole prefix
        assert wait_for(lambda: (query_stats(a) or {}).get("sessions_open", -1) == 0, 20)
        before = [len(t.steps) for t in targets]
        assert wait_for(lambda: all(len(t.steps) > n + 2 for t, n in zip(targets, before)), 20)
        assert all(t.client.address == b for t in targets)
        assert chains_agree(targets, tiny_drafters["good"]) >= 4 * 5
    finally:
        for t in targets:
            t.stop()
        servers.close()


def test_the_controller_adds_a_server_under_load_and_retires_it_when_the_load_goes(tiny_drafters):
    """Eight streams drafting without pause keep one server busy: a second is added and the targets
    are told; the streams then pause long between steps: the second server is retired, its sessions
    moved first, and nothing the streams drafted differs from the drafter's own chains."""
    servers = InProcess()
    first = servers.add_draft_server()
    targets = [Target(first, i) for i in range(8)]
    listed: list[list[str]] = []

    def tell(addresses: list[str]) -> None:  # what the gateway does: every target is told
        listed.append(list(addresses))
        for t in targets:
            t.client.relist(addresses)

    rule = ElasticConfig(max_servers=2, min_servers=1, high=0.6, low=0.3, high_sessions=1.5, low_sessions=0.5,
                         window=2, retire_window=2, cooldown_s=2.0, interval_s=0.5, drain_s=10.0)
    controller = Controller(servers, rule, tell)
    try:
        for t in targets:
            t.start()
        controller.start()
        assert wait_for(lambda: controller.counts.decisions["add"] >= 1, 60), controller.counts.last
        assert len(listed[-1]) == 2 and controller.counts.servers == 2
        for t in targets:
            t.pause_s = 1.0  # the load goes
        assert wait_for(lambda: controller.counts.decisions["retire"] >= 1, 60), controller.counts.last
        assert listed[-1] == [first] and servers.draft_servers() == [first]
        before = [len(t.steps) for t in targets]
        assert wait_for(lambda: all(len(t.steps) > n for t, n in zip(targets, before)), 30)  # drafting on
        assert chains_agree(targets, tiny_drafters["good"]) >= 8
    finally:
        controller.stop()
        for t in targets:
            t.stop()
        servers.close()


def test_a_retired_server_holding_only_an_idle_session_stops_without_waiting_out_the_drain(tiny_drafters):
    """Two servers and no load: the last added is retired. A stream that drafted on it and then paused
    keeps an idle session there: the server stops once no draft has been asked of it for QUIET_S, not
    after drain_s (60 s), and the stream, back, drafts on the first server from its whole prefix."""
    servers = InProcess()
    first, last = servers.add_draft_server(), servers.add_draft_server()
    idle = Target(last, 0)

    def tell(addresses: list[str]) -> None:
        idle.client.relist(addresses)

    rule = ElasticConfig(max_servers=2, min_servers=1, low=0.3, low_sessions=0.5, retire_window=2, cooldown_s=0.0,
                         interval_s=0.5, drain_s=60.0)
    controller = Controller(servers, rule, tell)
    try:
        idle.start()
        assert wait_for(lambda: len(idle.steps) >= 3, 20)
        idle.go.clear()  # it pauses at its next step: its session on `last` idles
        time.sleep(0.5)
        began = time.monotonic()
        controller.start()
        assert wait_for(lambda: controller.counts.decisions["retire"] >= 1, 30), controller.counts.last
        assert time.monotonic() - began < QUIET_S + 10 and servers.draft_servers() == [first]
        assert query_stats(last, timeout_s=1.0) is None  # stopped
        before = len(idle.steps)
        idle.go.set()
        assert wait_for(lambda: len(idle.steps) > before + 2, 30)
        assert idle.client.address == first and chains_agree([idle], tiny_drafters["good"]) >= 3
    finally:
        controller.stop()
        idle.stop()
        servers.close()


def test_a_target_that_joins_after_a_server_moved_is_told_where_it_runs_now():
    """The gateway lists the servers to targets that join later: a server that moved since it was
    listed is listed at its new address (listed at the old one, a target would draft on a dead one)."""
    from starsd.serve.pool import Pool

    pool = Pool([], max_queue=1, step_timeout_s=1.0)
    pool.draft_servers(["tcp://10.0.0.1:1", "tcp://10.0.0.2:1"])
    pool.draft_moved("tcp://10.0.0.1:1", "tcp://10.0.0.3:1")
    assert pool.listed == ("tcp://10.0.0.3:1", "tcp://10.0.0.2:1")
    pool.close()


@pytest.mark.alone  # its controller reads tiny draft servers on a local Ray cluster every 2 s: under the
# parallel suite's load, a reading late by more than its interval voided the readings until the run ended
def test_bench_elastic_adds_a_server_under_load_and_retires_it_when_the_targets_go(tmp_path):
    """`starsd bench elastic`, short, on tiny models: replay targets against draft server actors of a
    local one-node Ray cluster, the controller adding one under load and retiring it once the targets
    are gone (thresholds low enough for a tiny model's load): RayStar starts the added actor's server
    with the star's keys (the controller reads it with them), and stops it when it retires; every
    decision in /metrics, and nothing the targets decode differs from the recording (a replay target
    stops at the first token that does, and the run fails)."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'starsd[ray]')")
    target_dir, draft_dir = tiny.save_pair(tmp_path)
    latency = tmp_path / "latency.json"
    latency.write_text(json.dumps(LatencyProfile({1: (100.0,), 16: (110.0,)}, "test", {50: (100.0,)}).to_json()))
    out = tmp_path / "elastic.json"
    run = subprocess.run(
        [sys.executable, "-m", "starsd.cli", "bench", "elastic", "--phases", "4:25,0:25", "--settle-s", "2",
         "--baseline-s", "3", "--elastic-high", "0.002", "--elastic-low", "0.001", "--elastic-high-sessions", "0.002",
         "--elastic-low-sessions", "0.001", "--elastic-window", "2", "--elastic-retire-window", "2",
         "--elastic-cooldown-s", "3", "--elastic-interval-s", "2", "--elastic-drain-s", "5",
         "--limit", "4", "--max-new-tokens", "24", "--latency", str(latency), "--target", target_dir,
         "--draft", draft_dir, "--dtype", "float32", "--draft-quantize", "none", "--cache-dir", str(tmp_path / "cache"),
         "--json-out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and out.exists(), run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [d["action"] for d in result["decisions"]] == ["add", "retire"], result["decisions"]
    assert result["decision_counts"] == {"add": 1, "retire": 1}
    assert result["checks"]["decisions_in_metrics"] and result["checks"]["tokens_lost"] == 0
    assert result["checks"]["retired_servers_answering"] == []  # the retired actor's server stopped
    assert result["metrics"]['starsd:elastic_draft_servers'] == 1.0
    busy = result["phases"][0]
    assert busy["targets"] == 4 and busy["servers"]["most"] == 2 and busy["min_over_alone"] > 0
    work = busy["drafting"]  # what the answers begun in its window did with drafts
    assert work["answers"] > 0 and work["steps"] >= work["answers"] and 0 < work["drafted"] <= work["steps"]
    assert result["phases"][1]["servers"]["at_end"] == 1
    assert [x["servers"] for x in result["listed"]][-1] == [result["listed"][0]["servers"][0]]  # the first stays
    with gzip.open(tmp_path / "elastic.rows.gz", "rt") as f:  # each answer's rows, kept to be read again
        kept = json.load(f)
    assert len(kept["starts"]) == 2 and drafting(kept["rows"], kept["starts"][0] + 2, kept["starts"][1]) == work


def test_a_wait_figure_of_a_load_that_has_gone_is_forgotten(monkeypatch):
    """Seen on the ramp (bench elastic): 30 of 32 targets left a server whose last requests had waited
    2-3 s. The server kept saying so (the median of its last requests, however old), and each of the
    two targets that stayed kept its own last reply's figure: both asked for no draft for minutes on
    an idle server. A server's figure is of its last 10 s (0 when nothing came: nothing queues), a
    drafter's own of its last reply for as long."""
    from starsd.star import stats as stats_module
    from starsd.star.stats import ServerStats

    stats = ServerStats()
    assert stats.wait_ms() == -1.0  # none answered yet
    for _ in range(5):
        stats.replied(2500.0)
    assert stats.wait_ms() == 2500.0
    now = time.monotonic()
    monkeypatch.setattr(stats_module.time, "monotonic", lambda: now + stats_module.WAIT_WINDOW_S + 1)
    assert stats.wait_ms() == 0.0
    stats.replied(40.0)
    assert stats.wait_ms() == 40.0
    monkeypatch.undo()

    client = DraftClient("tcp://127.0.0.1:9", FP, "alone")  # no server: its figure is none (0)
    try:
        drafter = RemoteDrafter(client, cohosted=False)
        drafter.reply_ms, drafter.reply_at = 2500.0, time.monotonic()
        assert drafter.server_ms == 2500.0
        drafter.reply_at -= stats_module.WAIT_WINDOW_S + 1
        assert drafter.server_ms == 0.0
    finally:
        client.close()
