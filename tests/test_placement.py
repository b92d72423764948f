"""Several draft servers: a target's session goes to the one holding the fewest sessions, and the
sessions spread out again when a server joins (star/placement.py), nothing lost on a move."""

import random
import time

import pytest

import preloaded
import tiny
from starsd.config import DraftConfig, ModelConfig, PairConfig, SamplingConfig, ServerConfig
from starsd.models.loading import logits_width, vocab_fingerprint
from starsd.models.pair import Pair
from starsd.spec_decode.decode import speculative, target_only
from starsd.star.client import DraftClient, for_target, query_stats
from starsd.star.launch import start_server
from starsd.star.placement import least_loaded, should_move
from starsd.star.processes import free_port
from starsd.star.remote_drafter import RemoteDrafter

DRAFT = DraftConfig(depth=4, adaptive=False)
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    target, draft = tiny.save_pair(tmp_path_factory.mktemp("placement"))
    local = Pair.load(ModelConfig(target, dtype="float32"), None)
    return {"pair": PairConfig(draft=draft, dtype="float32", threads=1, draft_quantize="none"), "local": local,
            "fingerprint": vocab_fingerprint(local.tokenizer, logits_width(local.target.model))}


def sessions(address: str) -> int:
    return query_stats(address)["sessions_open"]


def test_the_rule_evens_out_and_leaves_a_difference_of_one():
    assert least_loaded(["b", "a"], {"a": 1, "b": 1}) == "b"  # a tie: the target's own order
    assert least_loaded(["b", "a", "c"], {"a": 0, "b": 2}) == "a"  # c did not answer
    assert least_loaded(["a", "b"], {"a": 0, "b": 2}, skip="a") == "b" and least_loaded(["a"], {}) is None
    rng = random.Random(1)
    assert not any(should_move(m, m - 1, rng) or should_move(m, m, rng) for m in range(1, 50))
    for mine, fewest in ((16, 0), (8, 0), (5, 1), (3, 1)):  # of all that see it, a quarter of the difference
        moved = sum(should_move(mine, fewest, rng) for _ in range(4000 * mine)) / 4000  # moves, one at least
        assert abs(moved - max(1, (mine - fewest) / 4)) < 0.05, (mine, fewest, moved)


def test_a_new_session_opens_at_the_server_holding_fewest(rig):
    star = start_server(rig["pair"], ServerConfig(), count=2)  # the two start side by side
    a, b = star.addresses
    clients = []
    try:
        for _ in range(2):  # two sessions at a, as targets given a alone
            clients.append(DraftClient(a, rig["fingerprint"], "only-a"))
            clients[-1].hello()
        clients.append(DraftClient(f"{a},{b}", rig["fingerprint"], "both"))  # a listed first
        assert clients[-1].address == b
        clients[-1].hello()
        assert (sessions(a), sessions(b)) == (2, 1)
        clients.append(DraftClient(f"{b},{a}", rig["fingerprint"], "both-2"))
        assert clients[-1].address == b  # 1 against 2
    finally:
        for c in clients:
            c.close()
        star.close()


def test_sessions_spread_out_when_a_server_joins_and_nothing_is_lost(rig):
    """Four targets given two servers while only the first is up all open there. The second starts:
    within seconds two sessions move to it (each a hello there and a reset with the whole accepted
    prefix), and every target's output stays target-only decoding's, drafted on both servers."""
    target = rig["local"].target
    a = preloaded.start_server(rig["pair"], ServerConfig())
    port = free_port()
    later = f"tcp://127.0.0.1:{port}"
    listed = f"{a.address},{later}"
    clients = [DraftClient(for_target(listed, i), rig["fingerprint"], f"t{i}") for i in range(4)]
    stars = [a]
    try:
        for c in clients:
            assert c.address == a.address  # the other does not answer
            c.hello()
        drafters = [RemoteDrafter(c) for c in clients]
        prompts = [[5 + i, 17, 33, 2] for i in range(4)]
        seqs = [d.start(p) for d, p in zip(drafters, prompts)]
        stars.append(preloaded.start_server(rig["pair"], ServerConfig(), port=port))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (sessions(a.address) == sessions(later) == 2):
            for d, s in zip(drafters, seqs):  # steps as a decode loop takes them
                d.propose(s, [7], DRAFT, GREEDY)
            time.sleep(0.05)
        assert (sessions(a.address), sessions(later)) == (2, 2)
        assert sum(d.rebalanced for d in drafters) >= 2 and not any(d.outages for d in drafters)
        for d, p in zip(drafters, prompts):
            gen = speculative(target, d, p, 40, DRAFT, GREEDY)
            assert gen.token_ids == target_only(target, p, 40, GREEDY).token_ids
            assert any(gen.depths), f"{d.client.name} drafted nothing after the move"
        assert query_stats(later)["requests"] > 0
    finally:
        for c in clients:
            c.close()
        for star in stars:
            star.close()


def test_no_session_is_moved_to_a_server_that_stopped_answering(rig, monkeypatch):
    """A server's figures stay fresh for seconds after its last answer: a server just killed, holding
    no session, looked the best place, and the sessions that moved there decoded alone until their
    hello gave up (seen in `bench servers`: one of two servers killed, a survivor's session moved to
    it a second later). Only a server that answered the last round of pings is a place to move to."""
    import starsd.star.client as client_module

    monkeypatch.setattr(client_module, "should_move", lambda mine, fewest, rng: True)  # where, not whether
    a, b = preloaded.start_server(rig["pair"]), preloaded.start_server(rig["pair"])
    clients = [DraftClient(f"{a.address},{b.address}", rig["fingerprint"], "both")]
    try:
        clients[0].hello()  # a tie: at a, listed first
        for _ in range(2):
            clients.append(DraftClient(a.address, rig["fingerprint"], "only-a"))
            clients[-1].hello()
        loads = clients[0].loads
        seen = loads.rounds
        while loads.rounds < seen + 3:  # (a Welcome's next two rounds are not judged: DraftClient.better)
            time.sleep(0.05)
        assert clients[0].better() is None  # 3 against 0, but in one round only (hellos may be in flight)
        seen = loads.rounds
        while loads.rounds < seen + 1:
            time.sleep(0.05)
        assert clients[0].better() == b.address  # the same in the next round, both answering: it would move
        b.close()
        t0 = time.monotonic()
        seen = loads.rounds
        while loads.rounds < seen + 2:  # b's figures are still fresh (held) for a few seconds
            time.sleep(0.05)
        assert b.address in loads.held() and time.monotonic() - t0 < loads.fresh_s
        assert clients[0].better() is None
    finally:
        for c in clients:
            c.close()
        a.close()
        b.close()
