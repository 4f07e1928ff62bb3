"""The control plane over HTTP (EaaS Fig. 7): connect / disconnect handshakes, health, hosted
experts and Prometheus metrics. JSON only; sizes from the network are validated before anything
is allocated; nothing is unpickled. Binds 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import httpx
from fastapi import FastAPI, HTTPException
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from moecomm.auth import SharedSecret
from moecomm.errors import MoecommError

# Served from a thread of the expert server's process; the tests and benches that pair make_app
# with it import it from here.
from moecomm.http_thread import HttpServer  # noqa: F401
from moecomm.runtime.health import metrics_lines
from moecomm.runtime.registry import SESSION_BYTES, ClientIdInUseError, UnknownSessionError
from moecomm.runtime.server import MAX_SLOTS_PER_CLIENT, ExpertServer
from moecomm.runtime.server_placement import ExpertHostedError
from moecomm.runtime.weights import pull_from_peer, pull_many_from_peer
from moecomm.wire.choose import choose
from moecomm.wire.protocol import SlotLayout, as_encoding

# Bounds on connect fields: generous for real models, small enough that a bad request cannot
# make the server allocate absurd regions (the byte total is checked again by the server).
MAX_TOKENS_LIMIT = 1 << 16
MAX_HIDDEN = 1 << 16
MAX_TOPK = 64
# A nixl handle carries the agent's connection info and a remote key (about 700 characters with
# one network interface, more with several); CUDA-IPC handles are about 200, shm names far
# shorter. The bound keeps a connect body small.
MAX_HANDLE_LEN = 8192
# Names a connect may ask for: the host transports and the GPU one. A server answers a client
# of a transport it does not serve with a clear 400 instead of failing at attach time.
TRANSPORT_NAMES = ("shm", "nixl", "cuda_ipc")
HTTP_TIMEOUT_S = 10.0


class ServerUnreachableError(MoecommError, ConnectionError):
    """No answer from a server's control plane (down, stopped, wrong address), as opposed to
    an answer that refuses the request."""


class LayoutModel(BaseModel):
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    hidden: int = Field(ge=1, le=MAX_HIDDEN)
    topk: int = Field(ge=1, le=MAX_TOPK)
    encoding: str = Field(max_length=32)
    out_encoding: str = Field(max_length=32)
    max_response_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)


class ConnectModel(BaseModel):
    client_id: int = Field(ge=0, lt=1 << 63)
    client_handle: str = Field(min_length=1, max_length=MAX_HANDLE_LEN)
    layout: LayoutModel
    num_slots: int = Field(ge=1, le=MAX_SLOTS_PER_CLIENT)
    token: str = Field(default="", max_length=256)
    # Clients from before the field existed spoke shm.
    transport: str = Field(default="shm", max_length=32)
    # The secret of this client's previous session with the server, when it reconnects.
    session: str = Field(default="", max_length=2 * SESSION_BYTES)
    # cuda_ipc: where the server's response ring starts in the client's region (one region
    # holds the rings of all the client's servers).
    response_ring_offset: int = Field(default=0, ge=0, lt=1 << 40)
    # The handle of the client's placement epoch word (server_placement.EpochWord): the server
    # pushes every epoch change into it. Clients from before the field existed read ours.
    placement_word: str = Field(default="", max_length=MAX_HANDLE_LEN)


class JoinModel(BaseModel):
    member_id: str = Field(min_length=1, max_length=128)
    token: str = Field(default="", max_length=256)


class TokenModel(BaseModel):
    token: str = Field(default="", max_length=256)


class ExpertModel(BaseModel):
    layer: int = Field(ge=0, lt=1 << 20)
    expert: int = Field(ge=0, lt=1 << 20)
    token: str = Field(default="", max_length=256)
    # The transport the reader speaks (an export); "" for the server's first one.
    transport: str = Field(default="", max_length=32)


class LoadModel(ExpertModel):
    # "checkpoint": the server's own weight source; "peer": pulled from the server at `peer`.
    source: str = Field(default="checkpoint", pattern="^(checkpoint|peer)$")
    peer: str = Field(default="", max_length=512)


# A batch of placement changes names at most this many experts: more than any server hosts,
# few enough that a bad request cannot make the server allocate without bound.
MAX_BATCH_EXPERTS = 4096


class ExpertRefModel(BaseModel):
    layer: int = Field(ge=0, lt=1 << 20)
    expert: int = Field(ge=0, lt=1 << 20)


class LoadRefModel(ExpertRefModel):
    source: str = Field(default="checkpoint", pattern="^(checkpoint|peer)$")
    peer: str = Field(default="", max_length=512)


class ExpertsModel(BaseModel):
    experts: list[ExpertRefModel] = Field(min_length=1, max_length=MAX_BATCH_EXPERTS)
    token: str = Field(default="", max_length=256)
    transport: str = Field(default="", max_length=32)


class LoadBatchModel(BaseModel):
    experts: list[LoadRefModel] = Field(min_length=1, max_length=MAX_BATCH_EXPERTS)
    token: str = Field(default="", max_length=256)


class ReleaseModel(BaseModel):
    export_id: str = Field(max_length=64)
    token: str = Field(default="", max_length=256)


class DisconnectModel(BaseModel):
    client_id: int = Field(ge=0, lt=1 << 63)
    token: str = Field(default="", max_length=256)
    # Set: frees the connection only if it is still this session's (a client that lost the id
    # to its own restart must not free its successor's slots).
    session: str | None = Field(default=None, max_length=2 * SESSION_BYTES)


def _mixed_hint(asked: str, offered: list[str]) -> str:
    """Why a host client and a GPU server (or the reverse) cannot talk: slots live in host
    memory on one side and GPU memory on the other, and nothing converts between them."""
    if asked == "cuda_ipc":
        return " (a device client needs an expert server started with --device cuda)"
    if offered == ["cuda_ipc"]:
        return (
            " (this is a GPU expert server, --device cuda: connect with a DeviceClient, e.g. "
            "`moecomm frontend --device cuda`)"
        )
    return ""


def make_app(server: ExpertServer, token: str = "") -> FastAPI:
    """The HTTP face of `server`. `token`, when set, must accompany connects and disconnects."""
    app = FastAPI(title=f"moecomm expert server {server.server_id}")
    table_reads = [0]  # GET /experts answered (a list: the handlers below add to it)

    secret = SharedSecret(token, "control-plane token") if token else None

    def authorize(given: str) -> None:
        if secret is not None and not secret.matches(given):
            raise HTTPException(status_code=401, detail="bad or missing token")

    @app.post("/connect")
    def connect(body: ConnectModel):
        authorize(body.token)
        offered = server.served_transports()
        served = ", ".join(offered)
        if body.transport not in offered:
            known = body.transport in TRANSPORT_NAMES
            raise HTTPException(
                status_code=400,
                detail=f"this server serves over {served}; it cannot serve a "
                + (
                    f"{body.transport!r} client{_mixed_hint(body.transport, offered)}"
                    if known
                    else f"client of unknown transport "
                    f"{body.transport[:32]!r} (known: {', '.join(TRANSPORT_NAMES)})"
                ),
            )
        try:
            layout = SlotLayout(
                body.layout.max_tokens,
                body.layout.hidden,
                body.layout.topk,
                as_encoding(body.layout.encoding),
                as_encoding(body.layout.out_encoding),
                body.layout.max_response_tokens,
            )
            return server.connect(
                body.client_id,
                body.client_handle,
                layout,
                body.num_slots,
                body.session,
                transport=body.transport,
                response_ring_offset=body.response_ring_offset,
                placement_word=body.placement_word,
            )
        except ClientIdInUseError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        except FileNotFoundError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from exc
        except (ValueError, MoecommError) as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc

    @app.post("/nvshmem/join")
    def nvshmem_join(body: JoinModel):
        """A rank in this server's NVSHMEM job (runtime/nvshmem_job.py)."""
        authorize(body.token)
        job = getattr(server, "nvshmem_job", None)
        if job is None:
            raise HTTPException(status_code=404, detail="this server runs no NVSHMEM job")
        try:
            return job.join(body.member_id)
        except (ValueError, MoecommError) as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc

    @app.get("/nvshmem")
    def nvshmem_state():
        job = getattr(server, "nvshmem_job", None)
        if job is None:
            raise HTTPException(status_code=404, detail="this server runs no NVSHMEM job")
        return job.describe()

    @app.get("/transports")
    def transports():
        """What a client needs to pick its transport (wire/choose.py). Holds no
        secret: the NIXL connection info travels in the token-checked connect."""
        return server.offer()

    @app.post("/disconnect")
    def disconnect(body: DisconnectModel):
        authorize(body.token)
        try:
            return {"disconnected": server.disconnect(body.client_id, body.session)}
        except UnknownSessionError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc

    @app.post("/drain")
    def drain(body: TokenModel):
        authorize(body.token)
        server.drain()
        return {"draining": True, "server_id": server.server_id}

    @app.get("/health")
    def health():
        result = server.health_check()
        if not result["ok"]:
            raise HTTPException(status_code=503, detail=result)
        return {
            **result,
            "server_id": server.server_id,
            "clients": server.num_clients,
            "draining": server.draining,
        }

    @app.get("/experts")
    def experts(client_id: int | None = None, load: bool = True):
        """The placement table (local index -> expert, -1: do not use) with its epoch and the
        per-expert load, and whether the server has a checkpoint to load experts from. A client
        that passes its id acks the epoch (see ServerPlacement)."""
        counts = [
            {"layer": layer, "expert": expert, "tokens": n}
            for (layer, expert), n in sorted(server.stats.expert_load.items())
            if load
        ]
        table_reads[0] += 1
        table = server.placement.describe(client_id)
        return {
            "server_id": server.server_id,
            "hidden": server.hidden,
            "checkpoint": server.weight_source is not None,
            **table,
            "load": counts,
        }

    @app.post("/experts/load")
    def load_expert(body: LoadModel):
        """Hosts one more expert, its weights read from the checkpoint or pulled from a peer
        over the transport; clients route to it from their next dispatch."""
        authorize(body.token)
        start = time.perf_counter()
        try:
            weights = None
            if body.source == "peer":
                if not body.peer.startswith(("http://", "https://")):
                    raise ValueError(f"source=peer needs the peer's control URL, got {body.peer!r}")
                # Over the transport the two servers share: shm on one host, nixl across hosts.
                name = choose(server.transports, http_transports(body.peer), body.peer)
                weights = pull_from_peer(
                    server.transports.get(name),
                    body.peer,
                    body.layer,
                    body.expert,
                    token,
                    HTTP_TIMEOUT_S,
                )
            out = server.load_expert(body.layer, body.expert, weights)
        except ExpertHostedError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        except (ValueError, KeyError, RuntimeError, OSError, MoecommError, httpx.HTTPError) as exc:
            raise HTTPException(status_code=400, detail=f"{type(exc).__name__}: {exc}") from exc
        return {**out, "source": body.source, "seconds": time.perf_counter() - start}

    @app.post("/experts/load_batch")
    def load_experts(body: LoadBatchModel):
        """Hosts several experts at once: the peer-sourced ones pulled in one export per peer,
        the rest read from the checkpoint, every layer rebuilt once and the table published in
        one epoch. All or nothing: a failure loads none of them."""
        authorize(body.token)
        start = time.perf_counter()
        try:
            by_peer: dict[str, list[tuple[int, int]]] = {}
            for x in body.experts:
                if x.source == "peer":
                    if not x.peer.startswith(("http://", "https://")):
                        raise ValueError(
                            f"source=peer needs the peer's control URL, got {x.peer!r}"
                        )
                    by_peer.setdefault(x.peer, []).append((x.layer, x.expert))
            pulled = {}
            for peer, refs in by_peer.items():
                name = choose(server.transports, http_transports(peer), peer)
                ws = pull_many_from_peer(
                    server.transports.get(name), peer, refs, token, HTTP_TIMEOUT_S
                )
                pulled.update(zip(refs, ws, strict=True))
            pull_s = time.perf_counter() - start
            items = [(x.layer, x.expert, pulled.get((x.layer, x.expert))) for x in body.experts]
            out = server.load_experts(items)
        except ExpertHostedError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        except (ValueError, KeyError, RuntimeError, OSError, MoecommError, httpx.HTTPError) as exc:
            raise HTTPException(status_code=400, detail=f"{type(exc).__name__}: {exc}") from exc
        sources = {}
        for x in body.experts:
            sources[x.source] = sources.get(x.source, 0) + 1
        return {
            **out,
            "sources": sources,
            "pull_seconds": pull_s,
            "seconds": time.perf_counter() - start,
        }

    @app.post("/experts/unload_batch")
    def unload_experts(body: ExpertsModel):
        """Stops publishing several experts in one epoch; freed once no client routes to them."""
        authorize(body.token)
        try:
            return server.unload_experts([(x.layer, x.expert) for x in body.experts])
        except KeyError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from exc

    @app.post("/experts/export_batch")
    def export_experts(body: ExpertsModel):
        authorize(body.token)
        try:
            refs = [(x.layer, x.expert) for x in body.experts]
            return server.export_experts(refs, body.transport or None)
        except KeyError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from exc
        except RuntimeError as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from exc

    @app.post("/experts/unload")
    def unload_expert(body: ExpertModel):
        """Stops publishing one expert; it is freed once no client can route to it."""
        authorize(body.token)
        try:
            return server.unload_expert(body.layer, body.expert)
        except KeyError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from exc

    @app.post("/experts/export")
    def export_expert(body: ExpertModel):
        authorize(body.token)
        try:
            return server.export_expert(body.layer, body.expert, body.transport or None)
        except KeyError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from exc
        except RuntimeError as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from exc

    @app.post("/experts/export/release")
    def release_export(body: ReleaseModel):
        authorize(body.token)
        return {"released": server.exports.release(body.export_id)}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics():
        lines = metrics_lines(server.server_id, server.stats, server.health, server.num_clients)
        # GET /experts answered: what a placement controller's watch costs this server.
        lines.append("# TYPE moecomm_server_table_reads_total counter")
        lines.append(
            f'moecomm_server_table_reads_total{{server="{server.server_id}"}} {table_reads[0]}'
        )
        return "\n".join(lines) + "\n"

    return app


