"""The embedded monitor: an HTTP service that tracks heartbeats and pushes join/loss events.

Run it as a process (`python -m moecomm.membership.monitor --port 7000`, later `moecomm
monitor`) or in a thread (`MonitorServer(...).start()`). All state lives in one asyncio event
loop, so handlers need no locks; watchers long-poll GET /events and are answered the moment an
event happens. Nothing is persisted: a restarted monitor starts empty under a new epoch, and
members come back by themselves (their next heartbeat is refused, so they register again).
Binds 127.0.0.1 unless told otherwise; an optional shared token guards every route but /health.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
from typing import Annotated

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from moecomm.auth import SecretError, SharedSecret, is_loopback, read_secret_file
from moecomm.http_thread import DEFAULT_HOST, START_TIMEOUT_S, STOP_TIMEOUT_S, HttpServer
from moecomm.membership import member as m
from moecomm.membership.base import TOKEN_ENV, monitor_token
from moecomm.membership.member import Member, Record, SupersededError
from moecomm.membership.registry import Registry, RegistryFullError, UnknownMemberError
from moecomm.readiness import announce_ready

log = logging.getLogger("moecomm.membership.monitor")

# A register request with every field at its bound is ~1.5 MB of JSON; nothing legitimate is
# larger, and the body is refused before it is read.
MAX_BODY_BYTES = 2 << 20
# Longest long-poll a watcher may ask for: bounds how long a handler holds a connection.
MAX_POLL_S = 30.0
# Expiry sweep period: the slack added to a TTL before a silent member is reported lost.
EXPIRY_SWEEP_S = 0.05
# A sweep this much later than planned means the monitor itself did not run (SIGSTOP, swapped
# out, a starved loop): heartbeats sent meanwhile wait unread in its sockets and would be read
# only after the sweep expired their senders. That time is credited to every lease instead, as
# etcd extends every lease when a new leader takes over: a member is never evicted for the
# monitor's own absence, and one that died is reported that much later. Ten sweeps: far above
# a sweep's jitter; a loop starved that long on a loaded machine is credited too, rightly.
STALL_S = 0.5
# Long-polls still open at shutdown are cut after this, so a stop never waits a full poll.
SHUTDOWN_GRACE_S = 0.5
# How often the monitor process checks that its server thread still runs.
LIVENESS_CHECK_S = 1.0
# Leases one POST /heartbeats renews, records one POST /registers adds: a process hosting this
# many members splits its batch (a heartbeat item is ~100 bytes: 8,192 stay under 1 MiB).
MAX_BATCH_ITEMS = 8192
# The routes counted in /health's "requests" (anything else is counted as "other"): what a
# scale test divides by members and seconds to get each member's control-plane request rate.
COUNTED_ROUTES = (
    "/register",
    "/registers",
    "/heartbeat",
    "/heartbeats",
    "/deregister",
    "/members",
    "/events",
    "/health",
)

RoleStr = Annotated[str, Field(pattern=m.ROLE_RE.pattern)]
MemberIdStr = Annotated[str, Field(pattern=m.MEMBER_ID_RE.pattern)]
IncarnationStr = Annotated[str, Field(min_length=1, max_length=m.MAX_INCARNATION)]


class MemberModel(BaseModel):
    role: RoleStr
    member_id: MemberIdStr
    endpoints: dict[
        Annotated[str, Field(max_length=m.MAX_ENDPOINT_NAME)],
        Annotated[str, Field(max_length=m.MAX_ENDPOINT_URL)],
    ] = Field(default_factory=dict, max_length=m.MAX_ENDPOINTS)
    experts: dict[int, Annotated[list[int], Field(max_length=m.MAX_HOSTED_EXPERTS)]] = Field(
        default_factory=dict, max_length=m.MAX_LAYERS
    )
    metadata: dict[
        Annotated[str, Field(max_length=m.MAX_METADATA_KEY)],
        Annotated[str, Field(max_length=m.MAX_METADATA_VALUE)],
    ] = Field(default_factory=dict, max_length=m.MAX_METADATA_ITEMS)


class RegisterModel(BaseModel):
    member: MemberModel
    ttl: float = Field(ge=m.MIN_TTL_S, le=m.MAX_TTL_S)
    incarnation: IncarnationStr


class LeaseModel(BaseModel):
    role: RoleStr
    member_id: MemberIdStr
    incarnation: IncarnationStr


class LeasesModel(BaseModel):
    """POST /heartbeats: the leases of many members (one process's), renewed in one request."""

    leases: list[LeaseModel] = Field(max_length=MAX_BATCH_ITEMS)


class RegistersModel(BaseModel):
    """POST /registers: many members registered (or re-registered) in one request."""

    records: list[RegisterModel] = Field(max_length=MAX_BATCH_ITEMS)


def status_of(exc: Exception) -> int:
    """The HTTP status a registry error is answered with, alone or as one item of a batch."""
    if isinstance(exc, UnknownMemberError):
        return 404
    if isinstance(exc, SupersededError):
        return 409
    if isinstance(exc, RegistryFullError):
        return 507
    if isinstance(exc, ValueError):
        return 422
    raise exc


def make_app(token: str = "") -> FastAPI:
    """The monitor's HTTP API (see docs/membership.md). `token`, when set, must come as
    `Authorization: Bearer <token>` on every route but /health."""
    registry = Registry()
    changed: asyncio.Condition | None = None

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        nonlocal changed
        changed = asyncio.Condition()
        sweeper = asyncio.create_task(sweep())
        yield
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper

    async def notify() -> None:
        async with changed:
            changed.notify_all()

    async def sweep() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(EXPIRY_SWEEP_S)
            now = time.monotonic()
            stalled = now - last - EXPIRY_SWEEP_S
            last = now
            if stalled > STALL_S:
                registry.extend(stalled)
                log.warning("the monitor did not run for %.2f s: every lease extended", stalled)
            if registry.expire(now):
                await notify()

    guard = SharedSecret(token, "monitor token") if token else None
    app = FastAPI(title="moecomm monitor", lifespan=lifespan)
    app.state.registry = registry
    requests = dict.fromkeys((*COUNTED_ROUTES, "other"), 0)

    class Guard:
        """Counts every request, then refuses, before anything is parsed, a bad token (an
        unauthenticated caller learns nothing about the API) and a POST without an acceptable
        Content-Length. Plain ASGI, not an `@app.middleware`: that wrapper costs about as much
        as a heartbeat's own handling, and a monitor of 10,000 members answers thousands a
        second."""

        def __init__(self, inner) -> None:
            self.inner = inner

        async def __call__(self, scope, receive, send) -> None:
            inner = self.inner
            if scope["type"] != "http":
                return await inner(scope, receive, send)
            path = scope["path"]
            requests[path if path in requests else "other"] += 1
            headers = dict(scope["headers"])
            refusal = None
            bearer = headers.get(b"authorization")
            if guard is not None and path != "/health" and not guard.matches_bearer(bearer):
                refusal = JSONResponse({"detail": "bad or missing monitor token"}, 401)
            if refusal is None and scope["method"] == "POST":
                length = headers.get(b"content-length", b"").decode("latin-1")
                if not length.isdigit():
                    refusal = JSONResponse({"detail": "a Content-Length header is required"}, 411)
                elif int(length) > MAX_BODY_BYTES:
                    refusal = JSONResponse(
                        {"detail": f"body of {length} bytes exceeds {MAX_BODY_BYTES}"}, 413
                    )
            if refusal is not None:
                return await refusal(scope, receive, send)
            return await inner(scope, receive, send)

    app.add_middleware(Guard)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError):
        # One line per problem, naming the field: readable in a client's exception message.
        problems = [
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}"
            for e in exc.errors()
        ]
        return JSONResponse({"detail": "invalid request: " + "; ".join(problems)}, 422)

    def detail(exc: Exception) -> str:
        # KeyError's str() quotes its message; the others say it plainly.
        return str(exc.args[0]) if isinstance(exc, UnknownMemberError) else str(exc)

    def held(call, *args):
        try:
            return call(*args)
        except (UnknownMemberError, SupersededError) as exc:
            raise HTTPException(status_code=status_of(exc), detail=detail(exc)) from None

    def add(body: RegisterModel, now: float) -> str:
        """Registers one record; raises ValueError (invalid member) or RegistryFullError."""
        try:
            member = Member(**body.member.model_dump())
        except ValueError as exc:
            raise ValueError(f"invalid member: {exc}") from None
        return registry.register(Record(member, body.ttl, body.incarnation), now)

    @app.post("/register")
    async def register(body: RegisterModel):
        try:
            kind = add(body, time.monotonic())
        except (ValueError, RegistryFullError) as exc:
            raise HTTPException(status_code=status_of(exc), detail=str(exc)) from None
        if kind:
            await notify()
        return {"epoch": registry.epoch, "ttl": body.ttl, "event": kind}

    @app.post("/registers")
    async def registers(body: RegistersModel):
        """Each record as POST /register would; one answer per record, in order: {"status":
        200, "ttl", "event"} or {"status": 422|507, "detail"}. Watchers are woken once."""
        now = time.monotonic()
        results, changed_any = [], False
        for item in body.records:
            try:
                kind = add(item, now)
            except (ValueError, RegistryFullError) as exc:
                results.append({"status": status_of(exc), "detail": str(exc)})
                continue
            changed_any = changed_any or bool(kind)
            results.append({"status": 200, "ttl": item.ttl, "event": kind})
        if changed_any:
            await notify()
        return JSONResponse({"epoch": registry.epoch, "results": results})

    @app.post("/heartbeat")
    async def heartbeat(body: LeaseModel):
        key = (body.role, body.member_id)
        ttl = held(registry.heartbeat, key, body.incarnation, time.monotonic())
        return {"epoch": registry.epoch, "ttl": ttl}

    @app.post("/heartbeats")
    async def heartbeats(body: LeasesModel):
        """Each lease as POST /heartbeat would; one answer per lease, in order: {"status": 200,
        "ttl"} or {"status": 404|409, "detail"}."""
        leases = [((b.role, b.member_id), b.incarnation) for b in body.leases]
        results = [
            {"status": 200, "ttl": r}
            if isinstance(r, float)
            else {"status": status_of(r), "detail": detail(r)}
            for r in registry.heartbeat_many(leases, time.monotonic())
        ]
        return JSONResponse({"epoch": registry.epoch, "results": results})

    @app.post("/deregister")
    async def deregister(body: LeaseModel):
        held(registry.deregister, (body.role, body.member_id), body.incarnation)
        await notify()
        return {"epoch": registry.epoch}

    @app.get("/members")
    async def members(
        role: Annotated[str | None, Query(pattern=m.ROLE_RE.pattern)] = None,
    ):
        return JSONResponse(
            {
                "epoch": registry.epoch,
                "seq": registry.seq,
                "members": registry.records(role, time.monotonic()),
            }
        )

    @app.get("/events")
    async def events(
        since: Annotated[int, Query(ge=0)],
        epoch: Annotated[str, Query(max_length=64)] = "",
        timeout: Annotated[float, Query(ge=0, le=MAX_POLL_S)] = 0.0,
        role: Annotated[str | None, Query(pattern=m.ROLE_RE.pattern)] = None,
    ):
        """Events after `since` (of members of `role` only, when given); waits up to `timeout`
        s for one. A watcher of another epoch (restarted monitor) or too far behind gets
        `resync: true` and a full member list (of `role`). `seq` always counts every event."""
        if epoch == registry.epoch:
            async with changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait_for(lambda: registry.seq != since), timeout)
            evs = registry.events_since(since)
        else:
            evs = None
        if evs is None:
            return JSONResponse(
                {
                    "epoch": registry.epoch,
                    "seq": registry.seq,
                    "resync": True,
                    "members": registry.records(role, time.monotonic()),
                }
            )
        if role is not None:
            # Filtered here, not by each watcher: a change to 3,000 servers is not sent to
            # every watcher of clients.
            evs = [e for e in evs if e["member"]["role"] == role]
        return JSONResponse({"epoch": registry.epoch, "seq": registry.seq, "events": evs})

    @app.get("/health")
    async def health():
        return {
            "ok": True,
            "epoch": registry.epoch,
            "members": len(registry),
            "seq": registry.seq,
            "requests": dict(requests),
        }

    return app


