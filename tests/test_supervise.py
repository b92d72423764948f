"""A local star keeps its processes up: `starsd serve` (tiny models) under a load of streaming
clients while its draft server, a target server, and both at once are killed with SIGKILL. The only
requests that fail are the streams that were running on a killed target, each with a clear error;
every other answer, the streams running while the draft server died among them, is the text of
target-only decoding; no request started after the restarts fails, and /metrics counts the restarts."""

import json
import re
import signal
import threading
import time

import httpx2 as httpx
import psutil
import pytest

import tiny
from starsd.config import ModelConfig, SamplingConfig
from starsd.models.pair import Pair
from starsd.spec_decode.decode import target_only
from starsd.star.processes import free_port, read_json_line, spawn

MODEL = "tiny-target"
CLIENTS = 3


PROMPT = "def f(x):"
MAX_TOKENS = 40


def target_only_text(target_dir: str) -> str:
    """The prompt's greedy answer by target-only decoding in this process: what every answer must be."""
    pair = Pair.load(ModelConfig(target_dir, dtype="float32"), None)
    ids = pair.tokenizer.encode(PROMPT, add_special_tokens=False)
    gen = target_only(pair.target, ids, MAX_TOKENS, SamplingConfig(temperature=0.0))  # ignore_eos: no EOS
    return pair.tokenizer.decode(gen.token_ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def star(tmp_path_factory):
    target, draft = tiny.save_pair(tmp_path_factory.mktemp("supervise"))
    port = free_port()
    proc = spawn(["serve", "--targets", "2", "--port", str(port), "--target", target, "--draft", draft,
                  "--dtype", "float32", "--draft-quantize", "none", "--draft-depth", "4", "--no-draft-adaptive",
                  "--max-queue", "8", "--step-timeout", "20", "--served-model-name", MODEL])
    try:
        read_json_line(proc, "ready", 300)
    except BaseException:
        proc.kill()
        raise
    yield {"url": f"http://127.0.0.1:{port}", "proc": proc, "text": target_only_text(target)}
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def child(star, name: str) -> psutil.Process:
    """The star's live process whose command line holds `name` (draft-server, target-0, ...)."""
    for p in psutil.Process(star["proc"].pid).children():
        if name in " ".join(p.cmdline()):
            return p
    raise AssertionError(f"no live {name}")


def restarts(star) -> dict[str, float]:
    text = httpx.get(star["url"] + "/metrics", timeout=10).text
    return {kind: float(n) for kind, n in re.findall(r'^starsd:process_restarts_total\{process="([^"]+)"\} (\S+)$',
                                                     text, re.M)}


class Load:
    """CLIENTS threads sending streaming completions one after another; each request's start and end
    (monotonic s) and outcome ("ok": its whole text is `text`; or the error it met) are kept."""

    def __init__(self, url: str, text: str):
        self.url = url
        self.text = text
        self.results: list[tuple[float, float, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(CLIENTS)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def _client(self) -> None:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                "ignore_eos": True}
        while not self._stop.is_set():
            started = time.monotonic()
            outcome = self._one(body)
            self.results.append((started, time.monotonic(), outcome))

    def _one(self, body: dict) -> str:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                if r.status_code != 200:
                    return f"HTTP {r.status_code}: {r.read().decode()[:200]}"
                text = ""
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"error"' in line:
                        return json.loads(line[6:])["error"]["code"] or "error"
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
                    if line == "data: [DONE]":
                        return "ok" if text == self.text else f"text {text!r}, not target-only's {self.text!r}"
                return "no [DONE]"
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"


def kill_and_wait(star, names: list[str], kinds: dict[str, float]) -> tuple[float, float]:
    """SIGKILL the named children, wait until the gateway counts their restarts and every target is
    in service again; returns when they were killed and the seconds until they were back."""
    before = restarts(star)
    for name in names:
        child(star, name).kill()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 180:
        counted = restarts(star)
        health = httpx.get(star["url"] + "/health", timeout=10).json()
        if all(counted.get(k, 0) >= before.get(k, 0) + n for k, n in kinds.items()) and \
                health["targets_up"] == health["targets"]:
            return t0, time.monotonic() - t0
        time.sleep(0.2)
    pytest.fail(f"not back within 180 s: restarts {restarts(star)}, health {health}")


def test_killed_processes_come_back_and_only_the_streams_on_a_killed_target_fail(star):
    kills = {}  # what was killed: (when, seconds until it was back)
    with Load(star["url"], star["text"]) as load:
        time.sleep(3)
        kills["draft-server"] = kill_and_wait(star, ["draft-server"], {"draft-server": 1})
        time.sleep(3)
        kills["target-0"] = kill_and_wait(star, ["target-0"], {"target-server": 1})
        time.sleep(3)
        kills["draft-server, target-1"] = kill_and_wait(star, ["draft-server", "target-1"],
                                                        {"draft-server": 1, "target-server": 1})
        last_back = sum(kills["draft-server, target-1"])
        time.sleep(5)
    print("back after (s):", {k: round(back, 1) for k, (_, back) in kills.items()})
    failed = [(start, end, outcome) for start, end, outcome in load.results if outcome != "ok"]

    def running_at(t: float) -> list[str]:
        return [outcome for start, end, outcome in failed if start <= t <= end]

    assert running_at(kills["draft-server"][0]) == []  # the targets went on alone
    for target_kill in ("target-0", "draft-server, target-1"):  # a target holds one stream
        assert running_at(kills[target_kill][0]) in ([], ["target_lost"])
    at_a_target_kill = [o for k in ("target-0", "draft-server, target-1") for o in running_at(kills[k][0])]
    assert len(failed) == len(at_a_target_kill), f"requests failed that ran at no target's kill: {failed}"
    assert sum(1 for start, _, outcome in load.results if start >= last_back and outcome == "ok") >= CLIENTS
    assert restarts(star) == {"draft-server": 2.0, "target-server": 2.0}
