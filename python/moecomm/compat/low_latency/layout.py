"""Pure-torch pieces of the DeepEP-shaped low-latency adapter: argument checks, the per-expert
receive layout, the combine reduction. No communication here (see ``moecomm.compat.deep_ep``).

Receive layout (the part that differs from DeepEP on purpose): the rows of local expert ``e`` in
``recv_x[e, :recv_count[e]]`` are ordered **source rank major, then source token index
ascending**. Every request is laid out with :func:`moecomm.ops.reorganize`, which keeps the flat
(batch = source rank, row, k) order of the copies, and a request keeps the sender's token order
(:func:`moecomm.ops.pack_dispatch`). DeepEP orders the ranks of one expert by arrival.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecomm._C import SlotRing
from moecomm.ops.reorg import ExpertLayout, reorganize
from moecomm.wire.protocol import SCALE_BLOCK, SlotLayout

# f32 holds every integer below 2^24 exactly; the request's score column carries token indices.
MAX_TOKENS_PER_RANK = 1 << 24
_LOW_HALF = 32  # layout_range packs (begin << 32) | count, as DeepEP does


@dataclass(frozen=True)
class LLShape:
    """What every low-latency call must agree on, on every rank (slots are sized from it).
    ``num_topk`` of a Buffer's shape is the largest top-k its slots hold; each dispatch takes
    its own top-k from ``topk_idx`` (any value up to that; the host path re-sizes for more)."""

    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_topk: int

    def describe(self) -> str:
        return (
            f"num_max_dispatch_tokens_per_rank={self.num_max_dispatch_tokens_per_rank}, "
            f"hidden={self.hidden}, num_experts={self.num_experts}, num_topk={self.num_topk}"
        )


def check_peer_agrees(
    api: str, rank: int, peer: int, mine: LLShape, theirs: LLShape, same_replicas: bool
) -> None:
    """What a peer sent at set-up against this rank's own: the same shape and replicas, or a
    ValueError naming both (``api`` names the Buffer, ``deep_ep.Buffer`` or ``nixl_ep.Buffer``)."""
    if theirs != mine:
        raise ValueError(
            f"{api} rank {rank}: rank {peer} set up with {theirs.describe()}, this rank with "
            f"{mine.describe()}"
        )
    if not same_replicas:
        raise ValueError(f"{api}: rank {peer} and rank {rank} were given different replicas")


def check_same_shape(have: LLShape, got: LLShape) -> None:
    """A call's shape against the buffer's: everything but the top-k must be the same."""
    keep = (have.num_max_dispatch_tokens_per_rank, have.hidden, have.num_experts)
    if keep != (got.num_max_dispatch_tokens_per_rank, got.hidden, got.num_experts):
        raise ValueError(
            f"this buffer was set up for num_max_dispatch_tokens_per_rank="
            f"{have.num_max_dispatch_tokens_per_rank}, hidden={have.hidden}, "
            f"num_experts={have.num_experts} (slots for top-k up to {have.num_topk}); got "
            f"{got.describe()}"
        )


def _positive_int(name: str, v: object, upper: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    if upper is not None and v > upper:
        raise ValueError(f"{name} must be at most {upper}, got {v}")
    return v


def check_shape(shape: LLShape, num_ranks: int) -> LLShape:
    _positive_int(
        "num_max_dispatch_tokens_per_rank",
        shape.num_max_dispatch_tokens_per_rank,
        MAX_TOKENS_PER_RANK,
    )
    _positive_int("hidden", shape.hidden)
    _positive_int("num_topk", shape.num_topk)
    e = _positive_int("num_experts", shape.num_experts)
    if e % num_ranks:
        raise ValueError(
            f"num_experts ({e}) must be divisible by the number of ranks ({num_ranks})"
        )
    return shape


def check_host(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "cuda":
        raise NotImplementedError(
            f"{name} is on {t.device}: the host path of moecomm.compat.deep_ep takes CPU tensors; "
            "CUDA tensors take the device kernels' path (compat/low_latency/device.py), chosen by "
            "the dispatch"
        )
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    return t


def check_dispatch_tensors(x: torch.Tensor, topk_idx: torch.Tensor) -> None:
    """The dtypes and shapes of a dispatch's ``x`` and ``topk_idx``, on either path (reads no
    value, so no host sync on the CUDA path)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be torch.bfloat16 (as in DeepEP), got {x.dtype}")
    if x.dim() != 2 or x.shape[1] < 1:
        raise ValueError(f"x must be [num_tokens, hidden], got shape {list(x.shape)}")
    if topk_idx.dtype != torch.int64:
        raise TypeError(f"topk_idx must be torch.int64, got {topk_idx.dtype}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] or topk_idx.shape[1] < 1:
        raise ValueError(
            f"topk_idx must be [num_tokens={x.shape[0]}, num_topk>=1], got {list(topk_idx.shape)}"
        )


def check_dispatch_inputs(
    x: object, topk_idx: object, num_max: object, num_experts: object, use_fp8: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    x = check_host("x", x)
    topk_idx = check_host("topk_idx", topk_idx)
    check_dispatch_tensors(x, topk_idx)
    _, e = check_dispatch_sizes(x, num_max, num_experts, use_fp8, MAX_TOKENS_PER_RANK)
    check_topk(topk_idx, e)
    return x, topk_idx


def check_dispatch_sizes(
    x: torch.Tensor, num_max: object, num_experts: object, use_fp8: bool, max_tokens=None
) -> tuple[int, int]:
    """``(num_max, num_experts)`` of a dispatch, on either path (reads no tensor value): both
    positive ints (``num_max`` at most ``max_tokens`` when given), ``x`` within ``num_max``
    tokens, and with ``use_fp8`` a hidden size the 128-channel scales divide."""
    m = _positive_int("num_max_dispatch_tokens_per_rank", num_max, max_tokens)
    e = _positive_int("num_experts", num_experts)
    if x.shape[0] > m:
        raise ValueError(
            f"x has {x.shape[0]} tokens, more than num_max_dispatch_tokens_per_rank={m}"
        )
    if use_fp8 and x.shape[1] % SCALE_BLOCK:
        raise ValueError(
            f"use_fp8 needs hidden to be a multiple of {SCALE_BLOCK} (one scale per "
            f"{SCALE_BLOCK} channels), got hidden={x.shape[1]}"
        )
    return m, e


def check_topk(topk_idx: torch.Tensor, num_experts: int) -> None:
    if not topk_idx.numel():
        return
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        raise ValueError(
            f"topk_idx entries must be in [-1, {num_experts}), got {int(topk_idx[bad][0])}"
        )
    s = topk_idx.sort(dim=1).values
    if bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()):
        raise ValueError("topk_idx selects the same expert twice for one token")


@dataclass
class ReceiveLayout:
    """Where the copies of one dispatch landed on this rank."""

    counts: torch.Tensor  # [L] int32 copies per local expert (recv_count)
    offsets: list[int]  # [L + 1] first layout row of each expert
    expert: torch.Tensor  # [N] int64 local expert of each layout row
    pos: torch.Tensor  # [N] int64 row inside recv_x[expert]
    src_token: torch.Tensor  # [N] int64 row of the concatenated requests
    token_index: torch.Tensor  # [N] int64 token index on the source rank
    layout_range: torch.Tensor  # [L, R] int64 (begin << 32) | count per source rank
    reply: list[torch.Tensor]  # per source: rows of recv_x.view(L * R * M, H) of its copies


def receive_layout(
    ids: list[torch.Tensor], token_index: list[torch.Tensor], num_local: int, rows_per_expert: int
) -> ReceiveLayout:
    """Lays out the copies of one request per source rank (``ids[p]`` [n_p, K] int32 local
    expert or -1; ``token_index[p]`` [n_p, K] f32 carrying the source token index)."""
    lay: ExpertLayout = reorganize(ids, token_index, num_local)
    n = lay.num_rows
    r = len(ids)
    expert = torch.repeat_interleave(torch.arange(num_local), lay.counts.to(torch.int64))
    pos = torch.arange(n) - lay.offsets.index_select(0, expert)
    flat = expert * rows_per_expert + pos
    per_rank = torch.bincount(
        expert * r + lay.src_batch.to(torch.int64), minlength=num_local * r
    ).view(num_local, r)
    begin = per_rank.cumsum(1) - per_rank
    reply = []
    for p in range(r):
        rows = lay.slot_of[lay.batch_offsets[p] : lay.batch_offsets[p + 1]].reshape(-1)
        # Copies in (row, k) order: the order the sender expects them back.
        reply.append(flat.index_select(0, rows[rows >= 0]))
    return ReceiveLayout(
        counts=lay.counts,
        offsets=lay.offsets.tolist(),
        expert=expert,
        pos=pos,
        src_token=lay.src_token,
        token_index=lay.scores.to(torch.int64),
        layout_range=(begin << _LOW_HALF) | per_rank,
        reply=reply,
    )


class Scratch:
    """Reusable work tensors by name. Fresh multi-MB tensors cost page faults on every call
    (measured ~3 ms per 15 MB on the 2-core hosts), more than the copies they hold."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        t = self._tensors.get(name)
        if t is None or t.dtype != dtype or t.numel() < n:
            t = self._tensors[name] = torch.empty(n, dtype=dtype)
        return t[:n].view(shape)


def weighted_sum(
    rows: torch.Tensor,
    source: torch.Tensor,
    topk_idx: torch.Tensor,
    weights: torch.Tensor,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """``out[t] = Σ_k w[t, k] · y(t, k)`` over k ascending with ``topk_idx[t, k] >= 0``, in f32:
    one product, then one sum, each rounded to f32 (no fused multiply-add).

    ``y(t, k) = rows[source[t, k]]`` (rows [N, H] bf16; source [T, K] int64; entries of
    unselected k may point anywhere, their product is replaced by -0.0, which leaves every sum
    unchanged). Returns [T, H] f32 (a scratch tensor when ``scratch`` is given).
    """
    scratch = scratch or Scratch()
    t, k = source.shape
    h = rows.shape[1]
    acc = scratch.get("acc", (t, h), torch.float32).zero_()
    picked = scratch.get("picked", (t, h), rows.dtype)
    prod = scratch.get("prod", (t, h), torch.float32)
    w = weights.float()
    skipped = (topk_idx < 0).t().tolist()
    for j in range(k):
        torch.index_select(rows, 0, source[:, j], out=picked)
        prod.copy_(picked).mul_(w[:, j : j + 1])
        holes = [i for i, s in enumerate(skipped[j]) if s]
        if holes:
            prod.index_fill_(0, torch.tensor(holes), -0.0)
        acc.add_(prod)
    return acc


def reduce_answers(
    parts: list[torch.Tensor],
    sent: list[torch.Tensor],
    topk_idx: torch.Tensor,
    weights: torch.Tensor,
    hidden: int,
    scratch: Scratch,
) -> torch.Tensor:
    """The combine's reduction over the answers of every rank, in rank order: ``parts[i]`` holds
    one row per copy ``sent[i]`` (flat ``t * K + k`` indices), bf16 (f32 when LogFMT-decoded).
    Copy (t, k) reads row ``source[t, k]`` of the concatenated answers; unselected copies read
    a zero row."""
    t, k = topk_idx.shape
    n = sum(p.shape[0] for p in parts)
    dtype = parts[0].dtype if parts else torch.bfloat16  # f32: LogFMT-decoded answers
    answers = scratch.get("answers", (n + 1, hidden), dtype)
    if parts:
        torch.cat(parts, out=answers[:n])
    answers[n].zero_()
    source = torch.full((t * k,), n, dtype=torch.int64)
    if sent:
        source[torch.cat(sent)] = torch.arange(n)
    return weighted_sum(answers, source.view(t, k), topk_idx, weights, scratch)


# ---------------------------------------------------------------------------- slots, handle
# DeepEP double-buffers the low-latency results; one slot per result in flight.
NUM_SLOTS = 2

# Combine answers travel with their own sequence numbers, disjoint from the requests' (which
# count dispatch / clean rounds from 1): a response's seq is never a request's, so answering a
# request twice, or a request already replaced by a newer round, touches no live request slot.
COMBINE_SEQ_BASE = 1 << 40


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


def shm_bytes_per_rank(shape: LLShape, num_ranks: int) -> int:
    """Shared memory one rank maps: a request ring and an answer ring per peer."""
    cfg = slot_layout(shape, num_ranks).config
    return num_ranks * (
        SlotRing(cfg, NUM_SLOTS, True).region_bytes + SlotRing(cfg, NUM_SLOTS, False).region_bytes
    )


# ---------------------------------------------------------------------------- combine, masks
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


def check_cost_stats(name: str, t, num_ranks: int) -> None:
    """DeepEP: int64 ``[num_ranks]`` contiguous (accumulated per source rank)."""
    if t is None:
        return
    check_host(name, t)
    if t.dtype != torch.int64 or tuple(t.shape) != (num_ranks,) or not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous int64 [{num_ranks}], got {t.dtype} {list(t.shape)}"
        )


def check_mask_tensor(mask_status, num_ranks: int) -> None:
    if not isinstance(mask_status, torch.Tensor) or mask_status.dtype != torch.int32:
        raise TypeError("mask_status must be a torch.int tensor, as in DeepEP")
    if tuple(mask_status.shape) != (num_ranks,):
        raise ValueError(f"mask_status must be [{num_ranks}], got {list(mask_status.shape)}")
