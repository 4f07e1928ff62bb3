"""The OpenAI-compatible HTTP front end over the continuous-batching engine.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming or not),
``GET /v1/models``, ``GET /health`` (a real one-token forward through the engine, experts
included) and ``GET /metrics`` (Prometheus text). See docs/frontend.md. The OpenAI layer itself
(parsing, checks, streaming, stop strings) is :mod:`moecomm_serving.api.routes`; here it runs over
the :class:`Engine`, whose thread feeds each request's events back into an asyncio queue. If the
engine fails a request half-way, its stream ends with an ``{"error": ...}`` event (the request
is not retried here: the client has seen tokens).

Higher layers add routes through :class:`AppExtension`: with a role (``--role prefill|decode``,
docs/router.md) the command adds the prefill/decode split's internal routes
(:class:`moecomm_serving.disagg.routes.PdRoutes`) and the router's question about the prefix
cache (:class:`CachedPrefixRoute`). Who may call which route (an API key, the deployment's
shared secret) is :mod:`moecomm_serving.api.auth`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from moecomm.http_thread import DEFAULT_HOST, HttpServer

from moecomm_serving.api import openai as oa
from moecomm_serving.api.auth import Access, install_access
from moecomm_serving.api.metrics import ServingMetrics
from moecomm_serving.api.routes import DEFAULT_MAX_BODY_BYTES, ApiFront, install_openai_routes
from moecomm_serving.engine.scheduler import Engine, EngineBusyError, EngineRequest
from moecomm_serving.kv.blocks import DEFAULT_BLOCK_TOKENS
from moecomm_serving.model.transformer import MoETransformer
from moecomm_serving.types import DEFAULT_REQUEST_TIMEOUT_S, ErrorEvent, FinishEvent, SamplingParams

# The health probe is one greedy token; it must answer well within a load balancer's timeout.
HEALTH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class FrontendSettings:
    """How a front end serves, apart from its model and tokenizer (``moecomm frontend``'s
    options). `chat_template`: a function of the messages; None uses the tokenizer's own
    template (the checkpoint's, as transformers renders it) or else
    :func:`~moecomm_serving.api.openai.default_chat_template`. Bodies over `max_body_bytes` get
    a 413. `kv_block_tokens` and `prefix_cache_bytes` size the paged KV cache and the prefix
    cache (see :class:`~moecomm_serving.engine.scheduler.Engine`)."""

    model_name: str
    max_batch_tokens: int
    max_num_seqs: int = 64
    max_model_len: int | None = None
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    batch_wait_s: float = 0.0
    chat_template: oa.ChatTemplate | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    kv_block_tokens: int | None = DEFAULT_BLOCK_TOKENS
    prefix_cache_bytes: int = 0


class AppExtension(Protocol):
    """Routes a higher layer adds to a front end's app (the prefill/decode split's,
    :class:`moecomm_serving.disagg.routes.PdRoutes`): installed once the front end exists,
    closed after its engine stopped."""

    def install(self, app: FastAPI, fe: Frontend) -> None: ...

    def close(self) -> None: ...


class Frontend(ApiFront):
    """The engine behind the OpenAI routes; :func:`make_frontend_app` wires it into FastAPI."""

    def __init__(self, model: MoETransformer, tokenizer, settings: FrontendSettings):
        max_batch_tokens = settings.max_batch_tokens
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
            settings.max_num_seqs,
            batch_wait_s=settings.batch_wait_s,
            eos_token_id=eos_ids,
            kv_block_tokens=settings.kv_block_tokens,
            prefix_cache_bytes=settings.prefix_cache_bytes,
        )
        backend = model.experts
        # Series other parts add (the prefill/decode hand-offs' counters): rows of
        # (kind, name, help, value), rendered after the rest.
        self.extra_metrics: list = []
        # Headers of this front end's own calls to the deployment's other front ends (a
        # prefill front end's KV reservation at a decode front end): the deployment secret,
        # when it has one (make_frontend_app sets it from its Access).
        self.peer_headers: dict[str, str] = {}
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
        max_len = settings.max_model_len
        super().__init__(
            tokenizer,
            settings.model_name,
            model.config.vocab_size,
            limit if max_len is None else min(max_len, limit),
            settings.request_timeout_s,
            metrics,
            settings.chat_template,
            settings.max_body_bytes,
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


class CachedPrefixRoute:
    """``POST /pd/cached`` on a front end, an :class:`AppExtension`: how many tokens of a
    prompt its prefix cache holds now (``{"cached_tokens": n, "prefix_cache": bool}``; body
    ``{"prompt": [token ids]}``). The router asks a decode front end before it sends it a long
    prompt: one the decode side mostly holds is prefilled there, with no hand-off. An internal
    route (under ``/pd``, behind the deployment secret): answering anyone would let them probe
    for other users' prompts."""

    def install(self, app: FastAPI, fe: Frontend) -> None:
        async def cached(request: Request):
            raw = await oa.read_body(request, fe.max_body_bytes)
            ids = _prompt_ids(raw, fe.vocab_size)
            cache = fe.engine.prefix_cache
            if cache is None:
                return {"cached_tokens": 0, "prefix_cache": False}
            # hashing a long prompt's blocks takes a while: off the event loop
            n = await asyncio.to_thread(cache.cached_tokens, ids)
            return {"cached_tokens": n, "prefix_cache": True}

        app.add_api_route("/pd/cached", cached, methods=["POST"])

    def close(self) -> None:
        pass


