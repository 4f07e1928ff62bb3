"""The OpenAI-compatible HTTP front end over the continuous-batching engine.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming or not),
``GET /v1/models``, ``GET /health`` (a real one-token forward through the engine, experts
included) and ``GET /metrics`` (Prometheus text). See docs/frontend.md. The OpenAI layer itself
(parsing, checks, streaming, stop strings) is :mod:`moecomm_serving.api.routes`; here it runs over
the :class:`Engine`, whose thread feeds each request's events back into an asyncio queue. If the
engine fails a request half-way, its stream ends with an ``{"error": ...}`` event (the request
is not retried here: the client has seen tokens).

With a role (``--role prefill|decode``, docs/router.md) the front end also serves the
prefill/decode split's internal routes (:mod:`moecomm_serving.disagg.routes`): a prefill front end
runs a request's prompt and hands its KV blocks to a decode front end over moecomm's transports;
a decode front end takes them and generates the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from moecomm.http_thread import DEFAULT_HOST, HttpServer

from moecomm_serving.api import openai as oa
from moecomm_serving.api.metrics import ServingMetrics
from moecomm_serving.api.routes import DEFAULT_MAX_BODY_BYTES, ApiFront, install_openai_routes
from moecomm_serving.engine.generate import SamplingParams
from moecomm_serving.engine.scheduler import (
    DEFAULT_REQUEST_TIMEOUT_S,
    Engine,
    EngineBusyError,
    EngineRequest,
    ErrorEvent,
    FinishEvent,
)
from moecomm_serving.kv.blocks import DEFAULT_BLOCK_TOKENS
from moecomm_serving.model.transformer import MoETransformer

# The health probe is one greedy token; it must answer well within a load balancer's timeout.
HEALTH_TIMEOUT_S = 30.0


class Frontend(ApiFront):
    """The engine behind the OpenAI routes; :func:`make_frontend_app` wires it into FastAPI."""

    def __init__(
        self,
        model: MoETransformer,
        tokenizer,
        model_name: str,
        max_batch_tokens: int,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        batch_wait_s: float = 0.0,
        chat_template: oa.ChatTemplate | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        kv_block_tokens: int | None = DEFAULT_BLOCK_TOKENS,
        prefix_cache_bytes: int = 0,
    ):
        self.model = model
        # An AttentionClient's slots hold at most layout.max_tokens rows per dispatch, and one
        # engine step dispatches all of its tokens at once.
        cap = getattr(getattr(model.experts, "layout", None), "max_tokens", None)
        if cap is not None and max_batch_tokens > cap:
            raise ValueError(
                f"max_batch_tokens {max_batch_tokens} exceeds the experts backend's "
                f"max_tokens {cap} per dispatch"
            )
        limit = model.config.max_position_embeddings
        # every EOS id the checkpoint's generation config lists ends a request
        eos_ids = getattr(tokenizer, "eos_ids", None) or None
        self.engine = Engine(
            model,
            max_batch_tokens,
            max_num_seqs,
            batch_wait_s=batch_wait_s,
            eos_token_id=eos_ids,
            kv_block_tokens=kv_block_tokens,
            prefix_cache_bytes=prefix_cache_bytes,
        )
        backend = model.experts
        # Series other parts add (the prefill/decode hand-offs' counters): rows of
        # (kind, name, help, value), rendered after the rest.
        self.extra_metrics: list = []
        metrics = ServingMetrics(
            queue_depth=lambda: self.engine.queue_depth,
            running=lambda: self.engine.num_running,
            # AttentionClient counts its re-sends to replicas; local experts never fail over
            failovers=lambda: int(getattr(backend, "failovers", 0)),
            # a pipelined model (--stages N) counts the replacements of its lost stages
            stage_recoveries=getattr(model, "recovery_counts", None),
            prefix_cache=self.engine.prefix_cache,
            extra=lambda: [row for source in self.extra_metrics for row in source()],
        )
        super().__init__(
            tokenizer,
            model_name,
            model.config.vocab_size,
            limit if max_model_len is None else min(max_model_len, limit),
            request_timeout_s,
            metrics,
            chat_template,
            max_body_bytes,
        )

    # ------------------------------------------------------------------ running a request
    def submit(
        self,
        ids: list[int],
        params: SamplingParams,
        priority: bool = False,
        timeout=None,
        **request_fields,
    ):
        """Queues a request; returns it with the asyncio queue its events arrive on.
        `request_fields`: further :class:`EngineRequest` fields (a prefill/decode hand-off)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(ev) -> None:
            # called on the engine thread; a closed loop (shutdown) just drops the event
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(events.put_nowait, ev)

        deadline = time.monotonic() + (self.request_timeout_s if timeout is None else timeout)
        req = EngineRequest(ids, params, emit, deadline, **request_fields)
        try:
            self.engine.submit(req, priority=priority)
        except EngineBusyError as exc:
            raise oa.ApiError(503, str(exc)) from None
        except ValueError as exc:
            raise oa.ApiError(400, str(exc)) from None
        return req, events

    async def health(self) -> JSONResponse:
        """One greedy token through the engine: embedding, every layer, the experts, LM head."""
        probe = [self.tok.bos_id if self.tok.bos_id is not None else 0]
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        t0 = time.monotonic()
        try:
            req, queue = self.submit(probe, params, priority=True, timeout=HEALTH_TIMEOUT_S)
        except oa.ApiError as exc:
            return JSONResponse({"status": "unhealthy", "error": exc.message}, 503)
        error = "no answer"
        async for ev in self.events(req, queue, None):
            if isinstance(ev, FinishEvent):
                return JSONResponse({"status": "ok", "forward_s": time.monotonic() - t0})
            if isinstance(ev, ErrorEvent):
                error = ev.message
        return JSONResponse({"status": "unhealthy", "error": error}, 503)


