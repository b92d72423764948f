"""The draft server's rules, with the server running in this process (real ZeroMQ sockets)."""

import threading
import time

import pytest
import torch

from starsd.config import DraftConfig, SamplingConfig, ServerConfig
from starsd.star import protocol as P
from starsd.star.client import DraftClient, DraftServerError
from starsd.star.connection import Connections
from starsd.star.remote_drafter import RemoteDrafter
from starsd.star.processes import free_port
from starsd.star.server import DraftServer, _to_ingest
from starsd.star.transport import Request

FP = "f" * 64
GREEDY = SamplingConfig()
CHAIN = (DraftConfig(depth=3, min_path_prob=0.0, adaptive=False), GREEDY)


@pytest.fixture
def make_server(tiny_drafters):
    servers = []

    def make(**cfg):
        address = f"tcp://127.0.0.1:{free_port()}"
        server = DraftServer(tiny_drafters["good"], FP, 128, ServerConfig(bind=address, **cfg))
        servers.append((server, server.start()))
        return server, address

    yield make
    for server, thread in servers:  # wait for each to close its sockets before the process exits
        server.stop()
        thread.join(timeout=5)


def client(address, fp=FP):
    c = DraftClient(address, fp, "t", timeout_s=10, heartbeat_s=0)
    c.hello()
    return c


def test_sessions_are_bounded(make_server):
    server, address = make_server(max_sessions=2)
    a, b = client(address), client(address)
    with pytest.raises(DraftServerError, match="too_many_sessions"):
        client(address)
    a.close()
    deadline = time.monotonic() + 5
    while len(server.sessions) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    c = client(address)  # room again once a session ends
    c.close()
    b.close()


def test_silent_session_times_out(make_server):
    server, address = make_server(session_timeout_s=0.5)
    a = client(address)
    a.draft([1, 2, 3], 5, *CHAIN)
    assert wait_for(lambda: a.tag not in server.sessions, within_s=10)  # reaped within about 0.6 s; a loaded
    # host's compute loop may come round later
    with pytest.raises(DraftServerError, match="unknown_session"):
        a.draft([4], 5, None)


def test_request_before_reset_and_bad_tokens_are_refused(make_server):
    server, address = make_server()
    a = client(address)
    with pytest.raises(DraftServerError, match="reset_required"):
        a.draft([1], 5, None)
    with pytest.raises(DraftServerError, match="bad_tokens"):
        a.draft([1, 500], 5, *CHAIN)
    reply, tensors = a.draft([1, 2], 5, *CHAIN)
    assert tensors[0].shape[0] == 3 and reply.batch_size == 1


def test_serial_mode_never_batches(make_server):
    server, address = make_server(serial=True)
    clients = [client(address) for _ in range(4)]
    errors = []

    def work(c, seed):
        try:
            c.draft([seed, seed + 1], 50, *CHAIN)
            for t in range(10):
                c.draft([(seed + t) % 100 + 1], 50, None)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(c, 10 * i + 1)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    snap = server.stats.snapshot(len(server.sessions))
    assert snap["batch_sizes"] == {"1": 44}


def test_two_requests_of_one_session_in_flight_are_served_in_order(make_server):
    """A second request queued behind the first is deferred to the next batch, not drafted twice
    in one batch (which corrupted the session's cache)."""
    server, address = make_server()
    ref, eager = client(address), client(address)
    steps = [[5, 6, 7], [8], [9, 10]]
    want = [ref.draft(steps[0], 50, *CHAIN)[1][0].tolist()] + [ref.draft(t, 50, None)[1][0].tolist() for t in steps[1:]]
    eager.draft(steps[0], 50, *CHAIN)
    for t in steps[1:]:  # both sent before either reply is read
        tok = torch.tensor(t, dtype=torch.int32)
        eager._send(P.DraftRequest(eager.tag, eager.step, False, None, None, 50, P.specs(tok)), (tok,))
        eager.step += 1
    got = [eager._receive(P.DraftReply)[1][0].tolist() for _ in steps[1:]]
    assert got == want[1:]


