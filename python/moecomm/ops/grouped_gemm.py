"""Group-shrink and the grouped expert MLP, in the masked and the contiguous layout.

Weight layout (HF Mixtral / Qwen-MoE names: w1 = gate, w3 = up, w2 = down, each ``[out, in]``):

- ``w13 [E, 2*I, H]``: rows ``0:I`` are gate (w1), rows ``I:2I`` are up (w3); build it with
  :func:`stack_gate_up`. One matrix so one GEMM produces both halves.
- ``w2 [E, H, I]``: down.

The expert MLP of a row x routed to expert e with score s is
``s · w2[e] @ (silu(w1[e] @ x) ⊙ (w3[e] @ x))``.

Layouts:

- *contiguous*: ``x [N, H]`` with rows sorted by expert and ``offsets [E + 1]`` (what
  :func:`moecomm.ops.reorg.reorganize` produces);
- *masked*: ``x [E, M_max, H]`` with ``counts [E]``: rows ``counts[e]:`` of expert e are padding,
  their output is zero.

Group-shrink turns per-expert counts into the compact list of *active* experts (count > 0) and
their tiles of ``block_m`` rows, so the GEMM visits active experts only: a server hosting 256
experts of which 8 received tokens does 8 groups of work, not 256.

CPU path: float32 experts run in one call of the native AVX2 kernel
(``moecomm._C.expert_mlp_f32``: weights streamed once, no packing, experts split over
``torch.get_num_threads()`` threads, GIL released). Each row's result there depends on that row
only, so the float32 path is *batch invariant*: a token gets the same bits whatever other tokens
share its server step — what lets the disaggregated layer match the monolith bit for bit and a
failover reproduce the fault-free run. Other dtypes and machines without the extension or AVX2
use torch GEMMs per active expert, whose results depend on the number of rows.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moecomm.ops._checks import FLOAT_DTYPES, INT_DTYPES, check_tensor, check_weights
from moecomm.ops.reorg import combine_rows, gather_tokens, reorganize

__all__ = [
    "DEFAULT_BLOCK_M",
    "GemmScratch",
    "ShrunkGroups",
    "expert_forward",
    "expert_forward_reference",
    "group_shrink",
    "group_shrink_reference",
    "grouped_mlp_contiguous",
    "grouped_mlp_contiguous_reference",
    "grouped_mlp_masked",
    "grouped_mlp_masked_reference",
    "stack_gate_up",
]

# Experts with at most this many rows run in the native kernel. No limit by default: the native
# kernel is batch invariant and measured on par with torch's packed GEMM up to 256 rows, while
# switching paths at a row count would make a token's result depend on its batch-mates.
NATIVE_MAX_ROWS = 1 << 31
# Rows per GEMM tile on the GPU: decode puts ~1-16 rows on an expert, and 16 is the smallest M
# that tensor-core dots (and tl.dot) accept.
DEFAULT_BLOCK_M = 16


@dataclass(frozen=True)
class ShrunkGroups:
    """The active experts of a grouped GEMM and their tiles.

    Attributes:
        active_experts: ``[A]`` int32, experts with count > 0, ascending.
        tile_counts: ``[A]`` int32, ``ceil(count / block_m)`` per active expert.
        tile_offsets: ``[A + 1]`` int32, exclusive prefix sum of ``tile_counts``.
        block_m: rows per tile.
    """

    active_experts: torch.Tensor
    tile_counts: torch.Tensor
    tile_offsets: torch.Tensor
    block_m: int

    @property
    def num_active(self) -> int:
        return int(self.active_experts.shape[0])

    @property
    def num_tiles(self) -> int:
        return int(self.tile_offsets[-1])


@dataclass(frozen=True)
class GemmScratch:
    """Caller-owned room for one :func:`grouped_mlp_contiguous` call, so that the call allocates
    nothing whose size grows with the rows (:class:`~moecomm.ops.ExpertWorkspace` hands these out
    from its buffers). Each may be longer than the call needs; its first entries are used.

    Attributes:
        counts: ``[>= E]`` int64, the rows per expert handed to the native kernel.
        experts: ``[>= E]`` int32 on the CPU, the experts handed to the native kernel.
        inter: ``[>= N, 2I]`` in x's dtype, the gate|up products.
        row_scores: ``[>= N]`` in x's dtype, the scores converted once for the torch GEMMs.
    """

    counts: torch.Tensor
    experts: torch.Tensor
    inter: torch.Tensor
    row_scores: torch.Tensor


def _check_counts(counts: torch.Tensor, block_m: int) -> None:
    check_tensor("counts", counts, dtypes=INT_DTYPES, dim=1)
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m <= 0:
        raise ValueError(f"block_m: expected a positive int, got {block_m!r}")
    if counts.numel() and int(counts.min()) < 0:
        raise ValueError(f"counts: expected non-negative counts, got min {int(counts.min())}")


def group_shrink_reference(counts: torch.Tensor, block_m: int = DEFAULT_BLOCK_M) -> ShrunkGroups:
    """Plain-Python reference of :func:`group_shrink`."""
    _check_counts(counts, block_m)
    active, tiles, offs = [], [], [0]
    for e, c in enumerate(counts.tolist()):
        if c > 0:
            active.append(e)
            tiles.append((c + block_m - 1) // block_m)
            offs.append(offs[-1] + tiles[-1])
    dev = counts.device

    def as_i32(v: list[int]) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int32, device=dev)

    return ShrunkGroups(as_i32(active), as_i32(tiles), as_i32(offs), block_m)


def group_shrink(counts: torch.Tensor, block_m: int = DEFAULT_BLOCK_M) -> ShrunkGroups:
    """Compact list of active experts and their tile counts from per-expert row counts.

    Args:
        counts: ``[E]`` int32/int64, rows per expert.
        block_m: rows per GEMM tile.
    """
    _check_counts(counts, block_m)
    active = torch.nonzero(counts > 0).squeeze(1)
    tiles = torch.div(
        counts.index_select(0, active) + (block_m - 1), block_m, rounding_mode="floor"
    )
    offs = torch.zeros(active.numel() + 1, dtype=torch.int32, device=counts.device)
    offs[1:] = tiles.cumsum(0)
    return ShrunkGroups(active.to(torch.int32), tiles.to(torch.int32), offs, block_m)


def stack_gate_up(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """``w13 [E, 2I, H]`` from HF-layout gate ``w1 [E, I, H]`` and up ``w3 [E, I, H]``."""
    check_tensor("w1", w1, dtypes=FLOAT_DTYPES, dim=3)
    check_tensor("w3", w3, dtypes=[w1.dtype], dim=3, device=w1.device)
    if w1.shape != w3.shape:
        raise ValueError(f"w3: expected shape {list(w1.shape)} like w1, got {list(w3.shape)}")
    return torch.cat([w1, w3], dim=1).contiguous()


def _mlp_rows(x: torch.Tensor, w13_e: torch.Tensor, w2_e: torch.Tensor) -> torch.Tensor:
    """Reference expert MLP of some rows, computed in float32."""
    h = x.float() @ w13_e.float().t()
    inter = w13_e.shape[0] // 2
    return (F.silu(h[:, :inter]) * h[:, inter:]) @ w2_e.float().t()


def _check_scores(scores: torch.Tensor | None, shape: Sequence[int], device: torch.device) -> None:
    if scores is None:
        return
    check_tensor("scores", scores, dtypes=[torch.float32], device=device)
    if list(scores.shape) != list(shape):
        raise ValueError(f"scores: expected shape {list(shape)}, got {list(scores.shape)}")


def _check_contiguous_args(x, offsets, w13, w2, scores) -> tuple[int, int]:
    check_tensor("x", x, dtypes=FLOAT_DTYPES, dim=2)
    num_experts, inter = check_weights(w13, w2, x.shape[1], x.dtype, x.device)
    check_tensor("offsets", offsets, dtypes=INT_DTYPES, dim=1, device=x.device)
    if offsets.shape[0] != num_experts + 1:
        raise ValueError(f"offsets: expected shape [{num_experts + 1}], got {list(offsets.shape)}")
    offs = offsets.tolist()  # E + 1 ints: checked in Python without allocating a tensor
    if offs[0] != 0 or offs[-1] != x.shape[0]:
        raise ValueError(f"offsets: expected to run from 0 to N={x.shape[0]}, "
                         f"got {offs[0]}..{offs[-1]}")  # fmt: skip
    if any(b < a for a, b in itertools.pairwise(offs)):
        raise ValueError("offsets: expected a non-decreasing prefix sum, got a decrease")
    _check_scores(scores, [x.shape[0]], x.device)
    return num_experts, inter


def _check_masked_args(x, counts, w13, w2, scores) -> tuple[int, int]:
    check_tensor("x", x, dtypes=FLOAT_DTYPES, dim=3)
    num_experts, inter = check_weights(w13, w2, x.shape[2], x.dtype, x.device)
    if x.shape[0] != num_experts:
        raise ValueError(f"x: expected {num_experts} experts in dim 0, got shape {list(x.shape)}")
    check_tensor("counts", counts, dtypes=INT_DTYPES, dim=1, device=x.device)
    if counts.shape[0] != num_experts:
        raise ValueError(f"counts: expected shape [{num_experts}], got {list(counts.shape)}")
    if counts.numel() and (int(counts.min()) < 0 or int(counts.max()) > x.shape[1]):
        raise ValueError(
            f"counts: expected values in [0, M_max={x.shape[1]}], "
            f"got [{int(counts.min())}, {int(counts.max())}]"
        )
    _check_scores(scores, x.shape[:2], x.device)
    return num_experts, inter


def grouped_mlp_contiguous_reference(x, offsets, w13, w2, scores=None) -> torch.Tensor:
    """Reference: one float32 MLP per expert over its rows, times the scores."""
    num_experts, _ = _check_contiguous_args(x, offsets, w13, w2, scores)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    offs = offsets.tolist()
    for e in range(num_experts):
        s, t = offs[e], offs[e + 1]
        if t > s:
            out[s:t] = _mlp_rows(x[s:t], w13[e], w2[e])
    if scores is not None:
        out *= scores[:, None]
    return out.to(x.dtype)


def grouped_mlp_masked_reference(x, counts, w13, w2, scores=None) -> torch.Tensor:
    """Reference of the masked layout: rows at or past ``counts[e]`` come out zero."""
    _check_masked_args(x, counts, w13, w2, scores)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, c in enumerate(counts.tolist()):
        if c:
            out[e, :c] = _mlp_rows(x[e, :c], w13[e], w2[e])
    if scores is not None:
        out *= scores[:, :, None]
    return out.to(x.dtype)


def _mlp_into(
    out: torch.Tensor,
    x: torch.Tensor,
    w13_e: torch.Tensor,
    w2_e: torch.Tensor,
    inter: int,
    scores: torch.Tensor | None,
    h: torch.Tensor | None = None,
) -> None:
    """Fast path of one group: one GEMM for gate and up, in-place SiLU·mul, one GEMM into out.
    ``h`` is optional room for the ``[rows, 2I]`` gate|up product; ``scores`` already in
    out's dtype or f32."""
    h = torch.mm(x, w13_e.t()) if h is None else torch.mm(x, w13_e.t(), out=h)
    gate = h[:, :inter]
    F.silu(gate, inplace=True)
    gate.mul_(h[:, inter:])
    torch.mm(gate, w2_e.t(), out=out)
    if scores is not None:
        out.mul_(scores[:, None] if scores.dtype == out.dtype else scores[:, None].to(out.dtype))


