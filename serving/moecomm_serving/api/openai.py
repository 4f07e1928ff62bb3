"""The OpenAI-compatible request schemas, their checks, and the response and chunk shapes.

Requests are validated strictly: an unknown field is an error (HTTP 400 naming it), not silently
ignored, because a client that sends ``logprobs`` or ``tools`` expects them to take effect.
Errors use OpenAI's body shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from moecomm.errors import MoecommError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from moecomm_serving.types import SamplingParams

# OpenAI's defaults, so that a client written against the real API gets what it expects.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
# Every stop-string list is bounded: each is matched against the decoded text after each token.
MAX_STOP_STRINGS = 8


class ApiError(MoecommError):
    """A request the front end refuses: HTTP `status` and a message for the client."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        kind = {
            404: "not_found_error",
            413: "request_too_large",
            503: "service_unavailable",
            504: "timeout",
        }
        etype = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {
                "message": self.message,
                "type": kind.get(self.status, etype),
                "param": self.param,
                "code": self.status,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share; vLLM's ``ignore_eos``, ``stop_token_ids`` and
    ``return_token_ids`` extensions are accepted (the load generator fixes output lengths with
    ``ignore_eos``; tests compare tokens with ``return_token_ids``)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    return_token_ids: bool = False

    def unsupported(self) -> str | None:
        """A message naming the first parameter set to something this server cannot do."""
        if self.n != 1:
            return f"n={self.n} is not supported: one choice per request (send n requests)"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported (must be 0)"
        if self.logit_bias:
            return "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options is only allowed with stream=true"
        return None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ApiError(400, f"stop takes 1 to {MAX_STOP_STRINGS} non-empty strings", "stop")
        return stops

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo is not supported"
        if self.logprobs is not None:
            return "logprobs is not supported"
        if self.best_of not in (None, 1):
            return f"best_of={self.best_of} is not supported"
        if self.suffix:
            return "suffix is not supported"
        p = self.prompt
        if isinstance(p, list) and len(p) > 1 and isinstance(p[0], str):
            return f"one prompt per request, got a batch of {len(self.prompt)}"
        return super().unsupported()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def template_dict(self) -> dict:
        """The message as a chat template reads it: ``role`` and ``content`` text."""
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs is not supported"
        return super().unsupported()


def default_chat_template(messages: Sequence[ChatMessage]) -> str:
    """A plain role-tagged transcript ending with the assistant's turn (the reference tokenizer
    has no chat template of its own)."""
    turns = [f"<|{m.role}|>\n{m.text()}\n" for m in messages]
    return "".join(turns) + "<|assistant|>\n"


ChatTemplate = Callable[[Sequence[ChatMessage]], str]


def parse_request(raw: bytes, schema: type[_Common]) -> Any:
    """Body bytes -> a validated request, or :class:`ApiError` 400 saying what is wrong."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # the parser recurses once per nesting level
        raise ApiError(400, "request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        req = schema.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "body"
            msg = "unsupported parameter" if err["type"] == "extra_forbidden" else err["msg"]
            problems.append(f"{where}: {msg}")
        first = exc.errors()[0]["loc"]
        raise ApiError(400, "; ".join(problems), str(first[0]) if first else None) from None
    why = req.unsupported()
    if why:
        raise ApiError(400, why)
    return req


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_choice(text, finish, token_ids=None, chat=False, delta=False, first=False):
    """One choice of a response (``delta=False``) or of a stream chunk."""
    if chat:
        if delta:
            body = {"content": text}
            if first:
                body = {"role": "assistant", **body}
            choice = {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish}
        else:
            msg = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def envelope(rid: str, model: str, choices: list, chat: bool, chunk: bool, usage_=None) -> dict:
    obj = "text_completion"
    if chat:
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model}
    body["choices"] = choices
    if usage_ is not None:
        body["usage"] = usage_
    return body


def sse(data: dict | str) -> bytes:
    """One server-sent event (``data: ...`` and a blank line)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def read_body(http: Request, limit: int) -> bytes:
    """The request body, or :class:`ApiError` 413 once it exceeds `limit` bytes (checked on the
    declared Content-Length first, then while reading, so an oversized body is never held)."""
    declared = http.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, f"invalid Content-Length {declared!r}")
        if int(declared) > limit:
            raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's body shape: refused requests, unknown routes and methods
    (Starlette's 404 / 405), and any unexpected failure (500)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        err = ApiError(exc.status_code, str(exc.detail))
        return JSONResponse(err.body(), exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(ApiError(400, str(exc.errors())).body(), 400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(err.body(), 500)
