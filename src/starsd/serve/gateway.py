"""The OpenAI-compatible HTTP gateway in front of the star (FastAPI, served by uvicorn).

/v1/completions and /v1/chat/completions (plain, or `stream: true` as server-sent events),
/v1/models, /health and /metrics (Prometheus: the gateway's own figures and the draft server's).
Each request goes to a target server with a free stream slot through the Pool; the targets do the
tokenising, the chat template, decoding and stop strings, and send back text one target step at a
time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response as HttpResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from starsd.config import ClientKeys, GatewayKeys
from starsd.errors import SettingError, Unavailable
from starsd.serve.metrics import DraftServerCollector, ElasticCollector, GatewayMetrics, RestartsCollector
from starsd.serve.openai_api import ApiError, ChatRequest, CompletionRequest, Response, Tally
from starsd.serve.pool import Overloaded, Pool, TargetFailed
from starsd.star import security
from starsd.star.client import query_stats
from starsd.star.security import SecurityError

log = logging.getLogger("starsd.gateway")
TARGET_ERRORS = {"bad_request": 400, "context_length": 400, "bad_settings": 400, "busy": 503, "timeout": 504,
                 "target_lost": 502}


@dataclass(frozen=True)
class GatewayConfig:
    targets: tuple[str, ...]  # target servers' ZeroMQ addresses
    draft_server: str = ""  # the draft servers' addresses, comma-separated, for /metrics (empty: not shown)
    max_queue: int = 32  # requests waiting for a free target at most; beyond: 503
    default_max_tokens: int = 256  # when a request names none
    step_timeout_s: float = 300.0  # longest wait for a target's next step (a long prefill on a CPU)
    start_timeout_s: float = 600.0  # for every target to answer at start (they load their models)
    api_key: str = ""  # if set, requests need `Authorization: Bearer KEY`
    keys: GatewayKeys = GatewayKeys()  # for target servers that require authentication
    draft_keys: ClientKeys = ClientKeys()  # for a draft server that does (its counters, on /metrics)


def draft_server_snapshots(addresses: str, keys: ClientKeys = ClientKeys()) -> list[dict | None]:
    """Each draft server's counters (`addresses`: comma-separated), None for one that does not
    answer within 2 s; asked all at once, so that a scrape takes 2 s at most, however many are down."""
    listed = [a for a in addresses.split(",") if a]
    if len(listed) < 2:
        return [query_stats(a, "gateway-metrics", timeout_s=2.0, keys=keys) for a in listed]
    with concurrent.futures.ThreadPoolExecutor(len(listed)) as pool:
        return list(pool.map(lambda a: query_stats(a, "gateway-metrics", timeout_s=2.0, keys=keys), listed))


class Gateway:
    """The routes' work. One request's path: parse and check it (ApiError on anything wrong), take
    a free stream slot of a target from the Pool (or wait, or 503), relay its Outputs whole or as
    SSE chunks, and count what happened in the metrics."""

    def __init__(self, cfg: GatewayConfig, restarts: Callable[[], dict[str, int]] | None = None, elastic=None):
        """`restarts`: a local star's restart counts by kind of process, for /metrics; `elastic`: a function
        giving the elastic controller (star/elastic.py) or None, for /metrics."""
        self.cfg = cfg
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry, max_position=64)
        self.draft_servers = cfg.draft_server  # as they run now (draft_moved)
        self.registry.register(DraftServerCollector(lambda: draft_server_snapshots(self.draft_servers, cfg.draft_keys)))
        if restarts:
            self.registry.register(RestartsCollector(restarts))
        if elastic:
            self.registry.register(ElasticCollector(elastic))
        self.pool: Pool | None = None  # made inside the event loop (lifespan)

    async def open(self) -> None:
        """Wait for every target to describe itself (they may still be loading their models).
        Raises Unavailable if one does not answer in time."""
        self.pool = Pool(list(self.cfg.targets), self.cfg.max_queue, self.cfg.step_timeout_s, self.cfg.keys)
        try:
            await self.pool.start(self.cfg.start_timeout_s)
        except TargetFailed as e:
            self.pool.close()
            raise Unavailable(f"{e}: is a target server running there, with keys this gateway has?") from None
        self.metrics.running.set_function(lambda: self.pool.running)
        self.metrics.waiting.set_function(lambda: self.pool.waiting)
        log.info("gateway: %d targets serving %s", len(self.pool.links), ", ".join(self.pool.models))

    def draft_moved(self, old: str, new: str) -> None:
        """A draft server of the star runs at `new` now: /metrics reads it there, and every target is told."""
        self.draft_servers = ",".join(new if a == old else a for a in self.draft_servers.split(","))
        self.pool.draft_moved(old, new)

    def draft_servers_listed(self, addresses: list[str]) -> None:
        """The star's draft servers are `addresses` now (star/elastic.py): /metrics reads them all, and
        every target is told."""
        self.draft_servers = ",".join(addresses)
        self.pool.draft_servers(addresses)

    async def api_error(self, request: Request, e: ApiError):
        outcome = "rejected" if e.status == 503 else "invalid" if e.status < 500 else "error"
        self.metrics.requests.labels(outcome).inc()
        return error_response(e)

    async def http_error(self, request: Request, e: StarletteHTTPException):
        """An unknown path (404) or method (405) in the OpenAI error shape, not FastAPI's {"detail"}."""
        return error_response(ApiError(e.status_code, str(e.detail)))

    async def authorize(self, request: Request, call_next):
        if self.cfg.api_key and request.url.path.startswith("/v1/") and \
                request.headers.get("authorization") != f"Bearer {self.cfg.api_key}":
            return JSONResponse(ApiError(401, "invalid or missing API key", kind="authentication_error").body(),
                                status_code=401)
        return await call_next(request)

    async def health(self):
        up = len(self.pool.links) - len(self.pool.failed)
        body = {"status": "ok" if up else "down", "targets": len(self.pool.links), "targets_up": up,
                "running": self.pool.running, "waiting": self.pool.waiting}
        return JSONResponse(body, status_code=200 if up else 503)

    def prometheus(self):
        return HttpResponse(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self):
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "starsd"}
                                           for m in self.pool.models]}

    async def completions(self, request: Request):
        return await self.serve(request, CompletionRequest, chat=False)

    async def chat_completions(self, request: Request):
        return await self.serve(request, ChatRequest, chat=True)

    async def serve(self, request: Request, kind, chat: bool):
        arrived = time.perf_counter()
        req = await self._parse(request, kind)
        try:
            generate = req.generate(self.pool.new_id(), self.cfg.default_max_tokens)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        if generate.max_tokens > self.pool.max_tokens:  # what a target would refuse, refused before it is sent
            raise ApiError(400, f"max_tokens is {generate.max_tokens}, more than the {self.pool.max_tokens} tokens "
                                "a target generates for one request", "max_tokens")
        try:
            link, waited = await self.pool.acquire()
        except Overloaded as e:
            raise ApiError(503, str(e), kind="server_overloaded") from None
        self.metrics.queue_time.observe(waited)
        outputs = self.pool.stream(link, generate)
        reply = Response(chat, req.model)
        if req.stream:
            return StreamingResponse(self._sse(outputs, reply, req.include_usage(), arrived),
                                     media_type="text/event-stream")
        return await self._whole(request, outputs, reply, arrived)

    async def _parse(self, request: Request, kind):
        try:
            body = await request.json()
        except ValueError as e:  # not JSON, or not UTF-8 (UnicodeDecodeError)
            raise ApiError(400, f"the body is not JSON in UTF-8: {e}") from None
        except RecursionError:
            raise ApiError(400, "the body nests deeper than JSON is read here") from None
        try:
            req = kind.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            raise ApiError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}",
                           str(first["loc"][0]) if first["loc"] else None) from None
        req.check()
        if req.model not in self.pool.models:
            raise ApiError(404, f"the model {req.model!r} does not exist; served: {', '.join(self.pool.models)}",
                           "model", code="model_not_found")
        return req

    def _account(self, tally: Tally, out, last: float, arrived: float) -> float:
        """Count one Output; returns its arrival time (perf_counter s)."""
        now = time.perf_counter()
        if tally.steps == 1:
            self.metrics.ttft.observe(now - arrived)
            self.metrics.prompt_tokens.inc(out.prompt_tokens)
        self.metrics.step(out.tokens, out.drafted, out.accepted, now - last)
        return now

    def _finished(self, tally: Tally, arrived: float) -> None:
        self.metrics.e2e.observe(time.perf_counter() - arrived)
        self.metrics.requests.labels(tally.finish if tally.finish in ("stop", "length") else "aborted").inc()

    async def _whole(self, request: Request, outputs, reply: Response, arrived: float):
        tally = Tally()
        last = arrived
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    tally.add(out)
                    last = self._account(tally, out, last, arrived)
                    if not out.finish and await request.is_disconnected():
                        self.metrics.requests.labels("aborted").inc()
                        return HttpResponse(status_code=499)
            except TargetFailed as e:
                raise target_error(e) from None
        self._finished(tally, arrived)
        return reply.whole(tally)

    async def _sse(self, outputs, reply: Response, include_usage: bool, arrived: float):
        tally = Tally()
        last = arrived
        done = False
        try:
            async with contextlib.aclosing(outputs):
                try:
                    async for out in outputs:
                        tally.add(out)
                        last = self._account(tally, out, last, arrived)
                        if out.text or out.finish or tally.steps == 1:
                            yield event(reply.chunk(out.text, out.finish, first=tally.steps == 1))
                except TargetFailed as e:
                    self.metrics.requests.labels("error").inc()
                    yield event(target_error(e).body())
                    done = True
                    return
            self._finished(tally, arrived)
            done = True
            if include_usage:
                yield event(reply.usage_chunk(tally))
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away mid-stream (the response was cancelled)
                self.metrics.requests.labels("aborted").inc()


