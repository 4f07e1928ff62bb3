"""Triton per-token quantization: the GPU twin of :func:`moecomm.ops.quant.quantize`.

Same encodings, same formula, same bits (see :mod:`moecomm.ops.quant`): ``s = amax / qmax``
(1 for an all-zero group), ``q = R(x / s)`` with IEEE-rounded division and round-half-to-even
onto the int8 or e4m3 grid. Two details keep GPU and reference identical:

- divisions use ``tl.math.div_rn`` (plain ``/`` may lower to an approximate f32 division);
- the e4m3 rounding is done in f32 arithmetic (scale by the value's ulp, round to an integer,
  scale back), so the final fp8 cast only ever sees exactly representable values and does not
  depend on the conversion rounding of the backend (the Triton interpreter's fp8 cast is not
  round-half-to-even).

One program quantizes one scale group: a whole token (INT8, FP8_E4M3) or one 128-channel block
of a token (FP8_E4M3_B128). ``triton`` is imported lazily so ``import moecomm`` works without it.
"""

from __future__ import annotations

import torch

from moecomm._C import SCALE_BLOCK, Encoding
from moecomm.ops.quant import (
    FP8_E4M3_MAX,
    INT8_MAX,
    QUANTIZED_ENCODINGS,
    check_activations,
    encoding_dtype,
    scales_per_token,
)

__all__ = ["triton_quantize"]

# Elements per loop step of a per-token program: 16 f32 registers per thread at 4 warps, and a
# hidden size of up to 8K takes at most four trips.
_MAX_CHUNK = 2048
# Smallest chunk: below one warp's worth of lanes a program would leave threads idle anyway.
_MIN_CHUNK = 16


def triton_quantize(x: torch.Tensor, encoding: Encoding) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`moecomm.ops.quant.quantize`: same arguments, same bits.

    ``x`` [T, H] bf16/fp16/f32 on a CUDA device (or on the CPU under ``TRITON_INTERPRET=1``);
    a non-unit channel stride is copied to contiguous first. Returns ``(q, scales)``.
    """
    check_activations(x)
    if not isinstance(encoding, Encoding) or encoding not in QUANTIZED_ENCODINGS:
        names = ", ".join(e.name for e in QUANTIZED_ENCODINGS)
        raise ValueError(f"encoding must be one of {names}, got {encoding!r}")
    t, h = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(t, h, dtype=encoding_dtype(encoding), device=x.device)
    n_groups = scales_per_token(encoding, h)
    scales = torch.empty(t, n_groups, dtype=torch.float32, device=x.device)
    if t == 0:
        return q, scales
    group = SCALE_BLOCK if encoding == Encoding.FP8_E4M3_B128 else h
    chunk = min(_MAX_CHUNK, max(_MIN_CHUNK, 1 << (group - 1).bit_length()))
    is_int8 = encoding == Encoding.INT8
    from moecomm.ops._triton_quant_kernel import quantize_groups

    quantize_groups[(t, n_groups)](
        x,
        q,
        scales,
        h,
        group,
        x.stride(0),
        q.stride(0),
        scales.stride(0),
        QMAX=INT8_MAX if is_int8 else FP8_E4M3_MAX,
        IS_INT8=is_int8,
        CHUNK=chunk,
    )
    return q, scales
