"""A property-based fuzz of the gateway's HTTP API over real processes: `starsd serve` (a draft
server and two target servers on tiny models) under requests that hypothesis builds.

Four fuzzes, each of FUZZ.max_examples requests:
- raw bodies: bytes that are not UTF-8, not JSON, JSON that is not an object, NaN and Infinity as
  JSON tokens, nesting deeper than a parser recurses, a wrong Content-Type;
- limits: requests right but for their numbers, each typical or just inside or just outside an edge
  (the least doubles, 2**63, 2**64, 1e308, the limits of star/protocol.py and of the context);
- completions and chat: bodies from the OpenAI request schemas, every field right most of the time
  (so that most requests reach a target), else of a wrong type, at a boundary, or unknown; unicode
  (lone surrogates escaped in JSON, emoji, NUL); prompts and message lists past the size limits.

The invariant, for every request:
- an answer within TIMEOUT_S (none is a hang), its status 2xx or 4xx, never 5xx;
- a non-2xx answer carries an OpenAI error body: {"error": {"message": str, "type": str, ...}};
- a streamed 200 is server-sent events ending with [DONE], or with an error event of a client error
  (type invalid_request_error; a server_error event is a 5xx told late);
- every target is still in service afterwards.
After each fuzz, every target answers normal requests, all alike (greedy on identical targets).

A failure is raised as a class named for what broke and for the last exception in the star's log,
e.g. `Http500_UnicodeDecodeError`: hypothesis tells bugs apart by exception class, so each bug gets
its own minimal example. What a failing request broke is not blamed on the next one: after it the
star is checked (Star.settle) and, if a target is still out of service, started anew, so that the
shrinker's tries each meet a whole star. (So a failing run takes minutes; a passing one about 80 s.)

`pytest -rP tests/test_http_fuzz.py` prints how many requests each fuzz sent, by answer.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import tiny
from starsd.config import MAX_SEED
from starsd.serve.openai_api import NO_OPS
from starsd.star import protocol as P
from starsd.star.processes import free_port, read_json_line, spawn

MODEL = "tiny-target"
TARGETS = 2
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
CONTEXT = 1024  # the tiny target's max_position_embeddings: prompt + max_tokens fit in it
TIMEOUT_S = 60.0  # longer than any answer may take: no answer by then is a hang
STEP_TIMEOUT_S = 10  # --step-timeout: a target silent this long is taken out of service (a 504)
DEFAULT_MAX_TOKENS = 16  # --max-tokens: what a request that names none generates
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
FUZZ = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                phases=[Phase.explicit, Phase.generate, Phase.target, Phase.shrink],  # no explain: slow, noisy here
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example, HealthCheck.filter_too_much])
SENT: collections.Counter = collections.Counter()  # (fuzz, answer): requests sent; answer is a status, "hang" or "cut"


# --------------------------------------------------------------------------------- the star
class Fault(AssertionError):
    """The gateway broke the invariant."""


_FAULTS: dict[str, type[Fault]] = {}


def fault_class(name: str) -> type[Fault]:
    """One Fault subclass per name, made once: hypothesis reports each class as a bug of its own."""
    if name not in _FAULTS:
        _FAULTS[name] = type(name, (Fault,), {})
    return _FAULTS[name]


def last_exception(log: str) -> str:
    """The name of the last exception in a log's tracebacks ("" if none): the one that escaped
    (an exception group's line comes before its members')."""
    names = [m.group(1).rsplit(".", 1)[-1] for m in re.finditer(
        r"^[\s|+]*((?:\w+\.)*\w*(?:Error|Exception|Exit|Interrupt))(?::|$)", log, re.M)]
    names = [n for n in names if not n.endswith("ExceptionGroup")]
    return names[-1] if names else ""


class Star:
    """`starsd serve` as a child process, its stderr (the gateway's and its servers') in a file:
    their tracebacks name what failed. Started anew before an example if it is not whole."""

    def __init__(self, target: str, draft: str, log: Path):
        self.args = ["serve", "--targets", str(TARGETS), "--target", target, "--draft", draft, "--dtype", "float32",
                     "--draft-quantize", "none", "--draft-depth", "4", "--no-draft-adaptive", "--max-queue", "2",
                     "--step-timeout", str(STEP_TIMEOUT_S), "--max-tokens", str(DEFAULT_MAX_TOKENS),
                     "--served-model-name", MODEL]
        self.log = log
        self.http = httpx.Client(timeout=TIMEOUT_S)
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.target_metrics: list[str] = []  # each target server's /metrics
        self.starts = 0
        self.last = ""  # the request in progress, or the last one
        self.passed = True  # the last request kept the invariant (and the star was whole after it)

    def start(self) -> None:
        port = free_port()
        with self.log.open("a") as err:
            self.proc = spawn([*self.args, "--port", str(port)], stderr=err)
        try:
            ready = read_json_line(self.proc, "ready", 300)
        except BaseException:
            self.proc.kill()
            raise
        self.url = f"http://127.0.0.1:{port}"
        self.target_metrics = ready["metrics"]["targets"]
        self.starts += 1

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # its servers die with it (PR_SET_PDEATHSIG)
            self.proc.wait(timeout=30)

    def health(self) -> dict:
        """The gateway's /health ({} if it does not answer it within seconds)."""
        try:
            health = self.http.get(self.url + "/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return {}
        return health if isinstance(health, dict) else {}

    def whole(self) -> bool:
        """Up, with every target in service."""
        return self.health().get("targets_up") == TARGETS

    def make_whole(self) -> None:
        """Before a request: after one that failed, the star may be short of a target; if so it is
        started anew. (After one that passed, the check that followed it found the star whole.)"""
        if not self.passed and (self.proc.poll() is not None or not self.whole()):
            self.restart()

    def restart(self) -> None:
        self.stop()
        self.start()

    def settle(self) -> None:
        """After a failing request: the gateway may have left a target waiting for the end of a
        stream that never began, out of the pool but counted up until --step-timeout, when the
        next request would see it go. If a target is stuck so, wait out the step timeout (it may
        rejoin); if the star is still not whole then, it is started anew."""
        self.http.close()  # new connections: uvicorn closes one under its client after an exception
        self.http = httpx.Client(timeout=TIMEOUT_S)
        if self.all_held():
            return
        time.sleep(STEP_TIMEOUT_S + 3)
        if not self.all_held():
            self.restart()

    def all_held(self) -> bool:
        """Whether every target takes a stream of its own within seconds (the streams are then closed)."""
        if not self.whole():
            return False
        long = {"model": MODEL, "prompt": "x", "max_tokens": 256, "ignore_eos": True, "temperature": 0, "stream": True}
        with contextlib.ExitStack() as held:
            try:
                for _ in range(TARGETS):
                    r = held.enter_context(self.http.stream("POST", self.url + COMPLETIONS, json=long, timeout=5))
                    if r.status_code != 200 or not next(r.iter_lines(), "").startswith("data: {"):
                        return False
            except httpx.HTTPError:
                return False
        return True

    def target_tokens(self) -> list[float]:
        """The tokens each target server has generated, from its own /metrics."""
        return [sum(map(float, re.findall(r"^starsd:target_tokens_total\{.*\} (\S+)$", self.http.get(url).text, re.M)))
                for url in self.target_metrics]

    def log_size(self) -> int:
        return self.log.stat().st_size

    def fault(self, kind: str, log_from: int, detail: str) -> Fault:
        time.sleep(0.3)  # uvicorn logs an exception after it has answered
        with self.log.open("rb") as f:
            f.seek(log_from)
            log = f.read().decode(errors="replace")
        culprit = last_exception(log)
        tail = "\n".join(log.splitlines()[-25:])
        return fault_class(f"{kind}_{culprit}" if culprit else kind)(
            f"{self.last}\n{detail}\n---- the star's log during the request ----\n{tail}")


@pytest.fixture(scope="module")
def star(tmp_path_factory):
    root = tmp_path_factory.mktemp("http_fuzz")
    tok = tiny.char_tokenizer()
    tok.chat_template = TEMPLATE
    target = tiny.tiny_model(1)
    s = Star(tiny.save(target, tok, root / "target"), tiny.save(tiny.perturbed(target, seed=7, scale=0.1), tok,
                                                                  root / "draft"), root / "star.log")
    s.start()
    yield s
    s.stop()
    s.http.close()


# ------------------------------------------------------------------------------ the invariant
def is_error_body(obj) -> bool:
    err = obj.get("error") if isinstance(obj, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


def stream_problem(text: str) -> tuple[str, str] | None:
    """What is wrong with a streamed 200's body, as (a fault's name, a detail); None if nothing:
    `data:` events of JSON objects, ending with `data: [DONE]` or with an error event of a client error."""
    *events, rest = text.split("\n\n")
    if rest:
        return "StreamCut", f"the body ends inside an event: {rest[-200:]!r}"
    for i, event in enumerate(events):
        last = i == len(events) - 1
        if not event.startswith("data: "):
            return "StreamGarbled", f"event {i} is not `data: ...`: {event[:200]!r}"
        if event == "data: [DONE]":
            return None if last else ("StreamGarbled", f"events after [DONE]: {events[i + 1][:200]!r}")
        try:
            obj = json.loads(event[6:])
        except ValueError:
            return "StreamGarbled", f"event {i} is not JSON: {event[:200]!r}"
        if isinstance(obj, dict) and "error" in obj:
            if not is_error_body(obj):
                return "StreamGarbled", f"event {i} is a malformed error: {event[:300]!r}"
            if obj["error"]["type"] != "invalid_request_error":
                code = re.sub(r"\W", "_", str(obj["error"].get("code")))
                return f"StreamError_{code}", f"event {i}: {event[:300]}"
            return None if last else ("StreamGarbled", f"events after an error: {events[i + 1][:200]!r}")
        if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
            return "StreamGarbled", f"event {i} is not a chunk: {event[:200]!r}"
    return "StreamCut", f"no [DONE] and no error at the end, after {len(events)} events"


def describe(path: str, body: bytes, content_type: str | None) -> str:
    shown = body if len(body) <= 400 else body[:300] + b"...(%d bytes)..." % len(body) + body[-60:]
    return f"POST {path} content-type={content_type!r} body={shown!r}"


def exchange(star: Star, fuzz: str, path: str, body: bytes, content_type: str | None = "application/json") -> None:
    """Send one request and check the invariant on its answer and on the star after it."""
    star.make_whole()
    star.last = describe(path, body, content_type)
    star.passed = False
    try:
        _exchange(star, fuzz, path, body, content_type)
    except Fault:
        star.settle()  # what this request broke is not blamed on the next one
        raise
    star.passed = True


def _exchange(star: Star, fuzz: str, path: str, body: bytes, content_type: str | None) -> None:
    log_from = star.log_size()
    t0 = time.monotonic()
    try:
        r = star.http.post(star.url + path, content=body,
                           headers={"content-type": content_type} if content_type is not None else {})
    except httpx.TimeoutException:
        SENT[fuzz, "hang"] += 1
        raise star.fault("Hang", log_from, f"no answer within {TIMEOUT_S:.0f} s") from None
    except httpx.TransportError as e:
        SENT[fuzz, "cut"] += 1
        raise star.fault("Cut", log_from, f"the connection broke: {e!r}") from None
    took = time.monotonic() - t0
    SENT[fuzz, r.status_code] += 1
    answer = f"HTTP {r.status_code} after {took:.1f} s: {r.text[:500]!r}"
    if took > TIMEOUT_S:
        raise star.fault("Hang", log_from, answer)
    if not 200 <= r.status_code < 500:
        raise star.fault(f"Http{r.status_code}", log_from, answer)
    if r.status_code >= 300:
        try:
            ok = is_error_body(r.json())
        except ValueError:
            ok = False
        if not ok:
            raise star.fault(f"ErrorBody{r.status_code}", log_from, answer)
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        problem = stream_problem(r.text)
        if problem:
            raise star.fault(problem[0], log_from, f"{problem[1]}\n{answer}")
    else:
        try:
            ok = isinstance(r.json().get("choices"), list)
        except (ValueError, AttributeError):
            ok = False
        if not ok:
            raise star.fault("NotACompletion", log_from, answer)
    health = star.health()
    if health.get("targets_up") != TARGETS:
        raise star.fault("TargetLost", log_from, f"{answer}\n/health after it: {health}")


def check_every_target_serves(star: Star) -> None:
    """Normal greedy requests, twice as many as targets, one at a time: each gets a 200, all the
    same text, every target generates some of them, and /health counts every target up."""
    before = star.target_tokens()
    texts = []
    for _ in range(2 * TARGETS):
        r = star.http.post(star.url + COMPLETIONS, json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 4,
                                                         "temperature": 0})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert len(set(texts)) == 1, f"greedy answers differ between targets: {texts}"
    generated = [b - a for a, b in zip(before, star.target_tokens())]
    assert len(generated) == TARGETS and all(n > 0 for n in generated), f"tokens generated by each target: {generated}"
    health = star.health()
    assert health.get("targets_up") == health.get("targets") == TARGETS, health


def fuzz_then_check(star: Star, name: str, fuzz) -> None:
    try:
        fuzz()
    finally:
        sent = {answer: n for (f, answer), n in sorted(SENT.items(), key=str) if f == name}
        print(f"{name}: {sum(sent.values())} requests {sent}; the star was started {star.starts} times")
    check_every_target_serves(star)


# ---------------------------------------------------------------------- values, right and wrong
@dataclass(frozen=True)
class Repeat:
    """A long text or list, built only when sent: hypothesis prints `Repeat('a', 1048577)`."""
    item: object
    times: int

    def expand(self):
        return self.item * self.times if isinstance(self.item, str) else [self.item] * self.times


@dataclass(frozen=True)
class Nested:
    """A JSON body nested this deep: `[[[...]]]`, or `{"a": {"a": ...}}`."""
    depth: int
    objects: bool

    def expand(self) -> bytes:
        return (b'{"a":' * self.depth + b"1" + b"}" * self.depth) if self.objects else \
            (b"[" * self.depth + b"]" * self.depth)


@dataclass(frozen=True)
class Spoiled:
    """A request's JSON with bytes that are not UTF-8 put in at a place."""
    request: dict
    bad: bytes
    at: int

    def expand(self) -> bytes:
        body = encode(self.request)
        at = self.at % (len(body) + 1)
        return body[:at] + self.bad + body[at:]


class _Absent:
    def __repr__(self):
        return "ABSENT"


ABSENT = _Absent()  # drawn for a field: the request leaves it out


def encode(request) -> bytes:
    """A request as a POST body: UTF-8 JSON (NaN and Infinity as JSON tokens, as Python writes
    them), lone surrogates escaped (UTF-8 has no bytes for them)."""
    try:
        return json.dumps(request, ensure_ascii=False, default=lambda o: o.expand()).encode()
    except UnicodeEncodeError:
        return json.dumps(request, default=lambda o: o.expand()).encode()


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy, odds: int = 8) -> st.SearchStrategy:
    """good, and bad about one time in odds + 1; the shrinker goes to good. (Not one_of(good, good,
    ..., bad): one_of drops repeated branches and flattens bad's own.)"""
    return st.integers(0, odds).flatmap(lambda i: good if i < odds else bad)