def http_connect(
    url: str,
    client_id: int,
    client_handle: str,
    layout: SlotLayout,
    num_slots: int,
    token: str = "",
    timeout: float = HTTP_TIMEOUT_S,
    transport: str = "shm",
    session: str = "",
    extra: dict | None = None,
) -> dict:
    """Client side of the connect handshake. `transport` names where the client's response
    slots live (the server must use the same one); `session` is the secret of a previous
    connection to this server, when reconnecting. Raises ClientIdInUseError when another live
    client holds `client_id` there, ConnectionError naming the server otherwise."""
    body = {
        "client_id": client_id,
        "client_handle": client_handle,
        "layout": layout.to_dict(),
        "num_slots": num_slots,
        "token": token,
        "transport": transport,
        "session": session,
        **(extra or {}),
    }
    try:
        r = httpx.post(f"{url}/connect", json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"connect to {url} failed: {exc}") from exc
    if r.status_code == 409:
        raise ClientIdInUseError(f"connect to {url} refused: {_detail(r)}")
    if r.status_code != 200:
        raise ConnectionError(f"connect to {url} refused ({r.status_code}): {r.text}")
    return r.json()


def http_transports(url: str, timeout: float = HTTP_TIMEOUT_S) -> dict:
    """What the server at `url` offers (GET /transports); a server from before the route
    offers shm only."""
    try:
        r = httpx.get(f"{url}/transports", timeout=timeout)
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"{url}/transports failed: {exc}") from exc
    if r.status_code == 404:
        return {"transports": ["shm"]}
    if r.status_code != 200:
        raise ConnectionError(f"{url}/transports refused ({r.status_code}): {r.text}")
    return r.json()


