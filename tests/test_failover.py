"""A draft server that dies: its targets notice within about a second, decode alone without losing
or repeating a token, and open a new session when a server is back at the address (real processes)."""

import time

import pytest

import tiny
from preloaded import start_server
from starsd.config import DraftConfig, ModelConfig, PairConfig, SamplingConfig, ServerConfig
from starsd.emulate.delay_proxy import DelayProxy
from starsd.models.loading import logits_width, vocab_fingerprint
from starsd.models.pair import Pair
from starsd.spec_decode.decode import speculative, speculative_steps, target_only
from starsd.spec_decode.depth import DepthPolicy
from starsd.spec_decode.drafting import LocalDrafting
from starsd.star.client import DraftClient, query_stats
from starsd.star.remote_drafter import RemoteDrafter
from starsd.star.processes import free_port

DRAFT = DraftConfig(depth=4, adaptive=False)
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target, draft = tiny.save_pair(tmp_path_factory.mktemp("failover"))
    return {"target": target, "draft": draft}


class KillAt(LocalDrafting):
    """A drafter that kills the draft server just before its k-th draft request, and times it (each
    draft waited for, as of a drafter in this process)."""

    def __init__(self, drafter: RemoteDrafter, k: int, kill):
        self.drafter = drafter
        self.device = drafter.device
        self.taps = drafter.taps
        self.k = k
        self.kill = kill
        self.calls = 0
        self.first_after_kill_s = None

    def start(self, *args):
        return self.drafter.start(*args)

    def propose(self, *args, **kw):
        self.calls += 1
        if self.calls == self.k:
            self.kill()
        t0 = time.perf_counter()
        tree = self.drafter.propose(*args, **kw)
        if self.calls == self.k:
            self.first_after_kill_s = time.perf_counter() - t0
        return tree


class Rig:
    """A draft-server process on a fixed port, the tiny target in this process, and a client with a
    session on the server, reached directly or through a proxy that delays each message."""

    def __init__(self, dirs, delay_ms: float | None = None):
        self.pair_cfg = PairConfig(draft=dirs["draft"], dtype="float32", threads=1, draft_quantize="none")
        self.port = free_port()
        self.stars = [start_server(self.pair_cfg, ServerConfig(), port=self.port)]
        self.local = Pair.load(ModelConfig(dirs["target"], dtype="float32"), None)
        self.proxy = None
        address = self.stars[0].address
        if delay_ms is not None:
            self.proxy = DelayProxy(("127.0.0.1", 0), ("127.0.0.1", self.port), delay_ms=delay_ms).start()
            address = f"tcp://127.0.0.1:{self.proxy.port}"
        fingerprint = vocab_fingerprint(self.local.tokenizer, logits_width(self.local.target.model))
        self.client = DraftClient(address, fingerprint, "t")
        self.client.hello()

    @property
    def target(self):
        return self.local.target

    def kill(self) -> None:
        self.stars[-1].server.kill()
        self.stars[-1].server.wait()

    def restart(self) -> None:
        """A new server at the same address."""
        self.stars.append(start_server(self.pair_cfg, ServerConfig(), port=self.port))

    def close_session(self) -> None:
        """The client's session ends, and the server has freed it: its Bye travels on a socket of its
        own, so a ping from another client could otherwise still count it (seen on CI: a target given
        two servers opened at the second and never moved)."""
        self.client.close()
        deadline = time.monotonic() + 10
        while query_stats(self.stars[-1].address)["sessions_open"] and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        self.client.close()
        if self.proxy:
            self.proxy.stop()
        for star in self.stars:
            star.close()


@pytest.fixture
def rig(dirs, request):
    r = Rig(dirs, getattr(request, "param", None))
    yield r
    r.close()


def test_killed_draft_server_targets_go_on_alone_then_reconnect(rig):
    drafter = RemoteDrafter(rig.client)
    killer = KillAt(drafter, 6, rig.kill)
    prompt = [5, 17, 33, 2]
    gen = speculative(rig.target, killer, prompt, 120, DRAFT, GREEDY)
    assert gen.token_ids == target_only(rig.target, prompt, 120, GREEDY).token_ids  # nothing lost or repeated
    assert all(d > 0 for d in gen.depths[:5]) and not any(gen.depths[5:])  # drafted, then alone
    assert killer.first_after_kill_s < 2.5, "the dead server was noticed late"
    assert drafter.down and drafter.outages == 1

    rig.restart()  # back at the same address
    deadline = time.monotonic() + 10
    while not rig.client.reachable() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(drafter.BACKOFF_S[0])
    prompt2 = [9, 8, 7]
    gen2 = speculative(rig.target, drafter, prompt2, 60, DRAFT, GREEDY)
    assert gen2.token_ids == target_only(rig.target, prompt2, 60, GREEDY).token_ids
    assert not drafter.down and gen2.depths[0] > 0 and all(d > 0 for d in gen2.depths[:-1])


