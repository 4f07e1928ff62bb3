"""A vLLM v1 KV connector that moves KV cache over moecomm's block transfer
(:mod:`moecomm.wire.kv`), for prefill/decode disaggregation on one host.

Loaded by module path, with no change to vLLM::

    --kv-transfer-config '{"kv_connector": "MoecommConnector",
                           "kv_connector_module_path": "moecomm.engines.vllm_kv",
                           "kv_role": "kv_producer"}'      # the prefill instance
                           ... "kv_role": "kv_consumer"}'  # the decode instance

The flow is vLLM's P/D flow as its NIXL connectors run it, over moecomm:

1. The router sends the prompt to the prefill instance with ``kv_transfer_params =
   {"do_remote_decode": true}`` and ``max_tokens = 1``. When the request finishes,
   :meth:`MoecommConnector.request_finished_all_groups` keeps its blocks (vLLM frees them once
   :meth:`get_finished` reports the request sent) and returns the parameters the decode side
   needs: ``do_remote_prefill``, ``remote_block_ids``, ``remote_request_id``, the prefill
   worker's side-channel address (``remote_host``, ``remote_ports``, one per TP rank) and
   ``remote_engine_id``.
2. The router sends the request, with those parameters, to the decode instance. Its scheduler
   asks :meth:`get_num_new_matched_tokens` (the prompt tokens it does not hold: loaded
   asynchronously), allocates blocks, and :meth:`update_state_after_alloc` records them; the
   next :meth:`build_connector_meta` hands them to the worker.
3. The decode worker (:meth:`start_load_kv`) reserves its destination blocks in its pool
   (``KvPeer.expect``: SGLang's shape, the receiver allocates first) and sends the transfer
   request and the prefill's source blocks to the prefill worker's side channel; the prefill
   worker writes every layer's blocks straight into the decode pool (``KvPeer.start`` /
   ``KvSend.layer`` / ``KvSend.finish``) and reports the request sent.
4. The decode worker polls the transfer (``KvRecv.poll``) in :meth:`get_finished` and reports
   it received; a transfer that fails (the prefill process died, the transfer was refused, no
   answer within ``load_timeout_s``) is reported through vLLM's own error path: the request in
   ``failed_recving`` and its blocks in :meth:`get_block_ids_with_load_errors`, so the
   scheduler fails or recomputes it (``kv_load_failure_policy``), never waits forever.

KV memory: vLLM allocates its caches and hands them to :meth:`register_kv_caches`; the pool
registers those very tensors (``KvPool(..., tensors=...)``: host tensors, written by the peer
process on the same host with one ``process_vm_writev`` per layer), so each KV byte is copied
once, from the prefill's cache into the decode's. Where the transport cannot take vLLM's
tensors (CUDA caches: not supported by the shm transport yet) the connector keeps a *staged*
host pool of the same layout beside vLLM's cache and copies the moved blocks between them: on
the prefill side from vLLM's blocks into the pool before the send, on the decode side from the
pool into vLLM's blocks when the transfer is done (two more copies, and the cache's memory
twice). :attr:`MoecommConnectorWorker.staged` says which.

Options (``kv_connector_extra_config``):

- ``host``: the address the prefill worker's side channel listens on, and that the decode side
  is told (default ``127.0.0.1``); ``port``: its first port (default 0: any free port; TP rank
  ``r`` listens on ``port + r`` when set).
- ``token`` or ``token_file``: the deployment's shared secret; every side-channel message must
  carry it (compared in constant time). A side channel on a non-loopback address without one
  is refused at start.
- ``load_timeout_s``: a transfer that has not completed this long after the decode worker
  asked for it is reported failed (default 120).
- ``lease_s``: blocks the prefill side holds for a decode that never asks for them are freed
  after this long (default 120).

Limits: one host (the shm transport); TP sizes equal on both sides (rank ``r`` talks to rank
``r``); attention KV cache groups (full, sliding-window, MLA) — Mamba state groups are refused
at start. The KV moves after the prefill finished, as in vLLM's NIXL connectors, not layer by
layer during the forward: :meth:`save_kv_layer`, :meth:`wait_for_layer_load` and
:meth:`wait_for_save` have no work (the decode request is scheduled only once its KV is in).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

from moecomm.auth import is_loopback
from moecomm.engines.side_channel import Listener, ask
from moecomm.errors import MoecommError
from moecomm.wire.kv import BlockTransferError, KvLayout, KvPart, KvPool, KvState
from moecomm.wire.kv.layout import DTYPES
from moecomm.wire.shm import ShmTransport

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

TRANSFER_MODE = "moecomm"
DEFAULT_HOST = "127.0.0.1"
# A decode that asked for KV gives the prefill this long to deliver it before vLLM is told the
# load failed. Generous: a prefill host busy with other requests still answers within it, and
# a dead prefill is found at once anyway (the transfer's liveness watch), not by this timeout.
DEFAULT_LOAD_TIMEOUT_S = 120.0
# Blocks the prefill holds for a decode that never asks for them (it was aborted, or the
# router sent it elsewhere) are freed after this long; vLLM's NIXL connector leases 30 s and
# renews with heartbeats, which this connector does not send, hence the longer lease.
DEFAULT_LEASE_S = 120.0
# vLLM's null block (the block pool's first block) stands for tokens a sliding window dropped:
# never moved.
NULL_BLOCK = 0


# ----------------------------------------------------------------------------- metadata
@dataclass
class RecvSpec:
    """A decode request whose KV is to be loaded from a prefill worker."""

    remote_request_id: str
    remote_engine_id: str
    remote_host: str
    remote_ports: dict[int, int]
    remote_block_ids: list[list[int]]  # per KV cache group
    local_block_ids: list[list[int]]  # per KV cache group
    # Nothing to load (the decode's prefix cache holds the prompt): only tell the prefill to
    # free its blocks now rather than at its lease's end.
    release_only: bool = False


@dataclass
class MoecommConnectorMetadata(KVConnectorMetadata):
    """What the scheduler-side connector tells the workers each step."""

    reqs_to_recv: dict[str, RecvSpec] = field(default_factory=dict)
    # prefill requests finished this step: their blocks, per group, held until sent
    reqs_to_send: dict[str, list[list[int]]] = field(default_factory=dict)


@dataclass
class MoecommHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler (vLLM's handshake path): where its side channel
    listens (port 0: it has none, a consumer) and its pools' descriptions."""

    tp_rank: int
    host: str
    port: int
    pools: list[str]


