"""An engine's sessions on one connection (star/connection.py): many sessions share one socket and
one heartbeat, each draft reaches its own session whatever the order of replies, a refusal reaches
the Hello it answers, and the server still binds each session to its connection."""

import threading
import time

import pytest
import torch
import zmq

from starsd.config import DraftConfig, SamplingConfig, ServerConfig
from starsd.star import protocol as P
from starsd.star.client import DraftClient, DraftServerError
from starsd.star.connection import Connections
from starsd.star.processes import free_port
from starsd.star.server import DraftServer

FP = "f" * 64
CFG = DraftConfig(depth=3)
GREEDY = SamplingConfig()


@pytest.fixture
def make_server(tiny_drafters):
    servers = []

    def make(address: str | None = None, **cfg):
        address = address or f"tcp://127.0.0.1:{free_port()}"
        server = DraftServer(tiny_drafters["good"], FP, 128, ServerConfig(bind=address, **cfg))
        servers.append((server, server.start()))
        return server, address

    yield make
    for server, thread in servers:
        server.stop()
        thread.join(timeout=5)


def prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j) % 120 + 1 for j in range(6 + i)]


def heartbeats() -> int:
    return sum(t.name == "starsd-heartbeat" for t in threading.enumerate())


def wait_for(condition, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_an_engines_sessions_share_one_connection_and_each_gets_its_own_drafts(make_server):
    """Five sessions on one connection, their requests sent at once and their replies read in the
    reverse order, draft what five sessions of their own connections draft."""
    server, address = make_server()
    shared = Connections(heartbeat_s=0)
    engine = [DraftClient(address, FP, f"e{i}", timeout_s=10, heartbeat_s=0, connections=shared) for i in range(5)]
    alone = [DraftClient(address, FP, f"a{i}", timeout_s=10, heartbeat_s=0) for i in range(5)]
    for c in engine + alone:
        c.hello()
    assert len(shared) == 1 and len({c.tag for c in engine}) == 5
    for i, c in enumerate(engine):
        c.send_draft(prompt(i), 8, CFG, GREEDY, more=len(engine) - i - 1)
    got = [c.receive_draft() for c in reversed(engine)][::-1]
    want = [c.draft(prompt(i), 8, CFG, GREEDY) for i, c in enumerate(alone)]
    for (reply, tensors), (reply_alone, tensors_alone) in zip(got, want):
        assert [t.tolist() for t in tensors] == [t.tolist() for t in tensors_alone]
    assert {reply.tag for reply, _ in got} == {c.tag for c in engine}
    assert wait_for(lambda: server.stats.connections == 6, 3.0)  # the engine's one, and each lone client's
    for c in engine + alone:
        c.close()
    assert len(shared) == 0  # closed with its last session


def test_hellos_with_stream_numbers_open_sessions_side_by_side(make_server):
    server, address = make_server()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)

    def hello(stream: int) -> P.Welcome:
        sock.send_multipart(P.encode(P.Hello(P.PROTOCOL_VERSION, FP, "raw", stream)))
        assert sock.poll(10_000)
        welcome = P.decode(sock.recv_multipart())[0]
        assert isinstance(welcome, P.Welcome) and welcome.stream == stream
        return welcome

    try:
        one, two = hello(1), hello(2)
        assert wait_for(lambda: one.tag in server.sessions and two.tag in server.sessions)
        again = hello(1)  # replaces stream 1's session, not stream 2's
        assert wait_for(lambda: one.tag not in server.sessions)
        assert two.tag in server.sessions and again.tag in server.sessions
        first, second = hello(0), hello(0)  # stream 0: the connection's only session, as a target's
        assert wait_for(lambda: first.tag not in server.sessions) and second.tag in server.sessions
    finally:
        sock.close(0)


def test_a_refused_hello_reaches_its_own_session_and_the_others_draft_on(make_server):
    server, address = make_server(max_sessions=2)
    shared = Connections(heartbeat_s=0)
    clients = [DraftClient(address, FP, f"e{i}", timeout_s=10, heartbeat_s=0, connections=shared) for i in range(3)]
    for c in clients:
        c.send_hello()
    with pytest.raises(DraftServerError, match="too_many_sessions"):  # read first: the others' Welcomes wait
        clients[2].receive_welcome()
    for c in clients[:2]:
        assert c.receive_welcome().tag == c.tag != 0
        assert len(c.draft(prompt(1), 8, CFG, GREEDY)[1][0]) > 0
    for c in clients:
        c.close()


