"""No request takes a target out of service, and a target that was out comes back: a real gateway
(`starsd serve --target-server`) in front of real target server processes (tiny models, decoding
alone), which the tests stop, kill and start again."""

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import time

import httpx2 as httpx
import pytest
import zmq

import tiny
from starsd.serve.gateway import draft_server_snapshots
from starsd.star import protocol as P
from starsd.star.processes import free_port, read_json_line, spawn

MODEL = "tiny-target"
STEP_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    tok = tiny.char_tokenizer()
    return tiny.save(tiny.tiny_model(1), tok, tmp_path_factory.mktemp("recovery") / "target")


def start_target(target_dir: str, address: str):
    proc = spawn(["target-server", "--bind", address, "--target", target_dir, "--dtype", "float32",
                  "--served-model-name", MODEL, "--threads", "1"])
    read_json_line(proc, "ready", 120)
    return proc


def stop(proc) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)  # in case a test left it stopped
        proc.kill()
    proc.wait(timeout=30)


@contextlib.contextmanager
def one_target_star(target_dir: str):
    """One target server and a gateway in front of it."""
    address = f"tcp://127.0.0.1:{free_port()}"
    target = {"proc": start_target(target_dir, address), "address": address}
    port = free_port()
    gateway = spawn(["serve", "--port", str(port), "--target-server", address, "--step-timeout", str(STEP_TIMEOUT_S),
                     "--max-queue", "4"])
    try:
        read_json_line(gateway, "ready", 120)
        yield {"url": f"http://127.0.0.1:{port}", "target": target, "dir": target_dir}
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(timeout=30)
        stop(target["proc"])


@pytest.fixture
def star(target_dir):
    """A star of its own: the test may stop, kill and restart the target."""
    with one_target_star(target_dir) as s:
        yield s


@pytest.fixture(scope="module")
def shared_star(target_dir):
    """One star for the tests that send it bad input and check that it serves on: each also checks
    that the inputs of those before it left it in service."""
    with one_target_star(target_dir) as s:
        yield s


def complete(url: str, max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def wait_up(url: str, within_s: float) -> float:
    """Seconds until /health says every target is in service; fails past within_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        health = httpx.get(url + "/health", timeout=5).json()
        if health["targets_up"] == health["targets"]:
            return time.monotonic() - t0
        time.sleep(0.1)
    pytest.fail(f"targets still out of service after {within_s} s: {health}")


def test_a_request_too_large_for_a_target_is_refused_and_the_target_stays_in_service(shared_star):
    """It was forwarded, refused by the target with no request named, waited out as a timeout, and
    the target was taken out of service for good: every later request got 503."""
    t0 = time.monotonic()
    r = complete(shared_star["url"], max_tokens=10**6)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert time.monotonic() - t0 < STEP_TIMEOUT_S
    for _ in range(3):
        r = complete(shared_star["url"])
        assert r.status_code == 200, r.text
    assert httpx.get(shared_star["url"] + "/health").json()["targets_up"] == 1


def test_a_body_that_is_not_utf8_is_a_bad_request(shared_star):
    r = httpx.post(shared_star["url"] + "/v1/completions", content=b'{"model": "\xff\xfe"}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "error" in r.json(), r.text
    assert complete(shared_star["url"]).status_code == 200


def test_a_protocol_refusal_names_the_request_it_refuses(shared_star):
    """A Generate the target cannot take (past its max_tokens): its Error carries the request's id,
    so a gateway ends that stream, not the link."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(shared_star["target"]["address"])
    try:
        sampling = P.SamplingConfig()
        sock.send_multipart(P.encode(P.Generate(4242, "x", None, P.MAX_TOKENS_PER_REQUEST + 1, sampling)))
        assert sock.poll(10_000), "no answer"
        msg, _ = P.decode(sock.recv_multipart())
        assert isinstance(msg, P.Error) and msg.code == "bad_request" and msg.tag == 4242, msg
        assert P.request_id([bytes([P.MsgType.GENERATE]) + b"\xc1"]) == 0  # unreadable: no id, no crash
    finally:
        sock.close()
        ctx.term()
    assert complete(shared_star["url"]).status_code == 200


def test_a_target_late_for_its_step_is_asked_and_rejoins_when_it_answers(star):
    """The target is stopped (SIGSTOP) past the step deadline mid-stream: that stream fails with a
    timeout, and the target, alive, comes back as soon as it runs again (it was out for good). The
    stop follows the stream's first event: a stop after a fixed sleep came after the whole answer
    once (400 tokens of the tiny model decoding alone took under 0.5 s on CI)."""
    proc = star["target"]["proc"]
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.stream("POST", star["url"] + "/v1/completions", json=body, timeout=60) as r:
            events = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
            first = next(events)
            os.kill(proc.pid, signal.SIGSTOP)
            assert "choices" in first, first
            last = list(events)[-1]
        assert last.get("error", {}).get("code") == "timeout", last
        assert httpx.get(star["url"] + "/health").json()["targets_up"] == 0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert wait_up(star["url"], within_s=10) < 10
    assert complete(star["url"]).status_code == 200


def test_a_target_back_after_dropping_while_idle_takes_one_stream_at_a_time(star):
    """A target killed while idle and started again at its address: it rejoined the idle targets
    while its old entry was still there, so two requests reached it at once and one got 503."""
    target = star["target"]
    stop(target["proc"])
    time.sleep(0.5)
    target["proc"] = start_target(star["dir"], target["address"])
    wait_up(star["url"], within_s=30)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: complete(star["url"], 48, ignore_eos=True), range(3)))
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]