def test_a_target_given_two_servers_moves_its_session_when_its_server_dies(rig):
    """Two draft servers; the target's is killed just before its 6th draft. The session moves to
    the other at once (a hello there, then a reset with the whole accepted prefix): the target
    drafts again within 2 s of the kill, and its output is target-only's, nothing lost or repeated."""
    other = start_server(rig.pair_cfg, ServerConfig())
    rig.close_session()  # both servers empty: the session opens at the first listed (placement.py)
    client = DraftClient(f"{rig.stars[0].address},{other.address}", rig.client.fingerprint, "t2")
    try:
        client.hello()
        assert client.address == rig.stars[0].address
        drafter = RemoteDrafter(client)
        killed_at = []
        killer = KillAt(drafter, 6, lambda: (rig.kill(), killed_at.append(time.time())))
        prompt = [5, 17, 33, 2]
        gen = speculative(rig.target, killer, prompt, 120, DRAFT, GREEDY)
        assert gen.token_ids == target_only(rig.target, prompt, 120, GREEDY).token_ids
        assert drafter.moves == 1 and client.address == other.address and not drafter.down
        again = next(end for (end, _), d in zip(gen.trace[6:], gen.depths[6:]) if d)
        assert again - killed_at[0] < 2.0, f"drafting again {again - killed_at[0]:.1f} s after the kill"
        assert query_stats(other.address)["requests"] > 0
    finally:
        client.close()
        other.close()


def test_a_session_follows_its_server_to_a_new_address(rig):
    """Two draft servers; the target's dies and a gateway says it runs at a new address now
    (DraftClient.readdress: a Ray actor started again on another node). The session follows it
    there at the very next draft, not to the other server and not after a silence; the servers'
    loads are read from the new address; the output is target-only's."""
    other, third = start_server(rig.pair_cfg, ServerConfig()), start_server(rig.pair_cfg, ServerConfig())
    rig.close_session()  # both servers empty: the session opens at the first listed
    old = rig.stars[0].address
    client = DraftClient(f"{old},{other.address}", rig.client.fingerprint, "t2")
    try:
        client.hello()
        assert client.address == old
        drafter = RemoteDrafter(client)
        killer = KillAt(drafter, 6, lambda: (rig.kill(), client.readdress(old, third.address)))
        prompt = [5, 17, 33, 2]
        gen = speculative(rig.target, killer, prompt, 120, DRAFT, GREEDY)
        assert gen.token_ids == target_only(rig.target, prompt, 120, GREEDY).token_ids
        assert client.addresses == [third.address, other.address] and client.address == third.address
        assert all(d > 0 for d in gen.depths[:-1]) and drafter.moves == 1  # no step without a draft
        assert query_stats(third.address)["requests"] > 0
        deadline = time.monotonic() + 10
        while third.address not in client.loads.held() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert set(client.loads.held()) == {third.address, other.address}
    finally:
        client.close()
        other.close()
        third.close()


def test_a_target_that_asks_no_draft_still_moves_off_a_dead_server(rig):
    """A target decoding alone (its steps ask for no draft, only keep the session up) whose server
    dies moves its session to the other within seconds, not at its next ask, which may be long
    after: until then it would hold no session anywhere."""
    other = start_server(rig.pair_cfg, ServerConfig())
    rig.close_session()  # both servers empty: the session opens at the first listed
    client = DraftClient(f"{rig.stars[0].address},{other.address}", rig.client.fingerprint, "t2")
    try:
        client.hello()
        assert client.address == rig.stars[0].address
        drafter = RemoteDrafter(client)
        seq = drafter.start([5, 17, 33, 2])
        rig.kill()
        deadline = time.monotonic() + 10
        while (drafter.down or client.address != other.address) and time.monotonic() < deadline:
            drafter.keep_up(seq)
            time.sleep(0.05)
        assert client.address == other.address and not drafter.down and drafter.moves == 1
        assert query_stats(other.address)["sessions_open"] == 1
    finally:
        client.close()
        other.close()


