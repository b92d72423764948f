"""The OpenAI API's request and response shapes, as far as StarSD serves them.

Requests are checked here: a parameter StarSD does not honour gets an OpenAI-style 400 that names
it, never silence. Parameters at their no-op value (n = 1, echo = false, penalties 0, ...) pass, as
clients send some of them by default. `ignore_eos` is vLLM's extension (always decode max_tokens);
`speculate` is StarSD's (false: this request decodes alone on its target, the same answer at
target-only speed, for a side-by-side comparison).
Responses carry `usage` and, as vLLM's per-request figures do, the request's speculation:
drafts, draft tokens, accepted tokens and the mean acceptance length (tokens per target step).
"""

from __future__ import annotations

import random
import time
import uuid

from pydantic import BaseModel, ConfigDict, Field

from starsd.config import MAX_SEED, SamplingConfig
from starsd.star import protocol as P

NO_OPS = {"n": 1, "echo": False, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": None,
          "top_logprobs": None, "logit_bias": None, "user": None, "suffix": None, "parallel_tool_calls": None,
          "tools": None, "tool_choice": None, "response_format": None, "service_tier": None, "store": None,
          "metadata": None}


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, and the parameter at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.kind = kind
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # extras are checked against NO_OPS, see unsupported()
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    speculate: bool = True  # false: decode this request without drafts (target-only)

    def check(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name not in NO_OPS:
                raise ApiError(400, f"unknown parameter {name!r}", name)
            if value != NO_OPS[name] and value not in (None, False):
                raise ApiError(400, f"{name}={value!r} is not supported by this server", name)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
        if len(self.stops) > P.MAX_STOPS or any(not 0 < len(s) <= P.MAX_STOP_CHARS for s in self.stops):
            raise ApiError(400, f"stop takes at most {P.MAX_STOPS} non-empty strings of up to {P.MAX_STOP_CHARS} "
                                "characters", "stop")
        for stop in self.stops:
            _check_text(stop, "stop")

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling(self) -> SamplingConfig:
        seed = self.seed if self.seed is not None else random.randrange(MAX_SEED)
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, seed=seed)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _check_text(text: str, param: str) -> None:
    """Text UTF-8 can carry: JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer
    or wire takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{param} holds a lone surrogate (U+{ord(text[e.start]):04X} at character {e.start}): "
                            "not Unicode text", param) from None


def _check_length(chars: int, param: str) -> None:
    if chars > P.MAX_PROMPT_CHARS:
        raise ApiError(400, f"the prompt has {chars} characters, more than {P.MAX_PROMPT_CHARS}", param)


class CompletionRequest(_Common):
    prompt: str | list[str]

    def check(self) -> None:
        super().check()
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ApiError(400, "one prompt per request (a list of prompts is n > 1)", "prompt")
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        _check_length(len(prompt), "prompt")
        _check_text(prompt, "prompt")

    def generate(self, stream_id: int, default_max: int) -> P.Generate:
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return P.Generate(stream_id, prompt, None, self.max_tokens or default_max, self.sampling(), self.stops,
                          self.ignore_eos, self.speculate)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if any(p.type != "text" for p in self.content):
            raise ApiError(400, "only text content parts are supported", "messages")
        return "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def check(self) -> None:
        super().check()
        if len(self.messages) > P.MAX_MESSAGES:
            raise ApiError(400, f"at most {P.MAX_MESSAGES} messages per request", "messages")
        for m in self.messages:
            if m.role not in ("system", "user", "assistant"):
                raise ApiError(400, f"message role {m.role!r} is not supported (system, user, assistant)", "messages")
            if m.model_extra:
                raise ApiError(400, f"message fields {sorted(m.model_extra)} are not supported", "messages")

        _check_length(sum(len(m.text()) for m in self.messages), "messages")
        for m in self.messages:
            _check_text(m.text(), "messages")

    def generate(self, stream_id: int, default_max: int) -> P.Generate:
        messages = tuple(P.Message(m.role, m.text()) for m in self.messages)
        limit = self.max_completion_tokens or self.max_tokens or default_max
        return P.Generate(stream_id, None, messages, limit, self.sampling(), self.stops, self.ignore_eos,
                          self.speculate)


class Tally:
    """What one request produced, from its Outputs."""

    def __init__(self):
        self.text: list[str] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.steps = 0
        self.finish = ""

    def add(self, out: P.Output) -> None:
        self.text.append(out.text)
        self.prompt_tokens += out.prompt_tokens
        self.completion_tokens += out.tokens
        self.steps += 1
        self.drafts += out.drafted > 0
        self.draft_tokens += out.drafted
        self.accepted_tokens += out.accepted
        self.finish = out.finish

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def spec_decode(self) -> dict:
        """Mean acceptance length as vLLM defines it: tokens per drafted step (1 + accepted/drafts)."""
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "target_steps": self.steps,
                "mean_acceptance_length": 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0}


def finish_reason(finish: str) -> str | None:
    """A target's finish ("stop", "length", "cancelled") as OpenAI names it."""
    return finish if finish in ("stop", "length") else None


class Response:
    """Builds the JSON objects of one request, plain or as stream chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, tally: Tally) -> dict:
        text = "".join(tally.text)
        choice = {"index": 0, "finish_reason": finish_reason(tally.finish), "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._envelope(False), "choices": [choice], "usage": tally.usage(),
                "spec_decode": tally.spec_decode()}

    def chunk(self, text: str | None, finish: str = "", first: bool = False) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason(finish), "logprobs": None}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return {**self._envelope(True), "choices": [choice]}

    def usage_chunk(self, tally: Tally) -> dict:
        return {**self._envelope(True), "choices": [], "usage": tally.usage(), "spec_decode": tally.spec_decode()}