def maybe(values: st.SearchStrategy, odds: int = 1) -> st.SearchStrategy:
    """ABSENT about odds times in odds + 1, else values."""
    return mostly(st.just(ABSENT), values, odds)


def request(fields: dict[str, st.SearchStrategy], extras: st.SearchStrategy) -> st.SearchStrategy[dict]:
    """A JSON object of the fields not drawn ABSENT, over a few extra ones."""
    return st.tuples(st.fixed_dictionaries(fields), extras).map(
        lambda t: {**t[1], **{k: v for k, v in t[0].items() if v is not ABSENT}})


EDGE_INTS = (0, -1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**64) - 1, 10**9,
             10**30, CONTEXT, CONTEXT + 1, P.MAX_TOKENS_PER_REQUEST, P.MAX_TOKENS_PER_REQUEST + 1, MAX_SEED,
             MAX_SEED + 1)
EDGE_FLOATS = (0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 2.0000001, -1.0, 5e-324, 1e-308, 1e308, -1e308, math.inf, -math.inf,
               math.nan)
ODD_TEXT = ("", "\x00", "a\x00b", "\ud800", "\udfff", "a\udc80b", "\ud83d\ude00", "😀", "👩‍👩‍👧", "\u202e",
            "\ufeff", "\uffff", "\U0010ffff", "<eos>", "\r\n", "   ", "\\", '"', "{{ messages }}", "{% raw %}", "ééé")
