"""Device dispatch/combine: the GPU twin of :func:`pack_dispatch` + send, and of :func:`combine`.

:class:`DeviceClient` drives the CUDA kernels of ``csrc/kernels/cuda/`` (client_dispatch.cuh,
client_combine.cuh) through ``moecomm._cuda`` over the CUDA-IPC backend. Everything stays on the
device: per-server token counts, row positions and sequence numbers live in device memory, the
workspaces are allocated once here, and neither call synchronises with the host, so a client step
(``dispatch`` + ``combine``) can be captured in a CUDA graph and replayed with new inputs.

Semantics match the host path bit for bit: request rows keep batch order, ``expert_ids`` are the
server's local indices or -1, scores are 0 where the id is -1, the quantization is the one of
:mod:`moecomm.ops.quant`, and the combine adds the servers' answers in server order in f32 before
the cast. The replica choice is the host's: :meth:`DeviceClient.set_expert_map` writes, per
logical expert, the chosen ``(server, local index)`` into device tables that the next dispatch
(or graph replay) reads. A server that gets no token is sent nothing and not waited for.

``combine`` never hangs: each server's wait has a deadline, and its outcome is a code in
:meth:`DeviceClient.status` (``moecomm._cuda.SERVER_STATUS``); a server that failed contributes
nothing. Reading the status is the caller's (synchronising) choice, after the step.
"""

from __future__ import annotations

import torch

import moecomm.cuda
from moecomm.protocol import Encoding, SlotLayout, as_encoding

__all__ = ["DeviceClient", "cuda_module", "ipc_peers"]

_FLOAT_ENCODING = {
    torch.bfloat16: Encoding.BF16,
    torch.float16: Encoding.FP16,
    torch.float32: Encoding.F32,
}
_ID_DTYPES = (torch.int32, torch.int64)
# Offsets and sequence numbers are u64 on the device; torch has no uint64 arithmetic we need, so
# they are held in int64 tensors of the same width.
_U64 = torch.int64


def cuda_module():
    """``moecomm._cuda``; GpuUnavailableError (a RuntimeError) saying it was not built. The
    device itself is checked through the tensors, which must be CUDA tensors."""
    return moecomm.cuda.cuda_module(need_device=False)


def ipc_peers(table) -> object:
    """The kernels' view (``moecomm._cuda.IpcPeers``) of a transport ``IpcPeerTable``: its
    region base, its device array of mapped peers and its liveness mask. The table keeps
    owning them; build the view again after peers join or leave only if max_peers changed
    (the arrays themselves are rewritten in place)."""
    k = cuda_module()
    view = table.backend()
    peers = k.IpcPeers()
    peers.local_base = view["local_base"]
    peers.peer_base = view["peer_base"]
    peers.alive = view["alive"]
    peers.max_peers = view["max_peers"]
    return peers