def test_a_session_is_served_only_on_the_connection_that_opened_it(make_server):
    server, address = make_server()
    shared = Connections(heartbeat_s=0)
    owner = DraftClient(address, FP, "owner", timeout_s=10, heartbeat_s=0, connections=shared)
    owner.hello()
    owner.draft(prompt(2), 8, CFG, GREEDY)
    thief = zmq.Context.instance().socket(zmq.DEALER)  # the owner's tag, from another connection
    thief.setsockopt(zmq.LINGER, 0)
    thief.connect(address)
    try:
        thief.send_multipart(P.encode(*P.draft_request(owner.tag, owner.step, torch.tensor([5], dtype=torch.int32),
                                                       8, None, None)))
        assert thief.poll(10_000)
        refusal = P.decode(thief.recv_multipart())[0]
        assert isinstance(refusal, P.Error) and refusal.code == "unknown_session"
    finally:
        thief.close(0)
    assert len(owner.draft([5], 8)[1][0]) > 0  # the owner's session drafts on
    owner.close()


def test_a_reply_for_a_session_that_left_is_dropped_not_given_to_another(make_server):
    server, address = make_server()
    shared = Connections(heartbeat_s=0)
    gone, stays = (DraftClient(address, FP, n, timeout_s=10, heartbeat_s=0, connections=shared) for n in "gs")
    gone.hello()
    stays.hello()
    gone.send_draft(prompt(4), 8, CFG, GREEDY)
    gone.close()  # its reply comes to a connection that no longer lists it
    reply, tensors = stays.draft(prompt(5), 8, CFG, GREEDY)
    assert reply.tag == stays.tag
    stays.close()


def test_one_heartbeat_keeps_every_session_of_a_connection_and_tells_each_when_it_is_gone(make_server):
    """Three sessions, no request for three session timeouts: the connection's one heartbeat keeps them
    all. The server restarted at the same address: each session learns it is gone from that heartbeat."""
    server, address = make_server(session_timeout_s=1.0)
    before = heartbeats()
    shared = Connections(heartbeat_s=0.1, dead_after_s=1.0)
    clients = [DraftClient(address, FP, f"e{i}", timeout_s=10, heartbeat_s=0.1, connections=shared) for i in range(3)]
    for c in clients:
        c.hello()
    assert heartbeats() == before + 1
    time.sleep(3.0)
    assert all(c.tag in server.sessions for c in clients)
    assert all(c.reachable() and not c.session_gone() for c in clients)
    server.stop()
    time.sleep(0.5)
    make_server(address, session_timeout_s=1.0)
    assert wait_for(lambda: all(c.session_gone() for c in clients), 5.0)
    for c in clients:
        c.close()
    assert wait_for(lambda: heartbeats() == before, 3.0)


def test_a_refusal_naming_no_hello_reaches_the_oldest_hello_waiting():
    """A server of another protocol version refuses a Hello with an Error that has no stream number (its
    Error has no such field): the oldest channel still waiting for its Welcome gets it, not nobody."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    shared = Connections(heartbeat_s=0)
    client = DraftClient(f"tcp://127.0.0.1:{port}", FP, "old", timeout_s=5, heartbeat_s=0, connections=shared)
    try:
        client.send_hello()
        assert router.poll(5000)
        peer, *_ = router.recv_multipart()
        router.send_multipart([peer, *P.encode(P.Error("version", "protocol version 10 is not supported"))])
        with pytest.raises(DraftServerError, match="version"):
            client.receive_welcome()
    finally:
        client.close()
        router.close(0)


def test_a_session_whose_channel_left_before_reading_its_welcome_is_said_goodbye_to(make_server):
    """Two channels leave with their sessions' Welcomes unread, one filed already, one still on the
    wire (a Hello queued while a server restarts is delivered after it): neither session outlives them."""
    server, address = make_server()
    shared = Connections(heartbeat_s=0)
    stays = DraftClient(address, FP, "stays", timeout_s=10, heartbeat_s=0, connections=shared)
    stays.hello()
    filed, unread = (DraftClient(address, FP, n, timeout_s=10, heartbeat_s=0, connections=shared) for n in "fu")
    filed.send_hello()
    unread.send_hello()
    assert wait_for(lambda: len(server.sessions) == 3)
    shared._open[address].pump(filed.link, 5000)  # filed's Welcome is in its inbox, not read by its client
    assert filed.link.tag and not filed.tag
    unread.close()  # its Welcome comes to a connection that no longer lists it
    filed.close()
    stays.draft(prompt(1), 8, CFG, GREEDY)  # reads on: the unread Welcome is answered with a Bye
    assert wait_for(lambda: len(server.sessions) == 1) and stays.tag in server.sessions
    stays.close()
