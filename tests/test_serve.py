"""The OpenAI-compatible endpoint over real processes: `starsd serve` (gateway, draft server and two
target servers on tiny models) queried with the official `openai` client and plain HTTP."""

import concurrent.futures
import re
import signal
import time

import httpx2 as httpx
import openai
import psutil
import pytest

import tiny
from starsd.config import ModelConfig, SamplingConfig
from starsd.models.pair import Pair
from starsd.spec_decode.decode import target_only
from starsd.star.processes import free_port, read_json_line, spawn

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
MODEL = "tiny-target"
MAX_QUEUE = 2


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    tok = tiny.char_tokenizer()
    tok.chat_template = TEMPLATE
    target = tiny.tiny_model(1)
    return {"target": tiny.save(target, tok, root / "target"),
            "draft": tiny.save(tiny.perturbed(target, seed=7, scale=0.1), tok, root / "draft")}


@pytest.fixture(scope="module")
def gateway(dirs):
    port = free_port()
    # --no-restart: a test below brings a killed target back by hand, as an operator would a remote
    # one (the star's own restarts: tests/test_supervise.py)
    proc = spawn(["serve", "--targets", "2", "--no-restart", "--port", str(port),
                  "--target", dirs["target"], "--draft", dirs["draft"],
                  "--dtype", "float32", "--draft-quantize", "none", "--draft-depth", "4", "--no-draft-adaptive",
                  "--max-queue", str(MAX_QUEUE), "--served-model-name", MODEL])
    try:
        ready = read_json_line(proc, "ready", 300)
    except BaseException:
        proc.kill()
        raise
    yield {"url": f"http://127.0.0.1:{port}", "proc": proc, "metrics": ready["metrics"]}
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(dirs):
    pair = Pair.load(ModelConfig(dirs["target"], dtype="float32"), None)
    pair.tokenizer.chat_template = TEMPLATE
    return pair


def reference(local, prompt_ids, max_tokens) -> str:
    """Target-only greedy decoding in this process: what every greedy answer must equal."""
    gen = target_only(local.target, prompt_ids, max_tokens, SamplingConfig(), local.eos_ids)
    return local.tokenizer.decode(gen.token_ids, skip_special_tokens=True)


def chat_ids(local, text):
    return list(local.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))


def scrape(gateway, url: str = "") -> dict[str, float]:
    """/metrics (the gateway's, or at url) as {series: value}, a series named with its labels as
    Prometheus prints them."""
    text = httpx.get(url or gateway["url"] + "/metrics").text
    return {name: float(value) for name, value in re.findall(r"^([^#\s][^ ]*) (\S+)$", text, re.M)}


def test_models_and_health(client, gateway):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(gateway["url"] + "/health").json()
    assert health["status"] == "ok" and health["targets_up"] == 2


def test_the_gateway_socket_sends_small_replies_without_waiting_for_acks():
    """The gateway's listening socket (gateway.listen) must give connections with Nagle's algorithm
    off, as uvicorn's own sockets have: asyncio sets TCP_NODELAY only where the socket's proto says
    TCP, and a socket made with proto 0 left it on. Then a kept-alive request's reply (headers, then
    body, in two writes) waited for the client's delayed ACK: /health took 44 ms instead of 1.5."""
    import asyncio
    import socket

    from starsd.serve.gateway import listen

    async def accepted_nodelay() -> int:
        sock = listen("127.0.0.1", 0, "")
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        async def handle(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)  # as uvicorn serves a given socket
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0


def test_greedy_completion_equals_target_only_decoding(client, local):
    prompt = "def add(a, b):"
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    ids = local.tokenizer.encode(prompt, add_special_tokens=False)
    assert got.choices[0].text == reference(local, ids, 40)
    assert got.usage.prompt_tokens == len(ids) and 0 < got.usage.completion_tokens <= 40
    spec = got.model_extra["spec_decode"]
    assert spec["drafts"] > 0 and spec["draft_tokens"] > spec["accepted_tokens"] > 0  # (a perturbed copy: drafts in part accepted)
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["drafts"])


