"""A target server: a target worker that takes generation requests for as long as it runs.

It loads the target once and serves up to `streams` Generate requests at once (--target-streams;
one, as in the paper, by default), each on a slot of the target (models/llamacpp.py: llama.cpp
verifies the slots' drafts together, one batched pass a step) driven by a worker thread of its own,
with a draft session of its own. A stream is a reset of its slot's draft session, and every target
step goes back at once as an Output (text delta and the step's draft figures), so a gateway can
stream tokens as they are accepted.

The main thread owns the ROUTER socket: it answers Describe and Ping at once, hands a Generate to
a free slot (or refuses it as busy when every slot holds a stream), marks a Cancel for its stream
(which ends after the step in progress), tells the slots' draft clients of a draft server that moved
(DraftMoved and DraftServers, from a gateway), and sends what the workers put on an inproc socket. Each
slot keeps one depth policy over its streams, so what it learns carries over.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time

import zmq

from starsd.config import DraftConfig, ServingKeys
from starsd.errors import Unavailable
from starsd.models.pair import Pair
from starsd.spec_decode.decode import measure_verify, speculative_steps, target_only_steps
from starsd.spec_decode.depth import DepthPolicy
from starsd.star import protocol as P
from starsd.star import security
from starsd.star.client import DraftClient
from starsd.star.remote_drafter import RemoteDrafter
from starsd.star.textstream import TextStream

log = logging.getLogger("starsd.target")


class Slot:
    """One stream at a time: the target's slot, its drafter and depth policy, and the stream it runs."""

    def __init__(self, index: int, target, client: DraftClient | None, depth: int):
        self.index = index
        self.target = target  # the target interface, for this slot's streams
        self.client = client
        self.drafter = RemoteDrafter(client) if client else None
        self.policy = DepthPolicy(depth)
        self.requests: queue.Queue = queue.Queue()  # (peer, Generate): at most one, while stream is set
        self.stream: tuple[bytes, int] | None = None  # (peer, id) of the stream it runs; set and cleared
        # by the main thread (ids are the sender's: two gateways may each send a stream 5)