def test_stop_is_prompt_however_long_the_queue(tiny_drafters):
    """A stopped server finishes the batch in hand and exits. It used to hang for good: the IO
    thread had gone, and handing it the batch's reply blocked the compute loop forever (a draft
    server under load ignored SIGTERM); and a serial server drafted its whole queue first."""

    began = []  # when each batch began (monotonic s)

    class Slow:
        model = tiny_drafters["good"].model
        device = tiny_drafters["good"].device  # without it every request was refused at once (internal): no queue
        taps = None

        def propose_batch(self, jobs, stop=None, done=None):
            began.append(time.monotonic())
            time.sleep(0.3)
            return tiny_drafters["good"].propose_batch(jobs, stop=stop, done=done)

        def start(self, prompt_ids):
            return tiny_drafters["good"].start(prompt_ids)

    address = f"tcp://127.0.0.1:{free_port()}"
    server = DraftServer(Slow(), FP, 128, ServerConfig(bind=address, serial=True))
    thread = server.start()
    clients = [DraftClient(address, FP, "t", timeout_s=3, heartbeat_s=0) for _ in range(8)]
    for c in clients:
        c.hello()

    def ask(c):
        try:
            c.draft([1, 2, 3], 5, *CHAIN)
        except DraftServerError:
            pass

    askers = [threading.Thread(target=ask, args=(c,)) for c in clients]
    for a in askers:
        a.start()
    warm = len(began)  # the warm-up's batches
    # the server drafts the first of the 8 requests, more wait behind it (2.4 s of work in all)
    assert wait_for(lambda: len(began) > warm and server.q_in.qsize() + len(server._waiting) > 0)
    stopped = time.monotonic()
    server.stop()
    thread.join(timeout=5)
    # Counted, not timed (a loaded host slows the batch in hand too): one batch may have begun as the
    # stop came, never the rest of the queue
    assert not thread.is_alive() and len([t for t in began if t > stopped]) <= 1
    for a in askers:
        a.join()
    for c in clients:
        c.link.close(0)


class Gated:
    """The tiny draft model, behind a gate the test can close: a closed gate holds the compute loop
    inside its next batch until the test opens it (a draft server that is busy, on purpose)."""

    def __init__(self, inner):
        self.inner = inner
        self.device = inner.device
        self.model = inner.model
        self.taps = inner.taps
        self.closed = threading.Event()
        self.entered = threading.Event()
        self.opened = threading.Event()

    def start(self, prompt_ids):
        return self.inner.start(prompt_ids)

    def propose_batch(self, jobs, stop=None, done=None):
        if self.closed.is_set():
            self.entered.set()
            self.opened.wait(10)
        return self.inner.propose_batch(jobs, stop=stop, done=done)


def test_a_request_refused_as_busy_costs_one_draft_not_the_session(tiny_target, tiny_drafters):
    """A `busy` refusal is not taken by the server. The client used to advance its step anyway, so
    every later request of the session was refused as bad_step and the generation failed. Now the
    target decodes that step without a draft, sends its tokens with the next request, and the
    output is still target-only greedy decoding."""
    from starsd.spec_decode.decode import speculative, target_only
    from starsd.star.remote_drafter import RemoteDrafter

    gated = Gated(tiny_drafters["good"])
    address = f"tcp://127.0.0.1:{free_port()}"
    server = DraftServer(gated, FP, 128, ServerConfig(bind=address, queue_limit=1))
    thread = server.start()
    blocker, filler, me = (client(address) for _ in range(3))
    for c in (blocker, filler):
        c.draft([1, 2, 3], 5, *CHAIN)
    background = []

    def fill_the_server():
        """The blocker's request holds the compute loop; the filler's fills Q_in (limit 1)."""
        gated.closed.set()
        background.append(threading.Thread(target=blocker.draft, args=([4], 5)))
        background[-1].start()
        assert gated.entered.wait(10)
        background.append(threading.Thread(target=filler.draft, args=([4], 5)))
        background[-1].start()
        deadline = time.monotonic() + 10
        while server.q_in.qsize() < 1 and time.monotonic() < deadline:
            time.sleep(0.005)

    def release():
        gated.closed.clear()
        gated.opened.set()
        for t in background:
            t.join(10)

    class Target:  # the tiny target, filling the server after its 2nd verify and releasing it after its 3rd
        device = tiny_target.device
        start = tiny_target.start
        commit = tiny_target.commit
        calls = 0

        def score(self, seq, tree):
            Target.calls += 1
            if Target.calls == 2:
                fill_the_server()
            if Target.calls == 3:
                release()
            return tiny_target.score(seq, tree)

    drafter = RemoteDrafter(me)
    prompt = [9, 8, 7]
    got = speculative(Target(), drafter, prompt, 40, CHAIN[0], GREEDY)
    assert got.token_ids == target_only(tiny_target, prompt, 40, GREEDY).token_ids
    assert drafter.timing.refused == 1 and got.accepted[2] == 0  # the 3rd step went without a draft
    assert drafter.timing.batch[2] == 0 and 0 not in drafter.timing.batch[:2] + drafter.timing.batch[3:]
    assert len(drafter.timing.wall) == sum(d > 0 for d in got.asked)  # one entry per request, in step
    for c in (blocker, filler, me):
        c.close()
    server.stop()
    thread.join(timeout=5)


