"""The Triton kernel behind :func:`moecomm.ops.triton_quant.triton_quantize`.

Kept in its own module because it imports triton at import time (the jit needs module-level
constexpr globals); only ``triton_quantize`` imports it, on first use.
"""

import triton
import triton.language as tl

from moecomm.ops.quant import ZERO_SCALE

# A group of zeros gets this scale (see moecomm.ops.quant).
ZERO_SCALE_F = tl.constexpr(ZERO_SCALE)
# Adding then subtracting 1.5 · 2²³ rounds an f32 of magnitude < 2²² to an integer, half to even
# (the sum lands where the f32 ulp is exactly 1). Portable: no libdevice, works in the interpreter.
ROUND_MAGIC = tl.constexpr(12582912.0)
# f32 layout: 23 mantissa bits under an 8-bit biased exponent.
F32_MANT = tl.constexpr(23)
F32_EXP_MASK = tl.constexpr(0xFF)
# e4m3 keeps 3 mantissa bits, so a normal value's grid step is 2^(e - 3) ...
FP8_MANT = tl.constexpr(3)
# ... and its subnormals step by 2⁻⁹ (biased f32 exponent 127 - 9).
FP8_MIN_ULP_EXP = tl.constexpr(127 - 9)
# 2^(127 - b) for biased exponent b has biased exponent 254 - b: a power of two's reciprocal.
RECIP_BIAS = tl.constexpr(254)


@triton.jit
def quantize_groups(
    x_ptr,
    q_ptr,
    s_ptr,
    hidden,
    group,
    stride_x,
    stride_q,
    stride_s,
    QMAX: tl.constexpr,
    IS_INT8: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Program (row, g) quantizes channels [g·group, min((g+1)·group, hidden)) of one row."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    start = g * group
    end = tl.minimum(start + group, hidden)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    q_row = q_ptr + row.to(tl.int64) * stride_q
    cols = tl.arange(0, CHUNK)

    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for off in range(start, end, CHUNK):
        mask = off + cols < end
        v = tl.load(x_row + off + cols, mask=mask, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(v))
    amax = tl.max(acc, axis=0)
    # div_rn: plain "/" may lower to an approximate f32 division on the GPU.
    scale = tl.where(amax == 0.0, ZERO_SCALE_F, tl.math.div_rn(amax, tl.full([], QMAX, tl.float32)))
    tl.store(s_ptr + row.to(tl.int64) * stride_s + g, scale)

    for off in range(start, end, CHUNK):
        mask = off + cols < end
        v = tl.load(x_row + off + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.math.div_rn(v, tl.zeros([CHUNK], tl.float32) + scale)
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if IS_INT8:
            r = (y + ROUND_MAGIC) - ROUND_MAGIC
            tl.store(q_row + off + cols, r.to(tl.int8), mask=mask)
        else:
            # Round onto the e4m3 grid in f32 (scale by 1/ulp, round to an integer, scale back;
            # every step exact but the rounding), so the cast below only sees representable
            # values and cannot depend on the backend's fp8 conversion rounding.
            bits = y.to(tl.int32, bitcast=True)
            exp = (bits >> F32_MANT) & F32_EXP_MASK
            ulp_exp = tl.maximum(exp - FP8_MANT, FP8_MIN_ULP_EXP)
            ulp = (ulp_exp << F32_MANT).to(tl.float32, bitcast=True)
            inv = ((ulp_exp * -1 + RECIP_BIAS) << F32_MANT).to(tl.float32, bitcast=True)
            # Round the magnitude (round-half-even is symmetric), then put the sign bit back:
            # the magic add would turn a value that rounds to -0 into +0.
            r = ((tl.abs(y) * inv + ROUND_MAGIC) - ROUND_MAGIC) * ulp
            r = tl.where(bits < 0, -r, r)
            tl.store(q_row + off + cols, r.to(q_ptr.dtype.element_ty), mask=mask)