def _detail(r: httpx.Response) -> str:
    try:
        return str(r.json()["detail"])
    except (ValueError, KeyError, TypeError):
        return r.text


_placement_http: tuple[int, httpx.Client] | None = None
_placement_http_lock = threading.Lock()


def _placement_client() -> httpx.Client:
    """One HTTP client per process for table fetches, keeping its connections: a fresh client
    per request costs ~25 ms of CPU (its TLS context), and a re-placement makes every client
    fetch a table from each server it changed, between two micro-batches."""
    global _placement_http
    with _placement_http_lock:
        if _placement_http is None or _placement_http[0] != os.getpid():  # not a forked copy
            _placement_http = (os.getpid(), httpx.Client())
        return _placement_http[1]


def http_placement(url: str, client_id: int, timeout: float = HTTP_TIMEOUT_S) -> dict:
    """A server's placement table and epoch, fetched by a client (which acks the epoch)."""
    try:
        r = _placement_client().get(
            f"{url}/experts", params={"client_id": client_id, "load": False}, timeout=timeout
        )
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"placement of {url}: {exc}") from exc
    if r.status_code != 200:
        raise ConnectionError(f"placement of {url} refused ({r.status_code}): {r.text}")
    return r.json()


def http_health(url: str, timeout: float = HTTP_TIMEOUT_S) -> bool:
    """True when the server's /health (a real forward pass) answers 200 within `timeout`."""
    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def http_disconnect(
    url: str,
    client_id: int,
    token: str = "",
    timeout: float = HTTP_TIMEOUT_S,
    session: str | None = None,
) -> None:
    body = {"client_id": client_id, "token": token, "session": session}
    # A server that cannot be reached is gone, and its slots went with it.
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"{url}/disconnect", json=body, timeout=timeout)
