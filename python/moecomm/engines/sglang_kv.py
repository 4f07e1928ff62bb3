"""SGLang's PD-disaggregation transfer backend on moecomm's KV block transfer.

SGLang moves a request's KV cache from a prefill server to a decode server through a transfer
backend chosen by ``--disaggregation-transfer-backend``: a manager per scheduler rank (built
from ``KVArgs``: the data pointers, byte lengths and per-page byte lengths of its KV buffers and
of its metadata ("aux") buffers), a sender per request on the prefill, a receiver per request on
the decode, and a bootstrap server on the prefill through which the two find each other
(``sglang/srt/disaggregation/base/conn.py``). This module is that backend, named ``moecomm``,
over :mod:`moecomm.wire.kv`:

- each side registers its KV buffers as one :class:`~moecomm.wire.kv.KvPool` (one "layer" of
  ``[pages, page bytes]`` per SGLang buffer: K and V of every layer, draft layers, in SGLang's
  order) and its metadata buffers as a second pool (one row per request slot);
- the decode's receiver reserves its destination pages and metadata row
  (:meth:`~moecomm.wire.kv.KvPeer.expect`) and posts the two transfer requests to the prefill
  rank it found through the bootstrap server; the prefill's sender writes each chunk SGLang hands
  it straight into the decode's pages (one copy per contiguous run), then the metadata row, then
  sets the completion word; the receiver's ``poll()`` reads the words, and the sender's
  liveness, without waiting.

SGLang owns its KV memory and passes raw pointers: the pools register SGLang's own buffers
(``KvPool(..., tensors=...)``), so the prefill's pages are written straight into the decode's
buffers (on one host, ``process_vm_writev``: each KV byte copied once, no staging buffer), and
only the completion words live in moecomm's shared memory.

What it takes: host memory (``--device cpu`` KV pools; CUDA pointers are refused with a clear
error), equal attention-TP on both sides (decode rank r reads prefill rank r), no pipeline
parallelism on the prefill, no hybrid state pools (Mamba, SWA, DSA: refused by name), no host
(HiCache) destinations. Failures are SGLang's: ``poll()`` answers ``KVPoll.Failed`` and
``failure_exception()`` raises the moecomm error of the cause, carrying the
``bootstrap_room``, ``failure_reason`` and ``is_from_another_rank`` SGLang's queues read:
``PeerLostError`` (the peer process died, or cannot be reached), ``BlockTransferError`` (pages
out of range, layouts that differ; on the decode the prefill's refusal arrives as
``RemoteError`` with its reason), ``DeadlineExceededError``
(``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` / ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``).

Registration: SGLang 0.5.23 resolves the backend name three times: its CLI choices (a list
extended through ``add_disagg_transfer_backend_choices``), the ``TransferBackend`` enum and the
if/elif of ``get_kv_class``. :func:`register` does all three; see its docstring for which are
official hooks. It is also SGLang's plug-in entry point (``sglang.srt.plugins`` group in
moecomm's package metadata), so every SGLang process that loads plug-ins registers it.

This module imports SGLang at import time; ``moecomm`` never imports it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)

from moecomm.errors import (
    DeadlineExceededError,
    MoecommError,
    PeerLostError,
    ProtocolError,
    RemoteError,
)
from moecomm.http_thread import HttpServer
from moecomm.wire.kv import (
    BlockTransferError,
    KvLayout,
    KvPart,
    KvPeer,
    KvPool,
    KvPoolInfo,
    KvRecv,
    KvState,
    KvTransferRequest,
)
from moecomm.wire.shm import ShmTransport

log = logging.getLogger("moecomm.engines.sglang_kv")

BACKEND_NAME = "moecomm"
# The TransferBackend member SGLang's code would name it by (TransferBackend.MOECOMM).
ENUM_MEMBER = "MOECOMM"
# One request on loopback to the bootstrap server or a prefill rank: milliseconds; this bounds a
# peer that accepted the connection and stopped answering.
HTTP_TIMEOUT_S = 5.0
# How long a prefill rank keeps retrying its registration: the bootstrap server starts in the
# prefill's main process, which may come up after a scheduler rank (SGLang's own backends retry
# for about a minute too).
REGISTER_DEADLINE_S = 60.0
REGISTER_RETRY_S = 0.1
# SGLang's defaults for its two deadlines (sglang/srt/environ.py), used when its env is unset.
DEFAULT_BOOTSTRAP_TIMEOUT_S = 300.0
DEFAULT_WAITING_TIMEOUT_S = 300.0
# The routes, on the bootstrap server and on each prefill rank's listener.
ROUTE_PREFILL = "/moecomm/prefill"  # PUT: a prefill rank registers; GET: a decode rank asks
ROUTE_TRANSFER = "/moecomm/transfer"  # POST (prefill rank): a decode's requests for one room
# The deployment's shared secret: when set (the same value in every prefill and decode process),
# the bootstrap server and the prefill ranks' listeners answer only requests carrying it
# (``Authorization: Bearer``); a bootstrap server on a non-loopback address refuses to start
# without it.
SECRET_ENV = "MOECOMM_SGLANG_KV_TOKEN"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def deployment_token() -> str | None:
    """The shared secret from MOECOMM_SGLANG_KV_TOKEN (None: unset or empty)."""
    return os.environ.get(SECRET_ENV) or None


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------


def register() -> None:
    """Makes ``--disaggregation-transfer-backend moecomm`` work in this process (idempotent).

    1. SGLang's CLI choices: ``add_disagg_transfer_backend_choices(["moecomm"])`` — SGLang's
       own registration call.
    2. ``TransferBackend("moecomm")``: the enum has no registration hook, so a member
       ``MOECOMM`` is added to the existing class (:func:`_add_enum_member`: the member maps
       ``_member_map_`` / ``_value2member_map_`` use, checked after). A monkey-patch, stated as
       one; it keeps every existing member and the class's identity.
    3. ``get_kv_class(TransferBackend.MOECOMM, ...)``: SGLang's plug-in hook registry
       (``sglang.srt.plugins.hook_registry.HookRegistry``, an AROUND hook on
       ``sglang.srt.disaggregation.utils.get_kv_class``); SGLang applies it and rebinds every
       module that imported the function by name (prefill.py, decode.py, disagg_service.py).
       Outside SGLang's plug-in loading the hooks are applied here.

    SGLang runs it in every process that loads plug-ins (the entry point ``moecomm`` of the
    ``sglang.srt.plugins`` group): ``sglang.launch_server`` and ``sglang.Engine`` load them
    before they parse arguments, the scheduler processes at their start. Without the installed
    entry point, ``python -m moecomm.engines.sglang_kv <sglang.launch_server args>`` registers
    first and then runs SGLang's launcher.
    """
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import (
        HookRegistry,
        HookType,
        _current_plugin_source,
    )

    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    _add_enum_member(TransferBackend, ENUM_MEMBER, BACKEND_NAME)
    target = "sglang.srt.disaggregation.utils.get_kv_class"
    global _hook_registered
    if not _hook_registered:
        HookRegistry.register(target, _get_kv_class_hook, HookType.AROUND)
        _hook_registered = True
    if _current_plugin_source.get() is not None:
        return  # inside SGLang's load_plugins(): it applies the hooks when every plug-in ran
    HookRegistry.apply_hooks()
    check_registered()


_hook_registered = False


def check_registered() -> None:
    """Raises RuntimeError unless SGLang's own lookups answer the moecomm backend (say, a hook
    of another plug-in on ``get_kv_class`` was applied before this one was registered)."""
    from sglang.srt.disaggregation import utils

    backend = utils.TransferBackend(BACKEND_NAME)
    if utils.get_kv_class(backend, utils.KVClassType.MANAGER) is not MoecommKVManager:
        raise RuntimeError(
            "moecomm SGLang backend: sglang.srt.disaggregation.utils.get_kv_class does not "
            "answer it (was get_kv_class hooked and applied before moecomm registered?)"
        )


def _add_enum_member(enum_cls, name: str, value: str) -> None:
    """Adds member `name` = `value` to an existing Enum class (no-op when present)."""
    if value in enum_cls._value2member_map_:
        return
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member.__init__(value)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    type.__setattr__(enum_cls, name, member)
    if enum_cls(value) is not member or getattr(enum_cls, name) is not member:
        raise RuntimeError(
            f"moecomm could not add {enum_cls.__name__}.{name} on this Python's enum "
            "implementation: the SGLang backend cannot be registered"
        )


def _get_kv_class_hook(original, transfer_backend, class_type):
    """SGLang's ``get_kv_class``, answering the moecomm backend's classes."""
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND_NAME:
        return original(transfer_backend, class_type)
    from sglang.srt.disaggregation.utils import KVClassType

    return {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: MoecommKVManager,
        KVClassType.SENDER: MoecommKVSender,
        KVClassType.RECEIVER: MoecommKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: MoecommKVBootstrapServer,
    }.get(class_type)


# ---------------------------------------------------------------------------------------------
# Pools over SGLang's buffers
# ---------------------------------------------------------------------------------------------


def layout_from_buffers(ptrs, lens, item_lens, what: str) -> KvLayout:
    """The KvLayout of SGLang buffers: one layer per buffer, one part ``[pages, page bytes]``
    of bytes. Every buffer must hold whole pages, the same number of them."""
    if not ptrs or not (len(ptrs) == len(lens) == len(item_lens)):
        raise BlockTransferError(
            f"sglang {what} buffers: {len(ptrs or [])} pointers, {len(lens or [])} lengths, "
            f"{len(item_lens or [])} page lengths (need the same non-zero count)"
        )
    counts = set()
    for i, (n, item) in enumerate(zip(lens, item_lens, strict=True)):
        if item <= 0 or n <= 0 or n % item:
            raise BlockTransferError(
                f"sglang {what} buffer {i}: {n} bytes is not a whole number of {item}-byte pages"
            )
        counts.add(n // item)
    if len(counts) != 1:
        raise BlockTransferError(
            f"sglang {what} buffers hold different numbers of pages: {sorted(counts)}"
        )
    layout = KvLayout(
        len(ptrs),
        counts.pop(),
        tuple(KvPart(i, what, (int(item),), "uint8") for i, item in enumerate(item_lens)),
    )
    layout.check()
    return layout


def host_tensor(ptr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over `nbytes` of host memory at `ptr` (SGLang's buffer, not copied)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def engine_pool(transport, layout: KvLayout, ptrs) -> KvPool:
    """SGLang's buffers (one per layer of `layout`) registered as a KvPool: peers write into
    them directly (no copy of SGLang's memory)."""
    n = layout.num_blocks
    tensors = [
        host_tensor(int(p), n * part.block_bytes).view(n, part.block_bytes)
        for p, part in zip(ptrs, layout.parts, strict=True)
    ]
    return KvPool(transport, layout, tensors=tensors)


# ---------------------------------------------------------------------------------------------
# HTTP: a small JSON app on moecomm's HttpServer, and its client
# ---------------------------------------------------------------------------------------------


class _JsonApp:
    """An ASGI app answering JSON routes: ``routes[(method, path)](query, body) -> (status,
    object)``; a handler's BlockTransferError or ValueError is a 400 with its message. With a
    `token`, a request without ``Authorization: Bearer <token>`` is a 401."""

    def __init__(self, routes, token: str | None):
        self.routes = routes
        self.token = token

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        handler = self.routes.get((scope["method"], scope["path"]))
        if self.token is not None and not self._authorized(scope):
            status, out = 401, {"error": f"the deployment's secret ({SECRET_ENV}) is required"}
        elif handler is None:
            status, out = 404, {"error": f"no route {scope['method']} {scope['path']}"}
        else:
            query = dict(urllib.parse.parse_qsl(scope.get("query_string", b"").decode()))
            try:
                status, out = handler(query, body)
            except (ValueError, KeyError, TypeError, MoecommError) as exc:
                status, out = 400, {"error": f"{type(exc).__name__}: {exc}"}
        data = json.dumps(out).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": data})

    def _authorized(self, scope) -> bool:
        given = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, credential = given.strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            credential.strip().encode(), self.token.encode()
        )