def test_a_hello_refused_for_room_goes_to_the_next_server(rig):
    """The first server has room for no session: a target given two opens its session at the
    second, and drafts there from its first steps."""
    full = start_server(rig.pair_cfg, ServerConfig(max_sessions=1))
    taken = DraftClient(full.address, rig.client.fingerprint, "taken")  # its one session
    taken.hello()
    client = DraftClient(f"{full.address},{rig.stars[0].address}", rig.client.fingerprint, "t2")
    try:
        assert not client.try_hello()
        drafter = RemoteDrafter(client)
        prompt = [5, 17, 33, 2]
        gen = speculative(rig.target, drafter, prompt, 40, DRAFT, GREEDY)
        assert gen.token_ids == target_only(rig.target, prompt, 40, GREEDY).token_ids
        assert client.address == rig.stars[0].address and drafter.moves == 1 and any(gen.depths[:4])
    finally:
        client.close()
        taken.close()
        full.close()


@pytest.mark.parametrize("rig", [150], indirect=True)
def test_slow_draft_server_costs_a_target_almost_no_waiting(rig):
    """Every draft comes 300 ms after its request (a delaying proxy in the path); the tiny target
    decodes a token in milliseconds, so no draft can pay. The target gives each draft the deadline
    its own decode time allows, decodes alone when it passes, and waits ever more rarely (or not at
    all, where the server's figure of its cost per level already says no draft pays)."""
    drafter = RemoteDrafter(rig.client)
    prompt = [5, 17, 33, 2]
    policy = DepthPolicy(4)
    gen = speculative(rig.target, drafter, prompt, 100, DraftConfig(depth=4), GREEDY, policy=policy)
    assert gen.token_ids == target_only(rig.target, prompt, 100, GREEDY).token_ids
    assert drafter.timing.late <= 4  # paused 16, 32, 64 steps after each miss in a row
    assert sum(drafter.timing.wall) < 300, "the target waited out the slow drafts"
    assert not drafter.down, "a slow server is not a dead one"
    gen2 = speculative(rig.target, drafter, [9, 8, 7], 30, DraftConfig(depth=4), GREEDY, policy=policy)
    assert gen2.token_ids == target_only(rig.target, [9, 8, 7], 30, GREEDY).token_ids  # a late reply
    # of the last stream is read and dropped, not taken for the new stream's answer


@pytest.mark.parametrize("rig", [100], indirect=True)
def test_a_draft_in_flight_when_the_server_dies_is_not_awaited_forever(rig):
    """A draft that missed its deadline stays in flight. If its server dies, the next step must
    notice (heartbeat), not wait for that reply step after step; and reconnect once a server is back."""
    cfg = DraftConfig(depth=4)
    drafter = RemoteDrafter(rig.client)
    seq = drafter.start([5, 17, 33, 2], cfg, GREEDY, 4)
    assert len(drafter.propose(seq, [], cfg, GREEDY, max_depth=4, deadline_ms=1)) == 0 and seq.pending
    rig.kill()
    deadline = time.monotonic() + 5
    while rig.client.reachable() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(drafter.propose(seq, [7], cfg, GREEDY, max_depth=4, deadline_ms=1)) == 0
    assert drafter.down and drafter.outages == 1 and not seq.pending
    rig.restart()
    deadline = time.monotonic() + 15
    tree = None
    while time.monotonic() < deadline and not (tree is not None and len(tree)):
        time.sleep(0.2)
        tree = drafter.propose(seq, [], cfg, GREEDY, max_depth=4, deadline_ms=2000)
    assert tree is not None and len(tree) > 0 and not drafter.down  # a new session, from the whole prefix


