"""The gateway's targets: one ZeroMQ link per target server, and the routing of streams to them.

Each request goes to an idle target. When every target is busy it waits in a bounded queue (FIFO);
past the bound it is refused at once (Overloaded, an HTTP 503). A stream whose consumer goes away
(the HTTP client disconnected) sends Cancel; its target returns to the pool only once it has said
the stream is over, so a target never holds two streams.

A target whose connection drops (its process died: the socket monitor reports the disconnect) is
taken out of service at once, and the stream it held fails with `target_lost`; when a target
server answers at the address again, it describes itself and rejoins the pool. A target that is
connected but sends nothing for step_timeout_s is taken out of service for good.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from starsd.config import GatewayKeys
from starsd.star import protocol as P
from starsd.star import security

log = logging.getLogger("starsd.gateway")


class Overloaded(Exception):
    """Every target is busy and the queue is full."""


class TargetFailed(Exception):
    """A target refused a request (code) or stopped answering."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class TargetLink:
    """The gateway's end of one target server: a DEALER socket and a reader that hands each
    Output (or Error) to the queue of the stream it belongs to."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, keys: GatewayKeys = GatewayKeys()):
        self.address = address
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        security.guard_client(self.sock, keys.gateway_key, keys.target_server_key)
        self.sock.connect(address)
        self.info: P.TargetInfo | None = None
        self.streams: dict[int, asyncio.Queue] = {}
        self.lost = False  # the connection dropped and has not come back
        self._described: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._monitor: zmq.asyncio.Socket | None = None

    async def describe(self, timeout_s: float) -> P.TargetInfo:
        """Ask the target who it is (it may still be loading its model: the message waits for it)."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        self._described = asyncio.get_running_loop().create_future()
        await self.send(P.Describe())
        try:
            self.info = await asyncio.wait_for(self._described, timeout_s)
        except asyncio.TimeoutError:
            raise TargetFailed("timeout", f"target {self.address} did not answer within {timeout_s:.0f} s") from None
        return self.info

    async def send(self, msg) -> None:
        await self.sock.send_multipart(P.encode(msg))

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                msg, _ = P.decode(frames)
            except P.ProtocolError as e:
                log.warning("malformed message from %s: %s", self.address, e)
                continue
            if isinstance(msg, P.TargetInfo):
                if self._described and not self._described.done():
                    self._described.set_result(msg)
            elif isinstance(msg, (P.Output, P.Error)):
                queue = self.streams.get(msg.id if isinstance(msg, P.Output) else msg.tag)
                if queue is not None:
                    queue.put_nowait(msg)

    def watch(self, on_change) -> None:
        """Call on_change(self, up) when the connection drops (up False) and when a target server
        completes a handshake at the address after a drop (up True)."""
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._watcher = asyncio.create_task(self._watch(on_change))

    async def _watch(self, on_change) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED and not self.lost:
                self.lost = True
                for stream_id, queue in self.streams.items():
                    queue.put_nowait(P.Error("target_lost", f"target {self.info.name} went away mid-stream", stream_id))
                on_change(self, False)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.lost:
                self.lost = False
                on_change(self, True)

    def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task:
                task.cancel()
        if self._monitor:  # a socket left open would hang the context's term()
            self.sock.disable_monitor()
            self._monitor.close(0)
        self.sock.close(0)


