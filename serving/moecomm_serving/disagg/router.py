"""The prefill/decode router: the OpenAI API in front of prefill and decode front ends.

Each request runs in two phases on two processes (the protocol: docs/router.md). The router
posts the prompt to a prefill front end (``/pd/prefill``), which computes the prompt's KV, draws
the first token and hands the KV blocks to the decode front end the router chose; that first
token is sent to the client at once (its TTFT). The router then streams the rest from the
decode front end (``/pd/decode``, NDJSON, one line per token).

Front ends fail; requests do not. A prefill front end that is unreachable, answers 5xx or stays
silent past the backend timeout is replaced by another for the same request; a prefill that
could not hand its KV to the chosen decode front end (502) is retried with another decode front
end. A decode front end that fails before or during its stream (refused, dropped connection,
killed, stopped) is replaced by *replaying* the request: it runs again from the prefill, on
another decode front end, and the tokens the client already has are checked against the replay
(greedy and seeded sampling draw the same tokens, so they match; every sampled request gets a
seed at submit for this) and skipped. Attempts are bounded (:data:`MAX_ATTEMPTS`) and every
HTTP call has a timeout inside the request's deadline. A 4xx from a front end is the request's
own fault: it reaches the client as is, without a retry.

A front end that failed is *suspect* for :data:`SUSPECT_S` (left out of the picks) and then
probed with ``GET /health`` in the background until it answers; picks prefer the healthy front
end with the fewest requests in flight (ties: round robin).

Not every request is split (conditional disaggregation): one whose prompt, less what the decode
front end's prefix cache holds (``POST /pd/cached``, asked only for prompts too long to be
short), has at most ``max_local_prefill_tokens`` tokens runs on the decode front end alone, as
its own streamed ``/v1/completions``: no hand-off. Every call to a front end carries the
deployment's shared secret, never the client's API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import json
import secrets
import time
from collections.abc import Sequence

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from moecomm.auth import SharedSecret

from moecomm_serving.api import openai as oa
from moecomm_serving.api.auth import Access, install_access
from moecomm_serving.api.metrics import PREFIX, ServingMetrics
from moecomm_serving.api.routes import DEFAULT_MAX_BODY_BYTES, ApiFront, install_openai_routes
from moecomm_serving.disagg.schema import (
    DecodeCall,
    DecodeError,
    PdRequestError,
    PrefillAnswer,
    PrefillCall,
    parse_line,
)
from moecomm_serving.types import (
    DEFAULT_REQUEST_TIMEOUT_S,
    ErrorEvent,
    FinishEvent,
    SamplingParams,
    TokenEvent,
)

PREFILL, DECODE = "prefill", "decode"
# Prefix affinity: requests whose prompts start with the same this many tokens go to the same
# prefill front end (rendezvous hashing over the healthy ones), so its prefix cache sees every
# repeat of a shared system prompt instead of 1/N of them. 64 = four blocks of the default
# 16-token KV block: a shorter common start saves too little prefill to be worth skewing load.
DEFAULT_AFFINITY_TOKENS = 64
# The preferred front end is skipped for the least loaded when it has this many more requests
# in flight: affinity must not pile a burst of one prompt family onto one front end.
AFFINITY_SLACK = 4
ROLES = (PREFILL, DECODE)
# Tries of one request, the first included: enough to lose a prefill and a decode front end
# during it and still have a spare; a request that fails this often has a cause no other front
# end will fix (the error says what the last try met).
MAX_ATTEMPTS = 4
# The longest a front end may stay silent before the router gives up on it: the prefill's
# answer, the decode stream's headers, the gap between two streamed tokens. Well above a
# prefill of a long prompt under load, well below the request deadline, so that a stopped
# (SIGSTOP) or wedged front end costs one timeout and a replay, not the request.
DEFAULT_BACKEND_TIMEOUT_S = 30.0
# Connecting is local-network fast; a front end that does not accept within this is down.
CONNECT_TIMEOUT_S = 5.0
# A failed front end is left out of the picks this long, then probed until it answers /health.
SUSPECT_S = 2.0
# How often the background task looks for suspects to probe.
PROBE_INTERVAL_S = 0.5
# A front end's /health is a one-token forward through its engine (experts included): give it
# as long as the front end gives itself (frontend.HEALTH_TIMEOUT_S).
HEALTH_TIMEOUT_S = 30.0
# Seeds the router gives sampled requests that have none: torch.Generator.manual_seed takes any
# 64-bit value; 63 bits stay a positive int in every JSON reader.
SEED_BITS = 63
# Open connections to the front ends: one per request in flight (a decode stream holds its
# connection), so the bound is far above any batch a front end runs.
MAX_CONNECTIONS = 1024
# Kept idle connections per router (keep-alive saves a TCP handshake per request).
MAX_KEEPALIVE = 64
# How much of a front end's error body goes into the client's message.
MAX_ERROR_CHARS = 300
# Conditional disaggregation: a request whose prompt, less what the decode front end's prefix
# cache already holds, has at most this many tokens is prefilled on the decode front end (a
# plain generate there, no hand-off). 0: every request is split. From bench/serving/pd.py (the
# conditional router beside single and always-split; docs/router.md, "Where a prompt is
# prefilled"): with every 64-token prompt of the mixed load prefilled on the decode front end,
# its decode ITL p99 stayed the always-split router's (1.00x) and the short requests' TTFT p99
# fell to 0.71x the single front end's (bench/results/pd_local_edge.json); a 768-token prefill
# takes 13-15 decode steps, so 64 tokens add about one step to the decodes batched with them.
DEFAULT_MAX_LOCAL_PREFILL_TOKENS = 64
# The question "how much of this prompt do you hold?" (POST /pd/cached) is answered from
# memory; a decode front end slower than this is busy, and the request is split (as if nothing
# were cached) rather than waiting for the answer.
CACHED_QUESTION_TIMEOUT_S = 1.0
# Where a try prefills its prompt (the moecomm_router_prefills_total label).
LOCAL_SHORT, LOCAL_CACHED, SPLIT = "local_short", "local_cached", "split"
PATHS = (LOCAL_SHORT, LOCAL_CACHED, SPLIT)


@dataclasses.dataclass
class Backend:
    """One front end as the router sees it."""

    url: str
    index: int
    healthy: bool = True
    in_flight: int = 0
    failures: int = 0  # consecutive
    suspect_until: float = 0.0
    last_error: str = ""
    # whether its engine has a prefix cache, as its /pd/cached said (None: not asked yet)
    prefix_cache: bool | None = None

    def describe(self) -> dict:
        out = {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight}
        if not self.healthy:
            out["error"] = self.last_error
        return out


def _rendezvous(key: bytes, url: str) -> bytes:
    return hashlib.blake2b(key + url.encode(), digest_size=8).digest()


def affinity_key(ids: Sequence[int], tokens: int) -> bytes | None:
    """The prefill affinity key of a prompt: its first `tokens` ids, or None when the prompt
    is not longer than that (nothing after the shared start: no prefix worth keeping)."""
    if tokens <= 0 or len(ids) <= tokens:
        return None
    return b"".join(int(t).to_bytes(4, "little") for t in ids[:tokens])


class Backends:
    """The front ends of one role: which is healthy, how busy, which to pick next."""

    def __init__(self, role: str, urls: Sequence[str]):
        if not urls:
            raise ValueError(f"no {role} front end given")
        self.role = role
        self.backends = [Backend(u, i) for i, u in enumerate(urls)]
        self._rr = 0  # round-robin offset among equally loaded front ends

    def pick(self, tried: set[int], affinity: bytes | None = None) -> Backend:
        """The healthy front end with the fewest requests in flight, not yet tried by this
        request if one is left; else a suspect one (it may be back); else one already tried
        (a busy one may have room now). Never None: the attempt bound ends a hopeless request.
        With an `affinity` key, the candidate that key hashes highest with (rendezvous
        hashing: a lost front end moves only its own keys) unless it has AFFINITY_SLACK more
        requests in flight than the least loaded."""
        for ok in (
            lambda b: b.healthy and b.index not in tried,
            lambda b: b.index not in tried,
            lambda b: b.healthy,
            lambda b: True,
        ):
            candidates = [b for b in self.backends if ok(b)]
            if candidates:
                break
        n = len(self.backends)
        best = min(candidates, key=lambda b: (b.in_flight, (b.index - self._rr) % n))
        if affinity is not None:
            home = max(candidates, key=lambda b: _rendezvous(affinity, b.url))
            if home.in_flight < best.in_flight + AFFINITY_SLACK:
                return home
        self._rr = (best.index + 1) % n
        return best

    def failed(self, b: Backend, why: str) -> None:
        b.healthy = False
        b.prefix_cache = None  # a restarted front end may have other settings
        b.failures += 1
        b.last_error = why
        b.suspect_until = time.monotonic() + SUSPECT_S

    def succeeded(self, b: Backend) -> None:
        b.healthy, b.failures, b.last_error = True, 0, ""

    @property
    def num_healthy(self) -> int:
        return sum(b.healthy for b in self.backends)


@dataclasses.dataclass
class _Failure:
    """What ended one try of a request, when another try may do better."""

    phase: str  # the call that failed: PREFILL or DECODE (the retries metric's label)
    message: str
    blame: tuple[tuple[str, Backend], ...] = ()  # (role, front end) marked failed
    avoid: tuple[tuple[str, Backend], ...] = ()  # left out of this request's next pick only


@dataclasses.dataclass
class _End:
    """The request is over: finished (its FinishEvent queued) or failed for good."""

    error: ErrorEvent | None = None


class RouterRequest:
    """One client request in the router: its deadline, the tokens the client has, the task
    that runs it. ``cancel()`` stops the task, which closes its front-end connections (the
    decode front end then cancels its side)."""

    def __init__(self, rid: str, ids: list[int], params: SamplingParams, deadline: float):
        self.id, self.ids, self.params, self.deadline = rid, ids, params, deadline
        self.emitted: list[int] = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.finished = False
        # where the current replay stands: tokens of this try checked against `emitted`
        self._seen = 0

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def new_try(self) -> None:
        self._seen = 0

    def finish(self, reason: str) -> None:
        """The request ended without a further token (a finish reported on its own)."""
        if not self.finished:
            self.finished = True
            self.queue.put_nowait(FinishEvent(reason, time.monotonic()))

    def take(self, token: int, finish: str | None) -> ErrorEvent | None:
        """One token of the current try: a replayed one must equal what the client got (then it
        is skipped); a new one is sent. An ErrorEvent when the replay diverged."""
        i, self._seen = self._seen, self._seen + 1
        if i < len(self.emitted):
            if token != self.emitted[i] or finish is not None:
                # The client cannot take back what it has; a replay that differs is a bug or a
                # non-reproducible draw, never silently glued onto the old tokens.
                return ErrorEvent(
                    f"replay diverged at token {i}: the client has {self.emitted[i]}, the "
                    f"replay drew {token}{' and finished' if finish else ''}",
                    500,
                    time.monotonic(),
                )
            return None
        self.emitted.append(token)
        now = time.monotonic()
        self.queue.put_nowait(TokenEvent(token, now, finish))
        if finish is not None:
            self.finished = True
            self.queue.put_nowait(FinishEvent(finish, now))
        return None


def _error_message(r: httpx.Response) -> str:
    """The message of a front end's OpenAI-shaped error body, or the start of its text."""
    try:
        msg = r.json()["error"]["message"]
        if isinstance(msg, str):
            return msg
    except (ValueError, KeyError, TypeError):
        pass
    return r.text[:MAX_ERROR_CHARS] or r.reason_phrase


