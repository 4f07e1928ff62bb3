"""Triton path of the expert server: group-shrink and the grouped MLP.

The GPU expert server (:mod:`moecomm.runtime.device_server`) runs
:func:`triton_grouped_mlp_contiguous` on the rows its CUDA gather kernel reorganized; the
reorganization and the combine are CUDA kernels there (``csrc/kernels/cuda/server_kernels.cuh``).
Same layout and results as :func:`moecomm.ops.grouped_gemm.grouped_mlp_contiguous` (the reference
the tests compare against). Triton is imported lazily, inside the functions. On a machine without
a GPU the kernels run under ``TRITON_INTERPRET=1`` on CPU tensors, in float32/float16 only: the
interpreter computes bfloat16 dots wrongly.

Differences from the CPU path, by design:

- float32 dots are exact (``input_precision="ieee"``), not TF32;
- launch sizes come from upper bounds known on the host (``N // BLOCK_M + min(E, N)`` tiles);
  the grouped MLP reads the real tile count from the device and surplus programs exit, so the
  path never synchronizes;
- the grouped MLP also takes quantized activations (float8_e4m3fn / int8 with ``x_scales``,
  per token or per 128 channels, the wire encodings of :mod:`moecomm.ops.quant`), scaled
  inside the K loop; the CPU path takes dequantized float activations only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecomm.ops._checks import FLOAT_DTYPES, check_tensor, check_weights
from moecomm.ops.grouped_gemm import DEFAULT_BLOCK_M, ShrunkGroups

__all__ = ["TileMap", "triton_group_shrink", "triton_grouped_mlp_contiguous"]

# Experts per chunk of the histogram / scan loops: one warp-wide vector of counts per step.
_BLOCK_E = 64
# Tiles resolved per program of the tile map.
_BLOCK_T = 64
# GEMM tile: N and K of 32 are the smallest tl.dot shapes that keep the interpreter fast; a GPU
# build would autotune these.
_BLOCK_N = 32
_BLOCK_K = 32
# Quantized activations the grouped MLP takes (with f32 scales): the wire's FP8_E4M3,
# FP8_E4M3_B128 and INT8 encodings (moecomm.ops.quant).
_QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8)
# Channels per activation scale of the block-scaled encoding: moecomm.ops.quant.SCALE_BLOCK
# (kept literal so this module does not need the compiled extension; a test checks they agree).
# _BLOCK_K must divide it.
_SCALE_BLOCK = 128


def _kernels():
    from moecomm.ops import _triton_moe_kernels

    return _triton_moe_kernels


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get exact float32 dots (a GPU would otherwise round them to TF32, which
    # the float32 references cannot match); half inputs use the tensor-core default.
    return "ieee" if dtype == torch.float32 else "tf32"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _expert_stride(t: torch.Tensor | None) -> int:
    """The expert stride a kernel takes for a ``[E or 1, rows, ...]`` view: 0 for the
    contiguous layout's one block of rows (and for an absent tensor, never read)."""
    return t.stride(0) if t is not None and t.shape[0] > 1 else 0


@dataclass(frozen=True)
class TileMap:
    """Group-shrink output in device memory, sized by host-known upper bounds.

    Attributes:
        groups: active experts, tile counts and tile offsets (first ``num_active`` entries valid).
        offsets: ``[E + 1]`` int64 row prefix sum of the counts.
        tile_expert: ``[max_tiles]`` int32, expert of each tile, -1 past ``num_tiles``.
        tile_mblock: ``[max_tiles]`` int32, block of BLOCK_M rows inside that expert.
        totals: ``[2]`` int32, ``[num_active, num_tiles]``.
    """

    groups: ShrunkGroups
    offsets: torch.Tensor
    tile_expert: torch.Tensor
    tile_mblock: torch.Tensor
    totals: torch.Tensor


