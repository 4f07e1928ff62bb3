"""The prefill/decode split's routes on a front end (``moecomm frontend --role``; docs/router.md).

A router (:mod:`moecomm_serving.disagg.router`) runs each request in two places:

- ``POST /pd/prefill`` on a prefill front end: the engine prefills the prompt (sharing the
  step with other requests, using the prefix cache as any request does), samples the first
  token and ends the request there (``EngineRequest.handoff``); its KV blocks are encoded
  (:func:`~moecomm_serving.kv.package.encode_package`) and sent over moecomm's transports to the
  decode front end the router named — shm when the two share this host's memory, nixl
  otherwise, the per-peer choice the runtime makes — and the answer says where they are.
- ``POST /pd/decode`` on a decode front end: takes that package from its inbox, imports it into
  its own block pool and generates the rest, streaming one NDJSON line per token.

``GET /pd/info`` says the role; ``GET /pd/kv/offer`` and ``POST /pd/kv/connect`` (decode side)
set up a prefill front end's channel. A front end of role ``both`` serves every route. The
bodies are checked by :mod:`moecomm_serving.disagg.schema`; the KV package by
:func:`~moecomm_serving.kv.package.decode_package` and the pool's own check, so a malformed
hand-off is a 400 before anything is imported.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from moecomm.errors import DeadlineExceededError, PeerLostError

from moecomm_serving.api import openai as oa
from moecomm_serving.api.routes import cancel_on_disconnect
from moecomm_serving.disagg.schema import (
    DecodeCall,
    DecodeError,
    DecodeToken,
    KvReceipt,
    PdRequestError,
    PrefillAnswer,
    PrefillCall,
    to_line,
)
from moecomm_serving.disagg.transfer import KvInbox, KvOutbox, KvTransferError, install_kv_routes
from moecomm_serving.kv.blocks import check_package
from moecomm_serving.kv.package import KvHandoffError, decode_package, encode_package
from moecomm_serving.types import ErrorEvent, FinishEvent, HandoffEvent, Resume, TokenEvent

ROLES = ("both", "prefill", "decode")
PREFILL_ROLES, DECODE_ROLES = ("both", "prefill"), ("both", "decode")
# The prefill front end answers the router only once the decode side acknowledged every chunk,
# so the package is normally there already; this bounds a wait for one that never comes (the
# router then retries elsewhere).
KV_ARRIVAL_TIMEOUT_S = 30.0
# How long a prefill front end waits for a decode front end to take a package's chunks.
KV_SEND_TIMEOUT_S = 30.0
NDJSON = "application/x-ndjson"


class PdState:
    """A front end's side of the split: the KV inbox (decode), the outbox (prefill) and their
    counters, which /metrics renders."""

    def __init__(self, role: str, transport="auto", host: str | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.role = role
        self.inbox = KvInbox(transport, host).start() if role in DECODE_ROLES else None
        self.outbox = (
            KvOutbox(transport, host, KV_SEND_TIMEOUT_S) if role in PREFILL_ROLES else None
        )
        self._lock = threading.Lock()
        self.counts = {
            ("sent", "handoffs"): 0,
            ("sent", "bytes"): 0,
            ("sent", "failures"): 0,
            ("received", "handoffs"): 0,
            ("received", "bytes"): 0,
            ("received", "failures"): 0,
        }
        self.transfer_s = 0.0
        self.sent_by_transport: dict[str, int] = {}

    def count(self, direction: str, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[(direction, what)] += n

    def sent(self, transport: str, seconds: float, nbytes: int) -> None:
        """Counts one package handed off over `transport` in `seconds`."""
        with self._lock:
            self.transfer_s += seconds
            if transport:
                self.sent_by_transport[transport] = self.sent_by_transport.get(transport, 0) + 1
            self.counts[("sent", "handoffs")] += 1
            self.counts[("sent", "bytes")] += nbytes

    def metric_rows(self) -> list[tuple]:
        with self._lock:
            counts, seconds = dict(self.counts), self.transfer_s
        rows = []
        for what, help_text in (
            ("handoffs", "KV hand-offs of the prefill/decode split, by direction."),
            ("bytes", "KV package bytes handed off, by direction."),
            ("failures", "KV hand-offs that failed (transfer lost, package refused)."),
        ):
            name = f"moecomm_kv_handoff_{what}_total"
            for direction in ("sent", "received"):
                labels = f'{{direction="{direction}"}}'
                rows.append(("counter", name, help_text, counts[(direction, what)], labels))
        for name in sorted(self.sent_by_transport):
            rows.append(
                (
                    "counter",
                    "moecomm_kv_handoff_sent_by_transport_total",
                    "KV packages sent, by the transport the decode front end was reached over "
                    "(shm on this host, nixl across hosts).",
                    self.sent_by_transport[name],
                    f'{{transport="{name}"}}',
                )
            )
        rows.append(
            (
                "counter",
                "moecomm_kv_handoff_send_seconds_total",
                "Seconds spent sending KV packages to decode front ends (until acknowledged).",
                seconds,
            )
        )
        return rows

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()
        if self.outbox is not None:
            self.outbox.close()


class PdRoutes:
    """The split's routes on one front end, an
    :class:`~moecomm_serving.api.app.AppExtension` (``make_frontend_app(..., extensions=[...])``):
    ``/pd/info``, ``/pd/prefill`` (prefill roles), ``/pd/decode`` (decode roles) and the KV
    inbox's routes. Its :class:`PdState` is ``.state`` once installed."""

    def __init__(self, role: str, transport="auto", host: str | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.role, self.transport, self.host = role, transport, host
        self.state: PdState | None = None  # opened by install()
        self.fe = None

    # ------------------------------------------------------------------ AppExtension
    def install(self, app: FastAPI, fe) -> None:
        """Adds the routes to `fe`'s app (`fe`: its :class:`~moecomm_serving.api.app.Frontend`)
        and opens the KV inbox or outbox the role needs."""
        if self.role in DECODE_ROLES and fe.engine.pool is None:
            raise ValueError(f"role {self.role!r} takes KV hand-offs: it needs the paged KV cache")
        self.fe = fe
        self.state = PdState(self.role, self.transport, self.host)
        fe.extra_metrics.append(self.state.metric_rows)
        install_kv_routes(app, lambda: self.state.inbox)
        app.add_api_route("/pd/info", self.info, methods=["GET"])
        app.add_api_route("/pd/prefill", self.prefill, methods=["POST"])
        app.add_api_route("/pd/decode", self.decode, methods=["POST"])

    def close(self) -> None:
        if self.state is not None:
            self.state.close()

    # ------------------------------------------------------------------ routes
    async def info(self):
        pool = self.fe.engine.pool
        return {
            "role": self.state.role,
            "model": self.fe.model_name,
            "block_tokens": None if pool is None else pool.block_tokens,
        }

    async def prefill(self, request: Request):
        state, fe = self.state, self.fe
        call = await self._read_call(request, state.outbox, "/pd/prefill", PrefillCall)
        t0 = time.monotonic()
        req, queue = fe.submit(call.prompt, call.params, handoff=True)
        token, finish, handed = None, None, None
        try:
            async for ev in fe.events(req, queue, request):
                if isinstance(ev, HandoffEvent):
                    token, handed = ev.token, ev
                elif isinstance(ev, TokenEvent):
                    token, finish = ev.token, ev.finish
                elif isinstance(ev, FinishEvent):
                    finish = ev.reason
                elif isinstance(ev, ErrorEvent):
                    raise oa.ApiError(ev.status, ev.message)
        finally:
            req.cancel()
        if token is None:  # the router hung up
            raise oa.ApiError(499, "request cancelled")
        prefill_s = time.monotonic() - t0
        if handed is None:  # the first token ended it: nothing to hand off
            return PrefillAnswer(token, finish, None, None, prefill_s, 0).to_json()
        receipt = await self._send(call, handed)
        rng = None if handed.rng_state is None else bytes(handed.rng_state.numpy())
        answer = PrefillAnswer(token, None, receipt, rng, prefill_s, handed.cached_tokens)
        return answer.to_json()

    async def _send(self, call: PrefillCall, handed: HandoffEvent) -> KvReceipt:
        """Hands `handed`'s KV package to the decode front end `call` names."""
        state = self.state
        data = await asyncio.to_thread(encode_package, handed.package, call.handoff_id)
        t1 = time.monotonic()
        try:
            client_id, tag = await asyncio.to_thread(
                state.outbox.send, call.decode_url, data, KV_SEND_TIMEOUT_S
            )
        except KvTransferError as exc:
            state.count("sent", "failures")
            raise oa.ApiError(502, f"KV hand-off to {call.decode_url} failed: {exc}") from None
        transfer_s = time.monotonic() - t1
        transport = state.outbox.connected().get(call.decode_url, "")
        state.sent(transport, transfer_s, data.numel())
        return KvReceipt(client_id, tag, data.numel(), transfer_s, transport)

    async def decode(self, request: Request):
        state, fe = self.state, self.fe
        call = await self._read_call(request, state.inbox, "/pd/decode", DecodeCall)
        if any(t >= fe.vocab_size for t in call.tokens):
            raise oa.ApiError(400, f"tokens must be ids in [0, {fe.vocab_size})")
        rng = None if call.params.greedy else _rng_state(call.rng)
        try:
            data = await asyncio.to_thread(
                state.inbox.take, call.client_id, call.tag, KV_ARRIVAL_TIMEOUT_S
            )
        except DeadlineExceededError as exc:
            state.count("received", "failures")
            raise oa.ApiError(504, f"the KV package did not arrive: {exc}") from None
        except PeerLostError as exc:
            state.count("received", "failures")
            raise oa.ApiError(502, f"the prefill side was lost mid-package: {exc}") from None
        try:
            package = await asyncio.to_thread(decode_package, data, call.handoff_id)
            # checked here, once: the engine imports the checked package without asking again
            package = check_package(fe.engine.pool, package)
        except (KvHandoffError, ValueError) as exc:
            state.count("received", "failures")
            raise oa.ApiError(400, f"KV package refused: {exc}") from None
        want = len(call.prompt) + len(call.tokens) - 1
        if package.length != want:
            state.count("received", "failures")
            raise oa.ApiError(
                400,
                f"KV package refused: it holds {package.length} tokens; the prompt and the "
                f"tokens given need {want}",
            )
        state.count("received", "handoffs")
        state.count("received", "bytes", data.numel())
        resume = Resume(package, list(call.tokens), rng)
        req, queue = fe.submit(call.prompt, call.params, resume=resume)
        body = cancel_on_disconnect(_ndjson(fe, req, queue), request, req)
        return StreamingResponse(body, media_type=NDJSON)

    async def _read_call(self, request: Request, side, route: str, message):
        """The route's checked body: 404 when this front end has no `side` for it (its role),
        400 for a malformed body or a prompt the model cannot take."""
        if side is None:
            raise oa.ApiError(404, f"{route}: this front end's role is {self.state.role!r}")
        raw = await oa.read_body(request, self.fe.max_body_bytes)
        try:
            call = message.from_json(raw)
        except PdRequestError as exc:
            raise oa.ApiError(400, str(exc)) from None
        self.fe.check_prompt(call.prompt, call.params.max_new_tokens)
        return call


def _rng_state(raw: bytes | None) -> torch.Tensor:
    """The torch generator state a sampled request's decode continues from."""
    if raw is None:
        raise oa.ApiError(400, "a sampled request's hand-off must carry its sampler state (rng)")
    state = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )
    try:
        torch.Generator().set_state(state)
    except RuntimeError as exc:
        raise oa.ApiError(400, f"rng is not a sampler state: {exc}") from None
    return state


async def _ndjson(fe, req, queue) -> AsyncIterator[bytes]:
    """One line per token; an error line ends a failed request. The request is cancelled
    whenever the stream stops early (the router hung up)."""
    try:
        async for ev in fe.events(req, queue, None):
            if isinstance(ev, TokenEvent):
                yield to_line(DecodeToken(ev.token, ev.finish))
            elif isinstance(ev, ErrorEvent):
                yield to_line(DecodeError(ev.message, ev.status))
            # a FinishEvent repeats the last token's finish: nothing to add
    finally:
        req.cancel()