class Pool:
    def __init__(self, addresses: list[str], max_queue: int, step_timeout_s: float, keys: GatewayKeys = GatewayKeys()):
        self.ctx = zmq.asyncio.Context()
        self.links = [TargetLink(self.ctx, a, keys) for a in addresses]
        self.max_queue = max_queue
        self.step_timeout_s = step_timeout_s  # longest wait for a target's next Output (a prefill included)
        self.idle: asyncio.Queue[TargetLink] = asyncio.Queue()
        self.waiting = 0
        self.running = 0
        self.failed: list[TargetLink] = []
        self._ids = itertools.count(1)

    async def start(self, timeout_s: float) -> None:
        """Wait until every target has described itself; they then all take requests."""
        await asyncio.gather(*(link.describe(timeout_s) for link in self.links))
        for link in self.links:
            self.idle.put_nowait(link)
            link.watch(self._changed)

    @property
    def models(self) -> list[str]:
        return sorted({link.info.model for link in self.links if link.info})

    def close(self) -> None:
        for link in self.links:
            link.close()
        self.ctx.term()

    async def acquire(self) -> tuple[TargetLink, float]:
        """An idle target and the seconds waited for it. Raises Overloaded."""
        if len(self.failed) == len(self.links):
            raise Overloaded(f"no target is in service (all {len(self.links)} stopped answering)")
        if self.idle.empty() and self.waiting >= self.max_queue:
            raise Overloaded(f"all {len(self.links) - len(self.failed)} targets are busy and {self.waiting} "
                             f"requests are waiting (--max-queue {self.max_queue}); retry later")
        t0 = time.perf_counter()
        self.waiting += 1
        try:
            link = await self.idle.get()
            while link in self.failed:  # it went out of service while idle
                link = await self.idle.get()
        finally:
            self.waiting -= 1
        return link, time.perf_counter() - t0

    async def stream(self, link: TargetLink, request: P.Generate) -> AsyncIterator[P.Output]:
        """Run one Generate on an acquired target and yield its Outputs; the target goes back to
        the pool when the stream is over, or after its Cancel, however the consumer leaves."""
        queue: asyncio.Queue = asyncio.Queue()
        link.streams[request.id] = queue
        finished = False
        self.running += 1
        try:
            await link.send(request)
            while not finished:
                msg = await self._next(link, queue)
                if isinstance(msg, P.Error):
                    finished = True
                    raise TargetFailed(msg.code, msg.message)
                finished = bool(msg.finish)
                yield msg
        finally:
            self.running -= 1
            if finished:
                self._release(link, request.id)
            elif link not in self.failed:  # the consumer left early: cancel, and wait for the end in the background
                asyncio.get_running_loop().create_task(self._cancel(link, request.id, queue))

    def new_id(self) -> int:
        return next(self._ids)

    async def _next(self, link: TargetLink, queue: asyncio.Queue):
        try:
            return await asyncio.wait_for(queue.get(), self.step_timeout_s)
        except asyncio.TimeoutError:
            self._fail(link)
            raise TargetFailed("timeout", f"target {link.info.name} sent nothing for {self.step_timeout_s:.0f} s; "
                                          "it is taken out of service") from None

    async def _cancel(self, link: TargetLink, stream_id: int, queue: asyncio.Queue) -> None:
        await link.send(P.Cancel(stream_id))
        try:
            while True:
                msg = await self._next(link, queue)
                if isinstance(msg, P.Error) or msg.finish:
                    break
        except TargetFailed:
            return
        self._release(link, stream_id)

    def _release(self, link: TargetLink, stream_id: int) -> None:
        link.streams.pop(stream_id, None)
        if link not in self.failed:
            self.idle.put_nowait(link)

    def _fail(self, link: TargetLink) -> None:
        if link not in self.failed:
            log.error("target %s at %s stopped answering: out of service", link.info.name, link.address)
            self.failed.append(link)

    def _changed(self, link: TargetLink, up: bool) -> None:
        if not up:
            log.error("target %s at %s disconnected: out of service until it is back", link.info.name, link.address)
            if link not in self.failed:
                self.failed.append(link)
        else:
            asyncio.get_running_loop().create_task(self._rejoin(link))

    async def _rejoin(self, link: TargetLink) -> None:
        try:
            await link.describe(timeout_s=60)
        except TargetFailed:
            return
        if link in self.failed and not link.lost:
            self.failed.remove(link)
            self.idle.put_nowait(link)
            log.info("target %s at %s is back in service", link.info.name, link.address)
