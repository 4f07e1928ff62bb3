"""DeepEP's low-latency fp8 cast, bit for bit, in torch (the host path of compat.deep_ep).

DeepEP (``csrc/kernels/legacy/internode_ll.cu`` dispatch, ``utils.cuh`` ``calculate_fp8_scales``,
``extract_required_scale_format``; deepseek-ai/DeepEP dd758ca) casts every 128-channel block of a
bf16 token as:

- ``amax = max(1e-4, max |x|)`` in f32 (``kFP8Margin``);
- plain: ``scale = 448 / amax`` (an f32 division), ``scale_inv = amax * (1/448)`` (f32 product
  with ``1/448`` rounded to f32);
- ``round_scale``: ``e = ceil(log2(amax * (1/448)))`` read off the f32 bits (exponent, plus one
  when the mantissa is non-zero), ``scale = 2^-e``, ``scale_inv = 2^e``;
- ``q = e4m3(x * scale)`` with round-to-nearest-even and saturation at ±448 (``__NV_SATFINITE``);
- the receiver gets ``scale_inv`` (f32), or with ``use_ue8m0`` its exponent byte
  (``bits >> 23``), four of them packed little-endian into one int32 per 512 channels.

So an all-zero block has ``amax = 1e-4`` and scale_inv ``1e-4 / 448`` (not 1), and a tiny block
is scaled up to at most 448 like any other.
"""

from __future__ import annotations

import torch

BLOCK = 128
UE8M0_PACK = 4  # scales per int32
FP8_MARGIN = 1e-4
E4M3_MAX = 448.0
_INV_E4M3_MAX = torch.tensor(1.0 / 448.0, dtype=torch.float32)  # 1/448 rounded to f32, as in C++


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e for int32 e in [-126, 127], built from the bits (DeepEP's ``fast_pow2``)."""
    return ((e + 127) << 23).to(torch.int32).view(torch.float32)


def _log2_ceil(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) of a positive normal f32 from its bits (DeepEP's ``fast_log2_ceil``)."""
    bits = x.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    return exp - 127 + ((bits & ((1 << 23) - 1)) != 0).to(torch.int32)


def fp8_scales(amax: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) f32 from the clamped block amax, as ``calculate_fp8_scales``."""
    if round_scale:
        e = _log2_ceil(amax * _INV_E4M3_MAX)
        return _pow2(-e), _pow2(e)
    return torch.full_like(amax, E4M3_MAX) / amax, amax * _INV_E4M3_MAX


def deepep_cast(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, H] bf16 (H % 128 == 0) -> (fp8 e4m3 [n, H], scale_inv f32 [n, H/128])."""
    n, h = x.shape
    v = x.float().view(n, h // BLOCK, BLOCK)
    amax = v.abs().amax(dim=2).clamp_min(FP8_MARGIN)
    scale, scale_inv = fp8_scales(amax, round_scale)
    q = (v * scale.unsqueeze(2)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(n, h), scale_inv


def ue8m0_bytes(scale_inv: torch.Tensor) -> torch.Tensor:
    """The exponent byte of each f32 scale (``extract_required_scale_format<true>``), uint8."""
    return (scale_inv.contiguous().view(torch.int32) >> 23).to(torch.uint8)


def pack_ue8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """[n, H/128] f32 power-of-two scales -> [n, H/512] int32, byte j of word i = block 4i+j."""
    n, s = scale_inv.shape
    return (
        ue8m0_bytes(scale_inv)
        .view(n, s // UE8M0_PACK, UE8M0_PACK)
        .view(torch.int32)
        .view(n, s // UE8M0_PACK)
    )


# LogFMT-10 (DeepEP's ``use_logfmt`` combine: ``logfmt_encode`` / ``decode_and_accumulate`` in
# internode_ll.cu). Per 128 channels of an expert output row: amax, amin of |y|;
# log_amax = log2(amax), log_amin = max(log2(amin), log_amax - 32) (amin = 0: log_amax - 32);
# cast only when log_amax < 0 and log_amin < log_amax, else the bf16 row travels as is.
# Cast: step = (log_amax - log_amin) / 510, code = floor(max(log2|y| / step + 2
# - log2((1 + 2^step) / 2) / step - log_amin / step, 0)) in 9 bits plus a sign bit; decoded as
# 0 (code 0) or ±2^((code - 1) * step + log_amin), in f32, then weighted and summed.
LOGFMT_BLOCK = 128
LOGFMT_MIN_CLIP = 32.0
LOGFMT_NUM_VALUES = 1 << 9


def logfmt_roundtrip(rows: torch.Tensor) -> torch.Tensor:
    """What DeepEP's combine receiver accumulates for bf16 answer rows [n, H]: their LogFMT-10
    encoding decoded, f32 [n, H]. DeepEP evaluates log2/exp2 with ``lg2.approx`` /
    ``ex2.approx`` (and nvcc may fuse the multiply-adds), so this is its formula in exact f32,
    not its bits: a code can differ by one where a value sits on a rounding boundary."""
    n, h = rows.shape
    v = rows.float().view(n, h // LOGFMT_BLOCK, LOGFMT_BLOCK)
    a = v.abs()
    amax, amin = a.amax(dim=2, keepdim=True), a.amin(dim=2, keepdim=True)
    log_amax = torch.log2(amax)
    log_amin = torch.where(
        amin == 0, log_amax - LOGFMT_MIN_CLIP, torch.maximum(torch.log2(amin), log_amax - 32)
    )
    cast = (log_amax < 0) & (log_amin < log_amax)
    step = (log_amax - log_amin) / float(LOGFMT_NUM_VALUES - 2)
    step_inv = 1.0 / step
    rounding = 2.0 - torch.log2((1.0 + torch.exp2(step)) * 0.5) * step_inv
    fused = rounding - log_amin * step_inv
    with torch.no_grad():
        code = torch.floor(torch.clamp_min(torch.log2(a) * step_inv + fused, 0))
        dec = torch.where(code == 0, torch.zeros_like(a), torch.exp2((code - 1) * step + log_amin))
        dec = torch.where(torch.signbit(v), -dec, dec)
    return torch.where(cast, dec, v).view(n, h)