# ----------------------------------------------------------------------------- options
@dataclass(frozen=True)
class Options:
    host: str
    port: int
    token: str
    load_timeout_s: float
    lease_s: float

    @staticmethod
    def from_config(vllm_config: VllmConfig) -> Options:
        kv = vllm_config.kv_transfer_config
        extra = dict(kv.kv_connector_extra_config or {})
        known = {"host", "port", "token", "token_file", "load_timeout_s", "lease_s"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise BlockTransferError(
                f"moecomm connector: unknown kv_connector_extra_config keys {unknown} "
                f"(known: {sorted(known)})"
            )
        token = str(extra.get("token", ""))
        if "token_file" in extra:
            if token:
                raise BlockTransferError("moecomm connector: give token or token_file, not both")
            with open(str(extra["token_file"]), encoding="utf-8") as f:
                token = f.read().strip()
        opts = Options(
            host=str(extra.get("host", DEFAULT_HOST)),
            port=int(extra.get("port", 0)),
            token=token,
            load_timeout_s=float(extra.get("load_timeout_s", DEFAULT_LOAD_TIMEOUT_S)),
            lease_s=float(extra.get("lease_s", DEFAULT_LEASE_S)),
        )
        if not 0 <= opts.port < 65536:
            raise BlockTransferError(f"moecomm connector: port {opts.port} out of range")
        if opts.load_timeout_s <= 0 or opts.lease_s <= 0:
            raise BlockTransferError("moecomm connector: load_timeout_s and lease_s must be > 0")
        return opts


def _tp_rank() -> int:
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return 0


def _attention_groups(kv_cache_config: KVCacheConfig) -> list[list[str]]:
    """The layer names of each KV cache group; refuses groups whose state is not paged
    attention KV (block i of a request is not a block of tokens there)."""
    groups = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        specs = (
            list(spec.kv_cache_specs.values())
            if isinstance(spec, UniformTypeKVCacheSpecs)
            else [spec]
        )
        bad = [type(s).__name__ for s in specs if not isinstance(s, AttentionSpec)]
        if bad:
            raise BlockTransferError(
                f"moecomm connector: KV cache group {i} holds {bad[0]} state; only attention "
                "KV (full, sliding-window, MLA) is moved"
            )
        groups.append(list(group.layer_names))
    return groups


def _pairs(src: list[int], dst: list[int]) -> tuple[list[int], list[int]]:
    """The blocks to move: the two lists aligned from their ends (the decode side allocated
    only the blocks it did not hold; the prefill side has the whole prompt), dropping pairs
    where either side is vLLM's null block (a sliding window's dropped tokens)."""
    n = min(len(src), len(dst))
    s, d = src[len(src) - n :], dst[len(dst) - n :]
    keep = [i for i in range(n) if s[i] != NULL_BLOCK and d[i] != NULL_BLOCK]
    return [s[i] for i in keep], [d[i] for i in keep]


# ----------------------------------------------------------------------------- scheduler side
class MoecommConnectorScheduler:
    """The scheduler half: decides what to load, holds the prefill's blocks, says where the
    prefill worker listens."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, opts: Options):
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.opts = opts
        self.num_groups = len(_attention_groups(kv_cache_config))
        self.ports: dict[int, int] = {}  # tp rank -> its side channel port (from handshake)
        self.host = opts.host
        self._recv: dict[str, RecvSpec] = {}
        self._send: dict[str, list[list[int]]] = {}
        self._sending: set[str] = set()  # finished prefills whose blocks we hold

    def set_handshake(self, metadata: dict) -> None:
        for key, meta in metadata.items():
            if isinstance(meta, MoecommHandshakeMetadata) and meta.port:
                tp = key[1] if isinstance(key, tuple) else int(key)
                self.ports[tp] = meta.port
                self.host = meta.host

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and params.get("remote_block_ids"):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        # Once: a re-entry (the second call after the load, a preemption) must not ask again.
        params["do_remote_prefill"] = False
        release_only = num_external_tokens <= 0
        try:
            spec = RecvSpec(
                remote_request_id=str(params["remote_request_id"]),
                remote_engine_id=str(params.get("remote_engine_id", "")),
                remote_host=str(params["remote_host"]),
                remote_ports={int(k): int(v) for k, v in dict(params["remote_ports"]).items()},
                remote_block_ids=[[int(b) for b in g] for g in params["remote_block_ids"]],
                local_block_ids=[list(g) for g in blocks.get_unhashed_block_ids_all_groups()],
                release_only=release_only,
            )
        except (KeyError, TypeError, ValueError) as exc:
            if release_only:
                return
            # Malformed parameters: the worker reports the load failed (vLLM's error path).
            logger.error(
                "moecomm connector: request %s: bad kv_transfer_params (%s)",
                request.request_id,
                exc,
            )
            local = [list(g) for g in blocks.get_unhashed_block_ids_all_groups()]
            spec = RecvSpec("", "", "", {}, [], local)
        self._recv[request.request_id] = spec

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MoecommConnectorMetadata:
        meta = MoecommConnectorMetadata(reqs_to_recv=self._recv, reqs_to_send=self._send)
        self._recv, self._send = {}, {}
        return meta

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None  # aborted: nothing to hand off
        if not self.ports:
            logger.error("moecomm connector: no worker side channel known (handshake missing)")
            return False, None
        groups = [list(g) for g in block_ids]
        hold = any(groups)
        if hold:
            self._send[request.request_id] = groups
            self._sending.add(request.request_id)
        return hold, dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=groups,
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_host=self.host,
            remote_ports={str(k): v for k, v in self.ports.items()},  # JSON keys
            remote_num_tokens=request.num_computed_tokens,
            transfer_mode=TRANSFER_MODE,
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.finished_sending or ():
            self._sending.discard(req_id)

    def has_pending_push_work(self) -> bool:
        # The engine must keep stepping while blocks wait for their decode: get_finished is
        # where they are reported sent (and freed).
        return bool(self._sending or self._send)


# ----------------------------------------------------------------------------- worker side
@dataclass
class _Recv:
    req_id: str
    local: list[list[int]]  # per group: vLLM's blocks for the request
    moves: list[tuple[object, list[int], list[int]]]  # per group: (KvRecv, src, dst)
    deadline: float


@dataclass
class _Held:
    blocks: list[list[int]]
    deadline: float


class MoecommConnectorWorker:
    """The worker half: the KV pools, the side channel (prefill) and the transfers."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, opts: Options):
        kv = vllm_config.kv_transfer_config
        self.opts = opts
        self.role = kv.kv_role
        self.kv_cache_config = kv_cache_config
        self.groups = _attention_groups(kv_cache_config)
        self.tp_rank = _tp_rank()
        self.transport = ShmTransport()
        self.pools: list[KvPool] = []
        self.caches: list[list[torch.Tensor]] = []  # per group: the tensors, pool part order
        self.staged = False
        self.listener: Listener | None = None
        self._lock = threading.Lock()
        self._peers: dict[str, object] = {}  # a peer pool's control handle -> KvPeer
        self._remote_pools: dict[tuple[str, int], list[str]] = {}
        self._recvs: dict[str, _Recv] = {}
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._bad_blocks: set[int] = set()
        self._held: dict[str, _Held] = {}  # prefill requests' blocks, until sent or expired
        # pull orders that came before their blocks: request id -> (deadline, order)
        self._orders: dict[str, tuple[float, dict]] = {}
        self._done_sending: set[str] = set()
        self._work: queue.Queue = queue.Queue()
        self._sender: threading.Thread | None = None
        if (
            self.role in ("kv_producer", "kv_both")
            and not opts.token
            and not is_loopback(opts.host)
        ):
            raise BlockTransferError(
                f"moecomm connector: a side channel on {opts.host} (not loopback) needs the "
                "deployment's shared secret (kv_connector_extra_config token or token_file)"
            )

    # -- registration
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self.kv_cache_config.num_blocks
        for gi, names in enumerate(self.groups):
            tensors, seen = [], set()
            for name in names:
                t = kv_caches.get(name)
                if t is None or (t.data_ptr(), tuple(t.shape)) in seen:
                    continue  # a layer sharing another's cache moves with it
                seen.add((t.data_ptr(), tuple(t.shape)))
                tensors.append(self._per_block(t, num_blocks, name))
            if not tensors:
                raise BlockTransferError(f"moecomm connector: no KV cache tensor for group {gi}")
            parts = tuple(
                KvPart(i, "kv", tuple(t.shape[1:]), str(t.dtype).removeprefix("torch."))
                for i, t in enumerate(tensors)
            )
            layout = KvLayout(len(tensors), num_blocks, parts)
            layout.check()
            try:
                pool = KvPool(self.transport, layout, tensors=tensors)
            except BlockTransferError as exc:
                # The transport cannot expose vLLM's own memory (yet): a pool beside it.
                logger.info("moecomm connector: staged KV pool (%s)", exc)
                pool = KvPool(self.transport, layout)
                self.staged = True
            self.pools.append(pool)
            self.caches.append(tensors)
        if self.role in ("kv_producer", "kv_both"):
            port = self.opts.port + self.tp_rank if self.opts.port else 0
            self.listener = Listener(
                self.opts.host,
                port,
                self.opts.token,
                self._on_pull,
                [p.info().to_json() for p in self.pools],
            )
            self._sender = threading.Thread(
                target=self._send_loop, name="moecomm-kv-sender", daemon=True
            )
            self._sender.start()

    @staticmethod
    def _per_block(t: torch.Tensor, num_blocks: int, name: str) -> torch.Tensor:
        """`t` as ``[num_blocks, ...]``: vLLM's per-layer views are ``[blocks, ...]``, with
        kernel blocks smaller than the manager's (a whole multiple) folded back."""
        if t.dim() < 2 or t.shape[0] % num_blocks:
            raise BlockTransferError(
                f"moecomm connector: layer {name}: cache shape {list(t.shape)} does not start "
                f"with the {num_blocks} blocks"
            )
        if t.shape[0] != num_blocks:
            t = t.unflatten(0, (num_blocks, t.shape[0] // num_blocks))
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            t = t.view(torch.uint8)
        return t

    def handshake(self) -> MoecommHandshakeMetadata:
        return MoecommHandshakeMetadata(
            tp_rank=self.tp_rank,
            host=self.opts.host,
            port=self.listener.port if self.listener else 0,
            pools=[p.info().to_json() for p in self.pools],
        )

    # -- the decode side
    def start_load(self, meta: MoecommConnectorMetadata) -> None:
        for req_id, spec in meta.reqs_to_recv.items():
            if spec.release_only:
                self._release_remote(spec)
                continue
            try:
                self._start_recv(req_id, spec)
            except (OSError, MoecommError, KeyError, TypeError, ValueError) as exc:
                logger.error("moecomm connector: loading KV of %s failed: %s", req_id, exc)
                self._fail_recv(req_id, spec.local_block_ids)
        for req_id, blocks in meta.reqs_to_send.items():
            with self._lock:
                self._held[req_id] = _Held(blocks, time.monotonic() + self.opts.lease_s)
                order = self._orders.pop(req_id, None)
            if order is not None:
                self._work.put((req_id, order[1]))

    def _release_remote(self, spec: RecvSpec) -> None:
        """An empty pull: the prefill reports its request sent, and vLLM frees its blocks."""
        try:
            port = spec.remote_ports[self.tp_rank]
            ask(spec.remote_host, port, self._pull(spec.remote_request_id, []))
        except (OSError, MoecommError, KeyError) as exc:
            # The prefill's lease frees them anyway.
            logger.warning(
                "moecomm connector: could not release %s: %s", spec.remote_request_id, exc
            )

    def _pull(self, remote_request_id: str, groups: list[dict]) -> dict:
        return {
            "op": "pull",
            "token": self.opts.token,
            "request_id": remote_request_id,
            "pools": [p.info().to_json() for p in self.pools],
            "groups": groups,
        }

    def _connect(self, host: str, port: int, group: int):
        key = (host, port)
        pools = self._remote_pools.get(key)
        if pools is None:
            pools = ask(host, port, {"op": "info", "token": self.opts.token})["pools"]
            if not isinstance(pools, list) or len(pools) != len(self.pools):
                raise BlockTransferError(
                    f"moecomm connector: the prefill at {host}:{port} has "
                    f"{len(pools) if isinstance(pools, list) else '?'} pools, this side "
                    f"{len(self.pools)} (KV cache groups differ)"
                )
            self._remote_pools[key] = pools
        info = pools[group]
        handle = json.loads(info)["control"]
        peer = self._peers.get(handle)
        if peer is None:
            peer = self.pools[group].connect(info)
            self._peers[handle] = peer
        return peer

    def _start_recv(self, req_id: str, spec: RecvSpec) -> None:
        if not spec.remote_host:
            raise BlockTransferError("malformed kv_transfer_params")
        if self.tp_rank not in spec.remote_ports:
            raise BlockTransferError(f"the prefill has no TP rank {self.tp_rank}")
        if len(spec.remote_block_ids) != len(self.pools):
            raise BlockTransferError(
                f"{len(spec.remote_block_ids)} block groups from the prefill, "
                f"{len(self.pools)} here"
            )
        port = spec.remote_ports[self.tp_rank]
        rec = _Recv(req_id, spec.local_block_ids, [], time.monotonic() + self.opts.load_timeout_s)
        groups = []
        try:
            for g, (src_all, dst_all) in enumerate(
                zip(spec.remote_block_ids, spec.local_block_ids, strict=True)
            ):
                src, dst = _pairs(src_all, dst_all)
                if not dst:
                    continue
                peer = self._connect(spec.remote_host, port, g)
                recv = peer.expect(dst)
                rec.moves.append((recv, src, dst))
                groups.append({"group": g, "request": recv.request.to_json(), "src": src})
            ask(spec.remote_host, port, self._pull(spec.remote_request_id, groups))
        except BaseException:
            for recv, _, _ in rec.moves:
                recv.release()
            self._remote_pools.pop((spec.remote_host, port), None)  # asked again next time
            raise
        with self._lock:
            self._recvs[req_id] = rec

    def _fail_recv(self, req_id: str, local: list[list[int]]) -> None:
        with self._lock:
            self._failed_recving.add(req_id)
            self._done_recving.add(req_id)
            self._bad_blocks.update(b for g in local for b in g if b != NULL_BLOCK)

    def _poll_recvs(self) -> None:
        now = time.monotonic()
        with self._lock:
            recvs = list(self._recvs.values())
        for rec in recvs:
            states = [recv.poll() for recv, _, _ in rec.moves]
            if all(s == KvState.DONE for s in states):
                if self.staged:
                    for g, (_, _, dst) in enumerate(rec.moves):
                        self._copy_in(g, dst)
                outcome = None
            elif any(s == KvState.FAILED for s in states):
                outcome = "failed (the prefill died or refused the transfer)"
            elif now > rec.deadline:
                outcome = f"not done within {self.opts.load_timeout_s:.0f} s"
            else:
                continue
            for recv, _, _ in rec.moves:
                recv.release()
            with self._lock:
                del self._recvs[rec.req_id]
                self._done_recving.add(rec.req_id)
            if outcome is not None:
                logger.error("moecomm connector: KV of %s %s", rec.req_id, outcome)
                self._fail_recv(rec.req_id, rec.local)

    def _copy_in(self, g: int, dst: list[int]) -> None:
        idx = torch.tensor(dst, dtype=torch.long)
        for i, cache in enumerate(self.caches[g]):
            blocks = self.pools[g].view(i).index_select(0, idx)
            cache[idx.to(cache.device)] = blocks.to(cache.device)

    # -- the prefill side
    def _on_pull(self, msg: dict) -> None:
        req_id = str(msg["request_id"])
        if not isinstance(msg.get("groups"), list) or not isinstance(msg.get("pools"), list):
            raise BlockTransferError("a pull names groups and pools")
        with self._lock:
            if req_id in self._held:
                self._work.put((req_id, msg))
            else:
                # Its blocks come with the next step's metadata (or never: dropped at expiry).
                self._orders[req_id] = (time.monotonic() + self.opts.lease_s, msg)

    def _send_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            req_id, msg = item
            try:
                self._send_one(req_id, msg)
            except Exception as exc:  # any failure frees the blocks (logged)
                logger.error("moecomm connector: sending KV of %s failed: %s", req_id, exc)
            with self._lock:
                if self._held.pop(req_id, None) is not None:
                    self._done_sending.add(req_id)

    def _send_one(self, req_id: str, msg: dict) -> None:
        """Writes the blocks a pull names into the decode's pool, group by group. Each send is
        started first (which checks the request against both pools and, when it fails, marks
        the decode's slot FAILED): whatever goes wrong afterwards is told to the decode through
        the slot too (``KvSend.fail``), so its load fails at once instead of at its timeout."""
        with self._lock:
            held = self._held.get(req_id)
        pools = msg["pools"]
        if len(pools) != len(self.pools):
            raise BlockTransferError(
                f"the decode has {len(pools)} pools, this side {len(self.pools)}"
            )
        for item in msg["groups"]:
            g = int(item["group"])
            if not 0 <= g < len(self.pools):
                raise BlockTransferError(f"no KV cache group {g}")
            src = [int(b) for b in item["src"]]
            handle = json.loads(pools[g])["control"]
            peer = self._peers.get(handle)
            if peer is None:
                peer = self.pools[g].connect(pools[g])
                self._peers[handle] = peer
            send = peer.start(item["request"], src)
            try:
                if held is None:
                    raise BlockTransferError(f"the blocks of {req_id} were freed (lease expired)")
                if not set(src) <= set(held.blocks[g]):
                    raise BlockTransferError(f"the pull names blocks {req_id} does not hold")
                if self.staged:
                    self._copy_out(g, src)
                for layer in range(self.pools[g].layout.num_layers):
                    send.layer(layer)
                send.finish()
            except BaseException as exc:
                with contextlib.suppress(Exception):
                    if not send.finished:
                        send.fail(f"prefill: {exc}")
                raise

    def _copy_out(self, g: int, src: list[int]) -> None:
        idx = torch.tensor(sorted(set(src)), dtype=torch.long)
        for i, cache in enumerate(self.caches[g]):
            self.pools[g].view(i)[idx] = cache.index_select(0, idx.to(cache.device)).cpu()

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            for req_id in [r for r, h in self._held.items() if now > h.deadline]:
                logger.warning("moecomm connector: no decode asked for the KV of %s in %.0f s; "
                               "freeing its blocks", req_id, self.opts.lease_s)  # fmt: skip
                del self._held[req_id]
                self._orders.pop(req_id, None)
                self._done_sending.add(req_id)
            for req_id in [r for r, (t, _) in self._orders.items() if now > t]:
                # A pull for blocks this side never held (or no longer holds): the sender
                # thread fails it into the decode's slots, which ends the decode's wait.
                self._work.put((req_id, self._orders.pop(req_id)[1]))

    # -- results
    def transfer_results(self) -> KVConnectorTransferResults:
        self._poll_recvs()
        self._expire_leases()
        with self._lock:
            out = KVConnectorTransferResults(
                finished_sending=self._done_sending,
                finished_recving=self._done_recving,
                failed_recving=self._failed_recving,
            )
            self._done_sending, self._done_recving, self._failed_recving = set(), set(), set()
        return out

    def block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._bad_blocks = self._bad_blocks, set()
        # Block ids are unique only within a group: with several groups vLLM takes failures
        # per request (failed_recving) and refuses block ids.
        return bad if len(self.pools) == 1 else set()

    def shutdown(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self._sender is not None:
            self._work.put(None)
            self._sender.join(timeout=5.0)
            self._sender = None
        with self._lock:
            for rec in self._recvs.values():
                for recv, _, _ in rec.moves:
                    recv.release()
            self._recvs.clear()
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
        for pool in self.pools:
            pool.close()
        self.pools = []


# ----------------------------------------------------------------------------- the connector
class MoecommConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector over moecomm: the scheduler half and the worker half, by role."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        opts = Options.from_config(vllm_config)
        self.scheduler: MoecommConnectorScheduler | None = None
        self.worker: MoecommConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = MoecommConnectorScheduler(vllm_config, kv_cache_config, opts)
        elif role == KVConnectorRole.WORKER:
            self.worker = MoecommConnectorWorker(vllm_config, kv_cache_config, opts)
        else:
            raise BlockTransferError(f"moecomm connector: unknown role {role}")

    # -- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # The request's own blocks are moved, every group of them.
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]):
        self.scheduler.set_handshake(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        if any(pp != 0 for pp, _ in metadata):
            raise BlockTransferError("moecomm connector: pipeline parallelism is not supported")
        self.scheduler.set_handshake(metadata)

    # -- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.handshake() if self.worker is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MoecommConnectorMetadata), type(meta)
        self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous (between scheduler steps): a request runs only once its KV is
        # in, so no layer is ever waited for here.
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # The KV is sent from the request's blocks after the prefill finished (held until the
        # decode asked and the send is done), not layer by layer during the forward.
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        r = self.worker.transfer_results()
        return r.finished_sending, r.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker.transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


__all__ = [
    "MoecommConnector",
    "MoecommConnectorMetadata",
    "MoecommHandshakeMetadata",
]
