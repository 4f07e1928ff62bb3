"""Triton kernels of the expert path. Imported only by moecomm.ops.triton_moe, lazily, so that
``import moecomm`` works where Triton is not installed.

No kernel waits on another program: every cross-program quantity (the group-shrink scan, the
tile map) is produced by an earlier launch on the same stream.
That is also what lets the Triton interpreter, which runs programs one after another, run them.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Sentinel for "past every tile" in the tile-map search: larger than any tile count we launch.
# A tl.constexpr: the compiler refuses a plain global inside a kernel (the interpreter allows
# it, which is how this first failed only on an H200).
_TILE_END_SENTINEL = tl.constexpr(2**30)


@triton.jit
def shrink_kernel(
    counts_ptr,
    offsets_ptr,
    active_ptr,
    tile_counts_ptr,
    tile_offsets_ptr,
    totals_ptr,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Group-shrink: one program scans the counts in chunks of BLOCK_E, carrying the totals.

    Writes offsets[E+1] (row prefix sum), the compact active-expert list with its tile counts
    and tile prefix sum, and totals = [num_active, num_tiles]."""
    tl.store(offsets_ptr, tl.zeros([], dtype=tl.int64))
    tl.store(tile_offsets_ptr, tl.zeros([], dtype=tl.int32))
    rows = tl.zeros([], dtype=tl.int64)
    n_active = tl.zeros([], dtype=tl.int32)
    n_tiles = tl.zeros([], dtype=tl.int32)
    for e0 in range(0, num_experts, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        em = e < num_experts
        c = tl.load(counts_ptr + e, mask=em, other=0).to(tl.int32)
        tl.store(offsets_ptr + 1 + e, rows + tl.cumsum(c, axis=0).to(tl.int64), mask=em)
        act = (c > 0).to(tl.int32)
        pos = n_active + tl.cumsum(act, axis=0) - act
        tiles = (c + BLOCK_M - 1) // BLOCK_M
        am = em & (c > 0)
        tl.store(active_ptr + pos, e, mask=am)
        tl.store(tile_counts_ptr + pos, tiles, mask=am)
        tl.store(tile_offsets_ptr + 1 + pos, n_tiles + tl.cumsum(tiles, axis=0), mask=am)
        rows += tl.sum(c, axis=0).to(tl.int64)
        n_active += tl.sum(act, axis=0)
        n_tiles += tl.sum(tiles, axis=0)
    tl.store(totals_ptr, n_active)
    tl.store(totals_ptr + 1, n_tiles)


@triton.jit
def tile_map_kernel(
    tile_offsets_ptr,
    active_ptr,
    totals_ptr,
    tile_expert_ptr,
    tile_mblock_ptr,
    max_tiles,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """For each tile id t < num_tiles: its expert and its block of rows inside that expert.
    Tiles past num_tiles (the launch is sized by an upper bound) get expert -1."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n_active = tl.load(totals_ptr)
    n_tiles = tl.load(totals_ptr + 1)
    a = tl.zeros([BLOCK_T], dtype=tl.int32)
    for a0 in range(0, n_active, BLOCK_E):
        j = a0 + tl.arange(0, BLOCK_E)
        ends = tl.load(tile_offsets_ptr + 1 + j, mask=j < n_active, other=_TILE_END_SENTINEL)
        a += tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), axis=1)
    valid = t < n_tiles
    e = tl.load(active_ptr + a, mask=valid, other=-1)
    first = tl.load(tile_offsets_ptr + a, mask=valid, other=0)
    tl.store(tile_expert_ptr + t, e, mask=t < max_tiles)
    tl.store(tile_mblock_ptr + t, tl.where(valid, t - first, 0), mask=t < max_tiles)


@triton.jit
def _tile(tile_expert_ptr, tile_mblock_ptr, row_start_ptr, row_count_ptr, t, num_cols,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Tile t's expert, its BLOCK_M rows and their mask, and this program's BLOCK_N output
    columns (of num_cols) and their mask."""
    e = tl.load(tile_expert_ptr + t)
    mb = tl.load(tile_mblock_ptr + t)
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = m < tl.load(row_count_ptr + e)
    rows = (tl.load(row_start_ptr + e) + m).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return e.to(tl.int64), rows, rmask, n, n < num_cols


@triton.jit
def _gate_up_dots(a, w, n, k, kmask, nmask, inter, stride_wn, stride_wk, acc_g, acc_u,
                  DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One K tile of the gate|up GEMMs: acc_g += a @ w1[n, k].T, acc_u += a @ w3[n, k].T."""
    wm = kmask[:, None] & nmask[None, :]
    wg = tl.load(w + n[None, :] * stride_wn + k[:, None] * stride_wk, mask=wm, other=0.0)
    wu = tl.load(w + (n + inter)[None, :] * stride_wn + k[:, None] * stride_wk, mask=wm, other=0.0)
    acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
    acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
    return acc_g, acc_u


@triton.jit
def _store_silu_mul(h_ptr, e, rows, rmask, n, nmask, acc_g, acc_u, stride_he, stride_hm):
    """h[rows, n] = silu(acc_g) * acc_u, in h's dtype."""
    out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    dst = h_ptr + e * stride_he + rows[:, None] * stride_hm + n[None, :]
    tl.store(dst, out.to(h_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _load_x_tile(ptrs, mask, w_dtype, QUANTIZED: tl.constexpr):
    """One [BLOCK_M, BLOCK_K] tile of x as the dots take it: float x as loaded (masked lanes
    0); quantized x converted to the weight dtype, which is exact (e4m3 and int8 values are all
    representable in fp16/bf16/f32)."""
    if QUANTIZED:
        # No `other=` on the quantized load (an int/float constant cast to fp8 is not lowered
        # everywhere): masked lanes are zeroed after the exact conversion instead.
        q = tl.load(ptrs, mask=mask)
        a = tl.where(mask, q.to(w_dtype), 0.0).to(w_dtype)
    else:
        a = tl.load(ptrs, mask=mask, other=0.0)
    return a


@triton.jit
def gate_up_kernel(
    x_ptr,
    xs_ptr,
    w13_ptr,
    h_ptr,
    tile_expert_ptr,
    tile_mblock_ptr,
    totals_ptr,
    row_start_ptr,
    row_count_ptr,
    hidden,
    inter,
    stride_xe,
    stride_xm,
    stride_xk,
    stride_se,
    stride_sm,
    stride_sk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_he,
    stride_hm,
    HAS_SCALES: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """h[rows, n] = silu(x @ w1[e].T) * (x @ w3[e].T) for one tile of one active expert.

    Row r of expert e sits at e * stride_?e + r * stride_?m: the contiguous layout passes
    stride_?e = 0 and row_start = offsets, the masked layout its expert stride and row_start 0.

    Float x (HAS_SCALES false): SCALE_BLOCK = BLOCK_K, xs_ptr and its strides are not read, and
    the dots accumulate straight into the accumulators over the whole of K.

    Quantized x (HAS_SCALES: float8_e4m3fn or int8 with f32 scales): the scale of row r for
    channels [b * SCALE_BLOCK, (b + 1) * SCALE_BLOCK) sits at xs + e * stride_se + r * stride_sm
    + b * stride_sk; per-token scales pass stride_sk = 0. DeepGEMM-style: each SCALE_BLOCK slice
    of K is accumulated on its own (the x tile converted to the weight dtype unscaled, exact),
    then that partial product is scaled per row and added to the accumulator. BLOCK_K divides
    SCALE_BLOCK, so no K tile straddles two scale blocks."""
    t = tl.program_id(0)
    if t >= tl.load(totals_ptr + 1):
        return
    e, rows, rmask, n, nmask = _tile(tile_expert_ptr, tile_mblock_ptr, row_start_ptr,
                                     row_count_ptr, t, inter, BLOCK_M, BLOCK_N)  # fmt: skip
    x_rows = x_ptr + e * stride_xe + rows[:, None] * stride_xm
    w = w13_ptr + e * stride_we
    s_rows = xs_ptr + e * stride_se + rows * stride_sm  # read only with HAS_SCALES
    w_dtype = w13_ptr.dtype.element_ty
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, hidden, SCALE_BLOCK):
        if HAS_SCALES:
            s = tl.load(s_rows + (kb // SCALE_BLOCK) * stride_sk, mask=rmask, other=0.0)
            part_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            part_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            part_g, part_u = acc_g, acc_u
        for kk in tl.static_range(0, SCALE_BLOCK, BLOCK_K):
            k = kb + kk + tl.arange(0, BLOCK_K)
            kmask = k < hidden
            am = rmask[:, None] & kmask[None, :]
            a = _load_x_tile(x_rows + k[None, :] * stride_xk, am, w_dtype, HAS_SCALES)
            part_g, part_u = _gate_up_dots(a, w, n, k, kmask, nmask, inter, stride_wn, stride_wk,
                                           part_g, part_u, DOT_PRECISION)  # fmt: skip
        if HAS_SCALES:
            acc_g += part_g * s[:, None]
            acc_u += part_u * s[:, None]
        else:
            acc_g, acc_u = part_g, part_u
    _store_silu_mul(h_ptr, e, rows, rmask, n, nmask, acc_g, acc_u, stride_he, stride_hm)


@triton.jit
def down_kernel(
    h_ptr,
    w2_ptr,
    y_ptr,
    scores_ptr,
    tile_expert_ptr,
    tile_mblock_ptr,
    totals_ptr,
    row_start_ptr,
    row_count_ptr,
    hidden,
    inter,
    stride_he,
    stride_hm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ye,
    stride_ym,
    stride_se,
    stride_sm,
    HAS_SCORES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """y[rows, n] = score * (h @ w2[e].T) for one tile of one active expert."""
    t = tl.program_id(0)
    if t >= tl.load(totals_ptr + 1):
        return
    e, rows, rmask, n, nmask = _tile(tile_expert_ptr, tile_mblock_ptr, row_start_ptr,
                                     row_count_ptr, t, hidden, BLOCK_M, BLOCK_N)  # fmt: skip
    h_rows = h_ptr + e * stride_he + rows[:, None] * stride_hm
    w = w2_ptr + e * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < inter
        a = tl.load(h_rows + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(
            w + n[None, :] * stride_wn + k[:, None] * stride_wk,
            mask=kmask[:, None] & nmask[None, :],
            other=0.0,
        )
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_SCORES:
        s = tl.load(scores_ptr + e * stride_se + rows * stride_sm, mask=rmask, other=0.0)
        acc = acc * s[:, None]
    dst = y_ptr + e * stride_ye + rows[:, None] * stride_ym + n[None, :]
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])