def _visit_list(groups: ShrunkGroups, num_experts: int) -> list[int]:
    visit = groups.active_experts.tolist()
    for e in visit:
        if not 0 <= e < num_experts:
            raise ValueError(f"groups: expected experts in [0, {num_experts}), got {e}")
    return visit


def _native_module():
    """moecomm._C when its AVX2 expert-MLP kernel can run here, else None."""
    try:
        from moecomm import _C
    except ImportError:  # a source checkout without the built extension: torch path only
        return None
    if not hasattr(_C, "expert_mlp_f32") or not _C.expert_mlp_has_avx2():
        return None
    return _C


def _native_ok(x2d: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scores) -> bool:
    """The native kernel takes float32 CPU rows with unit column stride and dense weights."""
    return (
        x2d.device.type == "cpu"
        and x2d.dtype == torch.float32
        and x2d.stride(1) == 1
        and w13.is_contiguous()
        and w2.is_contiguous()
        and (scores is None or scores.is_contiguous())
    )


def _split_native(visit: list[int], rows: list[int], native_ok: bool) -> tuple[list, list]:
    if not native_ok or _native_module() is None:
        return [], visit
    small = [e for e in visit if rows[e] <= NATIVE_MAX_ROWS]
    large = [e for e in visit if rows[e] > NATIVE_MAX_ROWS]
    return small, large