texts = mostly(st.text(max_size=12), st.one_of(st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2),
                                               st.sampled_from(ODD_TEXT)), odds=2)
huge_texts = st.one_of(st.builds(Repeat, st.sampled_from(["a", "é", "😀", "\x00"]),
                                 st.sampled_from([1000, CONTEXT, CONTEXT + 1, P.MAX_PROMPT_CHARS,
                                                  P.MAX_PROMPT_CHARS + 1])),
                       st.just(Repeat("a", 3 << 20)))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(EDGE_INTS), st.floats(), texts)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner,
                                                                                                    max_size=3),
                           max_leaves=5)
counts = mostly(st.integers(1, 16), st.one_of(st.sampled_from(EDGE_INTS), st.sampled_from(EDGE_FLOATS), json_values),
                odds=4)
unit_floats = st.one_of(st.sampled_from(EDGE_FLOATS), json_values)
stops = mostly(st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
               st.one_of(st.sampled_from(["", "a" * (P.MAX_STOP_CHARS + 1), ["a", "b", "c", "d", "e"], [""], [1]]),
                         texts, json_values))
known_extras = st.dictionaries(st.sampled_from(sorted(NO_OPS) + ["messages", "prompt", "max_completion_tokens",
                                                                 "frequency_penalty", "top_k", "min_p"]),
                               json_values, min_size=1, max_size=2)