def _check_cuda(name: str, t: object, dtypes: tuple, dim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor (the device path), got device {t.device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    return t


class DeviceClient:
    """One attention client's device dispatch/combine over a CUDA-IPC peer table.

    ``peers`` is a ``moecomm._cuda.IpcPeers`` (:func:`ipc_peers` makes one from the transport's
    ``IpcPeerTable``: our region's base, the device array of mapped server regions, the liveness
    mask); ``request_ring_offset[s]`` is where our request ring
    starts in server ``s``'s region, ``response_ring_offset[s]`` where server ``s``'s response
    ring starts in ours (both int64 CUDA tensors of ``num_servers`` entries, kept alive here).
    """

    def __init__(
        self,
        peers,
        layout: SlotLayout,
        num_servers: int,
        client_id: int,
        request_ring_offset: torch.Tensor,
        response_ring_offset: torch.Tensor,
        num_slots: int = 2,
        device: torch.device | str = "cuda",
    ):
        self._k = cuda_module()
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        for name, t in (
            ("request_ring_offset", request_ring_offset),
            ("response_ring_offset", response_ring_offset),
        ):
            _check_cuda(name, t, (_U64,), 1)
            if t.shape[0] != num_servers or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous with {num_servers} entries")
        self.layout = layout
        self.peers = peers
        self._offsets = (request_ring_offset, response_ring_offset)
        cfg = self._k.ClientConfig()
        cfg.num_servers, cfg.num_slots, cfg.client_id = num_servers, num_slots, client_id
        cfg.max_tokens, cfg.hidden, cfg.topk = layout.max_tokens, layout.hidden, layout.topk
        cfg.encoding, cfg.out_encoding = int(layout.encoding), int(layout.out_encoding)
        cfg.request_ring_offset = request_ring_offset.data_ptr()
        cfg.response_ring_offset = response_ring_offset.data_ptr()
        self.config = cfg
        self.workspace_layout = self._k.client_workspace_layout(cfg)
        total = self.workspace_layout["total"]
        self.workspaces = [
            torch.zeros(total, dtype=torch.uint8, device=device) for _ in range(num_slots)
        ]
        # Last sequence number sent to each server, shared by all slots like ClientChannel's.
        self.next_seq = torch.zeros(num_servers, dtype=_U64, device=device)
        self.expert_server = torch.zeros(0, dtype=torch.int32, device=device)
        self.expert_local = torch.zeros(0, dtype=torch.int32, device=device)

    def set_expert_map(self, expert_server: torch.Tensor, expert_local: torch.Tensor) -> None:
        """The replica choice: logical expert e goes to (expert_server[e], expert_local[e]).

        Copied into persistent device tables, so a captured graph sees the new map at its next
        replay (the number of experts must then stay the same).
        """
        if expert_server.shape != expert_local.shape or expert_server.dim() != 1:
            raise ValueError("expert_server and expert_local must be 1-D of the same length")
        n = expert_server.shape[0]
        if n < 1:
            raise ValueError("the expert map needs at least one expert")
        if self.expert_server.shape[0] != n:
            dev = self.next_seq.device
            self.expert_server = torch.empty(n, dtype=torch.int32, device=dev)
            self.expert_local = torch.empty(n, dtype=torch.int32, device=dev)
        self.expert_server.copy_(expert_server.to(torch.int32), non_blocking=True)
        self.expert_local.copy_(expert_local.to(torch.int32), non_blocking=True)

    def _part(self, slot: int, name: str, dtype: torch.dtype, count: int) -> torch.Tensor:
        start = self.workspace_layout[name]
        size = torch.tensor([], dtype=dtype).element_size() * count
        return self.workspaces[slot][start : start + size].view(dtype)

    def status(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(status, detail) int32 device views [num_servers] of the last combine on ``slot``."""
        n = self.config.num_servers
        return self._part(slot, "status", torch.int32, n), self._part(
            slot, "detail", torch.int32, n
        )

    def counts(self, slot: int) -> torch.Tensor:
        """Tokens sent to each server by the last dispatch on ``slot`` (int32 device view)."""
        return self._part(slot, "count", torch.int32, self.config.num_servers)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < len(self.workspaces):
            raise ValueError(f"slot must be in [0, {len(self.workspaces)}), got {slot}")

    def dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layer_id: int,
        slot: int = 0,
    ) -> None:
        """Routes, quantizes, packs and puts one request per server with tokens, on the
        current stream. Returns at once; ``x``/``topk_*`` must stay alive until the stream has
        run it."""
        self._check_slot(slot)
        _check_cuda("x", x, tuple(_FLOAT_ENCODING), 2)
        _check_cuda("topk_ids", topk_ids, _ID_DTYPES, 2)
        _check_cuda("topk_weights", topk_weights, tuple(_FLOAT_ENCODING), 2)
        t, h = x.shape
        if h != self.layout.hidden or x.stride(1) != 1:
            raise ValueError(f"x must be [T, {self.layout.hidden}] with unit column stride")
        if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
            raise ValueError("topk_ids and topk_weights must both be [T, K] with T = x.shape[0]")
        if not (topk_ids.is_contiguous() and topk_weights.is_contiguous()):
            raise ValueError("topk_ids and topk_weights must be contiguous")
        if self.expert_server.shape[0] == 0:
            raise ValueError("no expert map: call set_expert_map() first")
        a = self._k.DispatchArgs()
        a.x, a.x_dtype, a.x_row_stride = x.data_ptr(), int(_FLOAT_ENCODING[x.dtype]), x.stride(0)
        a.topk_ids, a.ids_int64 = topk_ids.data_ptr(), topk_ids.dtype == torch.int64
        a.topk_weights = topk_weights.data_ptr()
        a.weights_dtype = int(_FLOAT_ENCODING[topk_weights.dtype])
        a.num_tokens, a.topk = t, topk_ids.shape[1]
        a.expert_server, a.expert_local = (
            self.expert_server.data_ptr(),
            self.expert_local.data_ptr(),
        )
        a.num_experts, a.layer_id, a.slot = self.expert_server.shape[0], layer_id, slot
        a.next_seq, a.workspace = self.next_seq.data_ptr(), self.workspaces[slot].data_ptr()
        self._k.client_dispatch(self.peers, self.config, a, _stream(x.device))

    def combine(
        self,
        num_tokens: int,
        layer_id: int,
        slot: int = 0,
        timeout_s: float = 1.0,
        out: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Waits (deadline ``timeout_s`` per server) and sums the answers of the dispatch on
        ``slot`` into ``out`` [num_tokens, hidden] on the current stream; no synchronisation."""
        self._check_slot(slot)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if out is None:
            dtype = out_dtype or _dtype_of(as_encoding(self.layout.out_encoding))
            out = torch.empty(
                num_tokens, self.layout.hidden, dtype=dtype, device=self.next_seq.device
            )
        _check_cuda("out", out, tuple(_FLOAT_ENCODING), 2)
        if tuple(out.shape) != (num_tokens, self.layout.hidden) or not out.is_contiguous():
            raise ValueError(f"out must be contiguous [{num_tokens}, {self.layout.hidden}]")
        a = self._k.CombineArgs()
        a.num_tokens, a.layer_id, a.slot = num_tokens, layer_id, slot
        a.workspace, a.out = self.workspaces[slot].data_ptr(), out.data_ptr()
        a.out_dtype, a.timeout_ns = int(_FLOAT_ENCODING[out.dtype]), int(timeout_s * 1e9)
        self._k.client_combine(self.peers, self.config, a, _stream(out.device))
        return out


def _dtype_of(enc: Encoding) -> torch.dtype:
    for dtype, e in _FLOAT_ENCODING.items():
        if e == enc:
            return dtype
    raise ValueError(f"responses are never quantized, got {enc}")


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream
