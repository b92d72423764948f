"""Pre-drafting (star/ahead.py): drafts made in the draft server's idle time change no output, and
answer the requests whose outcome they assumed."""

import os
import re
import subprocess
import time
import types

import pytest
import torch

from starsd.config import DraftConfig, SamplingConfig, ServerConfig
from starsd.models.drafter import DraftJob
from starsd.spec_decode.decode import speculative, target_only
from starsd.star.client import DraftClient
from starsd.star.remote_drafter import RemoteDrafter
from starsd.star import ahead
from starsd.star.processes import free_port
from starsd.star.server import DraftServer
from starsd.star.sessions import Session
from starsd.star.hosts import on_this_host, server_on_this_host, shares_cores

FP = "f" * 64
CHAIN = DraftConfig(depth=3, min_path_prob=0.0, adaptive=False)
GREEDY = SamplingConfig()
PROMPT = [5, 9, 2, 7, 1]


def snapshot(seq):
    """The committed state: tokens, and the keys and values of the cached ones."""
    return list(seq.tokens), seq.cached, [s.keys[:, :, :seq.cached].clone() for s in seq.kv.layers]


def same(a, b):
    return a[:2] == b[:2] and all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


def test_a_clone_drafts_apart_and_a_stopped_draft_is_the_start_of_the_whole_one(tiny_drafters):
    """A pre-draft runs on a copy of a session's state and leaves the original as it was. Stopped at
    a level boundary (a request came), it holds the levels drafted so far, the same as the start of
    the whole draft, and its state drafts on as if it had run to the end."""
    drafter = tiny_drafters["good"]
    seq = drafter.start(PROMPT)
    tree = drafter.propose(seq, [], CHAIN, GREEDY)
    before = snapshot(seq)
    copy = seq.clone()
    drafter.propose(copy, tree.tokens.tolist()[:2] + [3], CHAIN, GREEDY)
    assert same(snapshot(seq), before) and seq.kept and len(copy.tokens) == len(seq.tokens) + 3
    full = seq.clone()
    whole = drafter.propose(full, [4, 4], CHAIN, GREEDY).tokens.tolist()
    asked = []
    stopped = seq.clone()
    cut = drafter.propose_batch([DraftJob(stopped, [4, 4], CHAIN, GREEDY)],
                                stop=lambda: asked.append(1) or len(asked) == 2)[0]  # before the third level
    assert len(whole) == 3 and cut.tokens.tolist() == whole[:2]
    assert same(snapshot(seq), before)
    after = drafter.propose(stopped, whole[:1] + [6], CHAIN, GREEDY)
    assert torch.equal(after.tokens, drafter.propose(full, whole[:1] + [6], CHAIN, GREEDY).tokens)


def test_each_predrafted_outcome_is_the_draft_its_request_would_get(tiny_drafters):
    """A chain 3 deep has four outcomes worth drafting ahead: accepted whole with the draft's own
    guess of the bonus, or rejected at position j with the draft's runner-up there as the target's
    token. With no tally yet they come whole chain first, then ever shorter; each pre-draft is token for token the
    draft its request gets from the session's state, and a request that brings its tokens takes it."""
    drafter = tiny_drafters["good"]
    s = Session(1, b"peer", "t", seq=drafter.start(PROMPT), draft=CHAIN, sampling=GREEDY)
    job = DraftJob(s.seq, [], CHAIN, GREEDY, max_depth=3)
    chain = drafter.propose_batch([job])[0].tokens.tolist()
    s.last_chain, s.last_second, s.budget = chain, job.second, 4
    assert len(chain) == len(s.last_second) == 3 and all(a != b for a, b in zip(chain, s.last_second))
    assert [short for _, short in ahead.plan([s], rows=4)] == [0, 1, 2, 3]
    state = s.seq.clone()
    for _ in range(4):  # one at a time, the likeliest first
        ahead.predraft(drafter, ahead.plan([s]))
    assert len(s.ahead) == 4 and not ahead.eligible(s)
    whole = next(k for k in s.ahead if len(k) == 4)
    assert list(whole[:3]) == chain
    for tokens in [list(whole)] + [chain[:j] + [s.last_second[j]] for j in range(3)]:
        real = drafter.propose(state.clone(), tokens, CHAIN, GREEDY)
        assert s.ahead[tuple(tokens)].chain == real.tokens.tolist()[:3]
    tokens = chain[:1] + [s.last_second[1]]
    assert ahead.answer(s, tokens, 4, reset=False).chain and s.carry == [] and s.ahead is None
    assert ahead.answer(s, tokens, 4, reset=False) is None  # used up
    ahead.observe(s, tokens)
    ahead.observe(s, chain + [7])
    ahead.observe(s, chain[:1] + [9])
    assert s.shortfall == pytest.approx([ahead.DECAY, 0.0, 1.0 + ahead.DECAY ** 2])  # whole once, 2 short twice
    assert [short for _, short in ahead.plan([s], rows=4)][:2] == [2, 0]
    other = Session(2, b"other", "u", seq=s.seq, draft=CHAIN, sampling=GREEDY, last_chain=chain,
                    last_second=s.last_second, budget=4, shortfall=[0.0, 3.0, 1.0])
    assert [(x.tag, short) for x, short in ahead.plan([s, other], rows=4)] == [(2, 1), (1, 2), (1, 0), (2, 2)]