unknown_extras = st.dictionaries(texts, json_values, min_size=1, max_size=2)
extras = mostly(st.just({}), st.one_of(known_extras, unknown_extras), odds=12)


def common_fields() -> dict[str, st.SearchStrategy]:
    """The fields both endpoints take (and top_k, which neither does)."""
    return {
        "model": mostly(st.just(MODEL), st.one_of(st.just(ABSENT), st.sampled_from(["gpt-4", "", MODEL.upper(),
                                                                                    MODEL + "\x00"]), json_values),
                        odds=12),
        "max_tokens": maybe(counts),
        "temperature": maybe(mostly(st.one_of(st.sampled_from([0, 0.0, 1]), st.floats(0, 2)), unit_floats)),
        "top_p": maybe(mostly(st.floats(0.01, 1), unit_floats)),
        "top_k": maybe(mostly(st.integers(0, 50), counts), odds=12),  # refused: not an OpenAI field
        "n": maybe(mostly(st.just(1), counts), odds=3),
        "stop": maybe(stops, odds=3),
        "stream": maybe(mostly(st.booleans(), json_values)),
        "stream_options": maybe(mostly(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
                                       json_values, odds=3), odds=8),  # refused without stream: true
        "seed": maybe(mostly(st.integers(0, 2**32), counts), odds=2),
        "ignore_eos": maybe(mostly(st.booleans(), json_values), odds=2),
        # the OpenAI fields served only at their no-op value
        "logprobs": maybe(mostly(st.sampled_from([None, False, 0]), st.one_of(st.booleans(), st.integers(0, 5),
                                                                              json_values)), odds=6),
        "presence_penalty": maybe(mostly(st.sampled_from([0, 0.0]), st.one_of(st.floats(-2, 2), unit_floats)), odds=6),
        "user": maybe(mostly(st.none(), st.one_of(texts, json_values)), odds=6),
    }