def _http(method: str, url: str, body: dict | None = None, token: str | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    if token is not None:
        req.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            why = json.loads(exc.read()).get("error", "")
        except (ValueError, AttributeError):
            why = ""
        raise RemoteError(exc.code, why, f"{method} {url}: ") from None
    except (urllib.error.URLError, OSError) as exc:
        raise PeerLostError(f"{method} {url}: {exc}") from None
    except ValueError as exc:
        raise ProtocolError(f"{method} {url}: the answer is not JSON ({exc})") from None


def failed(error: Exception, room) -> Exception:
    """`error` carrying what SGLang's queues read from a failure_exception() (the room, the
    reason, whether another rank reported it)."""
    error.bootstrap_room = room
    error.failure_reason = str(error)
    error.is_from_another_rank = False
    return error


def _loopback(host: str | None) -> str:
    return "127.0.0.1" if host in (None, "", "0.0.0.0", "::") else host


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r} is not a number of seconds") from None


# ---------------------------------------------------------------------------------------------
# Bootstrap server (the prefill's main process)
# ---------------------------------------------------------------------------------------------


class MoecommKVBootstrapServer(BaseKVBootstrapServer):
    """Where prefill ranks register (their pools' descriptions and their listener) and decode
    ranks look them up, keyed by (dp rank, engine rank). Started by SGLang on the prefill with
    ``--disaggregation-bootstrap-port``."""

    def __init__(self, host: str, port: int):
        self._lock = threading.Lock()
        self._ranks: dict[str, dict] = {}
        token = deployment_token()
        if token is None and host not in LOOPBACK_HOSTS:
            raise ValueError(
                f"moecomm SGLang backend: a bootstrap server on {host} (not loopback) needs the "
                f"deployment's secret: set {SECRET_ENV} in every prefill and decode process"
            )
        routes = {("PUT", ROUTE_PREFILL): self._put, ("GET", ROUTE_PREFILL): self._get}
        app = _JsonApp(routes, token)
        self._server = HttpServer(
            app, host, int(port), what="the moecomm KV bootstrap server", thread_name="kv-boot"
        )
        self.url = self._server.start()

    def _put(self, query, body):
        reg = json.loads(body)
        key = f"{int(reg['dp_rank'])}/{int(reg['engine_rank'])}"
        for k in ("endpoint", "kv_pool", "aux_pool", "dp_size", "page_size"):
            if k not in reg:
                raise ValueError(f"registration lacks {k!r}")
        with self._lock:
            self._ranks[key] = reg
        return 200, {"ok": True}

    def _get(self, query, body):
        key = f"{int(query['dp_rank'])}/{int(query['engine_rank'])}"
        with self._lock:
            reg = self._ranks.get(key)
        if reg is None:
            return 404, {"error": f"no prefill rank {key} registered yet"}
        return 200, reg

    def close(self) -> None:
        self._server.stop()


