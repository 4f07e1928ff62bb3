"""Small pieces of the DeepEP-shaped adapter: its event and handle types, slot sizing, the
rendezvous of region handles, and the argument checks of the combine."""

from __future__ import annotations

import contextlib
import json
import time
from datetime import timedelta

import torch

from moecomm import _C
from moecomm._C import SlotRing
from moecomm.compat._ll_layout import LLShape, ReceiveLayout, check_host
from moecomm.errors import PeerLostError, PeerOfflineError, TimeoutError
from moecomm.protocol import SlotLayout
from moecomm.transport import WaitStatus, reap_stale_segments

# DeepEP double-buffers the low-latency results; one slot per result in flight.
NUM_SLOTS = 2


class EventHandle:
    """DeepEP's ``deep_ep.EventHandle``: an event recorded on the current CUDA stream at
    construction; ``current_stream_wait()`` makes the (then) current stream wait for it.

    Where CUDA was never initialised in this process no device work exists to order, so the
    handle records nothing (``event`` is None) and its wait is a no-op: the host calls of
    moecomm are complete when they return."""

    def __init__(self) -> None:
        self.event = None
        if torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """DeepEP's ``deep_ep.EventOverlap`` (``deep_ep/utils/event.py``): ``event`` (an
    :class:`EventHandle`-like object, or None), ``extra_tensors``, ``current_stream_wait()``,
    ``register_hook_after_wait``, ``with event:`` / ``with event(release_handle=True):``.

    One difference: DeepEP asserts ``event is not None`` in ``current_stream_wait``; here an
    event of None stands for a call that completed on the host before it returned (moecomm's
    host path), so the wait is a no-op (the hook still runs)."""

    def __init__(self, event=None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            self.hook_after_wait()
            self.hook_after_wait = None
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait) -> None:
        if self.hook_after_wait is not None:
            raise RuntimeError("A hook is already registered on this `EventOverlap`")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


class CompletedEvent(EventOverlap):
    """The event of a host call: complete when the call returned (``event`` is None, as
    DeepEP's is without ``async_finish``)."""

    def __init__(self) -> None:
        super().__init__(None)


class LowLatencyHandle(tuple):
    """DeepEP's handle ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
    num_experts)``, plus (as attributes) what our combine needs."""

    def __new__(cls, src_info, layout_range, num_max, hidden, num_experts):
        return super().__new__(cls, (src_info, layout_range, num_max, hidden, num_experts))

    owner: int
    index: int  # dispatch number on the owning buffer
    round: int  # request round (dispatches and cleans): slot = round % NUM_SLOTS, seq = round + 1
    topk_idx: torch.Tensor
    sent_rows: list  # per destination rank: int64 t*K + k of each copy, in request order
    requests: list | None = None  # per source rank, after the receive: its Request (or None)
    layout: ReceiveLayout | None = None


def slot_layout(shape: LLShape, num_ranks: int, max_local: int | None = None) -> SlotLayout:
    """Requests carry at most M rows (each token once per destination rank); answers carry a row
    per (token, k) copy, at most M * min(K, L) of them, so the response slots are sized apart.
    ``max_local``: the most local experts of a rank (L plus its replicas), default L."""
    per_rank = shape.num_max_dispatch_tokens_per_rank
    local = shape.num_experts // num_ranks if max_local is None else max_local
    copies = per_rank * min(shape.num_topk, local)
    return SlotLayout(
        per_rank, shape.hidden, shape.num_topk, "bf16", "bf16", max_response_tokens=copies
    )


def exchange(
    mine: dict, rank: int, num_ranks: int, group, store, prefix: str, timeout: float, comm=None
) -> list[dict]:
    """Every rank's `mine`, by rank: one all_gather_object over `group`, one allgather over an
    mpi4py `comm`, else through `store` (keys ``{prefix}/{rank}``)."""
    if comm is not None:
        return list(comm.allgather(mine))
    if group is not None:
        import torch.distributed as dist

        out: list = [None] * num_ranks
        dist.all_gather_object(out, mine, group=group)
        return out
    keys = [f"{prefix}/{p}" for p in range(num_ranks)]
    store.set(keys[rank], json.dumps(mine))
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as exc:  # each store raises its own error type at the deadline
        missing = [p for p, k in enumerate(keys) if not store.check([k])]
        raise TimeoutError(
            f"deep_ep.Buffer rank {rank}: ranks {missing} did not publish their regions "
            f"within {timeout:.1f} s ({exc})"
        ) from exc
    return [json.loads(store.get(k)) for k in keys]