def triton_group_shrink(
    counts: torch.Tensor, block_m: int = DEFAULT_BLOCK_M, max_tiles: int | None = None
) -> TileMap:
    """Prefix scan of per-expert counts into the active-expert list and a tile map.

    Args:
        counts: ``[E]`` int32 rows per expert (device tensor).
        block_m: rows per tile.
        max_tiles: tile-map length, an upper bound on the tiles known on the host: the GEMM
            passes ``N // block_m + min(E, N)``, and 0 skips the tile map. None computes the
            exact count, which reads the counts on the host (one sync).
    """
    check_tensor("counts", counts, dtypes=[torch.int32], dim=1)
    if not isinstance(block_m, int) or block_m <= 0:
        raise ValueError(f"block_m: expected a positive int, got {block_m!r}")
    k = _kernels()
    dev, num_experts = counts.device, counts.shape[0]
    counts = counts.contiguous()
    if max_tiles is None:
        max_tiles = int(((counts + block_m - 1) // block_m).sum()) if num_experts else 0
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=dev)
    active = torch.full((num_experts,), -1, dtype=torch.int32, device=dev)
    tile_counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    tile_offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
    totals = torch.zeros(2, dtype=torch.int32, device=dev)
    k.shrink_kernel[(1,)](
        counts, offsets, active, tile_counts, tile_offsets, totals, num_experts,
        BLOCK_M=block_m, BLOCK_E=_BLOCK_E,
    )  # fmt: skip
    tile_expert = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    tile_mblock = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    if max_tiles:
        k.tile_map_kernel[(_cdiv(max_tiles, _BLOCK_T),)](
            tile_offsets, active, totals, tile_expert, tile_mblock, max_tiles,
            BLOCK_T=_BLOCK_T, BLOCK_E=_BLOCK_E,
        )  # fmt: skip
    groups = ShrunkGroups(active, tile_counts, tile_offsets, block_m)
    return TileMap(groups, offsets, tile_expert, tile_mblock, totals)


def _check_activations(x, x_scales, w13, w2, dim) -> tuple[int, int]:
    """Checks x (float, or quantized with x_scales) against the weights; returns (E, I).

    Float x: the weights have x's dtype. Quantized x (float8_e4m3fn / int8): x_scales is
    required and the weights may be any float dtype, which is also the output's."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES + _QUANT_DTYPES, dim=dim)
    if x.dtype in _QUANT_DTYPES:
        if x_scales is None:
            raise ValueError(
                f"x_scales: {x.dtype} activations need float32 scales (per token, or per "
                f"{_SCALE_BLOCK} channels), got None"
            )
        check_tensor("w13", w13, dtypes=FLOAT_DTYPES, dim=3)
        return check_weights(w13, w2, x.shape[-1], w13.dtype, x.device)
    if x_scales is not None:
        raise ValueError(
            f"x_scales: only float8_e4m3fn or int8 activations take scales, got x of {x.dtype}"
        )
    return check_weights(w13, w2, x.shape[-1], x.dtype, x.device)


def _check_x_scales(x_scales: torch.Tensor, lead: list[int], hidden: int, device) -> torch.Tensor:
    """Scales of rows ``lead`` (``[N]`` or ``[E, M_max]``) as ``[*lead, S]``, S = 1 (per token)
    or ``ceil(H / 128)`` (per block of 128 channels, the last one possibly partial)."""
    check_tensor("x_scales", x_scales, dtypes=[torch.float32], device=device)
    blocks = _cdiv(hidden, _SCALE_BLOCK)
    shape = list(x_scales.shape)
    if shape == lead:
        return x_scales.unsqueeze(-1)
    if shape[:-1] == lead and shape[-1] in (1, blocks):
        return x_scales
    raise ValueError(
        f"x_scales: expected shape {lead} or {[*lead, 1]} (per token) or {[*lead, blocks]} "
        f"(per {_SCALE_BLOCK} channels of H={hidden}), got {shape}"
    )


def _launch_mlp(x3, xs3, counts, row_start, w13, w2, scores3, out3, inter, max_tiles, block_m):
    """x3/xs3/out3/scores3 are viewed as [E or 1, rows, ...] with expert stride 0 for
    contiguous; xs3 is None for float x, else the [E or 1, rows, S] f32 scales of quantized x."""
    k = _kernels()
    tiles = triton_group_shrink(counts, block_m, max_tiles=max_tiles)
    if max_tiles == 0:
        return
    hidden = x3.shape[2]
    precision = _dot_precision(w13.dtype)
    h = torch.empty(x3.shape[0], x3.shape[1], inter, dtype=w13.dtype, device=x3.device)
    se_h = _expert_stride(h)
    scaled = xs3 is not None
    xs = xs3 if scaled else x3  # a pointer the float kernel never reads
    sm_s = xs3.stride(1) if scaled else 0
    sk_s = xs3.stride(2) if scaled and xs3.shape[2] > 1 else 0  # per token: every block, one scale
    k.gate_up_kernel[(max_tiles, _cdiv(inter, _BLOCK_N))](
        x3, xs, w13, h, tiles.tile_expert, tiles.tile_mblock, tiles.totals, row_start, counts,
        hidden, inter, _expert_stride(x3), x3.stride(1), x3.stride(2), _expert_stride(xs3), sm_s,
        sk_s, w13.stride(0), w13.stride(1), w13.stride(2), se_h, h.stride(1),
        HAS_SCALES=scaled, SCALE_BLOCK=_SCALE_BLOCK if scaled else _BLOCK_K, BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, DOT_PRECISION=precision,
    )  # fmt: skip
    has_scores = scores3 is not None
    s = scores3 if has_scores else out3
    sm_s = scores3.stride(1) if has_scores else 0
    k.down_kernel[(max_tiles, _cdiv(hidden, _BLOCK_N))](
        h, w2, out3, s, tiles.tile_expert, tiles.tile_mblock, tiles.totals, row_start, counts,
        hidden, inter, se_h, h.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        _expert_stride(out3), out3.stride(1), _expert_stride(scores3), sm_s,
        HAS_SCORES=has_scores, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        DOT_PRECISION=precision,
    )  # fmt: skip


def triton_grouped_mlp_contiguous(
    x: torch.Tensor,
    offsets: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scores: torch.Tensor | None = None,
    *,
    x_scales: torch.Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
) -> torch.Tensor:
    """Triton twin of :func:`moecomm.ops.grouped_gemm.grouped_mlp_contiguous`.

    ``x [N, H]`` rows sorted by expert, ``offsets [E + 1]`` int64 (device), ``w13 [E, 2I, H]``,
    ``w2 [E, H, I]``, optional ``scores [N]`` float32. Returns ``[N, H]`` in the weights' dtype
    (x's, for float x). The offsets are trusted (not read on the host): they come from the
    reorganization.

    Quantized activations: ``x`` float8_e4m3fn or int8 with ``x_scales`` float32, ``[N]`` or
    ``[N, 1]`` per token, or ``[N, ceil(H / 128)]`` per block of 128 channels (the encodings
    of :mod:`moecomm.ops.quant`); ``x = q · s``. The scales are applied inside the gate|up K
    loop, one per 128-channel slice; the weights stay float (any float dtype).
    """
    num_experts, inter = _check_activations(x, x_scales, w13, w2, dim=2)
    check_tensor("offsets", offsets, dtypes=[torch.int64], dim=1, device=x.device)
    if offsets.shape[0] != num_experts + 1:
        raise ValueError(f"offsets: expected shape [{num_experts + 1}], got {list(offsets.shape)}")
    if scores is not None:
        check_tensor("scores", scores, dtypes=[torch.float32], dim=1, device=x.device)
        if scores.shape[0] != x.shape[0]:
            raise ValueError(f"scores: expected shape [{x.shape[0]}], got {list(scores.shape)}")
    xs = None
    if x_scales is not None:
        xs = _check_x_scales(x_scales, [x.shape[0]], x.shape[1], x.device)[None]
    counts = (offsets[1:] - offsets[:-1]).to(torch.int32)
    out = torch.empty(x.shape, dtype=w13.dtype, device=x.device)
    # Each active expert adds at most one partial tile to the N // block_m full ones.
    max_tiles = x.shape[0] // block_m + min(num_experts, x.shape[0])
    _launch_mlp(x[None], xs, counts, offsets, w13, w2, None if scores is None else scores[None],
                out[None], inter, max_tiles, block_m)  # fmt: skip
    return out