prompts = mostly(texts, st.one_of(
    st.lists(texts, max_size=3),  # a list of prompts: one is allowed
    st.lists(st.one_of(st.integers(0, 127), st.sampled_from(EDGE_INTS)), max_size=4),  # token ids
    st.lists(st.lists(st.integers(0, 127), max_size=3), max_size=2),
    huge_texts, st.just(ABSENT), json_values))
completion_requests = request({**common_fields(), "prompt": prompts}, extras)

parts = st.one_of(
    *[st.fixed_dictionaries({"type": st.just("text"), "text": texts})] * 4,
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": texts})}),
    st.fixed_dictionaries({"type": texts}, optional={"text": json_values, "extra": json_values}),
    json_values)
messages = st.fixed_dictionaries({
    "role": mostly(st.sampled_from(["user", "user", "system", "assistant"]),
                   st.one_of(st.sampled_from(["tool", "developer", "function", "", "USER", "user "]), json_values)),
    "content": mostly(texts, st.one_of(st.lists(parts, max_size=3), huge_texts, json_values)),
    "name": maybe(texts, odds=6),
}).map(lambda m: {k: v for k, v in m.items() if v is not ABSENT})
chat_requests = request({
    **common_fields(),
    "messages": mostly(st.lists(messages, min_size=1, max_size=3), st.one_of(
        st.just([]), st.just(ABSENT), json_values, st.lists(json_values, min_size=1, max_size=2),
        st.builds(Repeat, st.just({"role": "user", "content": "a"}), st.sampled_from([P.MAX_MESSAGES,
                                                                                       P.MAX_MESSAGES + 1])))),
    "max_completion_tokens": maybe(counts, odds=2),
}, extras)