def test_a_predraft_cut_short_answers_only_a_request_asking_at_most_twice_as_deep():
    def session(cut: bool) -> Session:
        s = Session(1, b"peer", "t")
        s.ahead = {(1, 2): ahead.Outcome(1, cut, None, [], [5, 6], [7, 8])}
        return s

    assert ahead.answer(session(True), [1, 2], 6, reset=False) is None  # 5 deep asked: 2 levels are too few
    assert ahead.answer(session(True), [1, 2], 5, reset=False).chain == [5, 6]
    assert ahead.answer(session(False), [1, 2], 11, reset=False).chain == [5, 6]  # it went as deep as it paid
    assert ahead.answer(session(False), [1, 3], 3, reset=False) is None


class SlowTarget:
    """The tiny target, taking `ms` per verify pass: the draft server is idle meanwhile."""

    def __init__(self, target, ms):
        self.target, self.ms = target, ms
        self.device = target.device

    def start(self, ids):
        return self.target.start(ids)

    def commit(self, seq, verdict):
        self.target.commit(seq, verdict)

    def score(self, seq, tree):
        time.sleep(self.ms / 1e3)
        return self.target.score(seq, tree)


def generate(drafter, target, predraft: bool, n: int = 40, kv_budget_gib: float = 8.0, cohosted: bool = True,
             verify_ms: float = 30):
    """`cohosted`: pre-draft although the target is on this host (it stands for one elsewhere here)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    server = DraftServer(drafter, FP, 128, ServerConfig(bind=address, predraft=predraft, kv_budget_gib=kv_budget_gib,
                                                     predraft_cohosted=cohosted))
    thread = server.start()
    client = DraftClient(address, FP, "t", timeout_s=10, heartbeat_s=0)
    try:
        client.hello()
        got = speculative(SlowTarget(target, verify_ms), RemoteDrafter(client), PROMPT, n, CHAIN, GREEDY)
        return got, server.stats.snapshot(1)["predraft"] | {"requests": server.stats.requests}
    finally:
        client.close()
        server.stop()
        thread.join(timeout=5)


@pytest.mark.parametrize("quality", ["perfect", "good", "random"])
def test_predrafting_changes_no_output(tiny_target, tiny_drafters, quality):
    want = target_only(tiny_target, PROMPT, 40, GREEDY).token_ids
    on, stats = generate(tiny_drafters[quality], tiny_target, predraft=True)
    off, off_stats = generate(tiny_drafters[quality], tiny_target, predraft=False)
    assert on.token_ids == off.token_ids == want
    assert off_stats["outcomes"] == off_stats["hits"] == 0
    assert stats["outcomes"] > 0 and stats["hits"] + stats["misses"] <= on.num_steps
    if quality == "perfect":  # every draft is accepted whole and the bonus guessed: nearly every request hits
        assert stats["hits"] >= on.num_steps - 3 and on.accepted[1:-1] == [3] * (on.num_steps - 2)
    if quality == "random":
        assert stats["misses"] > stats["hits"]


def test_no_predrafting_while_a_target_on_this_host_is_connected(tiny_target, tiny_drafters):
    """The target connects over loopback: it shares this server's cores, and its idle gaps are its
    verify passes, so pre-drafting waits (by default) for it to leave."""
    got, stats = generate(tiny_drafters["perfect"], tiny_target, predraft=True, cohosted=False)
    assert got.token_ids == target_only(tiny_target, PROMPT, 40, GREEDY).token_ids
    assert stats["outcomes"] == stats["hits"] == 0 and stats["requests"] > 0


@pytest.mark.parametrize("address, local", [(None, True), ("127.0.0.1", True), ("127.0.0.53", True), ("::1", True),
                                            ("::ffff:127.0.0.1", True), ("198.51.100.7", False), ("2001:db8::1", False),
                                            ("not an address", False)])
def test_a_peer_on_this_host_is_told_by_its_address(address, local):
    assert on_this_host(address) == local


def test_a_peer_at_one_of_this_hosts_own_addresses_is_on_this_host():
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    own = [a for a in re.findall(r"inet (\S+)/", out) if not a.startswith("127.")]
    if not own:
        pytest.skip("no address beyond loopback on this host")
    assert all(on_this_host(a) for a in own)


def test_a_target_shares_cores_with_a_server_on_its_host_only_at_more_than_half_of_them():
    cores = len(os.sched_getaffinity(0))
    assert shares_cores("tcp://127.0.0.1:5555", cores) and shares_cores("tcp://localhost:5555", cores)
    assert shares_cores("ipc:///tmp/draft", cores)
    assert not shares_cores("tcp://127.0.0.1:5555", cores // 2) or cores == 1
    assert not shares_cores("tcp://198.51.100.7:5555", cores)


def test_a_server_is_on_this_host_whatever_the_threads():
    """What a co-hosted server's drafts cost (spec_decode/depth.py, Source.cohosted) does not depend on threads."""
    assert server_on_this_host("tcp://127.0.0.1:5555") and server_on_this_host("tcp://localhost:5555")
    assert server_on_this_host("ipc:///tmp/draft") and not server_on_this_host("tcp://198.51.100.7:5555")


