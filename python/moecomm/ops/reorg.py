"""Token reorganization on the expert server (EaaS Algorithm 1) and its inverse, the combine.

The server takes the requests of several clients at once. Each request b carries
``x_b [n_b, H]`` (float), ``ids_b [n_b, K]`` int32 holding the server's *local* expert index
(``0..E-1``) or ``-1`` (this copy goes to another server), and ``scores_b [n_b, K]`` f32.

``reorganize`` lays every token copy (b, row, k) with ``ids_b[row, k] >= 0`` out per expert:
rows ``offsets[e]:offsets[e+1]`` of the layout belong to expert ``e``. Inside one expert the rows
keep the *flat order* of the copies (batch, then row, then k), so the layout is deterministic and
identical across the torch, Triton and CUDA implementations. ``gather_tokens`` fills the layout
with activations; ``combine_rows`` sums the (already score-weighted) expert outputs back per token:
``y_b[row] = Σ_k rows[slot_of[b, row, k]]``.

Batches are concatenated in the order given; ``batch_offsets[b]`` is the first global token of
batch b. An empty batch (``n_b = 0``) is legal and costs nothing: every implementation walks the
flat list of copies, never the batches one by one.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moecomm.ops._checks import check_batches

__all__ = [
    "CombineScratch",
    "ExpertLayout",
    "check_activations",
    "combine_rows",
    "combine_rows_reference",
    "gather_tokens",
    "reorganize",
    "reorganize_reference",
    "tokens_view",
]


def _deprecated_workspace(fn: str, method: str) -> None:
    warnings.warn(
        f"{fn}(workspace=ws) is deprecated; call ws.{method}(...)", DeprecationWarning, stacklevel=3
    )


@dataclass(frozen=True)
class CombineScratch:
    """Caller-owned room for :func:`combine_rows` (:class:`~moecomm.ops.ExpertWorkspace` hands
    these out), so that it allocates nothing whose size grows with the tokens or rows. Each may
    be longer than the call needs; its first rows are used.

    Attributes:
        acc: ``[>= T, H]`` float32, the accumulator.
        rows_f32: ``[>= N, H]`` float32, half-precision rows widened for the sum (None: f32 rows).
        result: ``[>= T, H]`` in the rows' dtype, the sum rounded back (None: f32 rows).
    """

    acc: torch.Tensor
    rows_f32: torch.Tensor | None = None
    result: torch.Tensor | None = None


@dataclass(frozen=True)
class ExpertLayout:
    """Where every token copy of a set of client batches sits in the per-expert layout.

    N is the number of copies routed to this server (entries of ``ids`` that are >= 0).

    Attributes:
        num_experts: E, the experts hosted by this server.
        topk: K, copies per token.
        counts: ``[E]`` int32, copies routed to each expert.
        offsets: ``[E + 1]`` int64, exclusive prefix sum of ``counts`` (``offsets[E] == N``).
        src_batch: ``[N]`` int32, batch of each row of the layout.
        src_row: ``[N]`` int32, row inside that batch.
        src_k: ``[N]`` int32, top-k position of the copy.
        src_token: ``[N]`` int64, global token index ``batch_offsets[src_batch] + src_row``.
        scores: ``[N]`` float32, router score of each copy.
        batch_offsets: ``[B + 1]`` int64, first global token of each batch.
        slot_of: ``[T, K]`` int64, layout row of copy (token, k), or -1 when not on this server.
    """

    num_experts: int
    topk: int
    counts: torch.Tensor
    offsets: torch.Tensor
    src_batch: torch.Tensor
    src_row: torch.Tensor
    src_k: torch.Tensor
    src_token: torch.Tensor
    scores: torch.Tensor
    batch_offsets: torch.Tensor
    slot_of: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.src_token.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_of.shape[0])

    @property
    def batch_sizes(self) -> list[int]:
        # From a list: no tensor is allocated (the warm step calls this a few times).
        bo = self.batch_offsets.tolist()
        return [b - a for a, b in itertools.pairwise(bo)]


def _batch_offsets(sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(sizes) + 1, dtype=torch.int64)
    out[1:] = torch.tensor(list(sizes), dtype=torch.int64).cumsum(0)
    return out.to(device)


def reorganize_reference(
    ids: Sequence[torch.Tensor], scores: Sequence[torch.Tensor], num_experts: int
) -> ExpertLayout:
    """Plain-Python reference of :func:`reorganize`: one pass over every copy, one bucket per
    expert. Slow; the tests compare every implementation against it."""
    topk, device = check_batches(ids, scores, num_experts)
    sizes = [int(i.shape[0]) for i in ids]
    buckets: list[list[tuple[int, int, int, int, float]]] = [[] for _ in range(num_experts)]
    token = 0
    for b, (ids_b, sc_b) in enumerate(zip(ids, scores, strict=True)):
        ids_l, sc_l = ids_b.tolist(), sc_b.tolist()
        for r in range(sizes[b]):
            for k in range(topk):
                e = ids_l[r][k]
                if e >= 0:
                    buckets[e].append((b, r, k, token, sc_l[r][k]))
            token += 1
    flat = [c for bucket in buckets for c in bucket]
    slot_of = torch.full((token, topk), -1, dtype=torch.int64)
    for i, (_, _, k, t, _) in enumerate(flat):
        slot_of[t, k] = i
    counts = torch.tensor([len(b) for b in buckets], dtype=torch.int32)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
    offsets[1:] = counts.to(torch.int64).cumsum(0)

    def col(j: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([c[j] for c in flat], dtype=dtype).to(device)

    return ExpertLayout(
        num_experts=num_experts,
        topk=topk,
        counts=counts.to(device),
        offsets=offsets.to(device),
        src_batch=col(0, torch.int32),
        src_row=col(1, torch.int32),
        src_k=col(2, torch.int32),
        src_token=col(3, torch.int64),
        scores=col(4, torch.float32),
        batch_offsets=_batch_offsets(sizes, device),
        slot_of=slot_of.to(device),
    )


def reorganize(
    ids: Sequence[torch.Tensor],
    scores: Sequence[torch.Tensor],
    num_experts: int,
    workspace=None,
) -> ExpertLayout:
    """Per-expert layout of the token copies of several client batches (torch, any device).

    Args:
        ids: one ``[n_b, K]`` int32 tensor per batch: local expert index in ``[0, E)`` or -1.
        scores: one ``[n_b, K]`` float32 tensor per batch: router score of each copy.
        num_experts: E, experts hosted by this server.
        workspace: deprecated; use ``workspace.layout(ids, scores, num_experts)``.

    Returns:
        The :class:`ExpertLayout`; rows of one expert keep the flat (batch, row, k) order.

    Raises:
        TypeError / ValueError: on a wrong dtype, shape, device or an id outside ``[-1, E)``.
    """
    if workspace is not None:
        _deprecated_workspace("reorganize", "layout")
        return workspace.layout(ids, scores, num_experts)
    topk, device = check_batches(ids, scores, num_experts)
    sizes = [int(i.shape[0]) for i in ids]
    batch_offsets = _batch_offsets(sizes, device)
    num_tokens = sum(sizes)
    ids_flat = torch.cat([i.reshape(-1) for i in ids]) if ids else torch.empty(0, dtype=torch.int32)
    sc_flat = torch.cat([s.reshape(-1) for s in scores]) if scores else torch.empty(0)
    ids_flat = ids_flat.to(device)
    # Copies for this server, in flat order; a stable sort by expert keeps that order per expert.
    copy_idx = torch.nonzero(ids_flat >= 0).squeeze(1)
    experts = ids_flat.index_select(0, copy_idx).to(torch.int64)
    order = torch.argsort(experts, stable=True)
    src_flat = copy_idx.index_select(0, order)
    counts = torch.bincount(experts, minlength=num_experts).to(torch.int32)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    offsets[1:] = counts.cumsum(0)
    src_token = torch.div(src_flat, topk, rounding_mode="floor") if topk else src_flat
    src_k = src_flat - src_token * topk
    src_batch = torch.searchsorted(batch_offsets[1:], src_token, right=True)
    src_row = src_token - batch_offsets.index_select(0, src_batch)
    slot_of = torch.full((num_tokens * topk,), -1, dtype=torch.int64, device=device)
    slot_of.index_copy_(0, src_flat, torch.arange(src_flat.numel(), device=device))
    return ExpertLayout(
        num_experts=num_experts,
        topk=topk,
        counts=counts,
        offsets=offsets,
        src_batch=src_batch.to(torch.int32),
        src_row=src_row.to(torch.int32),
        src_k=src_k.to(torch.int32),
        src_token=src_token,
        scores=sc_flat.to(device).index_select(0, src_flat),
        batch_offsets=batch_offsets,
        slot_of=slot_of.view(num_tokens, topk),
    )


def check_activations(xs: Sequence[torch.Tensor], layout: ExpertLayout) -> torch.dtype:
    """Checks one ``[n_b, H]`` float tensor per batch of ``layout``; returns their dtype."""
    sizes = layout.batch_sizes
    if len(xs) != len(sizes):
        raise ValueError(f"expected {len(sizes)} activation tensors (one per batch), got {len(xs)}")
    if not xs:
        return torch.float32
    dtype, hidden = xs[0].dtype, None
    for b, x in enumerate(xs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x[{b}]: expected a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x[{b}]: expected a floating dtype, got {x.dtype}")
        if x.dtype != dtype:
            raise TypeError(f"x[{b}]: expected dtype {dtype} like x[0], got {x.dtype}")
        if x.dim() != 2 or x.shape[0] != sizes[b]:
            raise ValueError(f"x[{b}]: expected shape [{sizes[b]}, H], got {list(x.shape)}")
        hidden = x.shape[1] if hidden is None else hidden
        if x.shape[1] != hidden:
            raise ValueError(f"x[{b}]: expected hidden {hidden} like x[0], got {x.shape[1]}")
        if x.device != layout.src_token.device:
            raise ValueError(f"x[{b}]: expected device {layout.src_token.device}, got {x.device}")
    return dtype


def tokens_view(xs: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """All batches' activations as one ``[T, H]`` tensor without a copy, or None when they must
    be concatenated.

    No copy is needed when one batch holds every token, or when the batches are consecutive rows
    of one buffer (e.g. :meth:`ExpertWorkspace.token_views`, dequantized in place)."""
    full = [x for x in xs if x.shape[0]]
    if len(full) <= 1:
        # Empty batches own no token, so the single non-empty one starts at global token 0.
        return full[0] if full else xs[0]
    first, hidden = full[0], full[0].shape[1]
    if all(x.is_contiguous() for x in full):
        step = first.element_size() * hidden
        nxt, chained = first.data_ptr(), True
        for x in full:
            chained = chained and x.data_ptr() == nxt
            nxt = x.data_ptr() + x.shape[0] * step
        if chained and all(x.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                           for x in full):  # fmt: skip
            return first.as_strided((sum(x.shape[0] for x in full), hidden), (hidden, 1))
    return None


def gather_tokens(
    xs: Sequence[torch.Tensor], layout: ExpertLayout, out: torch.Tensor | None = None, *,
    room: torch.Tensor | None = None, workspace=None,
) -> torch.Tensor:  # fmt: skip
    """Activations in layout order: ``out[i] = xs[src_batch[i]][src_row[i]]``, shape ``[N, H]``.

    Pure data movement: the result is bit-identical to indexing the inputs. ``out`` (``[N, H]``,
    the activations' dtype) receives the rows; ``room`` (``[>= T, H]``, the activations' dtype)
    holds the concatenation of several batches when they are not already consecutive rows of one
    buffer (:func:`tokens_view`). ``workspace`` is deprecated: use ``workspace.gather_tokens``."""
    if workspace is not None:
        _deprecated_workspace("gather_tokens", "gather_tokens")
        return workspace.gather_tokens(xs, layout, out)
    dtype = check_activations(xs, layout)
    if not xs:
        raise ValueError("expected at least one batch to take the hidden size from, got none")
    if out is None and room is None:
        x_all = xs[0] if len(xs) == 1 else torch.cat(list(xs))
        return x_all.index_select(0, layout.src_token)
    x_all = tokens_view(xs)
    if x_all is None:
        total = sum(x.shape[0] for x in xs)
        x_all = torch.cat(list(xs), out=None if room is None else room[:total])
    if out is None:
        return x_all.index_select(0, layout.src_token)
    want = [layout.num_rows, xs[0].shape[1]]
    if not isinstance(out, torch.Tensor) or list(out.shape) != want or out.dtype != dtype:
        raise ValueError(
            f"out: expected a {dtype} tensor of shape {want}, got "
            f"{getattr(out, 'dtype', type(out).__name__)} {list(getattr(out, 'shape', []))}"
        )
    return torch.index_select(x_all, 0, layout.src_token, out=out)


def combine_rows_reference(rows: torch.Tensor, layout: ExpertLayout) -> list[torch.Tensor]:
    """Reference combine: ``y[t] = Σ_k rows[slot_of[t, k]]`` summed in k order, per batch."""
    out = torch.zeros(layout.num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    for t in range(layout.num_tokens):
        for k in range(layout.topk):
            s = int(layout.slot_of[t, k])
            if s >= 0:
                out[t] += rows[s].float()
    return list(out.to(rows.dtype).split(layout.batch_sizes))


def _check_out(out, layout: ExpertLayout, hidden: int, device: torch.device) -> None:
    sizes = layout.batch_sizes
    if isinstance(out, torch.Tensor) or len(out) != len(sizes):
        got = f"{type(out).__name__} of {len(out)}"
        raise ValueError(f"out: expected a list of {len(sizes)} per-batch tensors, got {got}")
    for b, (o, n) in enumerate(zip(out, sizes, strict=True)):
        if not isinstance(o, torch.Tensor) or not o.is_floating_point():
            raise TypeError(f"out[{b}]: expected a floating torch.Tensor, got {type(o).__name__}")
        if list(o.shape) != [n, hidden] or o.device != device:
            raise ValueError(
                f"out[{b}]: expected shape [{n}, {hidden}] on {device}, "
                f"got {list(o.shape)} on {o.device}"
            )


def combine_rows(
    rows: torch.Tensor, layout: ExpertLayout, out: Sequence[torch.Tensor] | None = None, *,
    scratch: CombineScratch | None = None, workspace=None,
) -> list[torch.Tensor]:  # fmt: skip
    """The server's half of combine: sums the score-weighted expert outputs of each token.

    Args:
        rows: ``[N, H]`` float, one expert output per layout row (already times its score).
        layout: the layout ``rows`` follows.
        out: optional caller-owned ``[n_b, H]`` float tensors (any float dtype, any row stride,
            possibly memory of another process): y_b is written into ``out[b]`` and ``out`` is
            returned. ``out[b]`` holds the result without ``out``, converted to its dtype.
        scratch: optional :class:`CombineScratch` holding the float32 accumulator (used for
            float32/float16/bfloat16 rows); without ``out`` the result is then views of it.
        workspace: deprecated; use ``workspace.combine_rows(rows, layout, out)``.

    Returns:
        One ``[n_b, H]`` tensor per batch (views of one buffer, or ``out``); tokens with no copy
        on this server are zero.
    """
    if workspace is not None:
        _deprecated_workspace("combine_rows", "combine_rows")
        return workspace.combine_rows(rows, layout, out)
    if not isinstance(rows, torch.Tensor) or not rows.is_floating_point():
        raise TypeError(
            f"rows: expected a floating torch.Tensor, got {getattr(rows, 'dtype', rows)}"
        )
    if rows.dim() != 2 or rows.shape[0] != layout.num_rows:
        raise ValueError(f"rows: expected shape [{layout.num_rows}, H], got {list(rows.shape)}")
    if out is not None:
        _check_out(out, layout, rows.shape[1], rows.device)
    # Half-precision rows are summed in float32, like the reference and the Triton kernel.
    acc_dtype = torch.float32 if rows.dtype in (torch.float16, torch.bfloat16) else rows.dtype
    tokens, hidden = layout.num_tokens, rows.shape[1]
    if scratch is None or acc_dtype != torch.float32:
        acc = torch.zeros(tokens, hidden, dtype=acc_dtype, device=rows.device)
        wide = rows.to(acc_dtype)
    else:
        acc = scratch.acc[:tokens].zero_()
        wide = rows
        if rows.dtype != acc_dtype:
            room = scratch.rows_f32
            wide = rows.to(acc_dtype) if room is None else room[: rows.shape[0]].copy_(rows)
    # index_add_ on the CPU adds rows in layout order, so the result is deterministic.
    acc.index_add_(0, layout.src_token, wide)
    # The result is the sum rounded to rows' dtype (as without out); out[b] receives that,
    # converted — straight from the accumulator when out has rows' dtype (the same one rounding).
    if acc.dtype != rows.dtype and (out is None or any(o.dtype != rows.dtype for o in out)):
        room = None if scratch is None else scratch.result
        acc = acc.to(rows.dtype) if room is None else room[:tokens].copy_(acc)
    if out is None:
        return list(acc.split(layout.batch_sizes))
    for o, part in zip(out, acc.split(layout.batch_sizes), strict=True):
        o.copy_(part)
    return out