BAD_UTF8 = (b"\xff", b"\x80", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80")
HI = '{"model": "tiny-target", "prompt": "hi"%s}'
ODD_BODIES = (
    b"", b" ", b"null", b"[]", b"{}", b'"x"', b"0", b"NaN", b"-Infinity", b"1e999", b"{", b"}", b'{"model"',
    b'{"model": "tiny-target", "prompt": "\xe9t\xe9"}',  # latin-1
    b"\xef\xbb\xbf" + (HI % "").encode(),  # a UTF-8 byte order mark
    (HI % "").encode("utf-16"), (HI % "").encode("utf-32"),
    *[(HI % f', "{k}": {v}').encode() for k in ("max_tokens", "temperature", "seed")
      for v in ("NaN", "Infinity", "-Infinity", "1e999", "1e308", "1E1", "2.0", "-0", "1" * 5000)],
    (HI % ', "model": 3').encode(),  # a key twice
    b'{"model": "tiny-target", "prompt": "\\ud800"}', b'{"model": "tiny-target", "prompt": "\\u0000"}',
    (HI % "").encode() + b" trailing", (HI % "").encode() + b"\x00",
    b"model=tiny-target&prompt=hi",
)
raw_bodies = st.one_of(
    st.binary(max_size=48),  # mostly not UTF-8, nearly never JSON
    st.builds(Spoiled, st.one_of(request({"model": st.just(MODEL), "prompt": texts}, st.just({})),
                                 request({"model": st.just(MODEL), "messages": st.lists(messages, min_size=1,
                                                                                        max_size=2)}, st.just({}))),
              st.sampled_from(BAD_UTF8), st.integers(0, 200)),
    json_values.map(lambda v: json.dumps(v).encode()),  # JSON, mostly not an object
    st.sampled_from(ODD_BODIES),
    st.builds(Nested, st.sampled_from([10, 1000, 100_000, 1_000_000]), st.booleans()),  # deeper than json recurses
)
content_types = st.sampled_from(["application/json", "application/json", "text/plain", "multipart/form-data; boundary=x",
                                 "application/x-www-form-urlencoded", "application/json; charset=latin-1", "", None])


# Requests right in every way but their numbers: each number typical, or at an edge just inside what
# the schema takes (it reaches a target, which must cope), or just outside (the gateway refuses it
# with a 400, never a target with a 5xx), the wire's and the context's limits included.
TINY = (5e-324, 1e-308, 1.1754943508222875e-38, 1e-30)  # the least doubles, the least normal float32


def edges(typical: st.SearchStrategy, inside: tuple, outside: tuple) -> st.SearchStrategy:
    return maybe(st.one_of(typical, st.sampled_from(inside), st.sampled_from(outside)))


token_counts = edges(st.integers(1, 16), (1, 16), (0, -1, 1.5, CONTEXT, CONTEXT + 1, P.MAX_TOKENS_PER_REQUEST + 1,
                                                   2**31, 2**63, 2**64, 10**9, 1e308, math.inf, math.nan))
limit_fields = {
    "model": st.just(MODEL), "max_tokens": token_counts,
    "temperature": edges(st.floats(0, 2), (0, *TINY, 2.0), (-5e-324, 2.0000000000000004, 1e308, math.inf, math.nan)),
    "top_p": edges(st.floats(0, 1, exclude_min=True), (*TINY, 1.0), (0.0, -0.0, 1.0000000000000002, math.inf,
                                                                   math.nan)),
    "seed": edges(st.integers(0, 2**32), (0, 2**32, MAX_SEED), (-1, MAX_SEED + 1, 2**63, 2**64, 1e308, math.nan)),
    "n": edges(st.just(1), (1,), (0, 2, -1, 2**63)),
    "stream": st.booleans(), "ignore_eos": st.booleans(),
}
plain_texts = mostly(st.text(max_size=8), huge_texts, odds=4)
limit_requests = st.one_of(
    st.tuples(st.just(COMPLETIONS), request({**limit_fields, "prompt": plain_texts}, st.just({}))),
    st.tuples(st.just(CHAT), request({
        **limit_fields, "max_completion_tokens": token_counts,
        "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": plain_texts}), min_size=1,
                             max_size=2)}, st.just({}))))


# ---------------------------------------------------------------------------------- the fuzzes
def test_raw_bodies_fuzz(star):
    @FUZZ
    @given(st.sampled_from([COMPLETIONS, CHAT]), raw_bodies, content_types)
    def fuzz(path, body, content_type):
        exchange(star, "raw", path, body if isinstance(body, bytes) else body.expand(), content_type)

    fuzz_then_check(star, "raw", fuzz)


def test_limits_fuzz(star):
    @FUZZ
    @given(limit_requests)
    def fuzz(path_and_request):
        path, req = path_and_request
        exchange(star, "limits", path, encode(req))

    fuzz_then_check(star, "limits", fuzz)


def test_completions_fuzz(star):
    @FUZZ
    @given(completion_requests)
    def fuzz(req):
        exchange(star, "completions", COMPLETIONS, encode(req))

    fuzz_then_check(star, "completions", fuzz)


def test_chat_completions_fuzz(star):
    @FUZZ
    @given(chat_requests)
    def fuzz(req):
        exchange(star, "chat", CHAT, encode(req))

    fuzz_then_check(star, "chat", fuzz)