def test_predrafts_hold_no_more_draft_kv_than_the_budget_leaves_free(tiny_target, tiny_drafters):
    """The tiny draft holds 512 bytes of KV per token, and the session's state 69 columns (35 KiB)
    here. A 160 KiB budget admits the session to its end (counted at up to 154 KiB, with room for a
    draft tree) and leaves room for three copies of its state, so at most three of its four outcomes
    are pre-drafted for a request; with the default budget, all four. Each verify pass takes 150 ms:
    time enough for four outcomes of the tiny draft on a loaded machine, so that the budget, not the
    time, tells the two runs apart."""
    got, stats = generate(tiny_drafters["perfect"], tiny_target, predraft=True, kv_budget_gib=160 / (1 << 20),
                          verify_ms=150)
    assert got.token_ids == target_only(tiny_target, PROMPT, 40, GREEDY).token_ids and got.num_steps <= 12
    assert 0 < stats["outcomes"] <= 3 * stats["requests"]
    _, free = generate(tiny_drafters["perfect"], tiny_target, predraft=True, verify_ms=150)
    assert free["outcomes"] > stats["outcomes"]  # the budget held it back, not the time


def test_recent_busy_reads_only_the_last_seconds(monkeypatch):
    """On a clock that stands still: on the real one, a window's edge inside a batch moved with every ms
    the test took between its batches and its reads (0.01 allowed: 10 ms, which a loaded host can take)."""
    from starsd.star import stats as stats_module
    from starsd.star.stats import ServerStats

    now = 1000.0
    monkeypatch.setattr(stats_module, "time", types.SimpleNamespace(perf_counter=lambda: now, time=lambda: 5000.0,
                                                                    monotonic=lambda: now))
    stats = ServerStats()
    stats.batch(now - 10.0, now - 9.0, 1)  # long ago
    stats.batch(now - 1.5, now - 0.5, 2)
    stats.batch(now - 0.4, now - 0.2, 2)
    assert stats.recent_busy(2.0) == pytest.approx(0.6)
    assert stats.recent_busy(1.0) == pytest.approx(0.7)  # 0.5 of the first recent batch, 0.2 of the next



def test_sessions_whose_requests_come_together_are_predrafted_in_one_batch():
    """The likeliest outcome over all sessions, and with it the likeliest of each session whose last
    request came in one group with its session's (an engine's batch of rows); not of one apart."""
    def session(tag, group, shortfall):
        return Session(tag, b"p%d" % tag, "t", draft=CHAIN, sampling=GREEDY, last_chain=[1, 2, 3],
                       last_second=[4, 5, 6], budget=4, shortfall=shortfall, group=group)

    row0, row1, apart = session(1, 7, [0.0, 3.0]), session(2, 7, [1.0, 1.0]), session(3, 8, [1.0, 0.0, 3.0])
    assert [(s.tag, short) for s, short in ahead.cohort_plan([row0, row1, apart])] == [(1, 1), (2, 0)]
    assert [(s.tag, short) for s, short in ahead.plan([row0, row1, apart])] == [(1, 1)]  # one at a time else
    assert [(s.tag, short) for s, short in ahead.cohort_plan([apart, row1])] == [(3, 2)]  # alone in its group
