"""``deep_ep.Buffer``'s low-latency API over moecomm's slot protocol: CPU tensors on the host
transport (this file), CUDA tensors on the device kernels over CUDA IPC (``_ll_device.py``).

Same calls, same shapes, backed by one-sided writes into slot rings (:mod:`moecomm.slots`)
instead of NVSHMEM. Rank ``r`` hosts experts ``r*L .. r*L+L-1`` (``L = num_experts /
num_ranks``) and owns a request ring (``ServerChannel``) and a response ring (``ClientChannel``)
per peer, itself included.

- **dispatch**: quantize once (fp8 e4m3, one f32 scale per 128 channels: ``FP8_E4M3_B128``),
  pack one request per rank with :func:`moecomm.ops.pack_dispatch` (each token once per
  destination, ids = local expert or -1), write them all, wake every rank. Receive = wait for
  every rank's request and lay the copies out per local expert.
- **combine**: answer each source rank with the outputs of its copies in its request's (row, k)
  order; wait for our answers and reduce ``out[t] = Σ_k w[t, k] · y(t, k)`` in f32, k ascending.

Differences from DeepEP (all deliberate; engines that rely on one of them must adapt):

1. **Order inside an expert is deterministic**: ``recv_x[e, :recv_count[e]]`` is source rank
   major, token index ascending. DeepEP orders source ranks by arrival. ``handle[1]``
   (``layout_range``, ``begin << 32 | count`` per source rank) describes it exactly as in DeepEP.
2. **CPU or CUDA tensors, one kind per Buffer** (the first dispatch decides). On the host,
   ``async_finish`` is ignored and ``event`` is a :class:`CompletedEvent`; on CUDA it is a
   ``torch.cuda.Event`` (rules of that path: ``_ll_device.py``, docs/compat-deep-ep.md).
3. **Hooks** (``None`` unless ``return_recv_hook``): dispatch/combine only write and signal; the
   hook receives into the tensors already returned. Calling a hook twice is a no-op.
4. **Two results in flight**, like DeepEP's two buffers: ``recv_x`` of dispatch ``i`` is reused by
   dispatch ``i + 2``. Stricter than DeepEP: dispatch ``i`` must be combined before dispatch
   ``i + 2`` (its request slot is released by the answer), else ``RuntimeError``.
5. Rows of ``recv_x`` past ``recv_count[e]`` are stale (DeepEP: unspecified). ``src_info``
   (``handle[0]``) holds the source token index of each valid row, ``-1`` elsewhere.
6. The fp8 scales are ``[L, R*M, hidden // 128]`` f32 with column-major last two dims (as in
   DeepEP). ``round_scale``, ``use_ue8m0``, ``use_logfmt`` and ``zero_copy`` raise
   ``NotImplementedError``; ``cumulative_local_expert_recv_stats`` is supported.
7. ``num_nvl_bytes``, ``num_rdma_bytes``, ``num_qps_per_rank`` and the NVLink/fabric flags are
   accepted and ignored: slots are sized from the shape. ``low_latency_mode=False`` (the normal
   kernels) and ``enable_shrink`` are not implemented.
8. **Rendezvous**: with a ``torch.distributed.ProcessGroup`` the region handles are exchanged by
   one ``all_gather_object`` — the only collective this module ever calls. Without one, pass
   keyword-only ``rank``, ``num_ranks`` and ``store`` (a ``torch.distributed.Store``). The
   exchange happens at construction when the keyword-only shape (``num_max_dispatch_tokens_per_
   rank``, ``hidden``, ``num_experts``, ``num_topk``) is given, else at the first dispatch (which
   every rank calls). The shape may not change afterwards.
9. **Every wait has a deadline** (``timeout``, default 30 s): ``moecomm.TimeoutError`` or
   ``moecomm.PeerLostError`` (a dead peer is noticed at once), naming the rank waited for.
10. Wire details: the request's score column carries the source token index (DeepEP's dispatch
    has no weights); a rank with nothing for a peer sends one row whose expert ids are all -1
    (the protocol has no empty message); answers carry one row per (token, k) copy, so response
    slots hold ``M * min(num_topk, L)`` rows and request slots ``M`` (bf16-sized, so use_fp8 may
    change per call) — see docs/compat-deep-ep.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from moecomm._C import Encoding
from moecomm.compat._ll_device import DevicePath
from moecomm.compat._ll_device_ops import DeviceHandle, check_mode, input_device
from moecomm.compat._ll_layout import (
    LLShape,
    Scratch,
    check_dispatch_inputs,
    check_host,
    check_shape,
    receive_layout,
    reduce_answers,
)
from moecomm.compat._ll_support import (
    NUM_SLOTS,
    CompletedEvent,
    LowLatencyHandle,
    check_combine_inputs,
    exchange,
    naming_peer,
    shm_bytes_per_rank,
    slot_layout,
)
from moecomm.errors import ProtocolError
from moecomm.ops.dispatch import ExpertMap, pack_dispatch
from moecomm.slots import ClientChannel, ServerChannel
from moecomm.transport import ShmTransport

__all__ = ["Buffer", "CompletedEvent", "LowLatencyHandle"]

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_STORE_PREFIX = "moecomm.compat.deep_ep"
# Only for get_low_latency_rdma_size_hint, which is not told the top-k (DeepSeek-V3 uses 8).
SIZE_HINT_TOPK = 8


class Buffer:
    """Low-latency dispatch/combine with DeepEP's signatures; see the module docstring."""

    def __init__(
        self,
        group=None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = True,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        *,
        rank: int | None = None,
        num_ranks: int | None = None,
        store=None,
        store_prefix: str = DEFAULT_STORE_PREFIX,
        num_max_dispatch_tokens_per_rank: int | None = None,
        hidden: int | None = None,
        num_experts: int | None = None,
        num_topk: int | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not low_latency_mode:
            raise NotImplementedError("only DeepEP's low-latency mode is implemented")
        if enable_shrink:
            raise NotImplementedError("enable_shrink (masking ranks out) is not implemented")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.group, self.store, self.store_prefix = group, store, store_prefix
        if group is not None:
            import torch.distributed as dist

            if not isinstance(group, dist.ProcessGroup):
                raise TypeError(f"group must be a ProcessGroup or None, got {type(group).__name__}")
            if rank is not None or num_ranks is not None or store is not None:
                raise ValueError("pass either a process group or rank/num_ranks/store, not both")
            rank, num_ranks = group.rank(), group.size()
        elif rank is None or num_ranks is None or store is None:
            raise ValueError("without a process group, rank=, num_ranks= and store= are required")
        if not (isinstance(num_ranks, int) and num_ranks >= 1 and 0 <= rank < num_ranks):
            raise ValueError(f"need 0 <= rank < num_ranks, got rank={rank}, num_ranks={num_ranks}")
        self.rank, self.num_ranks, self.group_size = rank, num_ranks, num_ranks
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = True
        self.timeout = float(timeout)
        self.shape: LLShape | None = None
        self._servers: list[ServerChannel] = []
        self._clients: list[ClientChannel] = []
        self._recv_buffers: dict = {}
        self._scratch = Scratch()
        self._in_flight: list[LowLatencyHandle | None] = [None] * NUM_SLOTS
        self._num_dispatches = 0
        self._destroyed = False
        self._mode: str | None = None  # "cpu" or "cuda", set by the first dispatch
        self._device: DevicePath | None = None
        given = (num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk)
        if any(v is not None for v in given):
            if any(v is None for v in given):
                raise ValueError(
                    "give all of num_max_dispatch_tokens_per_rank, hidden, num_experts and "
                    "num_topk to set up at construction, or none to set up at the first dispatch"
                )
            self._setup(LLShape(*given))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ set-up, rendezvous
    def _setup(self, shape: LLShape) -> None:
        check_shape(shape, self.num_ranks)
        layout = slot_layout(shape, self.num_ranks)
        transport = ShmTransport()
        r = self.rank
        try:
            for p in range(self.num_ranks):
                self._servers.append(
                    ServerChannel(transport, layout, p, NUM_SLOTS, name=f"rank {p}")
                )
                self._clients.append(
                    ClientChannel(transport, layout, r, NUM_SLOTS, name=f"rank {p}")
                )
            mine = {
                "shape": dataclasses.asdict(shape),
                "server": [s.handle for s in self._servers],
                "client": [c.handle for c in self._clients],
            }
            infos = self._exchange(mine)
            for p, info in enumerate(infos):
                if info["shape"] != mine["shape"]:
                    raise ValueError(
                        f"rank {p} set up with {LLShape(**info['shape']).describe()}, "
                        f"rank {r} with {shape.describe()}"
                    )
            for p, info in enumerate(infos):
                self._clients[p].connect(info["server"][r])
                self._servers[p].connect(info["client"][r])
        except BaseException:
            self._close_channels()
            raise
        num_local = shape.num_experts // self.num_ranks
        self._expert_map = ExpertMap(
            [[(e // num_local, e % num_local)] for e in range(shape.num_experts)], self.num_ranks
        )
        self.shape = shape

    def _exchange(self, mine: dict) -> list[dict]:
        return exchange(
            mine, self.rank, self.num_ranks, self.group, self.store, self.store_prefix, self.timeout
        )

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes of shared memory one rank maps for this shape (at top-8; the argument is
        ignored by the constructor, which sizes the slots itself)."""
        shape = LLShape(num_max_dispatch_tokens_per_rank, hidden, num_experts, SIZE_HINT_TOPK)
        return shm_bytes_per_rank(check_shape(shape, num_ranks), num_ranks)

    # ------------------------------------------------------------------ dispatch
    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        """Returns ``(recv_x, recv_count, handle, event, hook)`` as DeepEP does; recv_x is
        ``(fp8 [L, R*M, H], scales f32 [L, R*M, H/128])`` with use_fp8, else bf16 [L, R*M, H]."""
        self._check_open()
        if round_scale or use_ue8m0:
            raise NotImplementedError("round_scale / use_ue8m0 (power-of-2 or UE8M0 scales)")
        stats = cumulative_local_expert_recv_stats
        device = input_device(x=x, topk_idx=topk_idx, cumulative_local_expert_recv_stats=stats)
        self._mode = check_mode(self._mode, device is not None)
        if device is not None:
            self._device = self._device or DevicePath(self)
            m, e, hook = num_max_dispatch_tokens_per_rank, num_experts, return_recv_hook
            return self._device.dispatch(x, topk_idx, m, e, stats, use_fp8, hook, device)
        x, topk_idx = check_dispatch_inputs(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8
        )
        shape = LLShape(
            num_max_dispatch_tokens_per_rank, x.shape[1], num_experts, topk_idx.shape[1]
        )
        if self.shape is None:
            self._setup(shape)
        elif shape != self.shape:
            raise ValueError(
                f"this buffer was set up for {self.shape.describe()}; got {shape.describe()}"
            )
        num_local = num_experts // self.num_ranks
        if stats is not None:
            check_host("cumulative_local_expert_recv_stats", stats)
            if stats.dtype != torch.int32 or tuple(stats.shape) != (num_local,):
                raise ValueError(
                    f"cumulative_local_expert_recv_stats must be int32 [{num_local}], got "
                    f"{stats.dtype} {list(stats.shape)}"
                )
        index = self._num_dispatches
        slot = index % NUM_SLOTS
        prev = self._in_flight[slot]
        if prev is not None and not prev.combined:
            raise RuntimeError(
                f"dispatch {prev.index} is not combined yet and its slot is needed: at most "
                f"{NUM_SLOTS} dispatches may wait for their combine"
            )
        handle = self._send_requests(x, topk_idx, index, use_fp8)
        self._num_dispatches += 1
        self._in_flight[slot] = handle
        recv_x = self._recv_tensors(slot, use_fp8)
        recv_count = torch.zeros(num_local, dtype=torch.int32)

        def hook() -> None:
            self._receive(handle, recv_x, recv_count, stats, use_fp8)

        if return_recv_hook:
            return recv_x, recv_count, handle, CompletedEvent(), hook
        hook()
        return recv_x, recv_count, handle, CompletedEvent(), None

    def _send_requests(self, x, topk_idx, index: int, use_fp8: bool) -> LowLatencyHandle:
        shape = self.shape
        t, k = topk_idx.shape
        num_local = shape.num_experts // self.num_ranks
        rows_total = self.num_ranks * shape.num_max_dispatch_tokens_per_rank
        enc = Encoding.FP8_E4M3_B128 if use_fp8 else Encoding.BF16
        batches = {}
        if t:
            carried = torch.arange(t, dtype=torch.float32).unsqueeze(1).expand(t, k)
            for b in pack_dispatch(x, topk_idx, carried, self._expert_map, enc):
                batches[b.server] = b
        handle = LowLatencyHandle(
            torch.full((num_local, rows_total), -1, dtype=torch.int32),
            torch.zeros(num_local, self.num_ranks, dtype=torch.int64),
            shape.num_max_dispatch_tokens_per_rank,
            shape.hidden,
            shape.num_experts,
        )
        handle.owner, handle.index, handle.topk_idx = id(self), index, topk_idx.clone()
        handle.sent_rows = []
        slot, seq = index % NUM_SLOTS, index + 1
        for q, client in enumerate(self._clients):
            b = batches.get(q)
            if b is None:  # nothing for rank q: one row whose experts are all elsewhere
                act = torch.zeros(
                    1, shape.hidden, dtype=torch.float8_e4m3fn if use_fp8 else x.dtype
                )
                scales = torch.ones(1, shape.hidden // 128) if use_fp8 else None
                ids = torch.full((1, k), -1, dtype=torch.int32)
                sent = client.send(
                    slot, act, ids, torch.zeros(1, k), scales=scales, encoding=enc, wake=False
                )
                handle.sent_rows.append(torch.empty(0, dtype=torch.int64))
            else:
                sent = client.send(
                    slot,
                    b.activations,
                    b.expert_ids,
                    b.scores,
                    scales=b.scales,
                    encoding=enc,
                    wake=False,
                )
                flat = b.token_index.unsqueeze(1) * k + torch.arange(k)
                handle.sent_rows.append(flat[b.expert_ids >= 0])
            if sent != seq:
                raise ProtocolError(f"rank {q}: request sequence {sent}, expected {seq}")
        for client in self._clients:
            client.ring()
        return handle

    def _recv_tensors(self, slot: int, use_fp8: bool):
        """The slot's reusable receive buffers (DeepEP's two low-latency buffers)."""
        key = (slot, use_fp8)
        if key not in self._recv_buffers:
            s = self.shape
            num_local = s.num_experts // self.num_ranks
            rows = self.num_ranks * s.num_max_dispatch_tokens_per_rank
            if use_fp8:
                data = torch.empty(num_local, rows, s.hidden, dtype=torch.float8_e4m3fn)
                # Column-major in the last two dims, as DeepEP lays its scales out for TMA.
                scales = torch.empty(num_local, s.hidden // 128, rows).transpose(1, 2)
                self._recv_buffers[key] = (data, scales)
            else:
                self._recv_buffers[key] = torch.empty(
                    num_local, rows, s.hidden, dtype=torch.bfloat16
                )
        return self._recv_buffers[key]

    def _receive(self, handle: LowLatencyHandle, recv_x, recv_count, stats, use_fp8: bool) -> None:
        if handle.requests is not None:
            return
        self._check_open()
        slot, seq = handle.index % NUM_SLOTS, handle.index + 1
        want = Encoding.FP8_E4M3_B128 if use_fp8 else Encoding.BF16
        deadline = time.monotonic() + self.timeout
        reqs = []
        for p, server in enumerate(self._servers):
            with naming_peer(self.rank, p, "dispatch request"):
                req = server.wait_slot(slot, max(deadline - time.monotonic(), 0.0))
            if not req.valid or req.seq != seq:
                raise ProtocolError(
                    f"deep_ep.Buffer rank {self.rank}: request of rank {p} in slot {slot} is "
                    f"invalid or out of sequence (code {req.code}, seq {req.seq}, expected {seq})"
                )
            if req.encoding != want:
                raise ProtocolError(
                    f"deep_ep.Buffer rank {self.rank}: rank {p} dispatched {req.encoding.name}, "
                    f"this rank {want.name}: use_fp8 must agree on every rank"
                )
            reqs.append(req)
        num_local = self.shape.num_experts // self.num_ranks
        rows_per_expert = self.num_ranks * self.shape.num_max_dispatch_tokens_per_rank
        ids = [r.expert_ids for r in reqs]
        lay = receive_layout(ids, [r.scores for r in reqs], num_local, rows_per_expert)
        data = recv_x[0].view(torch.uint8) if use_fp8 else recv_x
        acts = torch.cat([r.activations.view(data.dtype) for r in reqs])
        # One gather per expert straight into its rows: the rows of an expert are contiguous
        # in the layout (index_copy_ / index_put_ measured 3x slower than index_select here).
        for e, (a, b) in enumerate(zip(lay.offsets[:-1], lay.offsets[1:], strict=True)):
            if b > a:
                torch.index_select(acts, 0, lay.src_token[a:b], out=data[e, : b - a])
        if use_fp8:
            scales = torch.cat([r.scales for r in reqs]).index_select(0, lay.src_token)
            recv_x[1][lay.expert, lay.pos] = scales
        src_info, layout_range = handle[0], handle[1]
        src_info[lay.expert, lay.pos] = lay.token_index.to(torch.int32)
        layout_range.copy_(lay.layout_range)
        recv_count.copy_(lay.counts)
        if stats is not None:
            stats += lay.counts
        for r in reqs:  # consumed into the receive buffers; only the copied metadata is kept
            r.activations = None
        handle.layout, handle.requests = lay, reqs

    # ------------------------------------------------------------------ combine
    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
    ):
        """Returns ``(combined_x, event, hook)``: combined_x [num_tokens, hidden] bf16."""
        self._check_open()
        if use_logfmt or zero_copy:
            raise NotImplementedError("use_logfmt / zero_copy combine")
        if self._mode == "cuda" and isinstance(handle, DeviceHandle) and handle.owner == id(self):
            return self._device.combine(x, topk_idx, topk_weights, handle, return_recv_hook, out)
        on_cuda = input_device(x=x, topk_idx=topk_idx, topk_weights=topk_weights, out=out)
        check_mode(self._mode or "cpu", on_cuda is not None)
        if not isinstance(handle, LowLatencyHandle) or handle.owner != id(self):
            raise ValueError("handle must come from low_latency_dispatch of this buffer")
        if handle.requests is None:
            raise RuntimeError("call the dispatch's receive hook before combining it")
        if handle.combined or self._in_flight[handle.index % NUM_SLOTS] is not handle:
            raise RuntimeError(f"dispatch {handle.index} was already combined")
        s = self.shape
        want = (
            s.num_experts // self.num_ranks,
            self.num_ranks * s.num_max_dispatch_tokens_per_rank,
            s.hidden,
        )
        check_combine_inputs(x, topk_idx, topk_weights, out, handle.topk_idx, want)
        t = topk_idx.shape[0]
        combined = out if out is not None else torch.empty(t, s.hidden, dtype=torch.bfloat16)
        flat_x = x.view(-1, s.hidden) if x.is_contiguous() else None
        for p, server in enumerate(self._servers):
            rows = handle.layout.reply[p]
            if not rows.numel():
                y = torch.zeros(1, s.hidden, dtype=torch.bfloat16)
            elif flat_x is not None:  # into scratch: respond() copies it into the slot
                y = self._scratch.get("reply", (rows.numel(), s.hidden), torch.bfloat16)
                torch.index_select(flat_x, 0, rows, out=y)
            else:
                y = x[rows // x.shape[1], rows % x.shape[1]]
            server.respond(dataclasses.replace(handle.requests[p], num_tokens=y.shape[0]), y)
        handle.combined = True
        weights = topk_weights.clone() if return_recv_hook else topk_weights
        done = []

        def hook() -> None:
            if not done:
                self._reduce(handle, weights, combined)
                done.append(True)

        if return_recv_hook:
            return combined, CompletedEvent(), hook
        hook()
        return combined, CompletedEvent(), None

    def _reduce(self, handle: LowLatencyHandle, weights, combined) -> None:
        self._check_open()
        s = self.shape
        slot, seq = handle.index % NUM_SLOTS, handle.index + 1
        parts, sent = [], []
        deadline = time.monotonic() + self.timeout
        for q, client in enumerate(self._clients):
            with naming_peer(self.rank, q, "combine answer"):
                resp = client.wait(slot, seq, max(deadline - time.monotonic(), 0.0))
            rows = handle.sent_rows[q]
            if rows.numel():
                if resp.num_tokens != rows.numel():
                    raise ProtocolError(
                        f"deep_ep.Buffer rank {self.rank}: rank {q} answered {resp.num_tokens} "
                        f"rows for {rows.numel()} copies"
                    )
                parts.append(resp.activations)
                sent.append(rows)
        combined.copy_(
            reduce_answers(parts, sent, handle.topk_idx, weights, s.hidden, self._scratch)
        )
        for client in self._clients:  # summed out of the response slots: released
            client.release(slot)

    # ------------------------------------------------------------------ lifetime, errors
    def _check_open(self) -> None:
        if self._destroyed:
            raise RuntimeError("this deep_ep.Buffer was destroyed")

    def _close_channels(self) -> None:
        for ch in (*self._servers, *self._clients):
            ch.close()
        self._servers, self._clients = [], []

    def destroy(self) -> None:
        """Marks our request slots OFFLINE (peers waiting on us fail fast) and unmaps them."""
        if self._destroyed:
            return
        self._destroyed = True
        if self._device is not None:
            self._device.destroy()
        for s in self._servers:
            with contextlib.suppress(Exception):
                s.mark_offline()
        self._close_channels()
        self._recv_buffers.clear()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()