def test_a_server_restarted_while_the_target_looked_away_is_noticed_at_once(rig):
    """The server dies and is back before the target asks again (it decoded alone meanwhile, or was
    paused): its draft in flight will never be answered and its session is gone, yet the heartbeat
    hears the new server, so nothing looks wrong. The Pongs say the session is unknown, and the next
    step opens a new session and drafts on it, instead of waiting out the client's timeout (60 s)
    for the lost reply, or sending a request the server must refuse."""
    cfg = DraftConfig(depth=4)
    drafter = RemoteDrafter(rig.client)
    seq = drafter.start([5, 17, 33, 2], cfg, GREEDY, 4)
    assert len(drafter.propose(seq, [], cfg, GREEDY, max_depth=4, deadline_ms=0)) == 0 and seq.pending
    rig.kill()
    rig.restart()
    deadline = time.monotonic() + 15
    while not rig.client.session_gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rig.client.session_gone() and rig.client.reachable()
    t0 = time.monotonic()
    tree = drafter.propose(seq, [7], cfg, GREEDY, max_depth=4, deadline_ms=5000)
    assert len(tree) > 0 and not drafter.down and drafter.outages == 1
    assert time.monotonic() - t0 < 5
    assert not rig.client.session_gone()
    stats = query_stats(rig.stars[-1].address)
    assert stats["sessions_open"] == 1 and "unknown_session" not in stats["errors"]


def test_steps_that_ask_no_draft_still_open_and_keep_a_new_session(rig):
    """A target that asks no draft for a while (none pays, or it paused after missed deadlines)
    calls keep_up() at each step: that notices the lost session, says hello and reads the Welcome,
    so the new session is held (its heartbeat pings it) before the target asks again."""
    cfg = DraftConfig(depth=4)
    drafter = RemoteDrafter(rig.client)
    seq = drafter.start([5, 17, 33, 2], cfg, GREEDY, 0)
    rig.kill()
    rig.restart()
    deadline = time.monotonic() + 20
    while (drafter.outages == 0 or drafter.down) and time.monotonic() < deadline:
        drafter.keep_up(seq)
        time.sleep(0.1)
    assert not drafter.down and drafter.outages == 1
    tag = rig.client.tag
    time.sleep(2 * rig.client.heartbeat_s)
    assert not rig.client.session_gone()  # the new session is held
    assert len(drafter.propose(seq, [7], cfg, GREEDY, max_depth=4, deadline_ms=5000)) > 0
    assert rig.client.tag == tag and query_stats(rig.stars[-1].address)["sessions_open"] == 1


@pytest.mark.parametrize("rig", [50], indirect=True)
def test_a_late_draft_is_taken_below_the_tokens_committed_since(rig, dirs):
    """A draft asked without waiting is not lost when it comes late: the next request's call takes
    the part of it below the tokens the target committed meanwhile, asks nothing new, and the stream
    goes on from there; a late draft the committed tokens left is dropped for a fresh one."""
    cfg = DraftConfig(depth=4, min_path_prob=0.0, adaptive=False)
    local = Pair.load(ModelConfig(dirs["target"], dtype="float32"), ModelConfig(dirs["draft"], dtype="float32"))
    prompt = [5, 17, 33, 2]
    own = local.drafter.propose(local.drafter.start(prompt), [], cfg, GREEDY)  # what the server drafts
    drafter = RemoteDrafter(rig.client)
    seq = drafter.start(prompt)
    assert len(drafter.propose(seq, [], cfg, GREEDY, max_depth=4, deadline_ms=0)) == 0  # asked ahead
    assert seq.pending and drafter.timing.ahead == 1 and drafter.timing.late == 0
    assert rig.client.link.sock.poll(10_000)  # it comes back while the target decodes a token alone (a 100 ms
    # round trip through the proxy; a fixed wait for it is a guess at a loaded host's pace)
    first = int(own.tokens[0])
    tree = drafter.propose(seq, [first], cfg, GREEDY, max_depth=4, deadline_ms=0)
    assert seq.behind == 1 and drafter.timing.taken_late == 1 and not seq.pending
    assert tree.tokens.tolist() == own.follow([first]).tokens.tolist() and len(tree) == 3
    assert tree.parents.tolist() == own.follow([first]).parents.tolist()
    # the draft is taken whole: the server's copy of the stream goes on from the path it drafted.
    # A fresh request that misses its deadline is no late draft (its step pauses the policy)
    missed = drafter.propose(seq, tree.tokens.tolist(), cfg, GREEDY, max_depth=4, deadline_ms=1)
    assert len(missed) == 0 and seq.behind == 0 and drafter.timing.late == 1
    fresh = drafter.propose(seq, [], cfg, GREEDY, max_depth=4, deadline_ms=5000)
    again = local.drafter.propose(local.drafter.start(prompt + [first] + tree.tokens.tolist()), [], cfg, GREEDY)
    assert seq.behind == 0 and fresh.tokens.tolist() == again.tokens.tolist()
    assert len(drafter.propose(seq, again.tokens.tolist()[:1], cfg, GREEDY, max_depth=4, deadline_ms=0)) == 0
    assert rig.client.link.sock.poll(10_000)
    wrong = (int(again.tokens[1]) + 1) % 50
    drafter.propose(seq, [wrong], cfg, GREEDY, max_depth=4, deadline_ms=5000)
    assert seq.behind == 0 and drafter.timing.taken_late == 1  # the late one no longer followed: a fresh draft