class MonitorServer:
    """The monitor served by uvicorn from a background thread."""

    def __init__(self, host: str = DEFAULT_HOST, port: int = 0, token: str = ""):
        if not is_loopback(host) and not token:
            log.warning("monitor on %s without a token: anyone who can reach it can register", host)
        self.app = make_app(token)
        self._http = HttpServer(
            self.app,
            host,
            port,
            what="the membership monitor (port in use?)",
            thread_name="moecomm-monitor",
            graceful_shutdown_s=SHUTDOWN_GRACE_S,
        )
        self.url = ""

    @property
    def epoch(self) -> str:
        return self.app.state.registry.epoch

    @property
    def alive(self) -> bool:
        return self._http.alive

    def start(self, timeout: float = START_TIMEOUT_S) -> str:
        self.url = self._http.start(timeout)
        return self.url

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self._http.stop(timeout)

    def __enter__(self) -> MonitorServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the monitor process (`moecomm monitor` and ``python -m
    moecomm.membership.monitor``), read by :func:`run`."""
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=0, help="port (0: any free one)")
    parser.add_argument(
        "--token-file", help=f"file holding the shared token (or set ${TOKEN_ENV}; not argv)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moecomm monitor", description="membership monitor: heartbeats, joins and losses"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Serves until SIGTERM or SIGINT; prints the URL alone on the first stdout line."""
    token = monitor_token()
    if args.token_file:
        try:
            token = read_secret_file(args.token_file, "moecomm monitor --token-file")
        except SecretError as exc:
            raise SystemExit(str(exc)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = MonitorServer(args.host, args.port, token)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        url = server.start()
    except RuntimeError as exc:
        print(f"moecomm monitor: {exc}", file=sys.stderr)
        return 1
    # The first stdout line is the URL alone, for people and shell scripts; starters that wait
    # for it read the ready file (moecomm.readiness).
    print(url, flush=True)
    announce_ready("monitor", url=url)
    while not stop.wait(LIVENESS_CHECK_S):
        if not server.alive:
            print("moecomm monitor: the HTTP server stopped", file=sys.stderr)
            return 1
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