def test_a_request_may_decode_without_drafts_for_a_comparison(client, local):
    prompt = "def add(a, b):"
    alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                      extra_body={"speculate": False})
    ids = local.tokenizer.encode(prompt, add_special_tokens=False)
    assert alone.choices[0].text == reference(local, ids, 40)
    spec = alone.model_extra["spec_decode"]
    assert spec["drafts"] == spec["draft_tokens"] == 0 and spec["target_steps"] == alone.usage.completion_tokens


def test_chat_streamed_equals_chat_whole_and_target_only(client, local):
    messages = [{"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed == reference(local, chat_ids(local, "hello there"), 30)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens == len(chat_ids(local, "hello there"))


def test_seeded_sampling_is_reproducible_and_stream_agrees(client):
    args = dict(model=MODEL, prompt="x = ", max_tokens=30, temperature=0.9, top_p=0.95, seed=1234)
    a = client.completions.create(**args).choices[0].text
    b = client.completions.create(**args).choices[0].text
    c = "".join(ch.choices[0].text for ch in client.completions.create(**args, stream=True))
    assert a == b == c


def test_stop_string_ends_the_text_before_it(client, local):
    prompt = "import os"
    full = reference(local, local.tokenizer.encode(prompt, add_special_tokens=False), 40)
    stop = full[10:13]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "never"])
    assert got.choices[0].text == full[:full.index(stop)] and got.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True))
    assert streamed == got.choices[0].text


def test_concurrent_clients_each_get_their_own_answer(client, local):
    prompts = [f"def f{i}(x):" for i in range(2 + MAX_QUEUE)]  # two on targets, the rest queued
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=24,
                                                                    temperature=0), prompts))
    for p, a in zip(prompts, answers):
        assert a.choices[0].text == reference(local, local.tokenizer.encode(p, add_special_tokens=False), 24)


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"), ({"logprobs": 2}, "logprobs"), ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"best_of": 3}, "best_of"), ({"no_such_thing": 1}, "no_such_thing"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
])
def test_unsupported_or_bad_parameters_get_a_400_naming_them(gateway, extra, param):
    r = httpx.post(gateway["url"] + "/v1/completions", json={"model": MODEL, "prompt": "hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_bad_requests_are_refused_clearly(client, gateway):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens is 5000, more than the 1023 tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5000)  # the gateway's check
    with pytest.raises(openai.BadRequestError, match="exceed the context"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1023)  # the target's, with the prompt
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}], max_tokens=2)
    r = httpx.post(gateway["url"] + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    # ... and the star still serves
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=3, temperature=0).choices[0].text is not None


def targets_total(gateway, key: str) -> float:
    """A target counter summed over the target servers' own /metrics."""
    return sum(value for url in gateway["metrics"]["targets"] for name, value in scrape(gateway, url).items()
               if name.startswith(f"starsd:target_{key}_total{{"))