def make_frontend_app(
    model: MoETransformer,
    tokenizer,
    model_name: str,
    max_batch_tokens: int,
    max_num_seqs: int = 64,
    max_model_len: int | None = None,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    batch_wait_s: float = 0.0,
    chat_template: oa.ChatTemplate | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    kv_block_tokens: int | None = DEFAULT_BLOCK_TOKENS,
    prefix_cache_bytes: int = 0,
    role: str | None = None,
    kv_transport="auto",
    kv_host: str | None = None,
) -> FastAPI:
    """The FastAPI app; its engine thread starts and stops with the app's lifespan.

    ``app.state.frontend`` holds the :class:`Frontend` (``.engine.stats``, ``.metrics``).
    `chat_template`: a function of the messages; None uses the tokenizer's own template (the
    checkpoint's, as transformers renders it) or else :func:`openai_api.default_chat_template`.
    Requests stop on every id of ``tokenizer.eos_ids``; bodies over `max_body_bytes` get a 413.
    `kv_block_tokens` and `prefix_cache_bytes` size the paged KV cache and the prefix cache
    (see :class:`~moecomm_serving.engine.scheduler.Engine`). With a `role` ("prefill", "decode" or
    "both") the app also serves the prefill/decode split's routes
    (:mod:`moecomm_serving.disagg.routes`), its KV hand-offs over `kv_transport` (shm, nixl or auto,
    nixl bound to `kv_host`).
    """
    fe = Frontend(
        model,
        tokenizer,
        model_name,
        max_batch_tokens,
        max_num_seqs,
        max_model_len,
        request_timeout_s,
        batch_wait_s,
        chat_template,
        max_body_bytes,
        kv_block_tokens,
        prefix_cache_bytes,
    )
    pd = None
    if role is not None:
        # imported here: a front end without a role never opens a transport for KV
        from moecomm_serving.disagg.routes import DECODE_ROLES, PdState

        if role in DECODE_ROLES and fe.engine.pool is None:
            raise ValueError(f"role {role!r} takes KV hand-offs: it needs the paged KV cache")
        pd = PdState(role, kv_transport, kv_host)
        fe.extra_metrics.append(pd.metric_rows)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        fe.engine.start()
        yield
        await asyncio.to_thread(fe.engine.stop)
        if pd is not None:
            await asyncio.to_thread(pd.close)

    app = FastAPI(title="moecomm", lifespan=lifespan)
    app.state.frontend = fe
    app.state.pd = pd

    install_openai_routes(app, fe)
    if pd is not None:
        from moecomm_serving.disagg.routes import install_pd_routes

        install_pd_routes(app, fe, pd)
    return app


def start_frontend(app: FastAPI, host: str = DEFAULT_HOST, port: int = 0) -> HttpServer:
    """Runs `app` in a background thread; ``server.start()`` already called, URL in ``.url``."""
    server = HttpServer(app, host, port)
    server.start()
    return server


def serve_frontend(
    model: MoETransformer,
    tokenizer,
    model_name: str,
    max_batch_tokens: int,
    host: str = DEFAULT_HOST,
    port: int = 8000,
    **app_kwargs,
) -> None:
    """Serves until interrupted (the ``moecomm serve`` entry point). `app_kwargs` go to
    :func:`make_frontend_app`."""
    import uvicorn

    app = make_frontend_app(model, tokenizer, model_name, max_batch_tokens, **app_kwargs)
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
