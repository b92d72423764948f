"""The gateway's targets: one ZeroMQ link per target server, and the routing of streams to them.

Each request goes to a target with a free stream slot (a target server serves as many streams at
once as its description says: --target-streams), the one with the most free slots. When no target
has one it waits in a bounded queue (FIFO); past the bound it is refused at once (Overloaded, an
HTTP 503). A stream whose consumer goes away (the HTTP client disconnected) sends Cancel; its slot
returns to the pool only once the target has said the stream is over, so a target never holds more
streams than it serves at once.

A target whose connection drops (its process died: the socket monitor reports the disconnect) is
taken out of service at once, and the stream it held fails with `target_lost`; when a target
server answers at the address again, it describes itself and rejoins the pool (one that moved to
another address, as a Ray actor started again on another node does, is told by `readdress`). A draft
server that moved likewise is told to every target, and again to each that joins later (a target server
started again knows only the addresses of its command line): `draft_moved`. A target that is
connected but sends nothing for step_timeout_s fails its stream (`timeout`), is taken out of
service and asked whether it is alive, with backoff: it rejoins as soon as it answers and holds no
stream. A refusal names the stream it refuses, so it ends that stream and nothing else.
"""

from __future__ import annotations

import asyncio
import collections
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
        self.lost = False  # the connection dropped, or the reader stopped, and no Describe has been answered since
        self._closed = False
        self._on_change = None
        self._described: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._monitor: zmq.asyncio.Socket | None = None

    async def describe(self, timeout_s: float) -> P.TargetInfo:
        """Ask the target who it is (it may still be loading its model: the message waits for it)."""
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read())
            self._reader.add_done_callback(self._reader_ended)
        self._described = asyncio.get_running_loop().create_future()
        await self.send(P.Describe())
        try:
            self.info = await asyncio.wait_for(self._described, timeout_s)
        except asyncio.TimeoutError:
            raise TargetFailed("timeout", f"target {self.address} did not answer within {timeout_s:g} s") from None
        self.lost = False
        return self.info

    async def send(self, msg) -> None:
        await self.sock.send_multipart(P.encode(msg))

    def tell(self, msg) -> None:
        """Send if it can go at once, else drop: for a target that may be gone (nothing waits on it)."""
        try:
            self.sock.send_multipart(P.encode(msg), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

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

    def _reader_ended(self, task: asyncio.Task) -> None:
        """The reader stopped while the link is open (an error in it, or it was cancelled): its
        streams would wait for Outputs nobody reads. They fail now, and the link is lost until a
        Describe (the pool's revival) starts a new reader and is answered."""
        if self._closed:
            return
        error = None if task.cancelled() else task.exception()
        log.error("the reader of target %s at %s stopped (%r)", self.name, self.address, error)
        self._lose("the gateway stopped reading it")

    def _lose(self, why: str) -> None:
        """Fail every stream on this link (`target_lost`) and tell the pool it is out of service."""
        if self.lost:
            return
        self.lost = True
        for stream_id, queue in self.streams.items():
            queue.put_nowait(P.Error("target_lost", f"target {self.name} went away mid-stream: {why}", stream_id))
        if self._on_change:
            self._on_change(self, False)

    @property
    def name(self) -> str:
        return self.info.name if self.info else self.address

    @property
    def slots(self) -> int:
        """Streams the target serves at once."""
        return self.info.streams if self.info else 1

    def watch(self, on_change) -> None:
        """Call on_change(self, up) when the connection drops (up False) and when a target server
        completes a handshake at the address after a drop (up True)."""
        self._on_change = on_change
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._watcher = asyncio.create_task(self._watch(on_change))

    async def _watch(self, on_change) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._lose("its connection dropped")
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.lost:
                on_change(self, True)

    def close(self) -> None:
        self._closed = True
        for task in (self._reader, self._watcher):
            if task:
                task.cancel()
        if self._monitor:  # a socket left open would hang the context's term()
            self.sock.disable_monitor()
            self._monitor.close(0)
        self.sock.close(0)


class IdleTargets:
    """The targets' free stream slots, at most as many for each as it serves at once, and the
    requests waiting for one, first come first served."""

    def __init__(self):
        self._free: dict[TargetLink, int] = {}  # free slots, in the order targets came (a tie goes to the first)
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    def __len__(self) -> int:
        """Free slots in all."""
        return sum(self._free.values())

    def put(self, link: TargetLink) -> None:
        """One of `link`'s slots takes a request: the oldest waiting one, else it waits here (never
        more of them than the target serves at once, however often it is put)."""
        if self._free.get(link, 0) >= link.slots:
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(link)
                return
        self._free[link] = self._free.get(link, 0) + 1

    def fill(self, link: TargetLink) -> None:
        """Every slot of `link` is free (it holds no stream)."""
        for _ in range(link.slots):
            self.put(link)

    def discard(self, link: TargetLink) -> None:
        self._free.pop(link, None)

    async def get(self) -> TargetLink:
        if self._free:
            link = max(self._free, key=self._free.__getitem__)  # the least loaded
            self._free[link] -= 1
            if not self._free[link]:
                del self._free[link]
            return link
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a target just as the request left
                self.put(waiter.result())
            raise


class Pool:
    REVIVE_MAX_S = 60.0  # the longest wait for an answer from a target out of service
    BUSY_POLL_S = 0.5  # between questions to one that answers but still ends a stream

    def __init__(self, addresses: list[str], max_queue: int, step_timeout_s: float, keys: GatewayKeys = GatewayKeys()):
        self.ctx = zmq.asyncio.Context()
        self.keys = keys
        self.links = [TargetLink(self.ctx, a, keys) for a in addresses]
        self.max_queue = max_queue
        self.step_timeout_s = step_timeout_s  # longest wait for a target's next Output (a prefill included)
        self.idle = IdleTargets()
        self.waiting = 0
        self.running = 0
        self.failed: list[TargetLink] = []  # out of service: lost, or silent past a step deadline
        self._reviving: dict[TargetLink, asyncio.Task] = {}
        self.draft_moves: list[tuple[str, str]] = []  # (old, new) of each draft server that moved, in order
        self.listed: tuple[str, ...] = ()  # the draft servers last listed to the targets (draft_servers; (): none)
        self._ids = itertools.count(1)

    async def start(self, timeout_s: float) -> None:
        """Wait until every target has described itself; they then all take requests."""
        await asyncio.gather(*(link.describe(timeout_s) for link in self.links))
        for link in self.links:
            self.idle.fill(link)
            link.watch(self._changed)

    @property
    def models(self) -> list[str]:
        return sorted({link.info.model for link in self.links if link.info})

    @property
    def max_tokens(self) -> int:
        """The most tokens a request may ask for: what every target takes (its limit, and its context
        less one prompt token), so a request no target would refuse for its size alone."""
        return min(min(link.info.max_tokens, link.info.max_context - 1) for link in self.links if link.info)

    def close(self) -> None:
        for task in self._reviving.values():
            task.cancel()
        for link in self.links:
            link.close()
        self.ctx.term()

    async def acquire(self) -> tuple[TargetLink, float]:
        """A target's free stream slot and the seconds waited for it. Raises Overloaded."""
        if len(self.failed) == len(self.links):
            raise Overloaded(f"no target is in service (all {len(self.links)} stopped answering; they are asked "
                             "again and rejoin when they answer)")
        if not len(self.idle) and self.waiting >= self.max_queue:
            raise Overloaded(f"every stream slot of the {len(self.links) - len(self.failed)} targets in service is "
                             f"busy and {self.waiting} requests are waiting (--max-queue {self.max_queue}); retry later")
        t0 = time.perf_counter()
        self.waiting += 1
        try:
            link = await self.idle.get()
        finally:
            self.waiting -= 1
        return link, time.perf_counter() - t0

    async def stream(self, link: TargetLink, request: P.Generate) -> AsyncIterator[P.Output]:
        """Run one Generate on an acquired target and yield its Outputs; the target goes back to
        the pool when the stream is over, or after its Cancel, however the consumer leaves."""
        queue: asyncio.Queue = asyncio.Queue()
        link.streams[request.id] = queue
        try:
            await link.send(request)
        except Exception:  # never sent (a message that cannot be encoded): the target holds nothing of it
            self._release(link, request.id)
            raise
        finished = False
        self.running += 1
        try:
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
            else:  # it failed mid-stream: if it is alive, it ends the stream and is then idle again
                link.streams.pop(request.id, None)
                link.tell(P.Cancel(request.id))

    def new_id(self) -> int:
        return next(self._ids)

    async def _next(self, link: TargetLink, queue: asyncio.Queue):
        try:
            return await asyncio.wait_for(queue.get(), self.step_timeout_s)
        except asyncio.TimeoutError:
            log.error("target %s at %s sent nothing for %.0f s: out of service until it answers", link.name,
                      link.address, self.step_timeout_s)
            self._out_of_service(link)
            self._revive(link)
            raise TargetFailed("timeout", f"target {link.name} sent nothing for {self.step_timeout_s:g} s; it is "
                                          "out of service until it answers again") from None

    async def _cancel(self, link: TargetLink, stream_id: int, queue: asyncio.Queue) -> None:
        try:
            await link.send(P.Cancel(stream_id))
            while True:
                msg = await self._next(link, queue)
                if isinstance(msg, P.Error) or msg.finish:
                    break
        except (TargetFailed, zmq.ZMQError):  # out of service meanwhile, or the gateway is closing
            link.streams.pop(stream_id, None)
            return
        self._release(link, stream_id)

    def _release(self, link: TargetLink, stream_id: int) -> None:
        link.streams.pop(stream_id, None)
        if link in self.links and link not in self.failed:  # (not a link replaced meanwhile: readdress)
            self.idle.put(link)

    def readdress(self, old: str, new: str) -> None:
        """The target server at `old` runs at `new` now (its Ray actor was started again on another
        node: star/ray_cluster.py): its streams fail (`target_lost`), its link is closed, and one to
        `new` is asked until it answers, then takes requests in its place."""
        link = next((x for x in self.links if x.address == old), None)
        if link is None:
            return
        log.error("target %s moved from %s to %s: out of service until it answers there", link.name, old, new)
        self._out_of_service(link)
        link._on_change = None  # lost for good: nothing revives it
        link._lose(f"it moved to {new}")
        if (task := self._reviving.pop(link, None)) is not None:
            task.cancel()
        link.close()
        fresh = TargetLink(self.ctx, new, self.keys)
        self.links[self.links.index(link)] = fresh
        self.failed[self.failed.index(link)] = fresh
        fresh.watch(self._changed)
        self._revive(fresh)

    def draft_moved(self, old: str, new: str) -> None:
        """The draft server at `old` runs at `new` now: every target is told (DraftMoved), and every
        target that joins again later is told again (_tell_moves). A target that lists no `old`
        ignores it."""
        log.warning("draft server %s moved to %s: telling the %d targets", old, new, len(self.links))
        self.draft_moves.append((old, new))
        self.listed = tuple(new if a == old else a for a in self.listed)  # (told to later joiners after the moves)
        for link in self.links:
            link.tell(P.DraftMoved(old, new))

    def draft_servers(self, addresses: list[str]) -> None:
        """The star's draft servers are `addresses` now (one added, or one retired: star/elastic.py):
        every target is told (DraftServers), and every target that joins later (_tell_moves)."""
        log.warning("the star's draft servers are now %s: telling the %d targets", ",".join(addresses), len(self.links))
        self.listed = tuple(addresses)
        for link in self.links:
            link.tell(P.DraftServers(self.listed))

    def _tell_moves(self, link: TargetLink) -> None:
        """Every draft server move so far, in order (a chain of them included), then the servers listed
        last, to a target that joins."""
        for old, new in self.draft_moves:
            link.tell(P.DraftMoved(old, new))
        if self.listed:
            link.tell(P.DraftServers(self.listed))

    def _out_of_service(self, link: TargetLink) -> None:
        if link not in self.failed:
            self.failed.append(link)
        self.idle.discard(link)

    def _changed(self, link: TargetLink, up: bool) -> None:
        """The link was lost (its connection dropped, or its reader stopped), or a target server has
        connected at its address again: either way it is asked until it answers."""
        if not up:
            log.error("target %s at %s is lost: out of service until it answers again", link.name, link.address)
            self._out_of_service(link)
        self._revive(link)

    def _revive(self, link: TargetLink) -> None:
        """Ask `link` whether it is alive, with backoff, until it answers holding no stream; then it rejoins."""
        if link not in self._reviving:
            self._reviving[link] = asyncio.get_running_loop().create_task(self._ask(link))

    async def _ask(self, link: TargetLink) -> None:
        """A target that does not answer is asked again after twice as long each time; one that answers
        while it still ends a stream (told to cancel it), every BUSY_POLL_S."""
        wait = 1.0
        try:
            while link in self.failed:
                try:
                    info = await link.describe(timeout_s=wait)
                except TargetFailed:
                    wait = min(2 * wait, self.REVIVE_MAX_S)
                    continue
                if not info.busy:
                    self._tell_moves(link)  # before any Generate: the same socket keeps the order
                    self.failed.remove(link)
                    self.idle.fill(link)
                    log.info("target %s at %s is back in service", link.name, link.address)
                    return
                await asyncio.sleep(self.BUSY_POLL_S)
        finally:
            self._reviving.pop(link, None)