def _run_native(
    x2d, row_begin, row_count, experts, w13, w2, scores, out2d, scratch=None, ex=None
) -> None:
    """Runs the listed experts in moecomm._C; every tensor stays referenced across the call.
    ``scratch`` (f32, contiguous) holds the gate|up products; ``ex`` is ``experts`` as an int32
    tensor already (both allocated here when omitted)."""
    ex = torch.tensor(experts, dtype=torch.int32) if ex is None else ex
    begin = row_begin.to(torch.int64).contiguous()
    count = row_count.to(torch.int64).contiguous()
    _native_module().expert_mlp_f32(
        x2d.data_ptr(), x2d.stride(0), begin.data_ptr(), count.data_ptr(), ex.data_ptr(),
        len(experts), w13.data_ptr(), w2.data_ptr(), 0 if scores is None else scores.data_ptr(),
        out2d.data_ptr(), out2d.stride(0), out2d.shape[1], w2.shape[2],
        torch.get_num_threads(), 0 if scratch is None else scratch.data_ptr(),
        0 if scratch is None else scratch.numel(),
    )  # fmt: skip


def _run_torch(experts, starts, rows, x2d, w13, w2, inter, scores, out2d, h=None) -> None:
    """The listed experts in torch GEMMs, expert e over rows ``starts[e] : starts[e] + rows[e]``
    of ``x2d`` into the same rows of ``out2d``; ``h`` is optional room for the gate|up product."""
    for e in experts:
        s, t = starts[e], starts[e] + rows[e]
        sc = None if scores is None else scores[s:t]
        _mlp_into(out2d[s:t], x2d[s:t], w13[e], w2[e], inter, sc, None if h is None else h[: t - s])


