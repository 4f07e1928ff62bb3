"""``deep_ep.Buffer`` over moecomm (exported as ``moecomm.compat.deep_ep.Buffer``; see that
module's docstring for the contract and the differences from DeepEP): the constructor and
rendezvous, the low-latency dispatch/combine (host path here and in ``host.py``, CUDA path in
``device.py``), the rest of DeepEP's ``Buffer`` surface (static helpers, configs,
events) and the members moecomm refuses by name.

Top-k per call: the slots are sized for the largest top-k the buffer has seen (its first
dispatch's, or the constructor's ``num_topk``); a dispatch with a smaller top-k uses them as they
are, one with a larger top-k re-sizes them first on the host path (``_grow_topk``: a rendezvous of
every rank, made at the same call on every rank as every call is) and is refused on the CUDA
path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import deque

import torch

from moecomm.compat.api import (
    CompletedEvent,
    Config,
    EventHandle,
    EventOverlap,
    combine_config,
    dispatch_config,
    refused,
)
from moecomm.compat.low_latency.device import DevicePath
from moecomm.compat.low_latency.device_ops import (
    DeviceHandle,
    check_mode,
    check_ue8m0_hidden,
    input_device,
)
from moecomm.compat.low_latency.host import HostPath
from moecomm.compat.low_latency.layout import (
    COMBINE_SEQ_BASE,
    NUM_SLOTS,
    LLShape,
    LowLatencyHandle,
    Scratch,
    check_combine_inputs,
    check_cost_stats,
    check_dispatch_inputs,
    check_host,
    check_peer_agrees,
    check_same_shape,
    check_shape,
    shm_bytes_per_rank,
    slot_layout,
)
from moecomm.compat.low_latency.replicas import ReplicaPlan, check_replicas_arg
from moecomm.compat.normal.mode import NormalCalls
from moecomm.compat.rendezvous import exchange, group_rank_and_size
from moecomm.wire.channel import DEFAULT_TIMEOUT_S
from moecomm.wire.client import ClientChannel
from moecomm.wire.server import ServerChannel
from moecomm.wire.shm import ShmTransport

__all__ = ["Buffer"]

DEFAULT_STORE_PREFIX = "moecomm.compat.deep_ep"
# Only for get_low_latency_rdma_size_hint, which is not told the top-k (DeepSeek-V3 uses 8).
SIZE_HINT_TOPK = 8
_refused = functools.partial(refused, "deep_ep.Buffer")

_NO_LOCAL_BUFFER = (
    "DeepEP returns a view of its registered NVLink/RDMA buffer, the one region its peers "
    "write into, which callers slice or zero (vLLM's fault-tolerance retry zeroes the RDMA "
    "buffer to reset the low-latency kernels' counters and flags). moecomm's buffer is not one "
    "region: it is a request ring and an answer ring per peer (separate shared-memory or IPC "
    "segments) whose state is numbered rounds, not counters that zeroing resets, so no tensor "
    "could mean what DeepEP's means"
)
_NO_INTERNODE = (
    "internode (RDMA) normal mode: moecomm's normal mode moves rows over its host transport "
    "between the ranks of one machine (dispatch/combine route there)"
)


class Buffer(HostPath, NormalCalls):
    """DeepEP's ``deep_ep.Buffer`` on moecomm: low-latency and normal-mode dispatch/combine
    with DeepEP's signatures; see ``moecomm.compat.deep_ep`` for the contract."""

    # DeepEP's class attribute: the SMs of its high-throughput kernels (set_num_sms). Read by
    # get_dispatch_config / get_combine_config; moecomm's calls use no SM budget of their own.
    num_sms: int = 20

    def __init__(
        self,
        group,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm=None,
        *,
        use_fabric: bool = False,
        rank: int | None = None,
        num_ranks: int | None = None,
        store=None,
        store_prefix: str = DEFAULT_STORE_PREFIX,
        num_max_dispatch_tokens_per_rank: int | None = None,
        hidden: int | None = None,
        num_experts: int | None = None,
        num_topk: int | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        reroute_replicas: bool = False,
        replicas: dict[int, list[int]] | None = None,
    ) -> None:
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.group, self.store, self.store_prefix, self.comm = group, store, store_prefix, comm
        given = (rank, num_ranks, store)
        if (group is not None or comm is not None) and any(v is not None for v in given):
            raise ValueError("pass a process group (or comm) or rank/num_ranks/store, not both")
        if group is not None:
            rank, num_ranks = group_rank_and_size(group)
        elif comm is not None:
            rank, num_ranks = comm.Get_rank(), comm.Get_size()
        elif rank is None or num_ranks is None or store is None:
            raise ValueError(
                "Either 'group' or 'comm' must be provided (or, moecomm's own way, rank=, "
                "num_ranks= and store=)"
            )
        if not (isinstance(num_ranks, int) and num_ranks >= 1 and 0 <= rank < num_ranks):
            raise ValueError(f"need 0 <= rank < num_ranks, got rank={rank}, num_ranks={num_ranks}")
        self.rank, self.num_ranks, self.group_size = rank, num_ranks, num_ranks
        spec = check_replicas_arg(replicas, reroute_replicas, enable_shrink, num_ranks)
        self._replica_spec = spec
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy, self.enable_shrink = explicitly_destroy, bool(enable_shrink)
        self.timeout = float(timeout)
        self.shape: LLShape | None = None
        self._servers: list[ServerChannel] = []
        self._clients: list[ClientChannel] = []
        self._recv_buffers: dict = {}
        self._combine_buffers: dict = {}
        self._scratch = Scratch()
        self._num_dispatches = 0
        self._num_rounds = 0  # dispatches and cleans: the request rounds
        self._num_combines = 0
        self._mask = torch.zeros(num_ranks, dtype=torch.int32)
        self.dropped_copies = 0  # (token, k) copies sent toward a masked rank: no live copy
        self._destroyed = False
        self._mode: str | None = None  # "cpu" or "cuda", set by the first dispatch
        self._device: DevicePath | None = None
        # The last two dispatches' handles and combines' done-flags: a re-size for a larger
        # top-k waits for none of them (their messages travel in the slots it replaces).
        self._recent_dispatches: deque = deque(maxlen=NUM_SLOTS)
        self._recent_combines: deque = deque(maxlen=NUM_SLOTS)
        given = (num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk)
        if any(v is not None for v in given):
            if any(v is None for v in given):
                raise ValueError(
                    "give all of num_max_dispatch_tokens_per_rank, hidden, num_experts and "
                    "num_topk to set up at construction, or none to set up at the first dispatch"
                )
            self._setup(LLShape(*given))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ set-up, rendezvous
    def _setup(self, shape: LLShape, prefix: str | None = None) -> None:
        check_shape(shape, self.num_ranks)
        plan = ReplicaPlan(self._replica_spec, shape.num_experts, self.num_ranks)
        layout = slot_layout(shape, self.num_ranks, plan.max_local)
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
                "replicas": plan.wire(),
            }
            infos = self._exchange(mine, prefix)
            for p, info in enumerate(infos):
                same_replicas = info["replicas"] == mine["replicas"]
                check_peer_agrees(
                    "deep_ep.Buffer", r, p, shape, LLShape(**info["shape"]), same_replicas
                )
            for p, info in enumerate(infos):
                self._clients[p].connect(info["server"][r])
                self._servers[p].connect(info["client"][r])
        except BaseException:
            self._close_channels()
            raise
        self._plan, self._num_local = plan, len(plan.local[r])
        self.shape = shape

    @property
    def local_experts(self) -> list[int]:
        """The logical expert of each local slot (row of recv_x): ``r*L .. r*L+L-1``, then the
        replicas this rank hosts (moecomm's ``replicas=``), sorted. Known once set up."""
        if self.shape is None:
            raise RuntimeError("the buffer is set up at its first dispatch (or give the shape)")
        return list(self._plan.local[self.rank])

    def _exchange(self, mine: dict, prefix: str | None = None) -> list[dict]:
        return exchange(
            mine,
            self.rank,
            self.num_ranks,
            self.group,
            self.store,
            self.store_prefix if prefix is None else prefix,
            self.timeout,
            self.comm,
        )

    def _grow_topk(self, num_topk: int) -> None:
        """Re-sizes the slots for a larger top-k: new request and answer rings for every peer,
        set up by a rendezvous (store keys ``{store_prefix}/topk{K}``), then the old rings are
        closed. Every rank makes it at the same dispatch (every rank makes the same calls with
        the same top-k, as engines do: one MoE layer, one top-k). Refused while a message of
        the old rings may still be unread: a dispatch not received or a combine not reduced
        among the last two, or a masked rank (it would not come to the rendezvous)."""
        s = self.shape
        if type(self)._setup is not Buffer._setup:  # a subclass that sets its channels up itself
            raise NotImplementedError(
                f"{type(self).__name__}: a dispatch with num_topk={num_topk} needs the slots "
                f"re-sized (set up for top-k up to {s.num_topk}), which this buffer cannot do"
            )
        pending = [h.index for h in self._recent_dispatches if h.requests is None]
        unreduced = sum(1 for done in self._recent_combines if not done)
        if pending or unreduced:
            raise RuntimeError(
                f"deep_ep.Buffer rank {self.rank}: a dispatch with num_topk={num_topk} needs "
                f"the slots re-sized (set up for top-k up to {s.num_topk}), which cannot happen "
                f"while results are in flight: call the receive hook of dispatch(es) {pending} "
                f"and of {unreduced} combine(s) first, or give the largest top-k at "
                "construction (Buffer(..., num_topk=...))"
            )
        if self.enable_shrink and bool(self._mask.any()):
            masked = self._mask.nonzero().flatten().tolist()
            raise NotImplementedError(
                f"deep_ep.Buffer rank {self.rank}: re-sizing the slots for num_topk={num_topk} "
                f"is a rendezvous of every rank, and ranks {masked} are masked"
            )
        old = (self._servers, self._clients)
        self._servers, self._clients = [], []
        try:
            grown = dataclasses.replace(s, num_topk=num_topk)
            self._setup(grown, f"{self.store_prefix}/topk{num_topk}")
        except BaseException:
            self._servers, self._clients = old
            raise
        for ch in (*old[0], *old[1]):
            ch.close()

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes of shared memory one rank maps for this shape (at top-8; the argument is
        ignored by the constructor, which sizes the slots itself)."""
        shape = LLShape(num_max_dispatch_tokens_per_rank, hidden, num_experts, SIZE_HINT_TOPK)
        return shm_bytes_per_rank(check_shape(shape, num_ranks), num_ranks)

    # ------------------------------------------------------------------ DeepEP's helpers
    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the FP8 features are there: moecomm's fp8 dispatch works on every path."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's: sets the class attribute ``Buffer.num_sms`` (even), which the recommended
        configs carry. moecomm's calls take no SM budget from it."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int):
            raise TypeError(f"the SM count must be an int, got {new_num_sms!r}")
        if new_num_sms % 2:
            raise ValueError("The SM count must be even")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """DeepEP's: an event captured on the current CUDA stream (``EventOverlap(
        EventHandle())``); without CUDA in this process, an event with nothing to wait for."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended normal-mode dispatch config for `num_ranks` (its table; other
        rank counts raise, as DeepEP asserts). Accepted and ignored by moecomm's dispatch."""
        return dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended normal-mode combine config (its table)."""
        return combine_config(num_ranks, Buffer.num_sms)

    def get_comm_stream(self):
        raise _refused(
            "get_comm_stream",
            "moecomm runs every call on the caller's current stream (host calls on the "
            "caller's thread); there is no communication stream",
        )

    def get_local_buffer_tensor(
        self,
        dtype: torch.dtype,
        size: torch.Size | None = None,
        offset: int = 0,
        use_rdma_buffer: bool = False,
    ) -> torch.Tensor:
        raise _refused(
            f"get_local_buffer_tensor(use_rdma_buffer={use_rdma_buffer})", _NO_LOCAL_BUFFER
        )

    def internode_dispatch(self, *args, **kwargs):
        raise _refused("internode_dispatch", _NO_INTERNODE)

    def internode_combine(self, *args, **kwargs):
        raise _refused("internode_combine", _NO_INTERNODE)

    def _check_ll(self) -> None:
        self._check_open()
        if not self.low_latency_mode:
            raise RuntimeError(
                "low-latency calls need Buffer(..., low_latency_mode=True), as in DeepEP"
            )

    # ------------------------------------------------------------------ dispatch
    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        *,
        use_nvfp4: bool = False,
        x_global_scale: torch.Tensor | None = None,
    ):
        """Returns ``(recv_x, recv_count, handle, event, hook)`` as DeepEP does. recv_x is
        ``(fp8 [L, R*M, H], scales)`` with use_fp8 (scales f32 ``[L, R*M, H/128]``, or with
        use_ue8m0 int32 ``[L, R*M, H/512]``; column-major last two dims), else bf16.

        The top-k is ``topk_idx.shape[1]``, per call. ``use_nvfp4`` / ``x_global_scale`` (the
        NVFP4 dispatch of DeepEP's hybrid-ep branch, which vLLM and SGLang pass for NVFP4
        models) are refused by name."""
        if use_nvfp4 or x_global_scale is not None:
            given = "use_nvfp4=True" if use_nvfp4 else "x_global_scale"
            raise NotImplementedError(
                f"deep_ep.Buffer.low_latency_dispatch({given}): NVFP4 dispatch (DeepEP's "
                "hybrid-ep branch) is not implemented by moecomm; dispatch bf16 or fp8 "
                "(vLLM: VLLM_DEEPEPLL_NVFP4_DISPATCH=0)"
            )
        self._check_ll()
        if use_ue8m0 and not round_scale:
            raise ValueError("UE8M0 SF requires `round_scale=True` (as DeepEP asserts)")
        stats = cumulative_local_expert_recv_stats
        cost = dispatch_wait_recv_cost_stats
        device = input_device(x=x, topk_idx=topk_idx, cumulative_local_expert_recv_stats=stats)
        self._mode = check_mode(self._mode, device is not None)
        if device is not None:
            if self.enable_shrink:
                raise NotImplementedError(
                    "enable_shrink is implemented on the host path only (CPU tensors): on CUDA "
                    "tensors the kernels would have to skip a masked rank on the device"
                )
            self._device = self._device or DevicePath(self)
            m, e, hook = num_max_dispatch_tokens_per_rank, num_experts, return_recv_hook
            flags = (use_fp8, round_scale, use_ue8m0)
            return self._device.dispatch(x, topk_idx, m, e, stats, cost, flags, hook, device)
        x, topk_idx = check_dispatch_inputs(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8
        )
        check_ue8m0_hidden(use_ue8m0, x.shape[1])
        shape = LLShape(
            num_max_dispatch_tokens_per_rank, x.shape[1], num_experts, topk_idx.shape[1]
        )
        if self.shape is None:
            self._setup(shape)
        else:
            check_same_shape(self.shape, shape)
        num_local = self._num_local
        if stats is not None:
            check_host("cumulative_local_expert_recv_stats", stats)
            if stats.dtype != torch.int32 or tuple(stats.shape) != (num_local,):
                raise ValueError(
                    f"cumulative_local_expert_recv_stats must be int32 [{num_local}], got "
                    f"{stats.dtype} {list(stats.shape)}"
                )
        check_cost_stats("dispatch_wait_recv_cost_stats", cost, self.num_ranks)
        if shape.num_topk > self.shape.num_topk:
            self._grow_topk(shape.num_topk)
        rnd = self._num_rounds
        handle = self._send_requests(x, topk_idx, rnd, use_fp8, round_scale)
        handle.index = self._num_dispatches
        self._recent_dispatches.append(handle)
        self._num_dispatches += 1
        self._num_rounds += 1
        recv_x = self._recv_tensors(rnd % NUM_SLOTS, use_fp8, use_ue8m0)
        recv_count = torch.zeros(num_local, dtype=torch.int32)

        def hook() -> None:
            self._receive(handle, recv_x, recv_count, stats, cost, use_fp8, use_ue8m0)

        if return_recv_hook:
            return recv_x, recv_count, handle, CompletedEvent(), hook
        hook()
        return recv_x, recv_count, handle, CompletedEvent(), None

    def get_next_low_latency_combine_buffer(self, handle: object):
        """The bf16 ``[L, R*M, H]`` tensor the next ``low_latency_combine(..., zero_copy=True)``
        reads its expert outputs from (fill it yourself). Reused two combines later."""
        self._check_ll()
        if isinstance(handle, DeviceHandle):
            if handle.owner != id(self) or self._device is None:
                raise ValueError("handle must come from low_latency_dispatch of this buffer")
            return self._device.combine_buffer(handle)
        _, _, m, hidden, _ = handle
        key = self._num_combines % NUM_SLOTS
        want = (self._num_local, self.num_ranks * m, hidden)
        buf = self._combine_buffers.get(key)
        if buf is None or tuple(buf.shape) != want:
            buf = self._combine_buffers[key] = torch.zeros(want, dtype=torch.bfloat16)
        return buf

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
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
        *,
        overlap: bool = False,
        packed_recv_count: torch.Tensor | None = None,
        comp_signal: torch.Tensor | None = None,
        block_m: int | None = None,
        threshold: int | None = None,
        num_sms: int | None = None,
        src_signals: torch.Tensor | None = None,
        src_signal_expect_value: int | None = None,
    ):
        """Returns ``(combined_x, event, hook)``: combined_x [num_tokens, hidden] bf16. With
        ``zero_copy`` the expert outputs are read from get_next_low_latency_combine_buffer's
        tensor (``x`` is only checked), as DeepEP reads its registered buffer.

        ``overlap=True`` with its signals (SGLang's single-batch overlap, a DeepEP fork: the
        combine starts while the expert GEMM still writes ``x`` and waits on per-block
        signals) is refused by name: moecomm reads ``x`` when the call runs. With
        ``overlap=False`` the fork's other keywords change nothing and are ignored."""
        if overlap:
            raise NotImplementedError(
                "deep_ep.Buffer.low_latency_combine(overlap=True): the signal-driven overlap "
                "of the combine with the expert GEMM (SGLang's single-batch overlap; comp_signal"
                " / src_signals) is not implemented by moecomm, whose combine reads x when it "
                "is called; run without single-batch overlap"
            )
        self._check_ll()
        cost = combine_wait_recv_cost_stats
        if self._mode == "cuda" and isinstance(handle, DeviceHandle) and handle.owner == id(self):
            if cost is not None:
                raise NotImplementedError(
                    "combine_wait_recv_cost_stats is implemented on the host path only (CPU "
                    "tensors): on CUDA tensors the combine waits inside a kernel, not on the host"
                )
            flags, hook = (use_logfmt, zero_copy), return_recv_hook
            return self._device.combine(x, topk_idx, topk_weights, handle, flags, hook, out)
        on_cuda = input_device(x=x, topk_idx=topk_idx, topk_weights=topk_weights, out=out)
        check_mode(self._mode or "cpu", on_cuda is not None)
        if not isinstance(handle, LowLatencyHandle) or handle.owner != id(self):
            raise ValueError("handle must come from low_latency_dispatch of this buffer")
        if handle.requests is None:
            raise RuntimeError("call the dispatch's receive hook before combining it")
        s = self.shape
        want = (self._num_local, self.num_ranks * s.num_max_dispatch_tokens_per_rank, s.hidden)
        check_combine_inputs(x, topk_idx, topk_weights, out, handle.topk_idx, want)
        check_cost_stats("combine_wait_recv_cost_stats", cost, self.num_ranks)
        if zero_copy:
            x = self.get_next_low_latency_combine_buffer(handle)
        c = self._num_combines
        self._num_combines += 1
        slot, seq = c % NUM_SLOTS, COMBINE_SEQ_BASE + c + 1
        t = topk_idx.shape[0]
        combined = out if out is not None else torch.empty(t, s.hidden, dtype=torch.bfloat16)
        flat_x = x.view(-1, s.hidden) if x.is_contiguous() else None
        for p, server in enumerate(self._servers):
            req = handle.requests[p]
            if req is None or not self._live(p):
                continue
            rows = handle.layout.reply[p]
            if not rows.numel():
                y = torch.zeros(1, s.hidden, dtype=torch.bfloat16)
            elif flat_x is not None:  # into scratch: respond() copies it into the slot
                y = self._scratch.get("reply", (rows.numel(), s.hidden), torch.bfloat16)
                torch.index_select(flat_x, 0, rows, out=y)
            else:
                y = x[rows // x.shape[1], rows % x.shape[1]]
            answer = dataclasses.replace(req, slot=slot, seq=seq, num_tokens=y.shape[0])
            server.respond(answer, y)
        weights = topk_weights.clone() if return_recv_hook else topk_weights
        idx = topk_idx.clone() if return_recv_hook else topk_idx
        done: list = []
        self._recent_combines.append(done)

        def hook() -> None:
            if not done:
                self._reduce(handle, slot, seq, idx, weights, combined, cost, use_logfmt)
                done.append(True)

        if return_recv_hook:
            return combined, CompletedEvent(), hook
        hook()
        return combined, CompletedEvent(), None

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
        self._close_normal()
        if self._device is not None:
            self._device.destroy()
        for s in self._servers:
            with contextlib.suppress(Exception):
                s.mark_offline()
        self._close_channels()
        self._recv_buffers.clear()
        self._combine_buffers.clear()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()
