"""The OpenAI API over any source of token events: request parsing and checks, the streaming and
non-streaming answers, stop strings, usage and the request metrics. Two sources plug in: the
front end's own continuous-batching engine (:class:`~moecomm_serving.api.app.Frontend`) and a
router that runs each request on a prefill and a decode front end
(:class:`~moecomm_serving.disagg.router.Router`). A source implements :meth:`ApiFront.submit`
(queue a request; its :class:`~moecomm_serving.engine.scheduler.TokenEvent` s, then one
:class:`~moecomm_serving.engine.scheduler.FinishEvent` or
:class:`~moecomm_serving.engine.scheduler.ErrorEvent`, arrive on an asyncio queue) and
:meth:`ApiFront.health`.

Each request's body is read up to a size limit (413 beyond), then parsed, tokenized and checked
in a worker thread, so a huge prompt never stalls the event loop (bad JSON, unknown model,
unsupported parameters, prompt too long -> 4xx in OpenAI's error shape before anything is
queued; every other failure is a 500 in the same shape). A streaming response sends one SSE
chunk per generated token; if the source fails the request half-way, the stream ends with an
``{"error": ...}`` event and no ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from moecomm_serving.api import openai as oa
from moecomm_serving.api.metrics import ServingMetrics
from moecomm_serving.types import ErrorEvent, FinishEvent, SamplingParams, TokenEvent

# A handler wakes at least this often to notice a client that hung up (non-streaming requests).
DISCONNECT_POLL_S = 1.0
# Past the source's own deadline, how long a handler still waits before giving up by itself
# (the source normally answers first with a 504 of its own).
DEADLINE_GRACE_S = 5.0
# How often a streaming response checks that its client is still there: the server does not
# close a stream's generator when the client hangs up (ASGI 2.4: the failed send only raises in
# the response), so without this a request would run on to its end for nobody.
STREAM_DISCONNECT_POLL_S = 0.5
# The largest request body accepted (413 beyond): a prompt of a 128k-token context as token ids
# is ~1 MiB of JSON; 8 MiB leaves room for long chats without letting one request pin memory.
DEFAULT_MAX_BODY_BYTES = 8 << 20


class _Tracker:
    """One request's output seen from the front end: tokens, text sent so far, stop strings,
    and the timings that feed the metrics."""

    def __init__(self, tokenizer, stops: Sequence[str], arrival: float, metrics: ServingMetrics):
        self.tok, self.stops, self.arrival, self.metrics = tokenizer, list(stops), arrival, metrics
        self.tokens: list[int] = []
        self.sent = ""  # text already handed to the client
        self.finish: str | None = None
        self.first_time: float | None = None
        self.last_time: float | None = None

    def on_token(self, ev: TokenEvent) -> str:
        """Records a token; returns the text that became final with it (may be empty)."""
        gap = None if self.last_time is None else ev.time - self.last_time
        if self.first_time is None:
            self.first_time = ev.time
            self.metrics.on_first_token(ev.time - self.arrival)
        self.last_time = ev.time
        self.metrics.on_token(gap, ev.time)
        self.tokens.append(ev.token)
        full = self.tok.decode(self.tokens)
        for s in self.stops:
            # only a match that ends in new text counts; earlier text was already checked
            at = full.find(s, max(0, len(self.sent) - len(s) + 1))
            if at >= 0:
                self.finish = "stop"
                return self._delta(full[:at])
        # Hold back a possibly unfinished UTF-8 character and any prefix of a stop string.
        hold = len(full) - len(full.rstrip("\ufffd"))
        for s in self.stops:
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return self._delta(full[: len(full) - hold])

    def flush(self) -> str:
        """At a normal finish: whatever was held back."""
        return self._delta(self.tok.decode(self.tokens))

    def _delta(self, text: str) -> str:
        if len(text) <= len(self.sent):
            return ""
        out = text[len(self.sent) :]
        self.sent = text
        return out

    def done(self, outcome: str, prompt_tokens: int) -> None:
        end = self.last_time if self.last_time is not None else time.monotonic()
        ttft = None if self.first_time is None else self.first_time - self.arrival
        self.metrics.on_request_done(
            outcome, prompt_tokens, ttft, end - self.arrival, len(self.tokens)
        )


class ApiFront:
    """The OpenAI routes' logic over a token source (subclasses implement :meth:`submit` and
    :meth:`health`).

    `vocab_size` and `max_model_len` bound the prompts accepted; `metrics` is fed per token and
    per request."""

    def __init__(
        self,
        tokenizer,
        model_name: str,
        vocab_size: int,
        max_model_len: int,
        request_timeout_s: float,
        metrics: ServingMetrics,
        chat_template: oa.ChatTemplate | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ):
        self.tok, self.model_name = tokenizer, model_name
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self.chat_template = chat_template
        self.max_body_bytes = max_body_bytes

    # ------------------------------------------------------------------ checks
    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise oa.ApiError(
                404, f"model {name!r} does not exist; this server serves {self.model_name!r}"
            )

    def check_prompt(self, ids: list[int], max_tokens: int | None) -> int:
        """Returns the completion budget; refuses prompts the model cannot take."""
        vocab = self.vocab_size
        if not ids:
            raise oa.ApiError(400, "the prompt is empty", "prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise oa.ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        room = self.max_model_len - len(ids)
        if max_tokens is None:
            max_tokens = room
        if room < 1 or max_tokens > room:
            raise oa.ApiError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request asks for {len(ids) + max(max_tokens, 1)} ({len(ids)} in the prompt, "
                f"{max(max_tokens, 1)} for the completion)",
                "prompt",
            )
        return max_tokens

    def completion_input(self, req: oa.CompletionRequest) -> tuple[list[int], int]:
        self._check_model(req.model)
        p = req.prompt
        if isinstance(p, str):
            ids = self.tok.encode(p)
        elif p and isinstance(p[0], str):
            ids = self.tok.encode(p[0])
        else:
            ids = [int(t) for t in p]
        return ids, self.check_prompt(ids, req.max_tokens)

    def chat_input(self, req: oa.ChatRequest) -> tuple[list[int], int]:
        self._check_model(req.model)
        own = getattr(self.tok, "chat_template", None)
        if self.chat_template is None and own is not None:
            # as transformers' apply_chat_template: the template writes its own special tokens
            messages = [m.template_dict() for m in req.messages]
            try:
                text = own.render(messages, add_generation_prompt=True)
            except ValueError as exc:
                raise oa.ApiError(400, str(exc), "messages") from None
            ids = self.tok.encode(text, add_bos=False)
        else:
            ids = self.tok.encode((self.chat_template or oa.default_chat_template)(req.messages))
        return ids, self.check_prompt(ids, req.max_completion_tokens or req.max_tokens)

    def parse(self, raw: bytes, chat: bool):
        """Body -> (request, prompt ids, completion budget); run off the event loop, since
        parsing and tokenizing a long prompt takes a while."""
        body = oa.parse_request(raw, oa.ChatRequest if chat else oa.CompletionRequest)
        ids, max_tokens = self.chat_input(body) if chat else self.completion_input(body)
        return body, ids, max_tokens

    # ------------------------------------------------------------------ the source
    def submit(self, ids: list[int], params: SamplingParams, priority: bool = False, timeout=None):
        """Queues a request; returns it (with ``deadline`` and ``cancel()``) and the asyncio
        queue its events arrive on. Raises :class:`~moecomm_serving.api.openai.ApiError`."""
        raise NotImplementedError

    async def health(self) -> JSONResponse:
        raise NotImplementedError

    # ------------------------------------------------------------------ answering
    async def events(self, req, queue: asyncio.Queue, http: Request | None):
        """The request's events until its finish or error; cancels it if the client leaves."""
        give_up = req.deadline + DEADLINE_GRACE_S
        while True:
            left = give_up - time.monotonic()
            if left <= 0:
                req.cancel()
                yield ErrorEvent("deadline exceeded (no answer from the engine)", 504, 0.0)
                return
            try:
                ev = await asyncio.wait_for(queue.get(), min(left, DISCONNECT_POLL_S))
            except asyncio.TimeoutError:
                if http is not None and await http.is_disconnected():
                    req.cancel()
                    return
                continue
            yield ev
            if not isinstance(ev, TokenEvent):
                return

    async def complete(self, http: Request, chat: bool) -> JSONResponse | StreamingResponse:
        arrival = time.monotonic()
        raw = await oa.read_body(http, self.max_body_bytes)
        body, ids, max_tokens = await asyncio.to_thread(self.parse, raw, chat)
        stops = body.stop_strings()
        params = body.sampling(max_tokens)
        req, queue = self.submit(ids, params)
        tracker = _Tracker(self.tok, stops, arrival, self.metrics)
        rid = oa.new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            gen = self._stream(req, queue, tracker, rid, chat, len(ids), body, include_usage)
            return StreamingResponse(
                cancel_on_disconnect(gen, http, req), media_type="text/event-stream"
            )
        text, error = "", None
        try:
            async for ev in self.events(req, queue, http):
                if isinstance(ev, TokenEvent):
                    text += tracker.on_token(ev)
                    if tracker.finish:  # a stop string: the engine may stop now
                        req.cancel()
                        break
                elif isinstance(ev, FinishEvent):
                    text += tracker.flush()
                    tracker.finish = ev.reason
                else:
                    error = ev
        finally:
            req.cancel()  # no-op when finished; stops the engine's work when we left early
        if tracker.finish is None:
            outcome = "error" if error else "cancelled"
            tracker.done(outcome, len(ids))
            if error is None:  # the client went away; nobody reads this
                error = ErrorEvent("request cancelled", 499, 0.0)
            return JSONResponse(oa.ApiError(error.status, error.message).body(), error.status)
        tracker.done("success", len(ids))
        tids = tracker.tokens if body.return_token_ids else None
        choice = oa.completion_choice(text, tracker.finish, tids, chat=chat)
        u = oa.usage(len(ids), len(tracker.tokens))
        return JSONResponse(oa.envelope(rid, self.model_name, [choice], chat, False, u))

    async def _stream(
        self, req, queue, tracker: _Tracker, rid, chat, n_prompt, body, include_usage
    ) -> AsyncIterator[bytes]:
        first = True
        outcome = "cancelled"
        try:
            async for ev in self.events(req, queue, None):
                if isinstance(ev, ErrorEvent):
                    outcome = "error"
                    yield oa.sse(oa.ApiError(ev.status, ev.message).body())
                    return
                if isinstance(ev, FinishEvent):  # normally already seen on the last token
                    tracker.finish = ev.reason
                    delta, ids = tracker.flush(), []
                else:
                    n_before = len(tracker.tokens)
                    delta = tracker.on_token(ev)
                    ids = tracker.tokens[n_before:]
                    if tracker.finish:  # a stop string ended it; the engine may stop
                        req.cancel()
                    elif ev.finish:  # the last token carries the finish reason
                        tracker.finish = ev.finish
                        delta += tracker.flush()
                if ids or tracker.finish:
                    tids = ids if body.return_token_ids else None
                    choice = oa.completion_choice(
                        delta, tracker.finish, tids, chat=chat, delta=True, first=first
                    )
                    first = False
                    yield oa.sse(oa.envelope(rid, self.model_name, [choice], chat, True))
                if tracker.finish:
                    outcome = "success"
                    break
            if outcome != "success":  # the deadline fallback ended without an event
                return
            if include_usage:
                u = oa.usage(n_prompt, len(tracker.tokens))
                yield oa.sse(oa.envelope(rid, self.model_name, [], chat, True, u))
            yield oa.sse("[DONE]")
        except Exception as exc:  # e.g. a token the tokenizer cannot decode
            # the headers are sent: an error event, never a cut connection
            outcome = "error"
            yield oa.sse(oa.ApiError(500, f"generation failed: {exc}").body())
        finally:
            req.cancel()
            tracker.done(outcome, n_prompt)


async def cancel_on_disconnect(
    body: AsyncIterator[bytes], http: Request, req
) -> AsyncIterator[bytes]:
    """`body`'s chunks; `req` is cancelled as soon as the client hangs up (or the stream ends
    early), and `body` closed, whatever the server does with the abandoned response."""

    async def watch() -> None:
        while not await http.is_disconnected():
            await asyncio.sleep(STREAM_DISCONNECT_POLL_S)
        req.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        async for chunk in body:
            yield chunk
    finally:
        watcher.cancel()
        req.cancel()
        await body.aclose()


def install_openai_routes(app: FastAPI, front: ApiFront) -> None:
    """The OpenAI routes and the probes over `front` (a front end's engine or the router):
    ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``,
    with the OpenAI error shape for every refusal."""
    oa.install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await front.complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await front.complete(request, chat=True)

    @app.get("/v1/models")
    async def models():
        card = {"id": front.model_name, "object": "model", "owned_by": "moecomm"}
        card["max_model_len"] = front.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        return await front.health()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(front.metrics.render(), media_type="text/plain; version=0.0.4")
