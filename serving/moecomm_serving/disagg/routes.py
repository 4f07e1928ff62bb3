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
import json
import threading
import time
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from moecomm.errors import DeadlineExceededError, PeerLostError

from moecomm_serving.api import openai as oa
from moecomm_serving.api.routes import cancel_on_disconnect
from moecomm_serving.disagg.schema import PdRequestError, parse_decode, parse_prefill, rng_to_json
from moecomm_serving.disagg.transfer import KvInbox, KvOutbox, KvTransferError, install_kv_routes
from moecomm_serving.engine.scheduler import (
    ErrorEvent,
    FinishEvent,
    HandoffEvent,
    Resume,
    TokenEvent,
)
from moecomm_serving.kv.blocks import check_package
from moecomm_serving.kv.package import KvHandoffError, decode_package, encode_package

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


async def _read_call(request: Request, fe, side, route: str, role: str, parse):
    """The route's checked body: 404 when this front end has no `side` for it (its role), 400
    for a malformed body or a prompt the model cannot take."""
    if side is None:
        raise oa.ApiError(404, f"{route}: this front end's role is {role!r}")
    raw = await oa.read_body(request, fe.max_body_bytes)
    try:
        call = parse(raw)
    except PdRequestError as exc:
        raise oa.ApiError(400, str(exc)) from None
    fe.check_prompt(call.prompt, call.params.max_new_tokens)
    return call


def install_pd_routes(app: FastAPI, fe, state: PdState) -> None:
    """Adds the split's routes to a front end's app (`fe`: its
    :class:`~moecomm_serving.api.app.Frontend`)."""
    install_kv_routes(app, lambda: state.inbox)

    @app.get("/pd/info")
    async def info():
        pool = fe.engine.pool
        return {
            "role": state.role,
            "model": fe.model_name,
            "block_tokens": None if pool is None else pool.block_tokens,
        }

    @app.post("/pd/prefill")
    async def prefill(request: Request):
        call = await _read_call(request, fe, state.outbox, "/pd/prefill", state.role, parse_prefill)
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
        answer = {
            "token": token,
            "finish": finish,
            "kv": None,
            "rng": None,
            "prefill_s": prefill_s,
            "cached_tokens": 0 if handed is None else handed.cached_tokens,
        }
        if handed is None:  # the first token ended it: nothing to hand off
            return answer
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
        with state._lock:
            state.transfer_s += transfer_s
            if transport:
                state.sent_by_transport[transport] = state.sent_by_transport.get(transport, 0) + 1
        state.count("sent", "handoffs")
        state.count("sent", "bytes", data.numel())
        answer["kv"] = {
            "client_id": client_id,
            "tag": tag,
            "bytes": data.numel(),
            "transfer_s": transfer_s,
            "transport": transport,
        }
        answer["rng"] = rng_to_json(handed.rng_state)
        return answer

    @app.post("/pd/decode")
    async def decode(request: Request):
        call = await _read_call(request, fe, state.inbox, "/pd/decode", state.role, parse_decode)
        if any(t >= fe.vocab_size for t in call.tokens):
            raise oa.ApiError(400, f"tokens must be ids in [0, {fe.vocab_size})")
        if not call.params.greedy:
            _check_rng(call.rng)
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
            check_package(fe.engine.pool, package)
        except (KvHandoffError, ValueError) as exc:
            state.count("received", "failures")
            raise oa.ApiError(400, f"KV package refused: {exc}") from None
        want = len(call.prompt) + len(call.tokens) - 1
        if package["length"] != want:
            state.count("received", "failures")
            raise oa.ApiError(
                400,
                f"KV package refused: it holds {package['length']} tokens; the prompt and the "
                f"tokens given need {want}",
            )
        state.count("received", "handoffs")
        state.count("received", "bytes", data.numel())
        resume = Resume(package, list(call.tokens), call.rng)
        req, queue = fe.submit(call.prompt, call.params, resume=resume)
        body = cancel_on_disconnect(_ndjson(fe, req, queue), request, req)
        return StreamingResponse(body, media_type=NDJSON)


def _check_rng(state: torch.Tensor | None) -> None:
    if state is None:
        raise oa.ApiError(400, "a sampled request's hand-off must carry its sampler state (rng)")
    try:
        torch.Generator().set_state(state)
    except RuntimeError as exc:
        raise oa.ApiError(400, f"rng is not a sampler state: {exc}") from None


async def _ndjson(fe, req, queue) -> AsyncIterator[bytes]:
    """One line per token; an error line ends a failed request. The request is cancelled
    whenever the stream stops early (the router hung up)."""
    try:
        async for ev in fe.events(req, queue, None):
            if isinstance(ev, TokenEvent):
                yield _line({"token": ev.token, "finish": ev.finish})
            elif isinstance(ev, ErrorEvent):
                yield _line({"error": {"message": ev.message, "status": ev.status}})
            # a FinishEvent repeats the last token's finish: nothing to add
    finally:
        req.cancel()


def _line(obj: dict) -> bytes:
    return (json.dumps(obj) + "\n").encode()