class TargetServer:
    def __init__(self, pair: Pair, bind: str, clients: list[DraftClient] | None, draft: DraftConfig, name: str,
                 model: str, insecure: bool = False, keys: ServingKeys = ServingKeys()):
        """`clients`: one draft session for each of the target's slots (pair.target.slots), or None to
        decode alone (target-only serving, the baseline). With `keys`, only gateways with an allowed
        key reach it; without, it listens on loopback only, unless `insecure` (star/security.py)."""
        targets = pair.target.slots
        if clients is not None and len(clients) != len(targets):
            raise ValueError(f"{len(targets)} slots need as many draft sessions, not {len(clients)}")
        self.pair = pair
        self.bind = bind
        self.insecure = insecure
        self.keys = keys
        self.draft = draft
        self.slots = [Slot(i, t, clients[i] if clients else None, draft.depth) for i, t in enumerate(targets)]
        self.speculative = clients is not None
        self.name = name
        self.model = model
        self.max_context = pair.target.max_context
        self.stopping = threading.Event()
        self._cancelled: set[tuple[bytes, int]] = set()  # (peer, id) a Cancel named: it ends after its step
        self._counters = {"name": name, "streams": 0, "tokens": 0, "steps": 0, "drafts": 0, "draft_tokens": 0,
                          "accepted_tokens": 0, "busy_seconds": 0.0, "running": 0}
        self._lock = threading.Lock()  # the counters are read by the metrics thread
        self.ctx = zmq.Context()  # its own: a context holds one ZAP authenticator, and a process may hold several servers
        self.outbox = f"inproc://target-outbox-{id(self)}"  # the workers' messages, for the main thread to send
        self.sock: zmq.Socket | None = None
        self._auth = None  # the ZAP authenticator, with keys

    def serve(self, on_ready=None) -> None:
        """Run until stop(). Raises a StarsdError if the address cannot be bound."""
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        outbox = self.ctx.socket(zmq.PULL)
        outbox.bind(self.outbox)
        workers: list[threading.Thread] = []
        try:
            try:
                self._auth = security.guard_server(self.ctx, self.sock, self.bind, self.keys.serve_key,
                                                   self.keys.serve_clients, self.insecure)
                self.sock.bind(self.bind)
            except zmq.ZMQError as e:
                raise Unavailable(f"cannot bind {self.bind}: {e}") from None
            self._measure()
            workers = [threading.Thread(target=self._work, args=(slot,), name=f"stream-{slot.index}", daemon=True)
                       for slot in self.slots]
            for w in workers:
                w.start()
            if on_ready:
                on_ready()
            log.info("target server %s (%s, %d stream%s at once) listening on %s", self.name, self.model,
                     len(self.slots), "s" if len(self.slots) > 1 else "", self.bind)
            poller = zmq.Poller()
            poller.register(self.sock, zmq.POLLIN)
            poller.register(outbox, zmq.POLLIN)
            while not self.stopping.is_set():
                ready = dict(poller.poll(100))
                if outbox in ready:
                    while outbox.poll(0):
                        self._forward(outbox.recv_multipart())
                if self.sock in ready:
                    self._handle(*self._receive())
        finally:
            self.stopping.set()
            for w in workers:
                w.join()
            while outbox.poll(0):  # the streams' last words
                self._forward(outbox.recv_multipart())
            outbox.close(0)
            self.sock.close(0)
            if self._auth:
                self._auth.stop()
            self.ctx.term()

    def stop(self) -> None:
        self.stopping.set()

    def counters(self) -> dict:
        with self._lock:
            return dict(self._counters)

    def _count(self, **add) -> None:
        with self._lock:
            for key, n in add.items():
                self._counters[key] += n

    def info(self) -> P.TargetInfo:
        busy = any(slot.stream is not None for slot in self.slots)
        return P.TargetInfo(self.name, self.model, self.max_context, self.speculative, busy, streams=len(self.slots))

    def _measure(self) -> None:
        """The verify costs the depth policies start from, measured on the first slot alone."""
        if not (self.speculative and self.draft.adaptive):
            return
        first = self.slots[0]
        log.info("%s: verify costs by width (ms): %s", self.name, measure_verify(first.target, first.policy))
        first.target.end()
        for slot in self.slots[1:]:
            slot.policy.verify_ms = copy.deepcopy(first.policy.verify_ms)

    # the main thread: the socket

    def _receive(self):
        """(peer, message or None): a malformed message is answered here and gives None."""
        peer, *frames = self.sock.recv_multipart(copy=False)
        try:
            msg, _ = P.decode(frames)
        except P.ProtocolError as e:  # named by the request's id where it can be read: its stream ends, not the link
            self._send(peer.bytes, P.Error(e.code, str(e), P.request_id(frames)))
            return peer.bytes, None
        return peer.bytes, msg

    def _handle(self, peer: bytes, msg) -> None:
        if msg is None:
            return
        if isinstance(msg, P.Describe):
            self._send(peer, self.info())
        elif isinstance(msg, P.Ping):
            self._send(peer, P.Pong(msg.tag, msg.sent))
        elif isinstance(msg, P.Cancel):
            if any(slot.stream == (peer, msg.id) for slot in self.slots):
                self._cancelled.add((peer, msg.id))
        elif isinstance(msg, P.DraftMoved):  # each slot's session follows at its next step (RemoteDrafter)
            if any([slot.client.readdress(msg.old, msg.new) for slot in self.slots if slot.client]):
                log.warning("%s: draft server %s moved to %s", self.name, msg.old, msg.new)
        elif isinstance(msg, P.DraftServers):  # each slot's session places itself among them at its next step
            for slot in self.slots:
                if slot.client:
                    slot.client.relist(list(msg.addresses))
            log.warning("%s: the star's draft servers are now %s", self.name, ",".join(msg.addresses))
        elif isinstance(msg, P.Generate):
            free = next((slot for slot in self.slots if slot.stream is None), None)
            if free is None:
                n = len(self.slots)
                self._send(peer, P.Error("busy", f"{self.name} is serving {n} stream{'s' if n > 1 else ''}, "
                                         "as many as it serves at once", msg.id))
            else:
                free.stream = (peer, msg.id)
                free.requests.put((peer, msg))
        else:
            self._send(peer, P.Error("unexpected", f"{type(msg).__name__} is not a request to a target", 0))

    def _forward(self, frames: list[bytes]) -> None:
        """Send a worker's message on; its stream's last one frees the slot first."""
        index, final, peer, *msg = frames
        if final:
            slot = self.slots[index[0]]
            self._cancelled.discard(slot.stream)
            slot.stream = None
        self.sock.send_multipart([peer, *msg])

    def _send(self, peer: bytes, msg) -> None:
        self.sock.send_multipart([peer, *P.encode(msg)])

    # the workers: one stream at a time each

    def _work(self, slot: Slot) -> None:
        out = self.ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, -1)
        out.connect(self.outbox)
        try:
            while not self.stopping.is_set():
                try:
                    peer, req = slot.requests.get(timeout=0.1)
                except queue.Empty:
                    continue
                ended = []

                def send(msg, final: bool = False) -> None:
                    out.send_multipart([bytes([slot.index]), b"1" if final else b"", peer, *P.encode(msg)])
                    if final:
                        ended.append(True)

                try:
                    self._stream(slot, req, send, (peer, req.id))
                    why = "it ended without a last step"
                except Exception as e:  # a bug outside the steps: the stream ends, the slot serves on
                    log.exception("stream %d failed", req.id)
                    why = f"generation failed: {e}"
                finally:
                    slot.target.end()
                if not ended:  # the slot is freed by a stream's last message: there is always one
                    send(P.Error("internal", why[:500], req.id), final=True)
        finally:
            out.close()

    def _stream(self, slot: Slot, req: P.Generate, send, key: tuple[bytes, int]) -> None:
        """Run one stream on `slot`, sending each step's Output; its last message says final. `key`
        is the stream's (peer, id), as a Cancel names it."""
        try:
            ids = self._encode(req)
        except ValueError as e:
            return send(P.Error("bad_request", str(e), req.id), final=True)
        if len(ids) + req.max_tokens > self.max_context:
            return send(P.Error("context_length", f"the prompt ({len(ids)} tokens) plus max_tokens "
                                f"({req.max_tokens}) exceed the context of {self.max_context}", req.id), final=True)
        eos = frozenset() if req.ignore_eos else self.pair.eos_ids
        if slot.drafter and req.speculate:
            steps = speculative_steps(slot.target, slot.drafter, ids, req.max_tokens, self.draft, req.sampling,
                                      eos, slot.policy)
        else:
            steps = target_only_steps(slot.target, ids, req.max_tokens, req.sampling, eos)
        text = TextStream(self.pair.tokenizer, req.stop)
        produced = 0
        prompt_tokens = len(ids)
        started = time.perf_counter()
        self._count(streams=1, running=1)
        finish = ""
        try:
            for step in steps:
                produced += len(step.tokens)
                self._count(tokens=len(step.tokens), steps=1, drafts=int(step.depth > 0), draft_tokens=step.depth,
                            accepted_tokens=step.accepted)
                delta, stopped = text.add(step.tokens)
                if stopped or (step.tokens and step.tokens[-1] in eos):
                    finish = "stop"
                elif produced >= req.max_tokens:
                    finish = "length"
                elif key in self._cancelled or self.stopping.is_set():
                    finish = "cancelled"
                if finish and not stopped:
                    delta += text.flush()
                send(P.Output(req.id, delta, len(step.tokens), step.depth, step.accepted, finish, prompt_tokens),
                     final=bool(finish))
                prompt_tokens = 0
                if finish:
                    return
        except Exception as e:  # a failed stream is reported to its sender; the server goes on
            log.exception("stream %d failed", req.id)
            send(P.Error("internal", f"generation failed: {e}"[:500], req.id), final=True)
        finally:
            steps.close()
            self._count(busy_seconds=time.perf_counter() - started, running=-1)

    def _encode(self, req: P.Generate) -> list[int]:
        tokenizer = self.pair.tokenizer
        if req.messages is not None:
            messages = [{"role": m.role, "content": m.content} for m in req.messages]
            try:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
            except Exception as e:  # the template's own checks (roles, order)
                raise ValueError(f"the chat template refused the messages: {e}") from None
        else:
            ids = tokenizer.encode(req.prompt, add_special_tokens=False)
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed to condition on")
        return list(ids)
