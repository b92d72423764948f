"""Who may talk to a draft server: CurveZMQ keys over real sockets, the loopback rule, and no pickle
anywhere on a network path."""

import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from starsd import cli
import zmq.asyncio

from starsd.config import ClientKeys, DraftConfig, GatewayKeys, SamplingConfig, ServerConfig, ServingKeys
from starsd.star import protocol as P
from starsd.star.client import DraftClient, DraftServerError
from starsd.star.processes import free_port
from starsd.star.security import SecurityError, guard_client, guard_server, is_loopback
from starsd.star.server import DraftServer

FP = "f" * 64
CHAIN = (DraftConfig(depth=3, min_path_prob=0.0, adaptive=False), SamplingConfig())
SRC = Path(__file__).resolve().parents[1] / "src" / "starsd"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """A server key pair, two allowed targets (a, b) and one stranger, made by `starsd keys`."""
    root = tmp_path_factory.mktemp("keys")
    assert cli.main(["keys", str(root / "server"), "server"]) == 0
    assert cli.main(["keys", str(root / "allowed"), "a", "b"]) == 0
    assert cli.main(["keys", str(root / "stranger"), "x"]) == 0
    return root


def client_keys(root: Path, who: str, where: str = "allowed") -> ClientKeys:
    return ClientKeys(str(root / where / f"{who}.key_secret"), str(root / "server" / "server.key"))


@pytest.fixture
def secure_server(tiny_drafters, keys):
    address = f"tcp://127.0.0.1:{free_port()}"
    server = DraftServer(tiny_drafters["good"], FP, 128, ServerConfig(
        bind=address, curve_key=str(keys / "server" / "server.key_secret"), curve_clients=str(keys / "allowed")))
    thread = server.start()
    yield server, address
    server.stop()
    thread.join(timeout=5)


def test_keys_command_writes_a_pair_with_a_private_secret(keys):
    assert (keys / "allowed" / "a.key").is_file()
    assert (keys / "allowed" / "a.key_secret").stat().st_mode & 0o077 == 0


def test_only_allowed_keys_get_an_answer(secure_server, keys):
    server, address = secure_server
    a = DraftClient(address, FP, "a", timeout_s=10, heartbeat_s=0, keys=client_keys(keys, "a"))
    a.hello()
    reply, tensors = a.draft([1, 2, 3], 5, *CHAIN)
    assert len(tensors[0]) == 3
    for who in (client_keys(keys, "x", "stranger"), ClientKeys()):  # a stranger's key, and no key at all
        peer = DraftClient(address, FP, "intruder", timeout_s=1.5, heartbeat_s=0, keys=who)
        # no handshake, so not even an Error comes back: the Hello waits unanswered (timeout) or, once
        # libzmq has dropped the refused connection (a few ms to 1 s after connect, measured), it
        # cannot even be queued (unreachable)
        with pytest.raises(DraftServerError, match="timeout|takes no message"):
            peer.hello()
        peer.close()
    assert server.stats.sessions_opened == 1 and len(server.sessions) == 1
    reply, tensors = a.draft([4], 5)  # the allowed session went on untouched
    assert reply.tag == a.tag and len(tensors[0]) == 3
    a.close()


def test_a_target_server_answers_only_gateways_with_an_allowed_key(tiny_target, keys):
    """A target server with --serve-key: a gateway with an allowed key gets its TargetInfo; a
    stranger's key, and no key at all, get nothing, not even a handshake."""
    import asyncio
    import threading

    from starsd.models.pair import Pair
    from starsd.serve.pool import TargetFailed, TargetLink
    from starsd.star.target_server import TargetServer

    import tiny

    address = f"tcp://127.0.0.1:{free_port()}"
    pair = Pair(tiny_target, None, tiny.char_tokenizer(), frozenset({0}))
    server = TargetServer(pair, address, None, CHAIN[0], "t0", "tiny", keys=ServingKeys(
        str(keys / "server" / "server.key_secret"), str(keys / "allowed")))
    ready = threading.Event()
    thread = threading.Thread(target=server.serve, kwargs={"on_ready": ready.set}, daemon=True)
    thread.start()
    assert ready.wait(10)

    async def describe(gateway: GatewayKeys):
        ctx = zmq.asyncio.Context()
        link = TargetLink(ctx, address, gateway)
        try:
            return (await link.describe(1.5)).name
        except TargetFailed:  # no answer in time
            return None
        finally:
            link.close()
            ctx.term()

    try:
        server_key = str(keys / "server" / "server.key")
        assert asyncio.run(describe(GatewayKeys(str(keys / "allowed" / "a.key_secret"), server_key))) == "t0"
        assert asyncio.run(describe(GatewayKeys(str(keys / "stranger" / "x.key_secret"), server_key))) is None
        assert asyncio.run(describe(GatewayKeys())) is None
    finally:
        server.stop()
        thread.join(timeout=5)


