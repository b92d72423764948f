"""A target server: a target worker that takes generation requests for as long as it runs.

It loads the target once, opens one session with the draft server, binds a ROUTER socket and
serves Generate requests one stream at a time (as in the paper): each stream is a reset of its
draft session, and every target step goes back at once as an Output (text delta and the step's
draft figures), so a gateway can stream tokens as they are accepted. Between steps it reads its
socket: a Cancel ends the stream after the step in progress, a Describe is answered, and another
Generate is refused as busy. One depth policy serves every stream, so what it learns carries over.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from starsd.config import DraftConfig, ServingKeys
from starsd.errors import Unavailable
from starsd.models.pair import Pair
from starsd.spec.decode import measure_verify, speculative_steps, target_only_steps
from starsd.spec.depth import DepthPolicy
from starsd.star import protocol as P
from starsd.star import security
from starsd.star.client import DraftClient
from starsd.star.remote_drafter import RemoteDrafter
from starsd.star.textstream import TextStream

log = logging.getLogger("starsd.target")


class TargetServer:
    def __init__(self, pair: Pair, bind: str, client: DraftClient | None, draft: DraftConfig, name: str,
                 model: str, insecure: bool = False, keys: ServingKeys = ServingKeys()):
        """client None: decode alone (target-only serving, the baseline). With `keys`, only gateways
        with an allowed key reach it; without, it listens on loopback only, unless `insecure`
        (star/security.py)."""
        self.pair = pair
        self.bind = bind
        self.insecure = insecure
        self.keys = keys
        self.client = client
        self.draft = draft
        self.drafter = RemoteDrafter(client) if client else None
        self.policy = DepthPolicy(draft.depth)
        self.name = name
        self.model = model
        self.max_context = pair.target.max_context
        self.stopping = threading.Event()
        self._counters = {"name": name, "streams": 0, "tokens": 0, "steps": 0, "drafts": 0, "draft_tokens": 0,
                          "accepted_tokens": 0, "busy_seconds": 0.0, "running": False}
        self._lock = threading.Lock()  # the counters are read by the metrics thread
        self.ctx = zmq.Context()  # its own: a context holds one ZAP authenticator, and a process may hold several servers
        self.sock: zmq.Socket | None = None
        self._auth = None  # the ZAP authenticator, with keys

    def serve(self, on_ready=None) -> None:
        """Run until stop(). Raises a StarsdError if the address cannot be bound."""
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        try:
            self._auth = security.guard_server(self.ctx, self.sock, self.bind, self.keys.serve_key,
                                               self.keys.serve_clients, self.insecure)
            self.sock.bind(self.bind)
        except zmq.ZMQError as e:
            raise Unavailable(f"cannot bind {self.bind}: {e}") from None
        if self.drafter and self.draft.adaptive:
            log.info("%s: verify costs by width (ms): %s", self.name, measure_verify(self.pair.target, self.policy))
        if on_ready:
            on_ready()
        log.info("target server %s (%s) listening on %s", self.name, self.model, self.bind)
        try:
            while not self.stopping.is_set():
                if self.sock.poll(100):
                    self._handle(*self._receive(), busy=False)
        finally:
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

    def _set_running(self, running: bool) -> None:
        with self._lock:
            self._counters["running"] = running

    def info(self, busy: bool) -> P.TargetInfo:
        return P.TargetInfo(self.name, self.model, self.max_context, self.drafter is not None, busy)

    def _receive(self):
        """(peer, message or None): a malformed message is answered here and gives None."""
        peer, *frames = self.sock.recv_multipart(copy=False)
        try:
            msg, _ = P.decode(frames)
        except P.ProtocolError as e:  # named by the request's id where it can be read: its stream ends, not the link
            self._send(peer.bytes, P.Error(e.code, str(e), P.request_id(frames)))
            return peer.bytes, None
        return peer.bytes, msg

    def _handle(self, peer: bytes, msg, busy: bool) -> int | None:
        """Answer one message; returns the id a Cancel names (the caller decides what it ends)."""
        if msg is None:
            return None
        if isinstance(msg, P.Describe):
            self._send(peer, self.info(busy))
        elif isinstance(msg, P.Ping):
            self._send(peer, P.Pong(msg.tag, msg.sent))
        elif isinstance(msg, P.Cancel):
            return msg.id
        elif isinstance(msg, P.Generate):
            if busy:
                self._send(peer, P.Error("busy", f"{self.name} is serving another stream", msg.id))
            else:
                self._stream(peer, msg)
        else:
            self._send(peer, P.Error("unexpected", f"{type(msg).__name__} is not a request to a target", 0))
        return None

    def _cancelled(self, stream_id: int) -> bool:
        """Read what arrived during a step; True if it cancels this stream."""
        cancelled = False
        while self.sock.poll(0):
            cancelled |= self._handle(*self._receive(), busy=True) == stream_id
        return cancelled or self.stopping.is_set()

    def _stream(self, peer: bytes, req: P.Generate) -> None:
        tokenizer = self.pair.tokenizer
        try:
            ids = self._encode(req)
        except ValueError as e:
            return self._send(peer, P.Error("bad_request", str(e), req.id))
        if len(ids) + req.max_tokens > self.max_context:
            return self._send(peer, P.Error("context_length", f"the prompt ({len(ids)} tokens) plus max_tokens "
                                            f"({req.max_tokens}) exceed the context of {self.max_context}", req.id))
        eos = frozenset() if req.ignore_eos else self.pair.eos_ids
        if self.drafter and req.speculate:
            steps = speculative_steps(self.pair.target, self.drafter, ids, req.max_tokens, self.draft, req.sampling,
                                      eos, self.policy)
        else:
            steps = target_only_steps(self.pair.target, ids, req.max_tokens, req.sampling, eos)
        text = TextStream(tokenizer, req.stop)
        produced = 0
        prompt_tokens = len(ids)
        started = time.perf_counter()
        self._count(streams=1)
        self._set_running(True)
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
                elif self._cancelled(req.id):
                    finish = "cancelled"
                else:
                    finish = ""
                if finish and not stopped:
                    delta += text.flush()
                self._send(peer, P.Output(req.id, delta, len(step.tokens), step.depth, step.accepted, finish,
                                          prompt_tokens))
                prompt_tokens = 0
                if finish:
                    return
        except Exception as e:  # a failed stream is reported to its sender; the server goes on
            log.exception("stream %d failed", req.id)
            self._send(peer, P.Error("internal", f"generation failed: {e}"[:500], req.id))
        finally:
            steps.close()
            self._count(busy_seconds=time.perf_counter() - started)
            self._set_running(False)

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

    def _send(self, peer: bytes, msg) -> None:
        self.sock.send_multipart([peer, *P.encode(msg)])