# ---------------------------------------------------------------------------------------------
# Manager
# ---------------------------------------------------------------------------------------------


@dataclass
class _Room:
    """What a decode asked of a prefill rank for one bootstrap room."""

    kv_request: KvTransferRequest | None = None
    aux_request: KvTransferRequest | None = None
    kv_peer: KvPeer | None = None
    aux_peer: KvPeer | None = None
    error: str = ""
    arrived: float = field(default_factory=time.monotonic)


class MoecommKVManager(BaseKVManager):
    """One per scheduler rank: its KV and metadata pools, and on the prefill a listener for
    decode requests (registered with the bootstrap server); on the decode the prefill ranks it
    found (``prefill_info_table``, read by SGLang's decode queue)."""

    supports_host_destination = False

    def __init__(self, args: KVArgs, disaggregation_mode, server_args, is_mla_backend=False):
        self.kv_args = args
        self.mode = getattr(disaggregation_mode, "value", disaggregation_mode)
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        device = str(getattr(server_args, "device", "cpu") or "cpu")
        if device != "cpu":
            raise BlockTransferError(
                f"moecomm SGLang backend: KV pools on {device!r} are not supported yet: host "
                "(--device cpu) pools only (the shm transport maps host memory)"
            )
        if int(getattr(args, "pp_rank", 0) or 0) != 0:
            raise BlockTransferError(
                "moecomm SGLang backend: pipeline parallelism is not supported"
            )
        states = [list(p) for p in (getattr(args, "state_data_ptrs", None) or [])]
        if any(states):
            kinds = [getattr(s, "value", s) for s in getattr(args, "state_types", []) or []]
            raise BlockTransferError(
                f"moecomm SGLang backend: hybrid state pools {kinds} are not supported "
                "(KV and metadata buffers only)"
            )
        self.engine_rank = int(args.engine_rank)
        self.dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        self.page_size = int(getattr(args, "page_size", 1) or 1)
        self.bootstrap_timeout = _env_seconds(
            "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", DEFAULT_BOOTSTRAP_TIMEOUT_S
        )
        self.waiting_timeout = _env_seconds(
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", DEFAULT_WAITING_TIMEOUT_S
        )
        self.transport = ShmTransport()
        self.kv = engine_pool(
            self.transport,
            layout_from_buffers(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, "kv"),
            args.kv_data_ptrs,
        )
        try:
            self.aux = engine_pool(
                self.transport,
                layout_from_buffers(
                    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, "aux"
                ),
                args.aux_data_ptrs,
            )
        except BaseException:
            self.kv.close()
            raise
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        self._peers: dict[str, KvPeer] = {}
        self.prefill_info_table: dict[str, SimpleNamespace] = {}
        self._routes: dict[tuple[str, int], dict] = {}
        self.token = deployment_token()
        self._listener: HttpServer | None = None
        self.endpoint = ""
        if self.mode == "prefill":
            self._listener = HttpServer(
                _JsonApp({("POST", ROUTE_TRANSFER): self._on_transfer}, self.token),
                "127.0.0.1",
                0,
                what="the moecomm KV request listener",
                thread_name="kv-requests",
            )
            self.endpoint = self._listener.start()
            self.register_to_bootstrap()

    # -- prefill side ------------------------------------------------------------------------

    def bootstrap_url(self) -> str:
        host = _loopback(getattr(self.server_args, "host", None))
        return f"http://{host}:{int(self.server_args.disaggregation_bootstrap_port)}"

    def register_to_bootstrap(self) -> None:
        reg = {
            "dp_rank": self.dp_rank,
            "engine_rank": self.engine_rank,
            "dp_size": int(getattr(self.server_args, "dp_size", 1) or 1),
            "page_size": self.page_size,
            "endpoint": self.endpoint,
            "kv_pool": self.kv.info().to_json(),
            "aux_pool": self.aux.info().to_json(),
        }
        url = self.bootstrap_url() + ROUTE_PREFILL
        deadline = time.monotonic() + REGISTER_DEADLINE_S
        while True:
            try:
                _http("PUT", url, reg, self.token)
                return
            except RemoteError as exc:  # it answered, and refused: retrying cannot help
                raise BlockTransferError(
                    f"moecomm SGLang backend: the bootstrap server refused prefill rank "
                    f"{self.engine_rank}: {exc}"
                ) from None
            except PeerLostError as exc:  # not listening yet
                if time.monotonic() > deadline:
                    raise DeadlineExceededError(
                        f"moecomm SGLang backend: prefill rank {self.engine_rank} could not "
                        f"register with the bootstrap server in {REGISTER_DEADLINE_S:.0f} s: {exc}"
                    ) from None
            time.sleep(REGISTER_RETRY_S)

    def peer(self, pool: KvPool, info_json: str) -> KvPeer:
        """The peer of `pool` described by `info_json` (attached once, then reused while its
        owner lives); BlockTransferError when the layouts differ."""
        info = KvPoolInfo.from_json(info_json)
        key = info.control_handle
        with self._lock:
            peer = self._peers.get(key)
        if peer is not None and peer.alive():
            return peer
        peer = pool.connect(info)
        with self._lock:
            self._peers[key] = peer
        return peer

    def _on_transfer(self, query, body):
        """A decode's requests for one room (the listener's thread)."""
        msg = json.loads(body)
        room_id = int(msg["room"])
        room = _Room()
        try:
            room.kv_peer = self.peer(self.kv, msg["kv_pool"])
            room.aux_peer = self.peer(self.aux, msg["aux_pool"])
            room.kv_request = KvTransferRequest.from_json(msg["kv_request"])
            room.aux_request = KvTransferRequest.from_json(msg["aux_request"])
        except (BlockTransferError, MoecommError, KeyError, ValueError) as exc:
            room.error = f"prefill rank {self.engine_rank} refused the decode's request: {exc}"
        with self._lock:
            self._rooms[room_id] = room
        if room.error:
            return 400, {"error": room.error}
        return 200, {"ok": True}

    def room(self, room_id: int) -> _Room | None:
        with self._lock:
            return self._rooms.get(room_id)

    def drop_room(self, room_id: int) -> None:
        with self._lock:
            self._rooms.pop(room_id, None)

    # -- decode side -------------------------------------------------------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Whether the prefill behind `bootstrap_addr` registered this rank's peer (SGLang's
        decode queue asks before it resolves a request's prefill dp rank)."""
        try:
            self.prefill_route(bootstrap_addr, 0)
        except (RemoteError, PeerLostError, ProtocolError):
            return False
        return True

    def prefill_route(self, bootstrap_addr: str, dp_rank: int) -> dict:
        """The registration of prefill rank (dp_rank, this engine rank) at `bootstrap_addr`."""
        key = (bootstrap_addr, int(dp_rank))
        with self._lock:
            reg = self._routes.get(key)
        if reg is None:
            query = urllib.parse.urlencode({"dp_rank": dp_rank, "engine_rank": self.engine_rank})
            reg = _http("GET", f"http://{bootstrap_addr}{ROUTE_PREFILL}?{query}", None, self.token)
            with self._lock:
                self._routes[key] = reg
                self.prefill_info_table[bootstrap_addr] = SimpleNamespace(
                    dp_size=int(reg["dp_size"]),
                    follow_bootstrap_room=True,
                    page_size=int(reg["page_size"]),
                )
        return reg

    def forget_route(self, bootstrap_addr: str, dp_rank: int) -> None:
        with self._lock:
            self._routes.pop((bootstrap_addr, int(dp_rank)), None)

    def close(self) -> None:
        """Stops the listener and frees the pools (tests; SGLang keeps a manager for life)."""
        if self._listener is not None:
            self._listener.stop()
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            p.close()
        self.kv.close()
        self.aux.close()


