"""The CUDA half of one ``deep_ep.Buffer`` (its lanes are in ``_ll_device.py``): stream order
across calls, the dispatch with its receive hook, the combine. ``torch.cuda`` is reached through
``_ll_device._cuda``, the one name the CPU tests replace with stand-ins."""

from __future__ import annotations

import torch

from moecomm.compat import _ll_device as dev
from moecomm.compat._ll_device_ops import (
    DeviceHandle,
    check_device_combine,
    check_device_cost,
    check_device_inputs,
    check_ue8m0_hidden,
)
from moecomm.compat._ll_layout import LLShape, check_same_shape, check_shape
from moecomm.compat._ll_support import NUM_SLOTS
from moecomm.errors import MoecommError


class DevicePath:
    """The CUDA half of one deep_ep.Buffer."""

    def __init__(self, buf, kernels=None) -> None:
        import moecomm.cuda

        try:
            self.k = kernels or moecomm.cuda.cuda_module()
        except MoecommError as exc:
            raise type(exc)(
                f"deep_ep.Buffer got CUDA tensors, but its CUDA path cannot run: {exc}"
            ) from exc
        self.buf = buf
        self.lanes: dict[bool, dev._Lane] = {}
        self.device: torch.device | None = None
        self.last_event = None
        self.last_stream = None
        self.num_dispatches = 0
        self.combine_buffers: dict[tuple[bool, int], torch.Tensor] = {}

    def _stream(self, device: torch.device):
        if self.device is None:
            self.device = device
        elif device != self.device:
            raise ValueError(f"this deep_ep.Buffer runs on {self.device}, got {device}")
        stream = dev._cuda.current_stream(device)
        if self.last_event is not None and stream != self.last_stream:
            stream.wait_event(self.last_event)  # keep the calls in order across streams
        return stream

    def _done(self, stream) -> dev.CudaEvent:
        ev = dev.CudaEvent(stream)
        self.last_event, self.last_stream = ev.event.event, stream
        return ev

    def dispatch(
        self, x, topk_idx, num_max, num_experts, stats, cost, flags, return_recv_hook, device
    ):
        """`flags`: (use_fp8, round_scale, use_ue8m0) as given to low_latency_dispatch."""
        buf = self.buf
        use_fp8, round_scale, use_ue8m0 = flags
        check_device_inputs(x, topk_idx, num_max, num_experts, use_fp8)
        check_ue8m0_hidden(use_ue8m0, x.shape[1])  # as the host path checks it
        use_ue8m0 = use_ue8m0 and use_fp8  # bf16 rows have no scales (DeepEP ignores it)
        shape = LLShape(num_max, x.shape[1], num_experts, topk_idx.shape[1])
        if buf.shape is None:
            buf.shape = check_shape(shape, buf.num_ranks)
        else:
            check_same_shape(buf.shape, shape)
            if shape.num_topk > buf.shape.num_topk:
                raise NotImplementedError(
                    f"low_latency_dispatch on CUDA tensors with num_topk={shape.num_topk}: this "
                    f"Buffer's CUDA slots were sized at its first dispatch for top-k up to "
                    f"{buf.shape.num_topk}, and the CUDA path does not re-size them (the host "
                    f"path does). Give the largest top-k at construction (Buffer(..., "
                    f"num_topk=...) with the other shape keywords)"
                )
            shape = buf.shape  # the lane is sized for the buffer's top-k; this call uses fewer
        num_local = num_experts // buf.num_ranks
        if stats is not None and (
            stats.dtype != torch.int32
            or tuple(stats.shape) != (num_local,)
            or stats.device != device
        ):
            raise ValueError(
                f"cumulative_local_expert_recv_stats must be int32 [{num_local}] on the device, "
                f"got {stats.dtype} {list(stats.shape)} on {stats.device}"
            )
        check_device_cost("dispatch_wait_recv_cost_stats", cost, buf.num_ranks, device)
        stream = self._stream(device)
        with dev._cuda.device(device), dev._cuda.stream(stream):
            lane = self.lanes.get(use_fp8)
            if lane is None:
                lane = self.lanes[use_fp8] = dev._Lane(self, shape, use_fp8, device)
            rows = buf.num_ranks * num_max
            handle = DeviceHandle(
                torch.full((num_local, rows), -1, dtype=torch.int32, device=device),
                torch.zeros(num_local, buf.num_ranks, dtype=torch.int64, device=device),
                num_max,
                x.shape[1],
                num_experts,
            )
            handle.owner, handle.index = id(buf), self.num_dispatches
            # The reduce reads the ids the kernels routed, whatever the caller does with theirs.
            handle.topk_idx, handle.lane = topk_idx.clone(), lane
            # Whatever became of the dispatch two earlier (combined or not), its slot is reused,
            # as DeepEP's buffers are: its handle keeps what its combine needs.
            lane.send(x, topk_idx, round_scale, handle, stream)
            self.num_dispatches += 1
            recv_x = lane.recv_tensors(handle.slot, use_ue8m0)
            recv_count = torch.zeros(num_local, dtype=torch.int32, device=device)
            event = self._done(stream)

        def hook() -> None:
            if handle.received:
                return
            buf._check_open()
            s = self._stream(device)
            with dev._cuda.device(device), dev._cuda.stream(s):
                lane.receive(handle, recv_x, recv_count, stats, cost, use_ue8m0, s)
                self._done(s)

        if return_recv_hook:
            return recv_x, recv_count, handle, event, hook
        hook()
        return recv_x, recv_count, handle, self._done(stream), None

    def combine_buffer(self, handle: DeviceHandle) -> torch.Tensor:
        """The bf16 [L, R*M, H] device tensor the next zero_copy combine of `handle`'s lane
        reads (one per response slot: reused two combines of the lane later)."""
        lane, s = handle.lane, self.buf.shape
        key = (lane.use_fp8, lane.num_combines % NUM_SLOTS)
        got = self.combine_buffers.get(key)
        if got is None:
            want = (lane.num_local, self.buf.num_ranks * s.num_max_dispatch_tokens_per_rank)
            with dev._cuda.device(lane.device):
                got = torch.zeros(*want, s.hidden, dtype=torch.bfloat16, device=lane.device)
            self.combine_buffers[key] = got
        return got

    def combine(self, x, topk_idx, topk_weights, handle, flags, return_recv_hook, out):
        """`flags`: (use_logfmt, zero_copy) as given to low_latency_combine."""
        buf = self.buf
        use_logfmt, zero_copy = flags
        if not handle.received:
            raise RuntimeError("call the dispatch's receive hook before combining it")
        lane = handle.lane
        s = buf.shape
        want = (s.num_experts // buf.num_ranks, buf.num_ranks * s.num_max_dispatch_tokens_per_rank)
        check_device_combine(x, topk_idx, topk_weights, out, handle, (*want, s.hidden))
        if zero_copy:
            x = self.combine_buffer(handle)
        device = x.device
        stream = self._stream(device)
        t = topk_idx.shape[0]
        with dev._cuda.device(device), dev._cuda.stream(stream):
            combined = (
                out
                if out is not None
                else torch.empty(t, s.hidden, dtype=torch.bfloat16, device=device)
            )
            slot, seq = lane.respond(x, handle, stream)
            # The host path's rule: a copy the combine's topk_idx no longer selects (-1 now)
            # is left out; the others are read where the dispatch routed them.
            idx = torch.where(topk_idx >= 0, handle.topk_idx, -1)
            weights = topk_weights.clone() if return_recv_hook else topk_weights
            event = self._done(stream)
        done = []

        def hook() -> None:
            if done:
                return
            buf._check_open()
            st = self._stream(device)
            with dev._cuda.device(device), dev._cuda.stream(st):
                lane.reduce(handle, slot, seq, idx, weights, combined, use_logfmt, st)
                self._done(st)
            done.append(True)

        if return_recv_hook:
            return combined, event, hook
        hook()
        return combined, self._done(stream), None

    def destroy(self) -> None:
        for lane in self.lanes.values():
            lane.close()
        self.lanes.clear()