def make_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="StarSD")
    app.add_exception_handler(ApiError, gateway.api_error)
    app.add_exception_handler(StarletteHTTPException, gateway.http_error)
    app.middleware("http")(gateway.authorize)
    app.add_api_route("/health", gateway.health, methods=["GET"])
    app.add_api_route("/metrics", gateway.prometheus, methods=["GET"])
    app.add_api_route("/v1/models", gateway.models, methods=["GET"])
    app.add_api_route("/v1/completions", gateway.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", gateway.chat_completions, methods=["POST"])
    return app


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def error_response(e: ApiError) -> HttpResponse:
    """JSON in ASCII: a parameter name or value a client sent may hold lone surrogates, which
    UTF-8 cannot carry (FastAPI's JSONResponse writes UTF-8)."""
    return HttpResponse(json.dumps(e.body()), status_code=e.status, media_type="application/json")


def target_error(e: TargetFailed) -> ApiError:
    status = TARGET_ERRORS.get(e.code, 500)
    return ApiError(status, str(e), kind="invalid_request_error" if status == 400 else "server_error", code=e.code)


def listen(host: str, port: int, api_key: str, insecure: bool = False) -> socket.socket:
    """The gateway's HTTP socket, bound before anything else starts, so that a taken port or an open
    host without a key is refused at once rather than after the star has loaded its models. Like the
    star's own sockets (star/security.py), a non-loopback host needs an API key, or `insecure`."""
    if not (api_key or insecure or security.is_loopback_host(host)):
        raise SecurityError(f"--host {host} opens the OpenAI endpoint beyond this machine: give an --api-key (or "
                            "--api-key-file) that clients must send, or pass --insecure to serve it open")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets
        # whose proto says TCP, and with it on, a kept-alive request's reply, written as headers then
        # body, waited ~40 ms for the client's delayed ACK
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise Unavailable(f"cannot listen on {host}:{port}: {(e.strerror or str(e)).lower()}; "
                          "choose another --host or --port") from None
    return sock  # listening starts when the gateway serves: until then, connections are refused


def read_api_key(api_key: str, api_key_file: str) -> str:
    """--api-key, or the first line of --api-key-file (a key kept out of the process list)."""
    if api_key and api_key_file:
        raise SettingError("give --api-key or --api-key-file, not both")
    if not api_key_file:
        return api_key
    try:
        key = Path(api_key_file).read_text().strip()
    except OSError as e:
        raise SettingError(f"cannot read the API key file {api_key_file}: {e.strerror}") from None
    if not key:
        raise SettingError(f"the API key file {api_key_file} is empty")
    return key


def run(cfg: GatewayConfig, sock: socket.socket, on_ready=None, restarts=None, moves=None, elastic=None) -> None:
    """Serve on `sock` (from listen) until SIGINT or SIGTERM, then return: first every target must
    describe itself, then uvicorn serves. `moves`, if given, is called once the targets are in, with a
    function moved(kind, old, new) to call from any thread when the address of a target server (kind
    "target") or of a draft server ("draft") changes (a Ray actor started again on another node), or
    when the star's draft servers are others (kind "listed", `new` their addresses: star/elastic.py).
    `elastic`: a function giving the elastic controller (or None), for /metrics.
    uvicorn shuts down gracefully on either signal and then raises it again with the handler it
    found: that one is made a no-op, so the caller's cleanup runs and the process exits 0."""
    import signal

    import uvicorn

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    gateway = Gateway(cfg, restarts, elastic)

    async def main():
        await gateway.open()
        if moves:
            loop = asyncio.get_running_loop()
            def moved(kind: str, old, new) -> None:
                if kind == "listed":
                    loop.call_soon_threadsafe(gateway.draft_servers_listed, new)
                else:
                    loop.call_soon_threadsafe(gateway.pool.readdress if kind == "target" else gateway.draft_moved,
                                              old, new)

            moves(moved)
        server = uvicorn.Server(uvicorn.Config(make_app(gateway), log_level="warning", lifespan="off"))
        try:
            task = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started and not task.done():
                await asyncio.sleep(0.05)
            if server.started and on_ready:
                on_ready()
            await task
        finally:
            gateway.pool.close()

    asyncio.run(main())
