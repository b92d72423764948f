"""The OpenAI-compatible HTTP gateway in front of the star (FastAPI, served by uvicorn).

/v1/completions and /v1/chat/completions (plain, or `stream: true` as server-sent events),
/v1/models, /health and /metrics (Prometheus: the gateway's own figures and the draft server's).
Each request goes to an idle target server through the Pool; the targets do the tokenising, the
chat template, decoding and stop strings, and send back text one target step at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response as HttpResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from starsd.serve.metrics import DraftServerCollector, GatewayMetrics
from starsd.serve.openai_api import ApiError, ChatRequest, CompletionRequest, Response, Tally
from starsd.serve.pool import Overloaded, Pool, TargetFailed
from starsd.star.client import DraftClient, DraftServerError

log = logging.getLogger("starsd.gateway")
TARGET_ERRORS = {"bad_request": 400, "context_length": 400, "bad_settings": 400, "busy": 503, "timeout": 504}


@dataclass(frozen=True)
class GatewayConfig:
    targets: tuple[str, ...]  # target servers' ZeroMQ addresses
    draft_server: str = ""  # its address, for /metrics and /health (empty: not shown)
    max_queue: int = 32  # requests waiting for a free target at most; beyond: 503
    default_max_tokens: int = 256  # when a request names none
    step_timeout_s: float = 300.0  # longest wait for a target's next step (a long prefill on a CPU)
    start_timeout_s: float = 600.0  # for every target to answer at start (they load their models)
    api_key: str = ""  # if set, requests need `Authorization: Bearer KEY`


def draft_server_snapshot(address: str):
    """The draft server's counters, or None if it does not answer within 2 s."""
    if not address:
        return None
    client = DraftClient(address, "", "gateway-metrics", timeout_s=2.0, heartbeat_s=0)
    try:
        return client.stats()
    except DraftServerError:
        return None
    finally:
        client.close()


def make_app(cfg: GatewayConfig) -> FastAPI:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, max_position=64)
    registry.register(DraftServerCollector(lambda: draft_server_snapshot(cfg.draft_server)))
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        pool = Pool(list(cfg.targets), cfg.max_queue, cfg.step_timeout_s)
        await pool.start(cfg.start_timeout_s)
        state["pool"] = pool
        metrics.running.set_function(lambda: pool.running)
        metrics.waiting.set_function(lambda: pool.waiting)
        log.info("gateway: %d targets serving %s", len(pool.links), ", ".join(pool.models))
        try:
            yield
        finally:
            pool.close()

    app = FastAPI(title="StarSD", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        metrics.requests.labels("rejected" if e.status == 503 else "invalid" if e.status < 500 else "error").inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if cfg.api_key and request.url.path.startswith("/v1/") and \
                request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            return JSONResponse(ApiError(401, "invalid or missing API key", kind="authentication_error").body(),
                                status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        pool: Pool = state["pool"]
        up = len(pool.links) - len(pool.failed)
        body = {"status": "ok" if up else "down", "targets": len(pool.links), "targets_up": up,
                "running": pool.running, "waiting": pool.waiting}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    def prometheus():
        return HttpResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        pool: Pool = state["pool"]
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "starsd"}
                                           for m in pool.models]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, ChatRequest, chat=True)

    async def serve(request: Request, kind, chat: bool):
        arrived = time.perf_counter()
        pool: Pool = state["pool"]
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            raise ApiError(400, f"the body is not JSON: {e}") from None
        try:
            req = kind.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            raise ApiError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}",
                           str(first["loc"][0]) if first["loc"] else None) from None
        req.check()
        if req.model not in pool.models:
            raise ApiError(404, f"the model {req.model!r} does not exist; served: {', '.join(pool.models)}",
                           "model", code="model_not_found")
        try:
            generate = req.generate(pool.new_id(), cfg.default_max_tokens)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        try:
            link, waited = await pool.acquire()
        except Overloaded as e:
            raise ApiError(503, str(e), kind="server_overloaded") from None
        metrics.queue_time.observe(waited)
        outputs = pool.stream(link, generate)
        reply = Response(chat, req.model)
        if req.stream:
            return StreamingResponse(sse(outputs, reply, req.include_usage(), arrived), media_type="text/event-stream")
        return await whole(request, outputs, reply, arrived)

    def account(tally: Tally, out, last: float, arrived: float) -> float:
        now = time.perf_counter()
        if tally.steps == 1:
            metrics.ttft.observe(now - arrived)
            metrics.prompt_tokens.inc(out.prompt_tokens)
        metrics.step(out.tokens, out.drafted, out.accepted, now - last)
        return now

    def finished(tally: Tally, arrived: float) -> None:
        metrics.e2e.observe(time.perf_counter() - arrived)
        metrics.requests.labels(tally.finish if tally.finish in ("stop", "length") else "aborted").inc()

    async def whole(request: Request, outputs, reply: Response, arrived: float):
        tally = Tally()
        last = arrived
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    tally.add(out)
                    last = account(tally, out, last, arrived)
                    if not out.finish and await request.is_disconnected():
                        metrics.requests.labels("aborted").inc()
                        return HttpResponse(status_code=499)
            except TargetFailed as e:
                raise target_error(e) from None
        finished(tally, arrived)
        return reply.whole(tally)

    async def sse(outputs, reply: Response, include_usage: bool, arrived: float):
        tally = Tally()
        last = arrived
        done = False
        try:
            async with contextlib.aclosing(outputs):
                try:
                    async for out in outputs:
                        tally.add(out)
                        last = account(tally, out, last, arrived)
                        if out.text or out.finish or tally.steps == 1:
                            yield event(reply.chunk(out.text, out.finish, first=tally.steps == 1))
                except TargetFailed as e:
                    metrics.requests.labels("error").inc()
                    yield event(target_error(e).body())
                    done = True
                    return
            finished(tally, arrived)
            done = True
            if include_usage:
                yield event(reply.usage_chunk(tally))
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away mid-stream (the response was cancelled)
                metrics.requests.labels("aborted").inc()

    return app


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def target_error(e: TargetFailed) -> ApiError:
    status = TARGET_ERRORS.get(e.code, 500)
    return ApiError(status, str(e), kind="invalid_request_error" if status == 400 else "server_error", code=e.code)


def run(cfg: GatewayConfig, host: str, port: int, on_ready=None) -> None:
    """Serve until SIGINT or SIGTERM, then return. uvicorn shuts down gracefully on either and then
    raises the signal again with the handler it found: that one is made a no-op, so the caller's
    cleanup runs and the process exits 0."""
    import signal

    import uvicorn

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)

    config = uvicorn.Config(make_app(cfg), host=host, port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    if on_ready is None:
        server.run()
        return

    async def main():
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            on_ready()
        await task

    asyncio.run(main())