def check_combine_inputs(x, topk_idx, topk_weights, out, dispatched_idx, want: tuple) -> None:
    x = check_host("x", x)
    if x.dtype != torch.bfloat16 or tuple(x.shape) != want:
        raise ValueError(f"x must be bf16 {list(want)}, got {x.dtype} {list(x.shape)}")
    check_host("topk_idx", topk_idx)
    # DeepEP reduces over the combine's own topk_idx: the dispatch's, where entries may have
    # been set to -1 since (its shrink test drops the experts of masked ranks that way). An
    # expert the dispatch did not send to has no received row to read.
    if (
        topk_idx.dtype != torch.int64
        or topk_idx.shape != dispatched_idx.shape
        or not bool(((topk_idx == dispatched_idx) | (topk_idx == -1)).all())
    ):
        raise ValueError(
            "topk_idx must be the one given to the dispatch of this handle (entries may be "
            "set to -1 since)"
        )
    check_host("topk_weights", topk_weights)
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"topk_weights must be float32 {list(topk_idx.shape)}, got "
            f"{topk_weights.dtype} {list(topk_weights.shape)}"
        )
    if out is not None:
        check_host("out", out)
        shape = (topk_idx.shape[0], want[2])
        if out.dtype != torch.bfloat16 or tuple(out.shape) != shape:
            raise ValueError(f"out must be bf16 {list(shape)}, got {out.dtype} {list(out.shape)}")


def shm_bytes_per_rank(shape: LLShape, num_ranks: int) -> int:
    """Shared memory one rank maps: a request ring and an answer ring per peer."""
    cfg = slot_layout(shape, num_ranks).config
    return num_ranks * (
        SlotRing(cfg, NUM_SLOTS, True).region_bytes + SlotRing(cfg, NUM_SLOTS, False).region_bytes
    )


@contextlib.contextmanager
def naming_peer(rank: int, peer: int, what: str):
    """Re-raises a wait's TimeoutError / PeerLostError naming both ranks and what was awaited."""
    try:
        yield
    except (TimeoutError, PeerLostError) as exc:
        raise type(exc)(
            f"deep_ep.Buffer rank {rank}: waiting for the {what} of rank {peer}: {exc}"
        ) from exc


# Combine answers travel with their own sequence numbers, disjoint from the requests' (which
# count dispatch / clean rounds from 1): a response's seq is never a request's, so answering a
# request twice, or a request already replaced by a newer round, touches no live request slot.
COMBINE_SEQ_BASE = 1 << 40
PEER_FAILURES = (TimeoutError, PeerLostError, PeerOfflineError)


def wait_request(server, slot: int, seq: int, deadline: float):
    """The request of round `seq` in `slot` of `server`. An older round's request still sitting
    there (a dispatch that was never combined: its slot is reused two rounds later, as DeepEP's
    buffers are) is skipped, whatever its header holds, until the peer overwrites it."""
    while True:
        for req in server.poll():
            if req.slot == slot and req.seq >= seq:
                return req
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{server.name}: no request of round {seq} in slot {slot}")
        status, _ = _C.wait_doorbell(
            server.transport, server.region, server._doorbell, int(remaining * 1e9), server.client
        )
        if status == WaitStatus.PEER_LOST:
            reap_stale_segments()
            raise PeerLostError(f"{server.name}: the process died ({server.client.describe()})")


def check_mask_tensor(mask_status, num_ranks: int) -> None:
    if not isinstance(mask_status, torch.Tensor) or mask_status.dtype != torch.int32:
        raise TypeError("mask_status must be a torch.int tensor, as in DeepEP")
    if tuple(mask_status.shape) != (num_ranks,):
        raise ValueError(f"mask_status must be [{num_ranks}], got {list(mask_status.shape)}")


def check_cost_stats(name: str, t, num_ranks: int) -> None:
    """DeepEP: int64 ``[num_ranks]`` contiguous (accumulated per source rank)."""
    if t is None:
        return
    check_host(name, t)
    if t.dtype != torch.int64 or tuple(t.shape) != (num_ranks,) or not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous int64 [{num_ranks}], got {t.dtype} {list(t.shape)}"
        )
