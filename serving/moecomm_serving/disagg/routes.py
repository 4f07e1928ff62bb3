"""The prefill/decode split's routes on a front end (``moecomm frontend --role``; docs/router.md).

A router (:mod:`moecomm_serving.disagg.router`) runs each request in two places:

- ``POST /pd/prefill`` on a prefill front end: the engine prefills the prompt (sharing the
  step with other requests, using the prefix cache as any request does), samples the first
  token and ends the request there (``EngineRequest.handoff``), holding its KV blocks; the
  front end asks the decode front end the router named to reserve blocks for them
  (``POST /pd/reserve`` there), writes its blocks straight into the decode's KV pool
  (:mod:`moecomm_serving.disagg.transfer`, over :mod:`moecomm.wire.kv`) and answers where they
  are (the transfer's slot and sequence number).
- ``POST /pd/reserve`` on a decode front end: checks the cache's metadata against its pool,
  once, and reserves destination blocks and a completion slot for the prefill's write.
- ``POST /pd/decode`` on a decode front end: waits for that transfer's completion word, hands
  the blocks to the engine (its sequence adopts them, no copy) and generates the rest,
  streaming one NDJSON line per token.

``GET /pd/info`` says the role. A front end of role ``both`` serves every route (a hand-off to
itself goes through its own pool). The bodies are checked by
:mod:`moecomm_serving.disagg.schema`, so a malformed call is a 400 before anything is reserved.

Across hosts each front end's pool is also registered with NIXL (the same memory): a decode
front end that cannot map the prefill's shm pool reserves over nixl instead, and the prefill
WRITEs its blocks there (``KvReceipt.transport`` is then ``nixl``), when NIXL is installed and
the transport is not ``shm``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from moecomm.errors import DeadlineExceededError, MoecommError, PeerLostError

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
    ReserveCall,
    to_line,
)
from moecomm_serving.disagg.transfer import (
    DEFAULT_KV_POOL_BYTES,
    KvBusyError,
    KvEndpoint,
    KvReservationError,
    KvTransferError,
    KvUnreachableError,
)
from moecomm_serving.types import ErrorEvent, FinishEvent, HandoffEvent, Resume, TokenEvent

log = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
PREFILL_ROLES, DECODE_ROLES = ("both", "prefill"), ("both", "decode")
# The prefill front end answers the router only once the transfer's completion word is set, so
# the blocks are normally there already; this bounds a wait for a transfer still under way.
KV_ARRIVAL_TIMEOUT_S = 30.0
# The transport the KV pools are written over (the only one moecomm.wire.kv pools speak yet).
KV_TRANSPORT = "shm"
# The transports a hand-off's KV can go over (KvReceipt.transport): pool to pool over shm on one
# host, over nixl across hosts.
KV_TRANSPORTS = (KV_TRANSPORT, "nixl")
NDJSON = "application/x-ndjson"


class PdState:
    """A front end's side of the split: its KV endpoint (the pool hand-offs are written from
    and into) and the counters /metrics renders."""

    def __init__(self, role: str, endpoint: KvEndpoint):
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.role = role
        self.endpoint = endpoint
        # the reservation calls to decode front ends (prefill roles), made on worker threads
        self.http = httpx.Client(trust_env=False) if role in PREFILL_ROLES else None
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

    @property
    def sends(self) -> bool:
        return self.role in PREFILL_ROLES

    @property
    def receives(self) -> bool:
        return self.role in DECODE_ROLES

    def count(self, direction: str, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[(direction, what)] += n

    def sent(self, transport: str, seconds: float, nbytes: int) -> None:
        """Counts one hand-off written over `transport` in `seconds`."""
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
            ("bytes", "KV bytes handed off (whole blocks, every layer), by direction."),
            (
                "failures",
                "KV hand-offs that failed (transfer lost or refused, reservation refused).",
            ),
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
                    "KV hand-offs sent, by the transport the decode front end's pool was "
                    "written over.",
                    self.sent_by_transport[name],
                    f'{{transport="{name}"}}',
                )
            )
        rows.append(
            (
                "counter",
                "moecomm_kv_handoff_send_seconds_total",
                "Seconds spent handing KV to decode front ends (reservation and write).",
                seconds,
            )
        )
        return rows

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
        self.endpoint.close()


class PdRoutes:
    """The split's routes on one front end, an
    :class:`~moecomm_serving.api.app.AppExtension` (``make_frontend_app(..., extensions=[...])``):
    ``/pd/info``, ``/pd/prefill`` (prefill roles), ``/pd/reserve`` and ``/pd/decode`` (decode
    roles). Its :class:`PdState` is ``.state`` once installed.

    `transport`: "shm" (pools on this host only), "auto" or "nixl" (the pool registered with
    nixl too, for front ends on other hosts, when NIXL is installed); `host`: the address nixl
    carries bytes over. `kv_pool_bytes`: the size of the front end's KV pool
    (:data:`~moecomm_serving.disagg.transfer.DEFAULT_KV_POOL_BYTES`)."""

    def __init__(
        self,
        role: str,
        transport="auto",
        host: str | None = None,
        kv_pool_bytes: int = DEFAULT_KV_POOL_BYTES,
    ):
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        name = getattr(transport, "name", transport)
        if name not in ("auto", "shm", "nixl"):
            raise ValueError(f"transport must be auto, shm or nixl, got {name!r}")
        self.nixl = None
        if name != "shm":
            from moecomm.wire.nixl import available

            ok, _ = available()
            if ok:
                self.nixl = name
            elif name == "nixl":
                raise ValueError(
                    "transport nixl: NIXL is not installed (pip install 'moecomm[nixl]')"
                )
        self.role, self.host, self.kv_pool_bytes = role, host, kv_pool_bytes
        self.state: PdState | None = None  # opened by install()
        self.fe = None

    # ------------------------------------------------------------------ AppExtension
    def install(self, app: FastAPI, fe) -> None:
        """Adds the routes to `fe`'s app (`fe`: its :class:`~moecomm_serving.api.app.Frontend`)
        and places its engine's KV cache in a KV pool (before the engine starts serving)."""
        if fe.engine.pool is None:
            raise ValueError(f"role {self.role!r} hands KV off: it needs the paged KV cache")
        self.fe = fe
        try:
            endpoint = KvEndpoint(
                fe.engine.pool, self.kv_pool_bytes, nixl=self.nixl is not None, nixl_host=self.host
            )
        except MoecommError as exc:
            if self.nixl != "auto":
                raise
            # "auto" is shm pools, and nixl for other hosts where it works: a front end whose
            # NIXL cannot start still serves hand-offs on this host
            log.warning("KV hand-offs across hosts are off: %s", exc)
            endpoint = KvEndpoint(fe.engine.pool, self.kv_pool_bytes)
        self.state = PdState(self.role, endpoint)
        # its calls to decode front ends carry the deployment's secret, when it has one
        peer_headers = getattr(fe, "peer_headers", None) or {}
        if self.state.http is not None:
            self.state.http.headers.update(peer_headers)
        fe.extra_metrics.append(self.state.metric_rows)
        app.add_api_route("/pd/info", self.info, methods=["GET"])
        app.add_api_route("/pd/prefill", self.prefill, methods=["POST"])
        app.add_api_route("/pd/reserve", self.reserve, methods=["POST"])
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
        call = await self._read_call(request, state.sends, "/pd/prefill", PrefillCall)
        t0 = time.monotonic()
        req, queue = fe.submit(call.prompt, call.params, handoff=True)
        token, finish, handed = None, None, None
        try:
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
        finally:
            if handed is not None:
                handed.package.release()  # sent or not, this front end's blocks go back
        rng = None if handed.rng_state is None else bytes(handed.rng_state.numpy())
        answer = PrefillAnswer(token, None, receipt, rng, prefill_s, handed.cached_tokens)
        return answer.to_json()

    async def _send(self, call: PrefillCall, handed: HandoffEvent) -> KvReceipt:
        """Writes `handed`'s blocks into the decode front end `call` names."""
        state = self.state
        held = handed.package
        t1 = time.monotonic()
        try:
            slot, seq, transport = await asyncio.to_thread(
                state.endpoint.send, state.http, call.decode_url, call.handoff_id, held
            )
        except KvTransferError as exc:
            state.count("sent", "failures")
            raise oa.ApiError(502, f"KV hand-off to {call.decode_url} failed: {exc}") from None
        transfer_s = time.monotonic() - t1
        nbytes = len(held.blocks) * self.fe.engine.pool.block_bytes
        state.sent(transport, transfer_s, nbytes)
        return KvReceipt(slot, seq, nbytes, transfer_s, transport)

    async def reserve(self, request: Request):
        state = self.state
        if not state.receives:
            raise oa.ApiError(404, f"/pd/reserve: this front end's role is {state.role!r}")
        raw = await oa.read_body(request, self.fe.max_body_bytes)
        try:
            call = ReserveCall.from_json(raw)
        except PdRequestError as exc:
            raise oa.ApiError(400, str(exc)) from None
        try:
            # bookkeeping (and, from a new peer, mapping its regions): on the event loop, where
            # a worker thread would add a wake-up to every hand-off
            answer = state.endpoint.reserve(call)
        except KvReservationError as exc:
            state.count("received", "failures")
            raise oa.ApiError(400, str(exc)) from None
        except KvUnreachableError as exc:
            state.count("received", "failures")
            raise oa.ApiError(409, str(exc)) from None
        except KvBusyError as exc:
            state.count("received", "failures")
            raise oa.ApiError(503, str(exc)) from None
        return answer.to_json()

    async def decode(self, request: Request):
        state, fe = self.state, self.fe
        call = await self._read_call(request, state.receives, "/pd/decode", DecodeCall)
        if any(t >= fe.vocab_size for t in call.tokens):
            raise oa.ApiError(400, f"tokens must be ids in [0, {fe.vocab_size})")
        try:
            if call.transport not in KV_TRANSPORTS:
                raise oa.ApiError(400, f"kv.transport must be one of {', '.join(KV_TRANSPORTS)}")
            take = (
                state.endpoint.take,
                call.handoff_id,
                call.client_id,
                call.tag,
                KV_ARRIVAL_TIMEOUT_S,
                call.transport,
            )
            if state.endpoint.ready(call.tag, call.transport):  # usual: written before the call
                held = take[0](*take[1:])
            else:
                held = await asyncio.to_thread(*take)
        except DeadlineExceededError as exc:
            state.count("received", "failures")
            raise oa.ApiError(504, f"the KV transfer did not arrive: {exc}") from None
        except PeerLostError as exc:
            state.count("received", "failures")
            raise oa.ApiError(502, f"the prefill side was lost mid-transfer: {exc}") from None
        except KvReservationError as exc:
            state.count("received", "failures")
            raise oa.ApiError(400, f"KV transfer refused: {exc}") from None
        except KvTransferError as exc:
            state.count("received", "failures")
            raise oa.ApiError(502, str(exc)) from None
        try:
            rng = None if call.params.greedy else _rng_state(call.rng)
            want = len(call.prompt) + len(call.tokens) - 1
            if held.package.length != want:
                raise oa.ApiError(
                    400,
                    f"KV transfer refused: it holds {held.package.length} tokens; the prompt "
                    f"and the tokens given need {want}",
                )
            resume = Resume(held, list(call.tokens), rng)
            req, queue = fe.submit(call.prompt, call.params, resume=resume)
        except BaseException as exc:
            held.release()
            if isinstance(exc, oa.ApiError) and exc.status < 500:
                state.count("received", "failures")
            raise
        state.count("received", "handoffs")
        state.count("received", "bytes", len(held.blocks) * fe.engine.pool.block_bytes)
        body = cancel_on_disconnect(_ndjson(fe, req, queue, held), request, req)
        return StreamingResponse(body, media_type=NDJSON)

    async def _read_call(self, request: Request, serves: bool, route: str, message):
        """The route's checked body: 404 when this front end's role does not serve `route`,
        400 for a malformed body or a prompt the model cannot take."""
        if not serves:
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


async def _ndjson(fe, req, queue, held) -> AsyncIterator[bytes]:
    """One line per token; an error line ends a failed request. The request is cancelled
    whenever the stream stops early (the router hung up), and the handed-off blocks are
    released if the engine never adopted them (a request cancelled while queued)."""
    try:
        async for ev in fe.events(req, queue, None):
            if isinstance(ev, TokenEvent):
                yield to_line(DecodeToken(ev.token, ev.finish))
            elif isinstance(ev, ErrorEvent):
                yield to_line(DecodeError(ev.message, ev.status))
            # a FinishEvent repeats the last token's finish: nothing to add
    finally:
        req.cancel()
        held.release()