def _prompt_ids(raw: bytes, vocab_size: int) -> list[int]:
    """The ``prompt`` token ids of a /pd/cached body; ApiError 400 naming what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise oa.ApiError(400, "the body is not JSON") from None
    ids = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise oa.ApiError(400, f"prompt must be a list of token ids in [0, {vocab_size})", "prompt")
    return ids


def make_frontend_app(
    model: MoETransformer,
    tokenizer,
    settings: FrontendSettings,
    extensions: Sequence[AppExtension] = (),
    access: Access | None = None,
) -> FastAPI:
    """The FastAPI app; its engine thread starts and stops with the app's lifespan.

    ``app.state.frontend`` holds the :class:`Frontend` (``.engine.stats``, ``.metrics``).
    Requests stop on every id of ``tokenizer.eos_ids``. Each of `extensions` adds its routes
    (the prefill/decode split's: :class:`moecomm_serving.disagg.routes.PdRoutes`) and is closed
    after the engine stopped. `access`: the API key and the deployment secret its routes take
    (:mod:`moecomm_serving.api.auth`; None: every route open).
    """
    fe = Frontend(model, tokenizer, settings)
    if access is not None and access.deployment is not None:
        fe.peer_headers = access.deployment.headers()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        fe.engine.start()
        yield
        await asyncio.to_thread(fe.engine.stop)
        for ext in extensions:
            await asyncio.to_thread(ext.close)

    app = FastAPI(title="moecomm", lifespan=lifespan)
    app.state.frontend = fe
    install_access(app, access)
    install_openai_routes(app, fe)
    for ext in extensions:
        ext.install(app, fe)
    return app


def start_frontend(app: FastAPI, host: str = DEFAULT_HOST, port: int = 0) -> HttpServer:
    """Runs `app` in a background thread; ``server.start()`` already called, URL in ``.url``."""
    server = HttpServer(app, host, port)
    server.start()
    return server


def serve_frontend(
    model: MoETransformer,
    tokenizer,
    settings: FrontendSettings,
    host: str = DEFAULT_HOST,
    port: int = 8000,
) -> None:
    """Serves until interrupted, in the foreground (uvicorn's own loop)."""
    import uvicorn

    app = make_frontend_app(model, tokenizer, settings)
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