def _refused_secret(r: httpx.Response, where: str) -> _End:
    """A front end refused the router's deployment secret: a misconfigured deployment, not the
    request's fault and not fixed by another try."""
    return _End(
        ErrorEvent(
            f"{where} refused the router's deployment secret ({r.status_code}: "
            f"{_error_message(r)}); give the router and every front end the same secret",
            502,
            time.monotonic(),
        )
    )


def _describe(exc: Exception) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class RouterMetrics:
    """The router's own counters (updated on the event loop only)."""

    def __init__(self):
        self.retries = dict.fromkeys(ROLES, 0)
        self.handoffs = 0
        self.kv_bytes = 0
        self.kv_transfer_s = 0.0
        self.prefills = dict.fromkeys(PATHS, 0)  # tries, by where the prompt was prefilled
        self.cached_questions = 0  # POST /pd/cached asked

    def rows(self, pools: dict[str, Backends]) -> list[tuple]:
        """Rows for :class:`ServingMetrics`' ``extra``: (kind, name, help, value[, labels])."""
        p = f"{PREFIX}_router"
        retries = (
            "Tries of a request re-run after a failure, by the call that failed (a replay after "
            "a lost decode front end counts under decode)."
        )
        healthy = "Front ends of each role the router currently sends requests to."
        return [
            *(
                ("counter", f"{p}_retries_total", retries, self.retries[ph], f'{{phase="{ph}"}}')
                for ph in ROLES
            ),
            (
                "counter",
                f"{p}_handoffs_total",
                "KV hand-offs from a prefill to a decode front end.",
                self.handoffs,
            ),
            (
                "counter",
                f"{p}_kv_bytes_total",
                "KV bytes handed off, as the prefill front ends report them.",
                self.kv_bytes,
            ),
            (
                "counter",
                f"{p}_kv_transfer_seconds_total",
                "Seconds the prefill front ends spent handing KV off (until acknowledged).",
                self.kv_transfer_s,
            ),
            *(
                ("gauge", f"{p}_backends_healthy", healthy, pools[r].num_healthy, f'{{role="{r}"}}')
                for r in ROLES
            ),
            *(
                (
                    "counter",
                    f"{p}_prefills_total",
                    "Tries by where the prompt was prefilled: on the decode front end because "
                    "it is short (local_short) or its decode front end held most of it "
                    "(local_cached), or on a prefill front end with a KV hand-off (split).",
                    self.prefills[path],
                    f'{{path="{path}"}}',
                )
                for path in PATHS
            ),
            (
                "counter",
                f"{p}_cached_questions_total",
                "Questions to decode front ends about how much of a prompt their prefix cache "
                "holds (POST /pd/cached).",
                self.cached_questions,
            ),
        ]