def test_batches_take_the_oldest_then_next_steps_before_new_prompts_within_a_token_budget(tiny_drafters):
    """New prompts (resets) beside streams' next steps: each batch holds the oldest request, then
    the steps before the prompts, and ingests at most batch_tokens tokens (a long prompt that is
    the oldest goes alone); serial drafts in arrival order. Requests of freed sessions are dropped."""
    drafter = tiny_drafters["good"]

    def waiting(server, sizes):
        out = []
        for k, (prompt, new, reset) in enumerate(sizes):
            s = server.sessions.open(b"p%d" % k, P.Hello(P.PROTOCOL_VERSION, FP, f"t{k}"))
            s.seq = drafter.start(list(range(1, prompt + 1)))
            if not reset:
                s.seq.cached = prompt  # as if drafted before: only the request's tokens are new
            t = torch.ones(prompt if reset else new, dtype=torch.int32)
            msg = P.DraftRequest(s.tag, 1, reset, CHAIN[0] if reset else None, GREEDY if reset else None, 4,
                                 P.specs(t))
            out.append((s, Request(b"p%d" % k, msg, (t,), 0.0)))
        return out

    def batches(server):
        out = []
        while batch := server._next_batch():
            out.append([_to_ingest(s, r) for s, r in batch])
        return out

    sizes = [(60, 0, True), (300, 0, True), (20, 2, False), (70, 0, True), (20, 1, False), (30, 0, True),
             (20, 3, False), (20, 1, False)]
    server = DraftServer(drafter, FP, 128, ServerConfig(max_batch=3, batch_tokens=100))
    server._waiting = waiting(server, sizes)
    assert batches(server) == [[60, 2, 1], [300], [70, 3, 1], [30]]
    serial = DraftServer(drafter, FP, 128, ServerConfig(serial=True))
    serial._waiting = waiting(serial, sizes)
    assert batches(serial) == [[60], [300], [2], [70], [1], [30], [3], [1]]
    server._waiting = waiting(server, sizes[:3])
    server.sessions.free(server._waiting[0][0], "bye")
    assert batches(server) == [[300], [2]]


def test_a_bye_is_taken_while_the_queue_is_full(tiny_drafters):
    """A Bye that came while Q_in was full was refused as busy, like a draft request, and its
    session kept its draft KV until it timed out (120 s). A Bye is always taken: the session goes
    as soon as the compute loop is free again."""
    gated = Gated(tiny_drafters["good"])
    address = f"tcp://127.0.0.1:{free_port()}"
    server = DraftServer(gated, FP, 128, ServerConfig(bind=address, queue_limit=1, session_timeout_s=120,
                                                  predraft=False))
    thread = server.start()
    blocker, filler, leaver = (client(address) for _ in range(3))
    for c in (blocker, filler, leaver):
        c.draft([1, 2, 3], 5, *CHAIN)  # each session holds draft KV
    background = [threading.Thread(target=c.draft, args=([4], 5)) for c in (blocker, filler)]
    try:
        gated.closed.set()
        background[0].start()  # the blocker's request holds the compute loop
        assert gated.entered.wait(10)
        background[1].start()  # the filler's fills Q_in (limit 1)
        assert wait_for(lambda: server.q_in.qsize() == 1)
        leaver.close()  # its Bye comes while Q_in is full
        assert wait_for(lambda: server.q_in.qsize() == 2 or "busy" in server.stats.errors)
        assert "busy" not in server.stats.errors
    finally:
        gated.closed.clear()
        gated.opened.set()
        for t in background:
            t.join(10)
    assert wait_for(lambda: leaver.tag not in server.sessions)
    assert len(server.sessions) == 2
    for c in (blocker, filler):
        c.close()
    server.stop()
    thread.join(timeout=5)