def grouped_mlp_contiguous(
    x: torch.Tensor,
    offsets: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scores: torch.Tensor | None = None,
    *,
    groups: ShrunkGroups | None = None,
    out: torch.Tensor | None = None,
    scratch: GemmScratch | None = None,
    workspace=None,
) -> torch.Tensor:
    """Grouped expert MLP over rows sorted by expert: ``out[i] = scores[i] · mlp_e(x[i])``.

    Args:
        x: ``[N, H]`` float32/float16/bfloat16, rows of expert e at ``offsets[e]:offsets[e+1]``.
        offsets: ``[E + 1]`` int32/int64.
        w13: ``[E, 2I, H]`` gate|up, same dtype and device as x.
        w2: ``[E, H, I]`` down.
        scores: optional ``[N]`` float32 router scores; omitted means 1.
        groups: the experts to visit (default: every expert with rows); rows of experts not
            visited come out zero.
        out: optional ``[N, H]`` tensor of x's dtype with unit column stride to write into.
        scratch: optional :class:`GemmScratch` for the gate|up products and the per-call index
            tensors (then no allocation proportional to N or H). Same bits as without it.
        workspace: deprecated; use ``workspace.grouped_mlp(...)``.

    Returns:
        ``[N, H]`` in x's dtype (``out`` when given).
    """
    if workspace is not None:
        warnings.warn(
            "grouped_mlp_contiguous(workspace=ws) is deprecated; call ws.grouped_mlp(...)",
            DeprecationWarning,
            stacklevel=2,
        )
        return workspace.grouped_mlp(x, offsets, w13, w2, scores, groups=groups, out=out)
    num_experts, inter = _check_contiguous_args(x, offsets, w13, w2, scores)
    n, hidden = x.shape
    if out is None:
        out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, dtypes=[x.dtype], dim=2, device=x.device)
        if tuple(out.shape) != (n, hidden) or (n and out.stride(1) != 1):
            raise ValueError(f"out: expected shape [{n}, {hidden}] with unit column stride, "
                             f"got {list(out.shape)} strides {list(out.stride())}")  # fmt: skip
        if groups is not None:
            out.zero_()  # rows of experts not visited come out zero
    offs = offsets.tolist()
    rows = [offs[e + 1] - offs[e] for e in range(num_experts)]
    # Without groups every expert with rows is visited, so every row of out gets written.
    if groups is None:
        visit = [e for e in range(num_experts) if rows[e] > 0]
    else:
        visit = _visit_list(groups, num_experts)
    small, large = _split_native(visit, rows, _native_ok(x, w13, w2, scores))
    if small:
        if scratch is None:
            counts, ex, room = offsets[1:] - offsets[:-1], None, None
        else:
            counts = torch.sub(offsets[1:], offsets[:-1], out=scratch.counts[:num_experts])
            ex = scratch.experts[: len(small)]
            ex.numpy()[:] = small  # a view of the same memory: no tensor is built from the list
            room = scratch.inter[:n].view(-1)
        _run_native(x, offsets[:-1], counts, small, w13, w2, scores, out, room, ex)
    if large and scratch is not None and scores is not None and scores.dtype != x.dtype:
        # Converted once for every group (without scratch each group's slice converts alike).
        scores = scratch.row_scores[:n].copy_(scores)
    room = None if scratch is None else scratch.inter
    _run_torch(large, offs, rows, x, w13, w2, inter, scores, out, room)
    return out