# ---------------------------------------------------------------------------------------------
# Sender (prefill)
# ---------------------------------------------------------------------------------------------


class MoecommKVSender(BaseKVSender):
    """One request's KV on the prefill: Bootstrapping until the decode's requests for its room
    arrive, WaitingForInput until SGLang sends, then each ``send`` writes its chunk of pages
    into the decode's pages; the last chunk also writes the metadata row and sets the
    transfer's completion word (Success)."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state: int | None = None
        self.failure: Exception | None = None
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        self.sent_pages = 0
        self.created = time.monotonic()
        self.started: float | None = None
        self.finished: float | None = None
        self.bytes_sent = 0

    def _fail(self, error: Exception) -> int:
        if self.conclude_state is None:
            self.conclude_state = KVPoll.Failed
            self.failure = failed(error, self.bootstrap_room)
            log.warning("moecomm KV send, room %s: %s", self.bootstrap_room, error)
            self._tell_decode(f"{type(error).__name__}: {error}")
            self.kv_mgr.drop_room(self.bootstrap_room)  # SGLang clears only successes
        return KVPoll.Failed

    def _tell_decode(self, reason: str) -> None:
        """Marks the decode's transfer FAILED with `reason`, so its poll fails now rather than
        at its deadline (when the decode is reachable and its request was valid)."""
        room = self.kv_mgr.room(self.bootstrap_room)
        if room is None or room.kv_request is None or not room.kv_peer.alive():
            return
        # A send of source page 0 for every destination page writes nothing until its layers
        # are sent; fail() only sets the decode's words and reason. When the request itself is
        # what was refused, that refusal already marked the slot.
        with contextlib.suppress(BlockTransferError, MoecommError):
            pages = [0] * len(room.kv_request.dst_blocks)
            room.kv_peer.start(room.kv_request, pages).fail(f"prefill: {reason}")

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        room = self.kv_mgr.room(self.bootstrap_room)
        if room is None:
            if time.monotonic() - self.created > self.kv_mgr.bootstrap_timeout:
                return self._fail(
                    DeadlineExceededError(
                        f"no decode asked for this room within "
                        f"{self.kv_mgr.bootstrap_timeout:.0f} s"
                    )
                )
            return KVPoll.Bootstrapping
        if room.error:
            return self._fail(BlockTransferError(room.error))
        if not room.kv_peer.alive():
            return self._fail(PeerLostError("the decode process died"))
        if self.num_pages is None or self.sent_pages == 0:
            return KVPoll.WaitingForInput
        return KVPoll.Transferring

    def init(self, num_kv_indices: int, aux_index: int | None = None):
        self.num_pages = int(num_kv_indices)
        self.aux_index = aux_index
        room = self.kv_mgr.room(self.bootstrap_room)
        if room is not None and room.kv_request is not None:
            expected = len(room.kv_request.dst_blocks)
            if expected != self.num_pages:
                self._fail(
                    BlockTransferError(
                        f"the prefill sends {self.num_pages} pages, the decode reserved {expected}"
                    )
                )

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None):
        if self.conclude_state is not None:
            return
        room = self.kv_mgr.room(self.bootstrap_room)
        if room is None or room.error or self.num_pages is None:
            self._fail(BlockTransferError("send before the decode's request arrived or init"))
            return
        if state_indices:
            self._fail(BlockTransferError("hybrid state indices are not supported by moecomm"))
            return
        pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        dst = room.kv_request.dst_blocks[self.sent_pages : self.sent_pages + len(pages)]
        chunk = KvTransferRequest(room.kv_request.pool, room.kv_request.slot,
                                  room.kv_request.seq, tuple(dst))  # fmt: skip
        if self.started is None:
            self.started = time.monotonic()
        try:
            mgr = self.kv_mgr
            # Checks the pages (range, count against the decode's) before writing; a refusal
            # marks the decode's slot FAILED with its reason.
            s = room.kv_peer.start(chunk, pages)
            for layer in range(mgr.kv.layout.num_layers):
                s.layer(layer)
            self.sent_pages += len(pages)
            self.bytes_sent += len(pages) * mgr.kv.layout.block_bytes
            if self.sent_pages < self.num_pages:
                return
            aux = [] if self.aux_index is None else [int(self.aux_index)]
            room.aux_peer.send(room.aux_request, aux)
            s.finish()
        except MoecommError as exc:
            self._fail(exc)
            return
        self.finished = time.monotonic()
        self.conclude_state = KVPoll.Success

    def get_transfer_metric(self) -> KVTransferMetric:
        latency = None
        if self.started is not None and self.finished is not None:
            latency = self.finished - self.started
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=self.bytes_sent)

    def failure_exception(self):
        if self.failure is not None:
            raise self.failure

    def clear(self):
        self.kv_mgr.drop_room(self.bootstrap_room)

    def abort(self):
        self._fail(BlockTransferError("aborted by the prefill"))
        self.kv_mgr.drop_room(self.bootstrap_room)


# ---------------------------------------------------------------------------------------------
# Receiver (decode)
# ---------------------------------------------------------------------------------------------


class MoecommKVReceiver(BaseKVReceiver):
    """One request's KV on the decode: ``init`` finds the prefill rank through the bootstrap
    server, ``send_metadata`` reserves the pages and the metadata row and posts the requests to
    it, ``poll`` reads the completion words (and the prefill's liveness)."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state: int | None = None
        self.failure: Exception | None = None
        self.abort_notified = False
        self.bootstrap_infos: list[dict] = []
        self.route: dict | None = None
        self.kv_peer: KvPeer | None = None
        self.aux_peer: KvPeer | None = None
        self.kv_recv: KvRecv | None = None
        self.aux_recv: KvRecv | None = None
        self.pages: list[int] = []
        self.aux_index: int | None = None
        self.sent_at: float | None = None

    def _fail(self, error: Exception) -> int:
        if self.conclude_state is None:
            self.conclude_state = KVPoll.Failed
            self.failure = failed(error, self.bootstrap_room)
            log.warning("moecomm KV receive, room %s: %s", self.bootstrap_room, error)
        self._release()
        return KVPoll.Failed

    def init(self, prefill_dp_rank: int):
        try:
            self.route = self.kv_mgr.prefill_route(self.bootstrap_addr, prefill_dp_rank)
            self.kv_peer = self.kv_mgr.peer(self.kv_mgr.kv, self.route["kv_pool"])
            self.aux_peer = self.kv_mgr.peer(self.kv_mgr.aux, self.route["aux_pool"])
        except (MoecommError, KeyError, ValueError) as exc:
            self.kv_mgr.forget_route(self.bootstrap_addr, prefill_dp_rank)
            kind = type(exc) if isinstance(exc, (PeerLostError, BlockTransferError)) else None
            self._fail(
                (kind or PeerLostError)(
                    f"bootstrap with the prefill at {self.bootstrap_addr} failed: {exc}"
                )
            )
            return
        self.bootstrap_infos = [self.route]

    def send_metadata(
        self,
        kv_indices,
        aux_index=None,
        state_indices=None,
        decode_prefix_len=None,
        destination=KVTransferDestination.DEVICE,
    ):
        if self.conclude_state is not None:
            return
        if self.route is None:
            self._fail(BlockTransferError("send_metadata before init"))
            return
        if destination != KVTransferDestination.DEVICE or state_indices:
            self._fail(
                BlockTransferError(
                    "host destinations and hybrid state are not supported by moecomm"
                )
            )
            return
        self.pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        self.aux_index = None if aux_index is None else int(aux_index)
        try:
            self.kv_recv = self.kv_peer.expect(self.pages)
            self.aux_recv = self.aux_peer.expect([] if aux_index is None else [self.aux_index])
            _http(
                "POST",
                self.route["endpoint"] + ROUTE_TRANSFER,
                {
                    "room": int(self.bootstrap_room),
                    "kv_pool": self.kv_mgr.kv.info().to_json(),
                    "aux_pool": self.kv_mgr.aux.info().to_json(),
                    "kv_request": self.kv_recv.request.to_json(),
                    "aux_request": self.aux_recv.request.to_json(),
                },
                self.kv_mgr.token,
            )
        except MoecommError as exc:
            self._fail(exc)
            return
        self.sent_at = time.monotonic()

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.route is None:
            return KVPoll.Bootstrapping
        if self.kv_recv is None:
            return KVPoll.WaitingForInput
        kv, aux = self.kv_recv.poll(), self.aux_recv.poll()
        if KvState.FAILED in (kv, aux):
            return self._fail(self._why_failed())
        if kv == KvState.DONE and aux == KvState.DONE:
            self._release()
            self.conclude_state = KVPoll.Success
            return KVPoll.Success
        if time.monotonic() - self.sent_at > self.kv_mgr.waiting_timeout:
            return self._fail(
                DeadlineExceededError(
                    f"the KV did not arrive within {self.kv_mgr.waiting_timeout:.0f} s"
                )
            )
        return KVPoll.Transferring if kv == KvState.TRANSFERRING else KVPoll.WaitingForInput

    def _why_failed(self) -> Exception:
        """The prefill's own reason when it left one in the slot, else its death."""
        for r in (self.kv_recv, self.aux_recv):
            try:
                r.wait(0.0)
            except (RemoteError, ProtocolError) as exc:
                return exc
            except MoecommError:
                pass  # not arrived yet, or the sender is gone: judged below
        if not self.kv_peer.alive():
            return PeerLostError("the prefill process died before the KV arrived")
        return ProtocolError("the transfer's words say FAILED without a reason")

    def _release(self) -> None:
        for r in (self.kv_recv, self.aux_recv):
            if r is not None:
                r.release()

    def failure_exception(self):
        if self.failure is not None:
            raise self.failure

    def clear(self):
        self._release()

    def abort(self):
        self._fail(BlockTransferError("aborted by the decode"))


def main(argv: list[str] | None = None) -> None:
    """``python -m moecomm.engines.sglang_kv <sglang.launch_server arguments>``: registers the
    backend, then runs SGLang's launcher in this process."""
    import runpy
    import sys

    register()
    sys.argv = ["sglang.launch_server", *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