def wait_for(condition, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def kept_for(sessions, tag: int) -> list[str]:
    """The names of the Sessions' dicts that still hold `tag`: after its session is freed, none."""
    return [name for name, value in vars(sessions).items() if isinstance(value, dict) and dict.__contains__(value, tag)]


def test_a_ping_for_a_freed_or_unknown_session_is_answered_unknown_and_leaves_nothing(make_server):
    server, address = make_server()
    gone = client(address)
    tag = gone.tag
    gone.close()
    assert wait_for(lambda: tag not in server.sessions)
    pinger = DraftClient(address, FP, "p", timeout_s=10, heartbeat_s=0)
    for t in (tag, 12345):
        pinger._send(P.Ping(t, time.time()))
        pong, _ = pinger._receive(P.Pong)
        assert not pong.known
        assert kept_for(server.sessions, t) == []
    pinger.close()


def test_a_ping_racing_with_free_leaves_nothing_of_the_session(tiny_drafters):
    """The IO thread's heartbeat found the tag live, the compute loop freed its session, and then
    the heartbeat wrote the tag's ping time into a dict free had already cleared: an entry leaked
    per such session, forever. Driven here in that order: the session is freed within the lookup."""
    sessions = DraftServer(tiny_drafters["good"], FP, 128, ServerConfig()).sessions
    s = sessions.open(b"peer", P.Hello(P.PROTOCOL_VERSION, FP, "t"))

    def free_now():  # the compute loop's turn: once, while the session is still held
        if dict.__contains__(sessions._by_tag, s.tag):
            sessions.free(s, "bye")

    class FreedAfterLookup(dict):
        def __contains__(self, tag):
            found = dict.__contains__(self, tag)
            free_now()
            return found

        def get(self, tag, default=None):
            found = dict.get(self, tag, default)
            free_now()
            return found

        def __getitem__(self, tag):
            found = dict.__getitem__(self, tag)
            free_now()
            return found

    sessions._by_tag = FreedAfterLookup(sessions._by_tag)
    assert sessions.heartbeat(s.tag)  # held when the ping came in
    assert not dict.__contains__(sessions._by_tag, s.tag)
    assert kept_for(sessions, s.tag) == []


def test_a_welcome_says_what_a_drafted_level_has_cost_lately(make_server):
    """The server's warm-up's steps before any target comes (a prompt's first draft ingests it: not
    what a level costs); after a few steps, each new session's Welcome gives the median time per
    level per stream of the recent step batches (a new stream's prior: spec_decode/depth.py, server_prior)."""
    server, address = make_server()
    warm = len(server.stats.levels)
    a = client(address)
    assert warm == 3 and 0 < a.level_ms == server.stats.level_ms()
    tokens = [1, 2, 3]
    a.draft(tokens, 5, *CHAIN)
    assert len(server.stats.levels) == warm
    for t in range(4, 10):
        a.draft([t], 5)
    b = client(address)
    assert 0 < b.level_ms == server.stats.level_ms() < 1e3 and len(server.stats.levels) == warm + 6
    a.close()
    b.close()


def test_a_welcome_says_what_a_prompt_token_costs_the_server(make_server):
    """The warm-up ends with a prompt of a warm model; its time, less its one drafted level, per token
    is what a new stream's prompt costs the server to ingest. Each Welcome says it: a target on the
    server's host weighs its first draft with it (spec_decode/depth.py, Situation.catch_up_pays)."""
    server, address = make_server()
    a = client(address)
    assert 0 < a.ingest_ms == server.stats.ingest_ms() < 1e3
    assert RemoteDrafter(a).ingest_ms == a.ingest_ms
    a.close()


def test_a_heartbeat_keeps_a_targets_figure_of_the_servers_cost_per_level_fresh(make_server):
    """A target's session opens with the star (its Welcome says what the warm-up's levels cost); its
    heartbeat's Pongs bring the figure of now once another stream's steps have been drafted."""
    server, address = make_server()
    quiet = DraftClient(address, FP, "quiet", timeout_s=10, heartbeat_s=0.05)
    quiet.hello()
    drafter = RemoteDrafter(quiet)
    warm = drafter.level_ms
    assert warm == server.stats.level_ms() > 0
    busy = client(address)
    busy.draft([1, 2, 3], 5, *CHAIN)
    for t in range(4, 10):
        busy.draft([t], 5)
    deadline = time.monotonic() + 5  # the next Pong after the last step brings the figure of now
    while quiet._heartbeat.level_ms != server.stats.level_ms() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert drafter.level_ms == quiet._heartbeat.level_ms == server.stats.level_ms() > 0  # a Pong's, not the Welcome's
    quiet.close()
    busy.close()


def test_welcome_and_pongs_say_how_long_the_servers_requests_wait_lately(make_server):
    """A stream that joins a server, or asks for no draft, knows from the server's word how long a
    draft would take to come: its queue (arrival to the start of its draft) and its time a level (a
    batch's whole time), apart, so that a draft d deep waits wait_ms + d * pace_ms whatever depths the
    others ask. Its drafter takes the queue as the server's until its own replies say longer
    (spec_decode/depth.py decodes alone where even a perfect draft waited for that long loses)."""
    server, address = make_server()
    fresh = DraftClient(address, FP, "fresh", timeout_s=10, heartbeat_s=0.05)
    fresh.hello()
    assert fresh.wait_ms == 0.0 and server.stats.wait_ms() == -1.0  # no request answered yet
    busy = client(address)
    busy.draft([1, 2, 3], 5, *CHAIN)
    for t in range(4, 8):
        busy.draft([t], 5)
    said = server.stats.wait_ms()
    assert said > 0
    quiet = DraftClient(address, FP, "quiet", timeout_s=10, heartbeat_s=0.05)
    quiet.hello()
    assert quiet.wait_ms == said  # its Welcome's
    assert quiet.pace_ms == server.stats.pace_ms() > 0 and server.stats.pace_ms() >= server.stats.level_ms()
    drafter = RemoteDrafter(quiet)
    assert drafter.pace_ms == quiet.pace_ms
    assert drafter.server_ms == said and drafter.reply_ms == 0.0
    drafter.reply_ms, drafter.reply_at = said + 500.0, time.monotonic()
    assert drafter.server_ms == said + 500.0  # its own replies, where they say longer
    deadline = time.monotonic() + 5  # a Pong that came during busy's drafts said the figure of then
    while fresh._heartbeat.wait_ms != said and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fresh.wait_ms == said  # a Pong's, for the session that opened before any reply
    for c in (fresh, busy, quiet):
        c.close()


def test_welcome_and_pongs_count_the_targets_on_the_servers_host(make_server):
    """Each Welcome, and every Pong after, says how many of the server's sessions are of targets on its
    own host (here all: loopback): a co-hosted stream's draft takes its compute from each of them
    (spec_decode/depth.py, Source.neighbours), so the count follows targets that come and go."""
    server, address = make_server()
    first = DraftClient(address, FP, "first", timeout_s=10, heartbeat_s=0.05)
    first.hello()
    drafter = RemoteDrafter(first)
    assert drafter.cohosted and first.local_sessions == 1 and drafter.neighbours == 0
    second = client(address)
    assert second._welcome_local == 2
    assert wait_for(lambda: drafter.neighbours == 1)  # the next Pong says so
    second.close()
    assert wait_for(lambda: drafter.neighbours == 0)
    first.close()


def test_each_request_says_where_its_chain_stops(make_server, tiny_drafters):
    """A stream's depth policy chooses each step's chain threshold (spec_decode/depth.py, Situation.stop):
    the server drafts each request with the threshold it carries (-1: the session's own), and the
    chains are the drafter's own at that threshold."""
    from starsd.models.drafter import DraftJob

    drafter = tiny_drafters["good"]
    steps = [[5, 6, 7, 1, 2], [8], [9, 10]]
    settings = DraftConfig(depth=8, min_path_prob=0.0, adaptive=False)

    def local(stop: float) -> list[list[int]]:  # the drafter's own chains, in this thread, before the server runs
        seq, chains = drafter.start([]), []
        cfg = DraftConfig(depth=8, min_path_prob=max(stop, 0.0), adaptive=False)
        for new in steps:
            chains.append(drafter.propose_batch([DraftJob(seq, new, cfg, GREEDY)])[0].tokens.tolist())
        return chains

    stops = (-1.0, 0.0, 0.5, 0.9)
    want = {stop: local(stop) for stop in stops}
    assert len({tuple(map(len, w)) for w in want.values()}) > 1  # the thresholds cut these chains apart
    server, address = make_server()
    for stop in stops:
        c = client(address)
        got = []
        for i, new in enumerate(steps):
            c.send_draft(new, 50, *((settings, GREEDY) if i == 0 else (None, None)), stop=stop)
            got.append(c.receive_draft()[1][0].tolist())
        c.close()
        assert got == want[stop], stop




def test_requests_announced_together_are_drafted_together(make_server):
    """Three sessions whose requests go out one after another, each saying how many follow it (as the
    vLLM plug-in sends its rows'): the server waits for the rest before a batch and drafts each round
    in one batch of three, not the first alone and the rest after it."""
    server, address = make_server(predraft=False)
    clients = [client(address) for _ in range(3)]
    rounds = 6
    for r in range(rounds):
        for i, c in enumerate(clients):
            tok = torch.tensor([10 * i + r + 1] * (3 if r == 0 else 1), dtype=torch.int32)
            c._send(*P.draft_request(c.tag, c.step, tok, 50, *(CHAIN if r == 0 else (None, None)), more=2 - i))
            c.step += 1
            time.sleep(0.001)  # the plug-in's own work for the next row
        for c in clients:
            assert len(c._receive(P.DraftReply)[1][0]) == 3
    sizes = server.stats.snapshot(len(server.sessions))["batch_sizes"]
    assert sizes.get("3", 0) >= rounds - 2, sizes  # (a loaded machine may part a round now and then:
    # GATHER_S between two requests at most)


def test_a_shallow_draft_is_answered_before_a_deep_one_drafted_beside_it(make_server):
    """Two sessions' requests in one batch, one a level deep and one ten: the shallow one is answered
    as soon as its level is drafted (its service ends there), not after the other's ten. With one
    reply a batch, a target asking a level waited for a neighbour's ten (in a run of bench elastic's
    two targets, one drafted at 1.98x while the other's looks missed their deadlines behind it and it
    decoded alone, 1.0x). Both sessions share one connection, as an engine's rows do: two connections'
    requests may reach the server in either order, and a deep draft that began first is cut at its
    first level when the shallow request comes (test_a_request_that_comes_during_a_deep_draft_...)."""
    server, address = make_server(predraft=False)
    shared = Connections(heartbeat_s=0)
    shallow, deep = (DraftClient(address, FP, name, timeout_s=10, heartbeat_s=0, connections=shared)
                     for name in ("shallow", "deep"))
    shallow.hello(), deep.hello()
    ten = (DraftConfig(depth=10, min_path_prob=0.0, adaptive=False), GREEDY)
    batched = 0
    for r in range(6):
        for i, (c, budget) in enumerate(((shallow, 2), (deep, 11))):
            tok = torch.tensor([10 * i + r + 1] * (3 if r == 0 else 1), dtype=torch.int32)
            c._send(*P.draft_request(c.tag, c.step, tok, budget, *(ten if r == 0 else (None, None)), more=1 - i))
            c.step += 1
        (a, ta), (b, tb) = shallow._receive(P.DraftReply), deep._receive(P.DraftReply)
        assert len(ta[0]) == 1 and len(tb[0]) == 10
        if a.batch_size == 2:
            batched += 1
            assert a.service_ms < b.service_ms, (a, b)
    assert batched >= 4


def test_a_request_that_comes_during_a_deep_draft_ends_it_at_its_level(tiny_drafters):
    """A stream's draft ten levels deep, 50 ms a level here; another stream's request comes 120 ms into
    it. The batch ends at the level it has reached (the deep draft goes out as deep as it got) and the
    newcomer is drafted next, not after the other's ten levels."""
    inner = tiny_drafters["good"]

    class Slow:  # the tiny drafter, 50 ms a level
        model, device, taps = inner.model, inner.device, None

        def start(self, prompt_ids):
            return inner.start(prompt_ids)

        def propose_batch(self, jobs, stop=None, done=None):
            slow = lambda: (time.sleep(0.05), stop is not None and stop())[1]
            time.sleep(0.05)
            return inner.propose_batch(jobs, stop=slow, done=done)

    address = f"tcp://127.0.0.1:{free_port()}"
    server = DraftServer(Slow(), FP, 128, ServerConfig(bind=address, predraft=False))
    thread = server.start()
    try:
        deep, late = client(address), client(address)
        ten = (DraftConfig(depth=10, min_path_prob=0.0, adaptive=False), GREEDY)
        late.draft([7, 8, 9], 2, *ten)  # its session's prompt, held: its next request is a step
        deep.send_draft([1, 2, 3], 11, *ten)
        time.sleep(0.12)
        late.send_draft([5], 2)
        (d, dt), (n, nt) = deep.receive_draft(), late.receive_draft()
        assert 1 <= len(dt[0]) < 10 and len(nt[0]) == 1
        assert n.queue_ms < 250, n  # not the 400 ms the deep draft's other levels would have taken
    finally:
        server.stop()
        thread.join(timeout=5)
