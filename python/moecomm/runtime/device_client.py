"""The device client: an attention client whose slots live in GPU memory (CUDA IPC).

The GPU twin of :class:`moecomm.runtime.AttentionClient`, behind the same seam
(:class:`moecomm.runtime.ExpertsBackend`): ``dispatch`` routes, quantizes, packs and puts one
request per server with tokens on the current stream; ``combine`` waits (a deadline per server)
and sums the answers in server order, in f32, then casts: the host path's order, so the result
is bit-identical to it. The kernels are ``csrc/kernels/cuda/client_{dispatch,combine}.cuh``.

Everything stays on the device during a step: counts, row positions and sequence numbers live
in device memory, workspaces are allocated once, and neither launch synchronises, so a step can
be captured in a CUDA graph (:meth:`DeviceClient.launch` / :meth:`DeviceClient.wait`). The
ExpertsBackend ``combine`` then reads the per-server statuses (one small device-to-host copy) and
fails over outside the graph: a server that timed out, died or answered an error is evicted and
the step runs again with its experts on their replicas — the host path's failover.

One region holds the response rings of every server (``max_servers`` of them); server ``s`` is
peer ``s`` of the CUDA-IPC peer table, which hands its kernel view to the launchers directly.
The expert map the kernels route by is allocated once per layer and rewritten in place on every
membership change (:mod:`moecomm.runtime.device_maps`), so a captured graph survives failover.

Every device deadline (the combine's ``timeout``) is multiplied by
:func:`moecomm.wire.cuda.deadline_scale` (``MOECOMM_DEVICE_DEADLINE_SCALE``, for sanitizers and
debuggers). ``MOECOMM_DEVICE_DEBUG=1`` records every device wait and prints them with the
per-server statuses on a failed step (:mod:`moecomm.runtime.device_debug`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import moecomm.wire.cuda
from moecomm import _C
from moecomm.errors import MoecommError
from moecomm.ops._checks import check_tensor
from moecomm.runtime import device_debug
from moecomm.runtime.client import random_client_id
from moecomm.runtime.device_maps import DEFAULT_MAX_EXPERTS, ExpertMaps
from moecomm.runtime.device_preload import preload_kernels
from moecomm.wire.protocol import ENCODING_DTYPE, SlotLayout, as_encoding

log = logging.getLogger("moecomm.device_client")

__all__ = ["DeviceClient", "DeviceHandle", "DeviceStepFailedError"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ID_DTYPES = (torch.int32, torch.int64)
# Offsets and sequence numbers are u64 on the device, held in int64 tensors of the same width.
_U64 = torch.int64
# Failed servers a combine evicts before giving up: each retry removes at least one.
MAX_FAILOVERS = 4
# A slot still held by a server after a timeout: how long a combine waits for it to free up
# before treating the server as failed.
BUSY_RETRY_S = 0.01


class DeviceStepFailedError(MoecommError):
    """A device step could not be completed on any replica."""


@dataclass
class _Server:
    url: str
    server_id: str
    session: str
    hosted: dict[int, list[int]]  # layer -> logical expert of each local index (-1: retired)


@dataclass
class DeviceHandle:
    """One dispatch in flight: its inputs stay referenced until combine (a retry re-sends them)."""

    slot: int
    layer_id: int
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    combined: bool = False


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def combine_timeout_ns(timeout_s: float) -> int:
    """The combine kernel's deadline for a ``timeout_s`` wait: scaled by
    ``MOECOMM_DEVICE_DEADLINE_SCALE`` (:func:`moecomm.wire.cuda.deadline_scale`)."""
    return int(timeout_s * 1e9 * moecomm.wire.cuda.deadline_scale())


class DeviceClient:
    """Device dispatch/combine over CUDA IPC with expert servers started ``--device cuda``.

    Build it with :meth:`connect` (the handshake), or construct it and :meth:`add_server` one
    URL at a time. ``layout`` is the slot layout every server agreed to (servers of the GPU path
    fix theirs at start); ``num_slots`` micro-batches may be in flight. ``max_experts`` sizes
    the per-layer expert maps once (a server hosting a higher logical expert id is refused:
    :mod:`moecomm.runtime.device_maps`)."""

    def __init__(
        self,
        layout: SlotLayout,
        device: torch.device | str = "cuda",
        num_slots: int = 2,
        max_servers: int = 8,
        client_id: int | None = None,
        timeout: float = 1.0,
        token: str = "",
        max_experts: int = DEFAULT_MAX_EXPERTS,
    ):
        self._k = moecomm.wire.cuda.cuda_module()  # a clear error without a build or a device
        if num_slots < 1 or max_servers < 1:
            raise ValueError("num_slots and max_servers must be >= 1")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"a DeviceClient lives on a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.layout, self.timeout, self.token = layout, float(timeout), token
        self.client_id = random_client_id() if client_id is None else int(client_id)
        # Every kernel loaded before the first connect (runtime/device_preload.py).
        preload_kernels(self._k, self.device.index)
        self.transport = self._k.IpcTransport(self.device.index)
        ring = _C.SlotRing(layout.config, num_slots, False)
        self.ring_bytes = ring.region_bytes
        self.region = self.transport.create_region(self.ring_bytes * max_servers)
        self.table = self._k.IpcPeerTable(self.transport, self.region, max_servers)
        dev = self.device
        self.request_ring_offset = torch.zeros(max_servers, dtype=_U64, device=dev)
        self.response_ring_offset = torch.arange(max_servers, dtype=_U64, device=dev)
        self.response_ring_offset.mul_(self.ring_bytes)
        cfg = self._k.ClientConfig()
        cfg.num_servers, cfg.num_slots, cfg.client_id = max_servers, num_slots, self.client_id
        cfg.max_tokens, cfg.hidden, cfg.topk = layout.max_tokens, layout.hidden, layout.topk
        cfg.encoding, cfg.out_encoding = int(layout.encoding), int(layout.out_encoding)
        cfg.request_ring_offset = self.request_ring_offset.data_ptr()
        cfg.response_ring_offset = self.response_ring_offset.data_ptr()
        self.config = cfg
        self.workspace_layout = self._k.client_workspace_layout(cfg)
        total = self.workspace_layout["total"]
        self.workspaces = [
            torch.zeros(total, dtype=torch.uint8, device=dev) for _ in range(num_slots)
        ]
        self.next_seq = torch.zeros(max_servers, dtype=_U64, device=dev)
        self.servers: dict[int, _Server] = {}  # peer index -> server
        # peer index -> its response ring (peer indices of retiring peers are not reused at
        # once, so the two numberings differ)
        self._rings: dict[int, int] = {}
        # layer -> (server, local) device tensors, allocated once, rewritten in place
        self._maps = ExpertMaps(dev, max_experts)
        # The debug mode's wait trace, handed to every launch (None: nothing recorded).
        self._trace = device_debug.WaitTraceBuffer(dev) if device_debug.enabled() else None
        self._next_slot = 0
        self._inflight: list[DeviceHandle | None] = [None] * num_slots

    # ------------------------------------------------------------------ membership
    @classmethod
    def connect(cls, urls: list[str], **kwargs) -> DeviceClient:
        """A client connected to every server in ``urls`` (``layout`` is built from
        max_tokens/hidden/topk/encoding/out_encoding keywords when not given)."""
        if "layout" not in kwargs:
            kwargs["layout"] = SlotLayout(
                kwargs.pop("max_tokens"),
                kwargs.pop("hidden"),
                kwargs.pop("topk"),
                as_encoding(kwargs.pop("encoding", "bf16")),
                as_encoding(kwargs.pop("out_encoding", "bf16")),
            )
        client = cls(**kwargs)
        try:
            for url in urls:
                client.add_server(url)
        except BaseException:
            client.close()
            raise
        return client

    @classmethod
    def from_servers(cls, urls: list[str], **kwargs) -> DeviceClient:
        """A client connected to every server in ``urls`` with the slot layout the first one
        serves (GPU servers fix theirs at start and publish it in GET /transports)."""
        from moecomm.runtime.control import http_transports

        if not urls:
            raise ValueError("from_servers needs at least one server URL")
        offer = http_transports(urls[0])
        if "layout" not in offer or "cuda_ipc" not in offer.get("transports", []):
            raise MoecommError(
                f"{urls[0]} is not a GPU expert server (it serves {offer.get('transports')}); "
                "start it with --device cuda"
            )
        layout = SlotLayout.from_dict(offer["layout"])
        kwargs.setdefault("num_slots", int(offer.get("num_slots", 2)))
        return cls.connect(urls, layout=layout, **kwargs)

    def add_server(self, url: str) -> int:
        """Connects to one more server (the cuda_ipc handshake) and routes to its experts from
        the next dispatch. Returns its peer index."""
        from moecomm.runtime.device_handshake import connect_device

        used = set(self._rings.values())
        free = [r for r in range(self.config.num_servers) if r not in used]
        if not free:
            raise MoecommError(f"all {self.config.num_servers} server places are taken")
        ring = free[0]
        # A ring an evicted server wrote into starts clean: signal words, arrival counters.
        self.transport.write(self.region, ring * self.ring_bytes, bytes(self.ring_bytes))
        answer = connect_device(self, url, ring * self.ring_bytes)
        hosted = {int(k): [int(e) for e in v] for k, v in answer["hosted"].items()}
        try:
            self._maps.check(hosted, url)  # refused before it is routed to (fixed-size maps)
            index = self.table.add_peer(answer["server_handle"])
        except BaseException:
            from moecomm.runtime.control import http_disconnect

            http_disconnect(url, self.client_id, self.token, session=answer.get("session"))
            raise
        self.request_ring_offset[index] = int(answer["request_ring_offset"])
        self.response_ring_offset[index] = ring * self.ring_bytes
        self._rings[index] = ring
        self._reset_peer(index)
        self.servers[index] = _Server(url, answer["server_id"], answer["session"], hosted)
        self._rebuild_maps()
        return index

    def _reset_peer(self, index: int) -> None:
        """A new server at `index`: its per-slot protocol state starts from zero (cumulative
        arrival bytes, a pending timed-out request)."""
        for ws in self.workspaces:
            for name, dtype in (("arrival_sent", _U64), ("pending_seq", _U64)):
                self._part(ws, name, dtype, self.config.num_servers)[index] = 0

    def evict(self, index: int, reason: str = "") -> None:
        """Stops routing to server `index` at once; its mapping closes when the work queued on
        the current stream is done."""
        server = self.servers.pop(index, None)
        if server is None:
            return
        from moecomm.runtime.control import http_disconnect

        log.warning("device client %x: evicting %s (%s)", self.client_id, server.url, reason)
        self.table.mark_dead(index)
        self.table.remove_peer(index, [_stream(self.device)])
        self._rebuild_maps()
        # Its ring is reused only once the server dropped us (or is gone): a live server that
        # timed out may still answer into it.
        http_disconnect(server.url, self.client_id, self.token, timeout=self.timeout,
                        session=server.session)  # fmt: skip
        self._rings.pop(index, None)

    def _rebuild_maps(self) -> None:
        """Per layer, logical expert -> (server, local index): the lowest live server hosting
        it, rewritten in place in the tensors every launch (and captured graph) reads."""
        self._maps.update({index: s.hosted for index, s in self.servers.items()})

    def routable(self, layer_id: int) -> set[int]:
        """Logical experts of ``layer_id`` that have a live server (no device read)."""
        return self._maps.routable(layer_id)

    def expert_map(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(server, local)`` device tensors the kernels route ``layer_id`` by
        (``[max_experts]`` int32, persistent)."""
        return self._maps.tensors(layer_id)

    # ------------------------------------------------------------------ kernel-level step
    def _part(self, ws: torch.Tensor, name: str, dtype: torch.dtype, count: int) -> torch.Tensor:
        start = self.workspace_layout[name]
        size = torch.empty((), dtype=dtype).element_size() * count
        return ws[start : start + size].view(dtype)

    def _peers(self):
        """The kernels' view of the peer table, with the debug trace when the mode is on."""
        return device_debug.attach(self.table.kernel_peers(), self._trace)

    def _native(self, what: str, launch: Callable[[], None]) -> None:
        """Runs one native launch; in the debug mode a failure (a CUDA error the launcher
        caught after the kernel) prints the report before it propagates."""
        try:
            launch()
        except Exception as exc:
            if self._trace is not None:
                self.debug_report(f"{what} failed: {type(exc).__name__}: {exc}")
            raise

    def status(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(status, detail) int32 device views [max_servers] of the last combine on ``slot``
        (``moecomm._cuda.SERVER_STATUS``)."""
        n, ws = self.config.num_servers, self.workspaces[slot]
        return self._part(ws, "status", torch.int32, n), self._part(ws, "detail", torch.int32, n)

    def launch(self, x, topk_ids, topk_weights, layer_id: int, slot: int) -> None:
        """Enqueues route + pack + put on the current stream; no synchronisation."""
        if not 0 <= slot < len(self.workspaces):
            raise ValueError(f"slot must be in [0, {len(self.workspaces)}), got {slot}")
        check_tensor("x", x, dtypes=_FLOAT_DTYPES, dim=2, device=self.device)
        check_tensor("topk_ids", topk_ids, dtypes=_ID_DTYPES, dim=2, device=self.device)
        check_tensor("topk_weights", topk_weights, dtypes=_FLOAT_DTYPES, dim=2, device=self.device)
        t, h = x.shape
        if h != self.layout.hidden or x.stride(1) != 1:
            raise ValueError(f"x must be [T, {self.layout.hidden}] with unit column stride")
        if t > self.layout.max_tokens:
            raise ValueError(f"{t} tokens exceed the layout's max_tokens {self.layout.max_tokens}")
        if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
            raise ValueError("topk_ids and topk_weights must both be [T, K] with T = x.shape[0]")
        if not (topk_ids.is_contiguous() and topk_weights.is_contiguous()):
            raise ValueError("topk_ids and topk_weights must be contiguous")
        if not self._maps.routable(layer_id):  # the layer's tensors outlive its servers
            raise MoecommError(f"no connected server hosts layer {layer_id}")
        server, local = self._maps.tensors(layer_id)
        a = self._k.DispatchArgs()
        a.x, a.x_dtype, a.x_row_stride = x.data_ptr(), int(as_encoding(x.dtype)), x.stride(0)
        a.topk_ids, a.ids_int64 = topk_ids.data_ptr(), topk_ids.dtype == torch.int64
        a.topk_weights = topk_weights.data_ptr()
        a.weights_dtype = int(as_encoding(topk_weights.dtype))
        a.num_tokens, a.topk = t, topk_ids.shape[1]
        a.expert_server, a.expert_local = server.data_ptr(), local.data_ptr()
        # The maps' fixed capacity: the same for every launch, before and after a failover.
        a.num_experts, a.layer_id, a.slot = self._maps.max_experts, layer_id, slot
        a.next_seq, a.workspace = self.next_seq.data_ptr(), self.workspaces[slot].data_ptr()
        peers, stream = self._peers(), _stream(self.device)
        self._native("dispatch", lambda: self._k.client_dispatch(peers, self.config, a, stream))

    def wait(self, num_tokens: int, layer_id: int, slot: int, out: torch.Tensor) -> torch.Tensor:
        """Enqueues wait + reduce into ``out`` [num_tokens, hidden] on the current stream."""
        check_tensor("out", out, dtypes=_FLOAT_DTYPES, dim=2, device=self.device)
        if tuple(out.shape) != (num_tokens, self.layout.hidden) or not out.is_contiguous():
            raise ValueError(f"out must be contiguous [{num_tokens}, {self.layout.hidden}]")
        a = self._k.CombineArgs()
        a.num_tokens, a.layer_id, a.slot = num_tokens, layer_id, slot
        a.workspace, a.out = self.workspaces[slot].data_ptr(), out.data_ptr()
        a.out_dtype, a.timeout_ns = int(as_encoding(out.dtype)), combine_timeout_ns(self.timeout)
        peers, stream = self._peers(), _stream(self.device)
        self._native("combine", lambda: self._k.client_combine(peers, self.config, a, stream))
        return out

    # ------------------------------------------------------------------ the seam
    def dispatch(self, x, topk_ids, topk_weights, layer_id: int) -> DeviceHandle:
        """Starts one step on the next free slot; at most ``num_slots`` steps are in flight
        (a slot's workspace is reused only after its combine)."""
        slot = self._next_slot
        held = self._inflight[slot]
        if held is not None and not held.combined:
            raise MoecommError(
                f"all {len(self.workspaces)} slots are in flight: combine a dispatch first"
            )
        self.launch(x, topk_ids, topk_weights, layer_id, slot)
        self._next_slot = (slot + 1) % len(self.workspaces)
        handle = DeviceHandle(slot, layer_id, x, topk_ids, topk_weights)
        self._inflight[slot] = handle
        return handle

    def combine(self, handle: DeviceHandle, out: torch.Tensor | None = None) -> torch.Tensor:
        """Waits for the answers of ``handle`` and returns y [T, hidden]; on a failed server,
        evicts it and runs the step again on the replicas (synchronises once per combine to
        read the statuses)."""
        if handle.combined:
            raise MoecommError("this dispatch was already combined")
        handle.combined = True
        t = handle.x.shape[0]
        if out is None:
            dtype = ENCODING_DTYPE[self.layout.out_encoding]
            out = torch.empty(t, self.layout.hidden, dtype=dtype, device=self.device)
        codes = self._k.SERVER_STATUS
        ok = {codes["OK"], codes["NOT_SENT"]}
        for attempt in range(MAX_FAILOVERS + 1):
            self.wait(t, handle.layer_id, handle.slot, out)
            status, detail = (v.tolist() for v in self.status(handle.slot))
            failed = {
                i: (s, d)
                for i, (s, d) in enumerate(zip(status, detail, strict=True))
                if s not in ok
            }
            if not failed:
                return out
            if self._trace is not None:
                self.debug_report(f"layer {handle.layer_id}: combine attempt {attempt} failed")
            busy = {i for i, (s, _) in failed.items() if s == codes.get("SLOT_BUSY", -1)}
            for index, (s, d) in failed.items():
                if index not in busy:
                    self.evict(index, f"status {s} detail {d} on layer {handle.layer_id}")
            if busy:
                time.sleep(BUSY_RETRY_S)
            needed = {int(e) for e in handle.topk_ids.flatten().tolist() if e >= 0}
            missing = needed - self.routable(handle.layer_id)
            if missing:
                self._raise_failed(
                    f"layer {handle.layer_id}: experts {sorted(missing)[:8]} have no live server "
                    f"left (last failures: {failed})"
                )
            log.info("device client %x: retry %d of layer %d", self.client_id, attempt + 1,
                     handle.layer_id)  # fmt: skip
            h = handle
            self.launch(h.x, h.topk_ids, h.topk_weights, h.layer_id, h.slot)
        self._raise_failed(f"layer {handle.layer_id}: failing after {MAX_FAILOVERS} retries")

    def _raise_failed(self, message: str) -> None:
        if self._trace is not None:
            self.debug_report(f"DeviceStepFailedError: {message}")
        raise DeviceStepFailedError(message)

    # ------------------------------------------------------------------ debugging
    def debug_state(self) -> dict[str, str]:
        """The client's side of a debug report: its servers, and per slot every server index
        that has state (status/detail of the last combine, the sequence sent, a pending one,
        the arrival bytes sent, the tokens)."""
        codes = {v: k for k, v in self._k.SERVER_STATUS.items()}
        servers = [
            f"    server {i}: {s.url} ({s.server_id}), response ring {self._rings.get(i)}"
            for i, s in sorted(self.servers.items())
        ]
        n = self.config.num_servers
        slots = []
        for slot, ws in enumerate(self.workspaces):
            status, detail = (v.tolist() for v in self.status(slot))
            sent = self._part(ws, "sent_seq", _U64, n).tolist()
            pending = self._part(ws, "pending_seq", _U64, n).tolist()
            arrival = self._part(ws, "arrival_sent", _U64, n).tolist()
            count = self._part(ws, "count", torch.int32, n).tolist()
            for i in range(n):
                if i not in self.servers and not (sent[i] or pending[i] or arrival[i]):
                    continue
                slots.append(
                    f"    slot {slot} server {i}: {codes.get(status[i], status[i])} detail "
                    f"{detail[i]}, sent seq {sent[i] & 0xFFFFFFFFFFFFFFFF:#x}, pending "
                    f"{pending[i]}, arrival sent {arrival[i]}, tokens {count[i]}"
                )
        return {
            "servers": "\n".join(servers) or "    (none)",
            "per-slot status": "\n".join(slots) or "    (nothing sent yet)",
        }

    def debug_report(self, title: str) -> str:
        """Prints (stderr) and returns the client's state and, in the debug mode, its recorded
        device waits; never raises (it runs on failure paths, where the device may be gone)."""
        sections: dict[str, str] = {}
        try:
            sections.update(self.debug_state())
        except Exception as exc:  # a sticky CUDA error makes every device read fail
            sections["client state"] = device_debug.unreadable(exc)
        sections["device waits"] = device_debug.trace_section(self._trace)
        return device_debug.report(f"client {self.client_id:#x}: {title}", sections)

    def close(self) -> None:
        """Disconnects from every server (they free this client's slots)."""
        from moecomm.runtime.control import http_disconnect

        torch.cuda.synchronize(self.device)
        for index in list(self.servers):
            server = self.servers.pop(index)
            http_disconnect(server.url, self.client_id, self.token, session=server.session)
            self.table.remove_peer(index, [_stream(self.device)])
        self._rings.clear()
        self._maps.clear()