def test_metrics_count_what_the_requests_did(client, gateway):
    before = scrape(gateway)
    target_tokens = targets_total(gateway, "tokens")
    target_accepted = targets_total(gateway, "accepted_tokens")
    answers = [client.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0,
                                         extra_body={"ignore_eos": True}) for p in ("a = 1", "b = 2")]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=3)
    after = scrape(gateway)

    def grew(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    spec = [a.model_extra["spec_decode"] for a in answers]
    assert grew("starsd:generation_tokens_total") == sum(a.usage.completion_tokens for a in answers) == 40
    assert grew("starsd:prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers)
    assert grew('starsd:requests_total{outcome="length"}') == 2
    assert grew('starsd:requests_total{outcome="invalid"}') == 1
    assert grew("starsd:spec_decode_num_drafts_total") == sum(s["drafts"] for s in spec)
    assert grew("starsd:spec_decode_num_draft_tokens_total") == sum(s["draft_tokens"] for s in spec)
    assert grew("starsd:spec_decode_num_accepted_tokens_total") == sum(s["accepted_tokens"] for s in spec)
    assert grew('starsd:spec_decode_num_accepted_tokens_per_pos_total{position="0"}') <= sum(s["drafts"] for s in spec)
    assert grew("starsd:time_to_first_token_seconds_count") == 2 and grew("starsd:e2e_request_latency_seconds_count") == 2
    assert grew("starsd:inter_token_latency_seconds_count") == 40
    assert after["starsd:draft_server_up"] == 1 and after["starsd:draft_server_sessions_open"] == 2
    assert after["starsd:draft_server_batch_size_count"] >= grew("starsd:spec_decode_num_drafts_total") > 0
    assert 0 < after["starsd:draft_server_busy_fraction"] < 1
    # every target server and the draft server serve their own /metrics too
    assert targets_total(gateway, "tokens") - target_tokens == 40
    assert targets_total(gateway, "accepted_tokens") - target_accepted == sum(s["accepted_tokens"] for s in spec)
    own = scrape(gateway, gateway["metrics"]["draft_server"])
    assert own["starsd:draft_server_up"] == 1 and own["starsd:draft_server_requests_total"] > 0


def test_full_queue_gets_503_and_a_disconnect_frees_its_target(client, gateway, local):
    """Two endless streams hold both targets, MAX_QUEUE requests wait, the next is refused; closing
    the streams frees the targets for the waiting requests, long before the streams would have ended."""
    long = dict(model=MODEL, prompt="while True:", max_tokens=900, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
    before = scrape(gateway)
    streams = [client.completions.create(**long) for _ in range(2)]
    for s in streams:
        next(iter(s))  # its first step is out: the stream holds a target
    with concurrent.futures.ThreadPoolExecutor(MAX_QUEUE) as pool:
        waiting = [pool.submit(client.completions.create, model=MODEL, prompt="y = ", max_tokens=8, temperature=0)
                   for _ in range(MAX_QUEUE)]
        deadline = time.monotonic() + 30
        while httpx.get(gateway["url"] + "/health").json()["waiting"] < MAX_QUEUE and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=MODEL, prompt="z", max_tokens=2)
        assert refused.value.status_code == 503 and "busy" in str(refused.value)
        t0 = time.monotonic()
        for s in streams:
            s.close()  # the client goes away mid-stream
        answers = [w.result(timeout=60) for w in waiting]
        freed_in = time.monotonic() - t0
    want = reference(local, local.tokenizer.encode("y = ", add_special_tokens=False), 8)
    assert all(a.choices[0].text == want for a in answers)
    aborted = 'starsd:requests_total{outcome="aborted"}'
    deadline = time.monotonic() + 10  # one freed target may serve both waiting requests before the
    while scrape(gateway)[aborted] - before.get(aborted, 0) < 2 and time.monotonic() < deadline:  # other
        time.sleep(0.1)  # stream's disconnect is noticed (at its next step)
    after = scrape(gateway)
    assert after[aborted] - before.get(aborted, 0) == 2
    assert after['starsd:requests_total{outcome="rejected"}'] - before.get('starsd:requests_total{outcome="rejected"}', 0) == 1
    assert freed_in < 20, f"the waiting requests took {freed_in:.1f} s: the cancelled streams held their targets"
    health = httpx.get(gateway["url"] + "/health").json()
    assert health["running"] == 0 and health["waiting"] == 0


def test_a_target_that_dies_fails_its_stream_at_once_and_rejoins_when_back(client, gateway, local):
    """SIGKILL one target server while both hold streams: its stream ends with an error within
    seconds (not after --step-timeout), the gateway serves on with the other, and the target
    rejoins once a target server is back at its address."""
    long = dict(model=MODEL, prompt="for i in range(10):", max_tokens=900, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
    streams = [client.completions.create(**long) for _ in range(2)]
    for s in streams:
        next(iter(s))
    victim = next(p for p in psutil.Process(gateway["proc"].pid).children() if "target-0" in p.cmdline())
    argv = victim.cmdline()
    victim.kill()
    t0 = time.monotonic()

    def drain(s):
        try:
            for _ in s:
                if time.monotonic() - t0 > 30:
                    return "still streaming"
        except openai.APIError as e:
            return time.monotonic() - t0 if "went away" in str(e) else str(e)
        return "ended"

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(drain, s) for s in streams]
        done, _ = concurrent.futures.wait(futures, timeout=60, return_when=concurrent.futures.FIRST_COMPLETED)
        failed_after = next(iter(done)).result()
        for s in streams:
            s.close()
    assert isinstance(failed_after, float) and failed_after < 10, failed_after
    health = httpx.get(gateway["url"] + "/health").json()
    assert health["targets_up"] == 1
    want = reference(local, local.tokenizer.encode("x = 2", add_special_tokens=False), 6)
    assert client.completions.create(model=MODEL, prompt="x = 2", max_tokens=6, temperature=0).choices[0].text == want
    back = spawn(argv[3:])  # the same target server command line, at the same address
    try:
        deadline = time.monotonic() + 120
        while httpx.get(gateway["url"] + "/health").json()["targets_up"] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert httpx.get(gateway["url"] + "/health").json()["targets_up"] == 2
        answers = [client.completions.create(model=MODEL, prompt="x = 2", max_tokens=6, temperature=0) for _ in range(3)]
        assert all(a.choices[0].text == want for a in answers)
    finally:
        back.terminate()
        back.wait(timeout=30)


def test_sigterm_stops_the_whole_star(gateway):
    def running(p):  # a target killed by a test before may be a zombie not yet reaped, or gone meanwhile
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    children = [p for p in psutil.Process(gateway["proc"].pid).children(recursive=True) if running(p)]
    assert children and all("draft-server" in p.cmdline() or "target-server" in p.cmdline() for p in children)
    gateway["proc"].send_signal(signal.SIGTERM)
    assert gateway["proc"].wait(timeout=30) == 0
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive


def test_two_draft_servers_share_the_targets_and_take_over_from_each_other(dirs, local):
    """`serve --draft-servers 2`: target i opens its session at server i, and the gateway's /metrics
    counts both. Server 0 killed (no restart): target-0's session moves to server 1 at its next
    step, and every answer stays target-only decoding's."""
    port = free_port()
    proc = spawn(["serve", "--targets", "2", "--draft-servers", "2", "--no-restart", "--port", str(port),
                  "--target", dirs["target"], "--draft", dirs["draft"], "--dtype", "float32", "--draft-quantize",
                  "none", "--draft-depth", "4", "--no-draft-adaptive", "--served-model-name", MODEL])
    try:
        ready = read_json_line(proc, "ready", 300)
        star = {"url": f"http://127.0.0.1:{port}"}
        first, second = ready["metrics"]["draft_servers"]
        assert len(ready["draft_server"].split(",")) == 2
        sessions = [scrape(star, url)["starsd:draft_server_sessions_open"] for url in (first, second)]
        assert sessions == [1, 1] and scrape(star)["starsd:draft_server_up"] == 2
        client = openai.OpenAI(base_url=star["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
        want = reference(local, local.tokenizer.encode("x = 2", add_special_tokens=False), 12)

        def both():  # two at once: one on each target
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                return list(pool.map(lambda _: client.completions.create(
                    model=MODEL, prompt="x = 2", max_tokens=12, temperature=0), range(2)))

        assert all(a.choices[0].text == want and a.model_extra["spec_decode"]["drafts"] for a in both())
        server = next(p for p in psutil.Process(proc.pid).children() if "draft-server" in p.cmdline()
                      and ready["draft_server"].split(",")[0] in " ".join(p.cmdline()))
        server.kill()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert all(a.choices[0].text == want for a in both())
            if scrape(star, second)["starsd:draft_server_sessions_open"] == 2:
                break
        assert scrape(star, second)["starsd:draft_server_sessions_open"] == 2
        assert scrape(star)["starsd:draft_server_up"] == 1
        answers = both()
        assert all(a.choices[0].text == want and a.model_extra["spec_decode"]["drafts"] for a in answers)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