class Slowed:
    """A target whose passes take `ms` each plus half of that per further token scored."""

    def __init__(self, target, ms: float):
        self.target, self.ms = target, ms
        self.device = target.device

    def start(self, *args):
        return self.target.start(*args)

    def score(self, seq, tree, *args):
        time.sleep(self.ms * (1 + 0.5 * len(tree)) / 1e3)
        return self.target.score(seq, tree, *args)

    def commit(self, seq, verdict):
        return self.target.commit(seq, verdict)


def test_a_target_that_will_not_wait_for_a_slow_server_still_uses_its_drafts(dirs):
    """Every draft comes 600 ms after its request, six of the target's 100 ms passes: waiting for
    it never pays (even 10 right tokens: 11 per 600 + 600 ms, against 1 per 100 ms alone), so the
    target decodes alone and asks ahead, as deep as the tokens it commits while a draft travels
    require; the drafts that come back (the draft model is the target's own here, so they are
    right) are verified below the tokens committed meanwhile. Output unchanged."""
    rig = Rig({"target": dirs["target"], "draft": dirs["target"]}, delay_ms=300)
    try:
        drafter = RemoteDrafter(rig.client)
        prompt = [5, 17, 33, 2]
        # 60 tokens: room for several drafts asked ahead, on a loaded machine too (at 40, a run whose
        # round trips took 400-760 ms took only one of them late). Whole chains: where the policy stops them,
        # at a verified token's 50 ms here, they are too short to reach past the tokens committed meanwhile
        cfg = DraftConfig(depth=10, min_path_prob=0.0, auto_stop=False)
        gen = speculative(Slowed(rig.target, 100), drafter, prompt, 60, cfg, GREEDY, policy=DepthPolicy(10))
        assert gen.token_ids == target_only(rig.target, prompt, 60, GREEDY).token_ids
    finally:
        rig.close()
    assert drafter.timing.ahead >= 2 and drafter.timing.taken_late >= 2
    assert gen.num_steps < len(gen.token_ids) - 4, "late drafts were not accepted"


def test_a_first_draft_not_there_when_the_prefill_ends_is_not_waited_for(dirs):
    """The first draft is asked before the target's prefill, so it is drafted meanwhile. If it has
    not come when the prefill ends (here a 600 ms round trip against a prefill of milliseconds),
    the first step decodes alone at once and the draft is taken at a later step, below the tokens
    committed meanwhile. The policy's first guesses would have waited for it up to ~1 s."""
    rig = Rig({"target": dirs["target"], "draft": dirs["target"]}, delay_ms=300)
    try:
        drafter = RemoteDrafter(rig.client)
        prompt = [5, 17, 33, 2]
        t0 = time.time()
        steps = speculative_steps(Slowed(rig.target, 100), drafter, prompt, 16,
                                  DraftConfig(depth=10, min_path_prob=0.0, auto_stop=False), GREEDY,
                                  policy=DepthPolicy(10))
        first = next(steps)
        first_s = first.end - t0
        rest = list(steps)
    finally:
        rig.close()
    assert first.depth == 0 and first.asked > 0 and first_s < 0.45
    assert first.tokens + [t for s in rest for t in s.tokens] == target_only(rig.target, prompt, 16, GREEDY).token_ids
    assert drafter.timing.taken_late >= 1 and any(s.depth > 0 for s in rest)