def test_a_reader_that_stops_fails_its_streams_at_once_and_the_link_comes_back(star):
    """The gateway's reader of a target link ended (here: cancelled): its streams waited for the
    step timeout, and the link served nothing after. Now they fail at once as target_lost, and the
    link, asked again, rejoins."""
    from starsd.serve.pool import Pool, TargetFailed

    async def scenario():
        pool = Pool([star["target"]["address"]], max_queue=4, step_timeout_s=30)
        await pool.start(30)
        try:
            link, _ = await pool.acquire()
            request = P.Generate(pool.new_id(), "def f(x):", None, 400, P.SamplingConfig(), (), True)
            outputs = pool.stream(link, request)
            await outputs.__anext__()
            link._reader.cancel()
            t0 = time.monotonic()
            with pytest.raises(TargetFailed) as failed:
                async for _ in outputs:
                    pass
            assert failed.value.code == "target_lost" and time.monotonic() - t0 < 3
            for _ in range(300):
                if not pool.failed:
                    break
                await asyncio.sleep(0.1)
            assert not pool.failed, "the link did not rejoin"
            link, _ = await asyncio.wait_for(pool.acquire(), 30)
            short = P.Generate(pool.new_id(), "x = ", None, 4, P.SamplingConfig(), (), False)
            assert [out async for out in pool.stream(link, short)][-1].finish
        finally:
            pool.close()

    asyncio.run(scenario())


def test_a_scrape_waits_for_draft_servers_that_are_down_at_once_not_in_turn():
    """/metrics asks every draft server for its counters; three that do not answer cost one 2 s
    timeout, not three in a row."""
    silent = ",".join(f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    t0 = time.monotonic()
    assert draft_server_snapshots(silent) == [None, None, None]
    assert time.monotonic() - t0 < 4.0  # in turn: at least 6 s


def test_targets_follow_a_draft_server_that_moved_even_once_started_again(tmp_path):
    """A draft server runs at a new address (on Ray: its actor started again on another node). The
    gateway tells its targets (DraftMoved), and a target server started again later, which lists the
    old address on its command line, is told again when it rejoins: both draft on the new server."""
    from preloaded import start_server
    from starsd.config import PairConfig
    from starsd.serve.pool import Pool
    from starsd.star.client import query_stats

    target_dir, draft_dir = tiny.save_pair(tmp_path)
    old, new = (start_server(PairConfig(draft=draft_dir, dtype="float32", threads=1, draft_quantize="none"))
                for _ in range(2))
    address = f"tcp://127.0.0.1:{free_port()}"
    argv = ["target-server", "--bind", address, "--target", target_dir, "--dtype", "float32", "--threads", "1",
            "--served-model-name", MODEL, "--connect", old.address, "--no-draft-adaptive"]
    target = spawn(argv)
    read_json_line(target, "ready", 120)

    async def drafted(pool: Pool) -> int:
        """One greedy stream; the steps that verified a draft."""
        link, _ = await asyncio.wait_for(pool.acquire(), 30)
        request = P.Generate(pool.new_id(), "def f(x):", None, 24, P.SamplingConfig(), (), True)
        return sum(1 for out in [out async for out in pool.stream(link, request)] if out.drafted)

    def restart():
        nonlocal target
        stop(target)
        t0 = time.monotonic()
        target = spawn(argv)
        read_json_line(target, "ready", 120)
        assert time.monotonic() - t0 < 30  # it waited out its draft client's 60 s timeout on the dead server

    async def scenario():
        pool = Pool([address], max_queue=4, step_timeout_s=30)
        await pool.start(30)
        try:
            assert await drafted(pool) > 0
            old.close()  # the old process is gone
            pool.draft_moved(old.address, new.address)
            assert await drafted(pool) > 0
            after_told = query_stats(new.address)["requests"]
            assert after_told > 0
            await asyncio.to_thread(restart)  # with the command line it had: the old address
            for _ in range(300):
                if not pool.failed:
                    break
                await asyncio.sleep(0.1)
            assert await drafted(pool) > 0
            assert query_stats(new.address)["requests"] > after_told
        finally:
            pool.close()

    try:
        asyncio.run(scenario())
    finally:
        stop(target)
        old.close()
        new.close()