class Router(ApiFront):
    """The OpenAI routes over prefill and decode front ends; :func:`make_router_app` wires it
    into FastAPI (whose lifespan calls :meth:`start` and :meth:`close`).

    `backend_timeout_s` bounds every silence of a front end (see
    :data:`DEFAULT_BACKEND_TIMEOUT_S`); `request_timeout_s` is each request's deadline.
    `max_local_prefill_tokens`: a prompt with at most this many tokens the decode front end
    does not hold yet is prefilled there (0: always split). `secret`: the deployment's shared
    secret, sent to every front end."""

    def __init__(
        self,
        tokenizer,
        model_name: str,
        vocab_size: int,
        max_model_len: int,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        chat_template: oa.ChatTemplate | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        backend_timeout_s: float = DEFAULT_BACKEND_TIMEOUT_S,
        affinity_tokens: int = DEFAULT_AFFINITY_TOKENS,
        max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
        secret: SharedSecret | None = None,
    ):
        if backend_timeout_s <= 0 or request_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be > 0, got backend {backend_timeout_s}, request "
                f"{request_timeout_s}"
            )
        self.pools = {
            PREFILL: Backends(PREFILL, prefill_urls),
            DECODE: Backends(DECODE, decode_urls),
        }
        self.backend_timeout_s = backend_timeout_s
        if affinity_tokens < 0:
            raise ValueError(f"affinity_tokens must be >= 0, got {affinity_tokens}")
        self.affinity_tokens = affinity_tokens
        if max_local_prefill_tokens < 0:
            raise ValueError(
                f"max_local_prefill_tokens must be >= 0, got {max_local_prefill_tokens}"
            )
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.secret = secret
        self.requests: dict[str, RouterRequest] = {}
        self.router_metrics = RouterMetrics()
        super().__init__(
            tokenizer,
            model_name,
            vocab_size,
            max_model_len,
            request_timeout_s,
            ServingMetrics(
                queue_depth=lambda: 0,  # nothing waits in the router: front ends queue
                running=lambda: len(self.requests),
                failovers=lambda: 0,  # the experts are the front ends' business
                extra=lambda: self.router_metrics.rows(self.pools),
            ),
            chat_template,
            max_body_bytes,
        )
        self._ids = itertools.count()
        self._client: httpx.AsyncClient | None = None
        self._prober: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifetime
    async def start(self) -> None:
        """Opens the connection pool and starts probing suspects (on the serving loop)."""
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_KEEPALIVE
            ),
            timeout=httpx.Timeout(self.backend_timeout_s, connect=CONNECT_TIMEOUT_S),
            # every call to a front end is the deployment's (/pd/*, a local prefill's OpenAI
            # route): never the client's key
            headers=None if self.secret is None else self.secret.headers(),
        )
        self._prober = asyncio.create_task(self._probe_loop())

    async def close(self) -> None:
        tasks = [r.task for r in self.requests.values() if r.task is not None]
        if self._prober is not None:
            tasks.append(self._prober)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("Router.start() was not called (make_router_app's lifespan does)")
        return self._client

    # ------------------------------------------------------------------ the source
    def submit(self, ids: list[int], params: SamplingParams, priority: bool = False, timeout=None):
        """Starts the request's task; returns it with the queue its events arrive on.
        `priority` has no meaning here (the front ends schedule)."""
        if not params.greedy and params.seed is None:
            # a replay after a lost front end must draw the same tokens
            params = dataclasses.replace(params, seed=secrets.randbits(SEED_BITS))
        deadline = time.monotonic() + (self.request_timeout_s if timeout is None else timeout)
        req = RouterRequest(f"rt-{next(self._ids)}-{secrets.token_hex(4)}", ids, params, deadline)
        self.requests[req.id] = req
        req.task = asyncio.get_running_loop().create_task(self._run(req))
        return req, req.queue

    async def _run(self, req: RouterRequest) -> None:
        tried = {PREFILL: set(), DECODE: set()}
        last, last_phase = "no front end was tried", None
        try:
            for attempt in range(1, MAX_ATTEMPTS + 1):
                if last_phase is not None:
                    self.router_metrics.retries[last_phase] += 1
                left = req.deadline - time.monotonic()
                if left <= 0:
                    req.queue.put_nowait(
                        ErrorEvent(
                            f"deadline exceeded; last failure: {last}", 504, time.monotonic()
                        )
                    )
                    return
                key = affinity_key(req.ids, self.affinity_tokens)
                # with local prefills, prompts that share a start meet the same decode front
                # end's prefix cache too
                local = self.max_local_prefill_tokens > 0
                d = self.pools[DECODE].pick(tried[DECODE], key if local else None)
                req.new_try()
                try:
                    async with asyncio.timeout(left):
                        path = await self._where(req, d)
                        self.router_metrics.prefills[path] += 1
                        if path == SPLIT:
                            p = self.pools[PREFILL].pick(tried[PREFILL], key)
                            out = await self._try(req, f"{req.id}-{attempt}", p, d)
                        else:
                            out = await self._local(req, d)
                except TimeoutError:
                    out = _End(ErrorEvent(f"deadline exceeded ({last})", 504, time.monotonic()))
                if isinstance(out, _End):
                    if out.error is not None:
                        req.queue.put_nowait(out.error)
                    return
                last, last_phase = out.message, out.phase
                for role, b in out.blame:
                    self.pools[role].failed(b, out.message)
                for role, b in (*out.blame, *out.avoid):
                    tried[role].add(b.index)
            req.queue.put_nowait(
                ErrorEvent(
                    f"the request failed on {MAX_ATTEMPTS} tries; the last: {last}",
                    503,
                    time.monotonic(),
                )
            )
        except asyncio.CancelledError:
            raise  # the client left (or shutdown): nobody reads the queue
        except Exception as exc:  # a bug here must still end the client's request
            req.queue.put_nowait(
                ErrorEvent(f"router failed: {_describe(exc)}", 500, time.monotonic())
            )
        finally:
            self.requests.pop(req.id, None)

    async def _try(self, req: RouterRequest, handoff_id: str, p: Backend, d: Backend):
        """One try: prefill on `p` handing the KV to `d`, then decode on `d`."""
        call = PrefillCall(handoff_id, req.ids, req.params, d.url)
        where = f"prefill front end {p.url}"
        p.in_flight += 1
        try:
            r = await self.client.post(f"{p.url}/pd/prefill", json=call.to_json())
        except httpx.TimeoutException as exc:
            # silent: stuck itself, or stuck handing the KV to `d` (a stopped decode front end
            # takes no package); `p` is blamed, `d` left out of this request's next try
            why = f"{where}: {_describe(exc)}"
            return _Failure(PREFILL, why, blame=((PREFILL, p),), avoid=((DECODE, d),))
        except httpx.HTTPError as exc:
            why = f"{where}: {_describe(exc)}"
            return _Failure(PREFILL, why, blame=((PREFILL, p),))
        finally:
            p.in_flight -= 1
        if r.status_code in (401, 403):
            return _refused_secret(r, where)
        if r.status_code == 502:  # the KV did not reach `d`
            why = f"{where} could not hand the KV to {d.url}: {_error_message(r)}"
            return _Failure(PREFILL, why, blame=((DECODE, d),))
        if r.status_code in (503, 504):  # busy or slow: alive, just not for this request
            why = f"{where} answered {r.status_code}: {_error_message(r)}"
            return _Failure(PREFILL, why, avoid=((PREFILL, p),))
        if r.status_code >= 500:
            why = f"{where} answered {r.status_code}: {_error_message(r)}"
            return _Failure(PREFILL, why, blame=((PREFILL, p),))
        if r.status_code != 200:
            return _End(ErrorEvent(_error_message(r), r.status_code, time.monotonic()))
        try:
            ans = PrefillAnswer.from_json(r.content)
        except PdRequestError as exc:
            why = f"{where} answered a malformed prefill result: {exc}"
            return _Failure(PREFILL, why, blame=((PREFILL, p),))
        self.pools[PREFILL].succeeded(p)
        if ans.kv is not None:
            m = self.router_metrics
            m.handoffs += 1
            m.kv_bytes += ans.kv.bytes
            m.kv_transfer_s += ans.kv.transfer_s
        err = req.take(ans.token, ans.finish)
        if err is not None or req.finished:
            return _End(err)
        return await self._decode(req, DecodeCall.after_prefill(call, ans), p, d)

    async def _decode(self, req: RouterRequest, call: DecodeCall, p: Backend, d: Backend):
        where = f"decode front end {d.url}"
        d.in_flight += 1
        try:
            async with self.client.stream("POST", f"{d.url}/pd/decode", json=call.to_json()) as r:
                if r.status_code != 200:
                    await r.aread()
                    return self._decode_refused(r, where, p, d)
                async for line in r.aiter_lines():
                    if not line.strip():
                        continue
                    msg = parse_line(line)
                    if isinstance(msg, DecodeError):
                        if msg.status < 500:
                            return _End(ErrorEvent(msg.message, msg.status, time.monotonic()))
                        why = f"{where} failed the request: {msg.message}"
                        return _Failure(DECODE, why, blame=((DECODE, d),))
                    err = req.take(msg.token, msg.finish)
                    if err is not None:
                        return _End(err)
                    if req.finished:
                        self.pools[DECODE].succeeded(d)
                        return _End()
            why = f"{where}: the stream ended before the request finished"
            return _Failure(DECODE, why, blame=((DECODE, d),))
        except httpx.HTTPError as exc:
            return _Failure(DECODE, f"{where}: {_describe(exc)}", blame=((DECODE, d),))
        except PdRequestError as exc:
            why = f"{where} sent a malformed line: {exc}"
            return _Failure(DECODE, why, blame=((DECODE, d),))
        finally:
            d.in_flight -= 1

    def _decode_refused(self, r: httpx.Response, where: str, p: Backend, d: Backend):
        """The decode front end answered an error before its stream started."""
        if r.status_code in (401, 403):
            return _refused_secret(r, where)
        why = f"{where} answered {r.status_code}: {_error_message(r)}"
        if r.status_code == 502:  # the prefill's sender died before the KV package completed
            return _Failure(DECODE, why, blame=((PREFILL, p),))
        if r.status_code == 504:  # the package did not arrive in time: either side
            return _Failure(DECODE, why, avoid=((PREFILL, p), (DECODE, d)))
        if r.status_code == 503:  # busy: alive, not for this request
            return _Failure(DECODE, why, avoid=((DECODE, d),))
        if r.status_code >= 500:
            return _Failure(DECODE, why, blame=((DECODE, d),))
        return _End(ErrorEvent(_error_message(r), r.status_code, time.monotonic()))

    # ------------------------------------------------------------------ local prefills
    async def _where(self, req: RouterRequest, d: Backend) -> str:
        """Where this try prefills: on `d` when the prompt is short, or when `d`'s prefix
        cache holds all of it but a short tail (asked with POST /pd/cached, only for a prompt
        too long to be short and only of a front end not known to have no prefix cache);
        else on a prefill front end, with a hand-off."""
        limit = self.max_local_prefill_tokens
        if limit == 0:
            return SPLIT
        if len(req.ids) <= limit:
            return LOCAL_SHORT
        if d.prefix_cache is False:
            return SPLIT
        self.router_metrics.cached_questions += 1
        try:
            r = await self.client.post(
                f"{d.url}/pd/cached", json={"prompt": req.ids}, timeout=CACHED_QUESTION_TIMEOUT_S
            )
            answer = r.json() if r.status_code == 200 else None
            cached = answer["cached_tokens"]
            has_cache = answer["prefix_cache"]
            if type(cached) is not int or type(has_cache) is not bool:
                raise TypeError("cached_tokens must be an int and prefix_cache a bool")
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            # a busy, old or failing decode front end: split, as if nothing were cached (the
            # decode call itself finds out whether it is alive)
            return SPLIT
        d.prefix_cache = has_cache
        return LOCAL_CACHED if len(req.ids) - cached <= limit else SPLIT

    def _local_body(self, req: RouterRequest) -> dict:
        """The request as a decode front end's own OpenAI completion: token ids in, token ids
        out, streamed; the router applies stop strings and counts usage itself."""
        sp = req.params
        return {
            "model": self.model_name,
            "prompt": req.ids,
            "max_tokens": sp.max_new_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "seed": sp.seed,
            "stop_token_ids": list(sp.stop_token_ids),
            "ignore_eos": sp.ignore_eos,
            "stream": True,
            "return_token_ids": True,
        }

    async def _local(self, req: RouterRequest, d: Backend):
        """One try prefilled and decoded on `d` alone (its /v1/completions, streamed): the same
        engine path as the split's two halves, so the same tokens (greedy, and seeded: the
        router gave every sampled request its seed)."""
        where = f"decode front end {d.url}"
        d.in_flight += 1
        try:
            body = self._local_body(req)
            async with self.client.stream("POST", f"{d.url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return self._local_refused(r, where, d)
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        break
                    out = self._local_chunk(req, json.loads(data), where, d)
                    if out is not None:
                        return out
            why = f"{where}: the stream ended before the request finished"
            return _Failure(DECODE, why, blame=((DECODE, d),))
        except httpx.HTTPError as exc:
            return _Failure(DECODE, f"{where}: {_describe(exc)}", blame=((DECODE, d),))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            why = f"{where} sent a malformed stream chunk: {_describe(exc)}"
            return _Failure(DECODE, why, blame=((DECODE, d),))
        finally:
            d.in_flight -= 1

    def _local_chunk(self, req: RouterRequest, msg: dict, where: str, d: Backend):
        """One SSE chunk of a local try: its tokens go to the client (a replay's checked), an
        error ends the try. None while the request goes on."""
        if "error" in msg:
            err = msg["error"]
            status = err.get("code") if isinstance(err.get("code"), int) else 500
            if status < 500:
                return _End(ErrorEvent(str(err.get("message")), status, time.monotonic()))
            why = f"{where} failed the request: {err.get('message')}"
            return _Failure(DECODE, why, blame=((DECODE, d),))
        choice = msg["choices"][0]
        ids, finish = choice["token_ids"], choice.get("finish_reason")
        if not isinstance(ids, list) or any(type(t) is not int for t in ids):
            raise TypeError("token_ids must be a list of ints")
        for k, token in enumerate(ids):
            error = req.take(token, finish if k == len(ids) - 1 else None)
            if error is not None:
                return _End(error)
        if finish is not None and not ids:
            req.finish(str(finish))
        if req.finished:
            self.pools[DECODE].succeeded(d)
            return _End()
        return None

    def _local_refused(self, r: httpx.Response, where: str, d: Backend):
        """The decode front end refused a local try before its stream started."""
        if r.status_code in (401, 403):
            return _refused_secret(r, where)
        why = f"{where} answered {r.status_code}: {_error_message(r)}"
        if r.status_code in (503, 504):  # busy: alive, not for this request
            return _Failure(DECODE, why, avoid=((DECODE, d),))
        if r.status_code >= 500:
            return _Failure(DECODE, why, blame=((DECODE, d),))
        return _End(ErrorEvent(_error_message(r), r.status_code, time.monotonic()))

    # ------------------------------------------------------------------ health
    async def _probe(self, role: str, b: Backend) -> bool:
        try:
            r = await self.client.get(f"{b.url}/health", timeout=HEALTH_TIMEOUT_S)
            ok, why = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as exc:
            ok, why = False, f"/health: {_describe(exc)}"
        if ok:
            self.pools[role].succeeded(b)
        else:
            self.pools[role].failed(b, why)
        return ok

    async def _probe_loop(self) -> None:
        """Re-probes every suspect whose suspect time is over, all at once (a stopped one must
        not hold up the others)."""
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            now = time.monotonic()
            due = [
                (role, b)
                for role, pool in self.pools.items()
                for b in pool.backends
                if not b.healthy and b.suspect_until <= now
            ]
            if due:
                # a suspect being probed is not probed again meanwhile
                for _, b in due:
                    b.suspect_until = now + HEALTH_TIMEOUT_S
                await asyncio.gather(*(self._probe(role, b) for role, b in due))

    async def health(self) -> JSONResponse:
        """Every front end's /health, at once: ok when at least one of each role answers."""
        checks = [(role, b) for role, pool in self.pools.items() for b in pool.backends]
        await asyncio.gather(*(self._probe(role, b) for role, b in checks))
        body = {role: [b.describe() for b in self.pools[role].backends] for role in ROLES}
        missing = [role for role in ROLES if self.pools[role].num_healthy == 0]
        if missing:
            error = " and ".join(f"no {role} front end answers /health" for role in missing)
            return JSONResponse({"status": "unhealthy", "error": error, **body}, 503)
        return JSONResponse({"status": "ok", **body})


def make_router_app(router: Router, api_key: SharedSecret | None = None) -> FastAPI:
    """The router's FastAPI app: the OpenAI routes, /health and /metrics.
    ``app.state.router`` holds the :class:`Router`. With `api_key`, every route but /health
    and /metrics needs it (:mod:`moecomm_serving.api.auth`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="moecomm router", lifespan=lifespan)
    app.state.router = router
    install_access(app, Access(api_key=api_key))
    install_openai_routes(app, router)
    return app