def test_a_session_belongs_to_its_key(secure_server, keys):
    _, address = secure_server
    a = DraftClient(address, FP, "a", timeout_s=10, heartbeat_s=0, keys=client_keys(keys, "a"))
    b = DraftClient(address, FP, "b", timeout_s=10, heartbeat_s=0, keys=client_keys(keys, "b"))
    a.hello()
    b.hello()
    a.draft([1, 2, 3], 5, *CHAIN)
    b.tag = a.tag  # b knows (or guesses) a's tag
    with pytest.raises(DraftServerError, match="unknown_session"):
        b.draft([7], 5)
    reply, _ = a.draft([4], 5)
    assert reply.tag == a.tag
    a.close()
    b.close()


def test_listening_beyond_loopback_needs_keys_or_insecure(tiny_drafters, keys):
    assert is_loopback("tcp://127.0.0.1:5555") and is_loopback("tcp://[::1]:5") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:5555") and not is_loopback("tcp://*:5555")
    assert not is_loopback("tcp://10.0.0.2:5555") and not is_loopback("tcp://eth0:5555")
    port = free_port()
    with pytest.raises(SecurityError, match="--insecure"):
        DraftServer(tiny_drafters["good"], FP, 128, ServerConfig(bind=f"tcp://0.0.0.0:{port}")).start()
    server = DraftServer(tiny_drafters["good"], FP, 128, ServerConfig(bind=f"tcp://0.0.0.0:{port}", insecure=True))
    thread = server.start()
    c = DraftClient(f"tcp://127.0.0.1:{port}", FP, "t", timeout_s=10, heartbeat_s=0)
    c.hello()
    c.close()
    server.stop()
    thread.join(timeout=5)


def test_half_given_keys_are_refused(keys):
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(SecurityError, match="secret key"):
            guard_server(ctx, sock, "tcp://127.0.0.1:1", allowed=str(keys / "allowed"))
        with pytest.raises(SecurityError, match="directory"):
            guard_server(ctx, sock, "tcp://127.0.0.1:1", key=str(keys / "server" / "server.key_secret"))
        with pytest.raises(SecurityError, match="no secret key"):
            guard_server(ctx, sock, "tcp://127.0.0.1:1", key=str(keys / "server" / "server.key"),
                         allowed=str(keys / "allowed"))
        with pytest.raises(SecurityError, match="both"):
            guard_client(sock, key=str(keys / "allowed" / "a.key_secret"))
    finally:
        sock.close(0)


def test_no_network_path_deserialises_code(make_plain_server, monkeypatch):
    """Nothing the server or a target reads off the wire goes through pickle (or torch.load, which
    unpickles): a full session runs with them made to fail, and no module that touches a socket
    mentions them."""
    def forbidden(*a, **kw):
        raise AssertionError("a network path deserialised with pickle")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    address = make_plain_server()
    c = DraftClient(address, FP, "t", timeout_s=10, heartbeat_s=0.05)
    c.hello()
    c.draft([1, 2, 3], 5, *CHAIN)
    c.draft([4, 5], 5)
    assert c.ping() > 0 and "requests" in c.stats()
    with pytest.raises(DraftServerError):
        c._send(P.Hello(P.PROTOCOL_VERSION, "0" * 64, "wrong vocabulary"))  # an Error travels back too
        c._receive(P.Welcome)
    c.close()
    for folder in ("star", "serve", "emulate"):
        for path in (SRC / folder).glob("*.py"):
            text = path.read_text()
            for word in (r"import pickle|from pickle|\bpickle\.\w", r"torch\.load\b", r"_pyobj\b", r"\bmarshal\b", r"(?<![\w.])eval\(",
                         r"(?<![\w.])exec\("):
                assert not re.search(word, text), f"{path.name} matches {word}"


@pytest.fixture
def make_plain_server(tiny_drafters):
    servers = []

    def make():
        address = f"tcp://127.0.0.1:{free_port()}"
        server = DraftServer(tiny_drafters["good"], FP, 128, ServerConfig(bind=address))
        servers.append((server, server.start()))
        return address

    yield make
    for server, thread in servers:
        server.stop()
        thread.join(timeout=5)


def test_keys_flags_reach_the_client():
    args = cli.build_parser(["stats"]).parse_args(["stats", "--connect", "tcp://127.0.0.1:1", "--curve-key", "k",
                                                   "--curve-server-key", "s"])
    from starsd import config as C

    assert C.from_args(C.ClientKeys, args) == ClientKeys("k", "s")
    assert json.dumps(ClientKeys().given) == "false"