def grouped_mlp_masked(
    x: torch.Tensor,
    counts: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scores: torch.Tensor | None = None,
    *,
    groups: ShrunkGroups | None = None,
) -> torch.Tensor:
    """Grouped expert MLP over the masked layout ``x [E, M_max, H]`` with ``counts [E]``.

    ``out[e, m] = scores[e, m] · mlp_e(x[e, m])`` for ``m < counts[e]``, zero for padding rows.
    ``scores`` is optional ``[E, M_max]`` float32; the other arguments are as in
    :func:`grouped_mlp_contiguous`.
    """
    num_experts, inter = _check_masked_args(x, counts, w13, w2, scores)
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    cnt = counts.tolist()
    visit = _visit_list(group_shrink(counts) if groups is None else groups, num_experts)
    m_max = x.shape[1]
    # The native kernel addresses expert e's rows as e * M_max + m of one [E * M_max, H] view.
    flat_ok = x.stride(0) == m_max * x.stride(1) and _native_ok(x.flatten(0, 1), w13, w2, scores)
    small, large = _split_native(visit, cnt, flat_ok)
    if small:
        begin = torch.arange(num_experts, dtype=torch.int64) * m_max
        _run_native(x.flatten(0, 1), begin, counts, small, w13, w2, scores, out.flatten(0, 1))
    for e in large:
        c = cnt[e]
        sc = None if scores is None else scores[e, :c]
        _mlp_into(out[e, :c], x[e, :c], w13[e], w2[e], inter, sc)
    return out


def expert_forward_reference(xs, ids, scores, w13, w2) -> list[torch.Tensor]:
    """Per-token reference of the whole server step: ``y_b[r] = Σ_k s · mlp_{ids[r,k]}(x_b[r])``
    for every ``ids >= 0``, computed in float32 in k order."""
    outs = []
    for x, i, s in zip(xs, ids, scores, strict=True):
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for r in range(x.shape[0]):
            for k in range(i.shape[1]):
                e = int(i[r, k])
                if e >= 0:
                    y[r] += float(s[r, k]) * _mlp_rows(x[r : r + 1], w13[e], w2[e])[0]
        outs.append(y.to(x.dtype))
    return outs


def expert_forward(
    xs: Sequence[torch.Tensor],
    ids: Sequence[torch.Tensor],
    scores: Sequence[torch.Tensor],
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    workspace=None,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """One expert-server step over several client batches (CPU fast path; works on any device).

    Reorganizes the copies per expert, shrinks to the active experts, runs the grouped MLP with
    the router scores applied, and sums per token.

    Args:
        xs: one ``[n_b, H]`` float tensor per batch (dequantized activations).
        ids: one ``[n_b, K]`` int32 tensor per batch: local expert index or -1.
        scores: one ``[n_b, K]`` float32 tensor per batch.
        w13: ``[E, 2I, H]`` gate|up weights, dtype of the activations.
        w2: ``[E, H, I]`` down weights.
        workspace: optional :class:`~moecomm.ops.workspace.ExpertWorkspace`: the step runs
            there (:meth:`~moecomm.ops.workspace.ExpertWorkspace.forward`), every buffer taken
            from it (grown if the step is larger), so a warm step allocates no storage
            proportional to tokens or H. Same bits as without it.
        out: optional caller-owned ``[n_b, H]`` float tensors (f32/bf16/f16, unit column
            stride; may be memory of another process): y_b is written into ``out[b]``.

    Returns:
        One ``[n_b, H]`` tensor per batch: ``Σ_k score · expert_k(x)`` over this server's
        experts — ``out`` when given; with a workspace and no ``out``, views of the workspace
        valid until its next step.
    """
    check_tensor("w13", w13, dtypes=FLOAT_DTYPES, dim=3)
    if workspace is not None:
        # The workspace runs the step in its buffers, calling this module's kernels.
        return workspace.forward(xs, ids, scores, w13, w2, out=out)
    layout = reorganize(ids, scores, int(w13.shape[0]))
    x_rows = gather_tokens(xs, layout)
    # Into out: the expert rows need no zeroing (every one is written), hence empty_like.
    rows_out = None if out is None else torch.empty_like(x_rows)
    rows = grouped_mlp_contiguous(x_rows, layout.offsets, w13, w2, layout.scores, out=rows_out)
    return combine_rows(rows, layout, out=out)
