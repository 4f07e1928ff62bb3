"""Small pieces of the DeepEP-shaped adapter: its event and handle types, slot sizing, the
rendezvous of region handles, and the argument checks of the combine."""

from __future__ import annotations

import contextlib
import json
from datetime import timedelta

import torch

from moecomm._C import SlotRing
from moecomm.compat._ll_layout import LLShape, ReceiveLayout, check_host
from moecomm.errors import PeerLostError, TimeoutError
from moecomm.protocol import SlotLayout

# DeepEP double-buffers the low-latency results; one slot per result in flight.
NUM_SLOTS = 2


class CompletedEvent:
    """Stands in for DeepEP's ``EventOverlap``: host calls are complete when they return."""

    def current_stream_wait(self) -> None:
        return None

    def __enter__(self) -> CompletedEvent:
        return self

    def __exit__(self, *exc) -> None:
        return None


class LowLatencyHandle(tuple):
    """DeepEP's handle ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
    num_experts)``, plus (as attributes) what our combine needs."""

    def __new__(cls, src_info, layout_range, num_max, hidden, num_experts):
        return super().__new__(cls, (src_info, layout_range, num_max, hidden, num_experts))

    owner: int
    index: int  # dispatch number on the owning buffer; slot = index % NUM_SLOTS, seq = index + 1
    topk_idx: torch.Tensor
    sent_rows: list  # per destination rank: int64 t*K + k of each copy, in request order
    requests: list | None = None  # per source rank, after the receive: its Request
    layout: ReceiveLayout | None = None
    combined: bool = False


def slot_layout(shape: LLShape, num_ranks: int) -> SlotLayout:
    """Requests carry at most M rows (each token once per destination rank); answers carry a row
    per (token, k) copy, at most M * min(K, L) of them, so the response slots are sized apart."""
    per_rank = shape.num_max_dispatch_tokens_per_rank
    copies = per_rank * min(shape.num_topk, shape.num_experts // num_ranks)
    return SlotLayout(
        per_rank, shape.hidden, shape.num_topk, "bf16", "bf16", max_response_tokens=copies
    )


def exchange(
    mine: dict, rank: int, num_ranks: int, group, store, prefix: str, timeout: float
) -> list[dict]:
    """Every rank's `mine`, by rank: one all_gather_object over `group`, else through `store`
    (keys ``{prefix}/{rank}``)."""
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
    if not torch.equal(topk_idx, dispatched_idx):
        raise ValueError("topk_idx must be the one given to the dispatch of this handle")
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