def test_a_reply_found_at_a_step_that_asked_none_says_how_late_it_came(dirs):
    """A draft asked ahead whose reply comes within the step, while the stream goes on decoding alone
    for 40 steps: the reply is read at the first of them (keep_up), so the drafter takes it as a token
    late, not 41 (read only at the next draft asked, as it was: a probe's reply 64 steps on then
    said 64 tokens late, and a stream that took its drafts for that late asked none ahead)."""
    rig = Rig(dirs)
    try:
        drafter = RemoteDrafter(rig.client)
        seq = drafter.start([5, 17, 33, 2])
        assert not len(drafter.propose(seq, [], DRAFT, GREEDY, max_depth=3, deadline_ms=0))  # asked ahead
        deadline = time.monotonic() + 10
        drafter.keep_up(seq, unsent=1)  # the first step decoded alone: the reply is found at it, however loaded
        while seq.arrived is None and time.monotonic() < deadline:  # the host (each call the same step again)
            time.sleep(0.05)
            drafter.keep_up(seq, unsent=1)
        for t in range(1, 40):
            drafter.keep_up(seq, unsent=t + 1)
        tree = drafter.propose(seq, [7] * 40, DRAFT, GREEDY, max_depth=3, deadline_ms=0)
    finally:
        rig.close()
    assert drafter.lateness < 1.5 and not len(tree)  # (a draft of a prefix the stream has left)
    assert drafter.timing.ahead >= 1


def test_a_server_too_far_behind_is_not_sent_each_new_prompt(dirs):
    """Drafts come a second after their request, twenty of the target's 50 ms passes, and a draft is
    4 deep: none can pay, so the target stops asking but for a probe now and then (64 steps apart
    here). What it learnt of the server carries over to its next prompt, whose first draft is not
    asked either: a server past saturation would otherwise ingest every new prompt for a draft
    nobody takes. Output unchanged."""
    rig = Rig(dirs, delay_ms=500)
    try:
        drafter = RemoteDrafter(rig.client)
        policy = DepthPolicy(4, explore=64)
        target = Slowed(rig.target, 50)
        speculative(target, drafter, [5, 17, 33, 2], 36, DraftConfig(depth=4), GREEDY, policy=policy)
        assert drafter.lateness >= 3, "the drafts were not seen to come late"  # 1 when on time
        assert drafter.timing.late <= 2, "the target kept waiting for drafts that missed"
        time.sleep(1.1)  # a request still in flight reaches the server
        before = query_stats(rig.stars[0].address)["requests"]
        prompt = [9, 8, 7]
        gen = speculative(target, drafter, prompt, 20, DraftConfig(depth=4), GREEDY, policy=policy)
        time.sleep(1.1)
        asked = query_stats(rig.stars[0].address)["requests"] - before
    finally:
        rig.close()
    assert gen.token_ids == target_only(rig.target, prompt, 20, GREEDY).token_ids
    assert asked == 0, f"{asked} requests for 20 tokens no draft could pay for"


@pytest.mark.parametrize("rig", [300], indirect=True)
def test_a_draft_asked_ahead_does_not_wait_for_a_new_sessions_welcome(rig):
    """Seen on an AMX Xeon (bench elastic): when a second server came, 16 sessions moved to it, a hello
    each, and the step of each that asked a draft ahead waited about 800 ms for the busy new server's
    Welcome. A step that asks ahead goes on at once, and a draft waited for waits for the Welcome no
    longer than its deadline; neither sends a request while no session holds it (the next is a reset
    with the whole prefix, once the Welcome has come), and then the stream drafts. Here every message
    to the server takes 300 ms, so a Welcome comes a second or more after its hello (a new
    connection's handshake too)."""
    client = DraftClient(rig.client.address, rig.client.fingerprint, "late")
    try:
        drafter = RemoteDrafter(client, cohosted=False)
        cfg = DraftConfig(depth=4)
        seq = drafter.start([5, 17, 33, 2])
        t0 = time.monotonic()
        assert len(drafter.propose(seq, [], cfg, GREEDY, max_depth=4, deadline_ms=0)) == 0
        assert time.monotonic() - t0 < 0.2 and drafter.down and not drafter.holds(seq)  # its hello is out
        t0 = time.monotonic()
        assert len(drafter.propose(seq, [], cfg, GREEDY, max_depth=4, deadline_ms=150)) == 0
        assert time.monotonic() - t0 < 0.4 and drafter.down and not drafter.holds(seq)
        tree, deadline = drafter.propose(seq, [7], cfg, GREEDY, max_depth=4, deadline_ms=5000), time.monotonic() + 15
        while not len(tree) and time.monotonic() < deadline:  # a connection's handshake through the delays too
            tree = drafter.propose(seq, [], cfg, GREEDY, max_depth=4, deadline_ms=5000)
        assert len(tree) and not drafter.down and drafter.holds(seq)
    finally:
        client.close()
