"""Per-token activation quantization: the request encodings of the slot protocol.

Three quantized encodings (``csrc/protocol/header.h``), all symmetric, all with f32 scales:

- ``Encoding.INT8``: int8 values in [-127, 127], one scale per token, ``s = amax / 127``.
- ``Encoding.FP8_E4M3``: ``torch.float8_e4m3fn`` values, one scale per token,
  ``s = amax / 448``.
- ``Encoding.FP8_E4M3_B128``: as above but one scale per block of ``SCALE_BLOCK`` = 128
  channels of each token, i.e. ``ceil(H / 128)`` scales; the last block may be partial.

``amax`` is the largest ``|x|`` over the token (or block) computed in f32; a token (block) of
zeros gets ``s = 1`` so that nobody ever divides by zero. Quantization is ``q = R(x / s)`` with an
IEEE-rounded f32 division and ``R`` round-half-to-even onto the target grid (saturating at the
grid's largest value); dequantization is ``x̂ = q · s`` in f32. Every implementation in this
package (torch reference, CPU fast path, Triton, CUDA) follows exactly these steps, so they agree
bit for bit.

Error bounds of one round trip, for finite inputs, per element, with ``s`` the element's scale
(derivations in docs/ops-quant-dispatch.md; the tests check them):

- int8:  ``|x − x̂| ≤ s · (1/2 + 2⁻¹⁵)``, i.e. at most about ``amax / 254``.
- fp8:   ``|x − x̂| ≤ 2⁻⁴ · |x| · (1 + 2⁻¹⁶) + 2⁻¹⁰ · s · (1 + 2⁻¹⁶)``: half an e4m3 ulp
  (3 mantissa bits) relative to the value, plus the absolute step of e4m3 subnormals.

Non-finite inputs are not supported: a NaN or infinity makes its whole token (block) meaningless.
"""

from __future__ import annotations

import torch

from moecomm import _C
from moecomm._C import SCALE_BLOCK, Encoding
from moecomm.wire.protocol import ENCODING_DTYPE

__all__ = [
    "FP8_E4M3_MAX",
    "INT8_MAX",
    "QUANTIZED_ENCODINGS",
    "SCALE_BLOCK",
    "dequantize",
    "dequantize_reference",
    "encoding_dtype",
    "encoding_for_dtype",
    "quantize",
    "quantize_reference",
    "scales_per_token",
]

# Largest finite float8_e4m3fn value (1.75 · 2⁸); the top mantissa pattern of the top exponent
# is NaN in the "fn" variant, so the grid saturates here.
FP8_E4M3_MAX = 448.0
# Symmetric int8: -128 is never produced, so negating a quantized value is exact.
INT8_MAX = 127.0
# Scale given to an all-zero token (block): any positive value dequantizes zeros to zeros, and
# 1 keeps the division exact.
ZERO_SCALE = 1.0

_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The wire dtype of each encoding is defined once, next to the protocol.
_WIRE_DTYPE = ENCODING_DTYPE
QUANTIZED_ENCODINGS = (Encoding.INT8, Encoding.FP8_E4M3, Encoding.FP8_E4M3_B128)
_QMAX = {
    Encoding.INT8: INT8_MAX,
    Encoding.FP8_E4M3: FP8_E4M3_MAX,
    Encoding.FP8_E4M3_B128: FP8_E4M3_MAX,
}


def _check_encoding(encoding: object, allowed: tuple = tuple(_WIRE_DTYPE)) -> Encoding:
    if not isinstance(encoding, Encoding):
        raise TypeError(f"encoding must be a moecomm._C.Encoding, got {type(encoding).__name__}")
    if encoding not in allowed:
        names = ", ".join(e.name for e in allowed)
        raise ValueError(f"encoding must be one of {names}, got {encoding.name}")
    return encoding


def encoding_dtype(encoding: Encoding) -> torch.dtype:
    """The torch dtype of activations on the wire for ``encoding``."""
    return _WIRE_DTYPE[_check_encoding(encoding)]


def encoding_for_dtype(dtype: torch.dtype) -> Encoding:
    """The unquantized encoding that carries ``dtype`` activations unchanged."""
    for enc, dt in _WIRE_DTYPE.items():
        if dt == dtype and enc not in QUANTIZED_ENCODINGS:
            return enc
    raise TypeError(f"activations must be one of {_ACTIVATION_DTYPES}, got {dtype}")


def scales_per_token(encoding: Encoding, hidden: int) -> int:
    """f32 scales carried per token (0 for unquantized encodings), from the C++ header."""
    return _C.encoding_scales_per_token(_check_encoding(encoding), hidden)


def check_activations(x: object, name: str = "x") -> torch.Tensor:
    """Checks a [T, H] activation tensor (T >= 0, H >= 1, bf16/fp16/f32)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _ACTIVATION_DTYPES:
        raise TypeError(f"{name} must have dtype bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] < 1:
        raise ValueError(f"{name} must have shape [T, H] with H >= 1, got {tuple(x.shape)}")
    return x


# ----------------------------------------------------------------------------------------------
# Fast path: vectorized over all tokens, a few fused passes, no Python loop over tokens.


def _blocked(xf: torch.Tensor) -> torch.Tensor:
    """[T, H] f32 → [T, ceil(H/128), 128], zero-padding the last block (zeros leave amax alone)."""
    t, h = xf.shape
    pad = -h % SCALE_BLOCK
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    # reshape, not view: x may be any strided tensor (then this is the one copy of the path).
    return xf.reshape(t, (h + pad) // SCALE_BLOCK, SCALE_BLOCK)


def _scales_from_amax(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    scales = amax / qmax
    return scales.masked_fill_(amax == 0, ZERO_SCALE)


def _round_to_grid(y: torch.Tensor, encoding: Encoding) -> torch.Tensor:
    """y (f32, scaled, modified in place) → wire dtype, round-half-even, saturating."""
    qmax = _QMAX[encoding]
    if encoding == Encoding.INT8:
        return y.round_().clamp_(-qmax, qmax).to(torch.int8)
    # The fp8 cast rounds half to even but turns out-of-range values into NaN: clamp first.
    return y.clamp_(-qmax, qmax).to(torch.float8_e4m3fn)


def quantize(x: torch.Tensor, encoding: Encoding) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes activations ``x`` [T, H] (bf16/fp16/f32, any device, any strides).

    Returns ``(q, scales)``: ``q`` [T, H] int8 or float8_e4m3fn, contiguous; ``scales``
    [T, S] f32, contiguous, ``S = scales_per_token(encoding, H)``. ``x`` is not modified.
    See the module docstring for the exact formula and error bounds.
    """
    check_activations(x)
    enc = _check_encoding(encoding, QUANTIZED_ENCODINGS)
    t, h = x.shape
    # .float() copies unless x is already f32; the division below writes a fresh tensor, so x is
    # never written through.
    xf = x.float()
    if enc == Encoding.FP8_E4M3_B128:
        xb = _blocked(xf)
        scales = _scales_from_amax(xb.abs().amax(dim=2), _QMAX[enc])
        y = torch.div(xb, scales.unsqueeze(2)).view(t, xb.shape[1] * SCALE_BLOCK)[:, :h]
        return _round_to_grid(y, enc).contiguous(), scales
    # abs().amax() rather than vector_norm(inf) or aminmax: measured 30x and 13x faster on CPU.
    amax = xf.abs().amax(dim=1) if t else xf.new_zeros(0)
    scales = _scales_from_amax(amax, _QMAX[enc])
    q = _round_to_grid(torch.div(xf, scales.unsqueeze(1)), enc)
    # Elementwise ops keep the layout of a strided input; the wire wants row-major rows.
    return q.contiguous(), scales.unsqueeze(1).contiguous()


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    encoding: Encoding,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x̂ = q · s`` computed in f32, then cast to ``dtype`` (bf16/fp16/f32).

    ``q`` [T, H] in the wire dtype of ``encoding``; ``scales`` [T, S] f32 as returned by
    :func:`quantize`. The bounds of the module docstring hold for ``dtype=torch.float32``; a
    narrower ``dtype`` adds its own rounding (half an ulp of bf16/fp16).

    ``out`` (optional, ``[T, H]`` of ``dtype``, unit column stride, e.g. a view of
    :meth:`moecomm.ops.ExpertWorkspace.token_views`) receives the result, bit-identical to the
    returned tensor without it. An f32 ``out`` is filled in place (the exact widening of q, then
    one f32 multiply per element, as without ``out``) with no allocation; a bf16/fp16 ``out``
    still goes through one f32 temporary.
    """
    enc = _check_quantized_pair(q, scales, encoding, dtype)
    t, h = q.shape
    if out is not None:
        _check_out(out, (t, h), dtype, q.device)
        if dtype == torch.float32:
            return _dequantize_into(out, q, scales, enc)
        return out.copy_(_dequantize_into(torch.empty(t, h, device=q.device), q, scales, enc))
    qf = q.float()
    if enc == Encoding.FP8_E4M3_B128:
        qb = _blocked(qf)
        out = (qb * scales.unsqueeze(2)).view(t, qb.shape[1] * SCALE_BLOCK)[:, :h]
    else:
        out = qf * scales
    return out.to(dtype).contiguous()


def _check_out(out: object, shape: tuple[int, int], dtype: torch.dtype, device) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype or tuple(out.shape) != shape or out.device != device:
        raise ValueError(
            f"out must be {dtype} of shape {shape} on {device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if shape[0] and out.stride(1) != 1:
        raise ValueError(f"out must have unit column stride, got strides {out.stride()}")


def _dequantize_into(out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, enc) -> torch.Tensor:
    """out (f32) = q · s: the exact widening of q into out, then one in-place f32 multiply per
    element by its token's (block's) scale — the same single rounding as ``q.float() * s``."""
    t, h = q.shape
    out.copy_(q)
    if enc != Encoding.FP8_E4M3_B128:
        return out.mul_(scales)
    full = h // SCALE_BLOCK
    if full:
        # Whole 128-channel blocks as [T, blocks, 128] (a view: unit column stride).
        out[:, : full * SCALE_BLOCK].view(t, full, SCALE_BLOCK).mul_(scales[:, :full, None])
    if h % SCALE_BLOCK:
        out[:, full * SCALE_BLOCK :].mul_(scales[:, full:])
    return out


def _check_quantized_pair(q: object, scales: object, encoding: object, dtype: object) -> Encoding:
    enc = _check_encoding(encoding, QUANTIZED_ENCODINGS)
    for name, v in (("q", q), ("scales", scales)):
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
    assert isinstance(q, torch.Tensor) and isinstance(scales, torch.Tensor)
    if q.dtype != _WIRE_DTYPE[enc]:
        raise TypeError(f"q must have dtype {_WIRE_DTYPE[enc]} for {enc.name}, got {q.dtype}")
    if q.dim() != 2 or q.shape[1] < 1:
        raise ValueError(f"q must have shape [T, H] with H >= 1, got {tuple(q.shape)}")
    if scales.dtype != torch.float32:
        raise TypeError(f"scales must have dtype float32, got {scales.dtype}")
    expected = (q.shape[0], scales_per_token(enc, q.shape[1]))
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"scales must have shape {expected} for {enc.name}, got {tuple(scales.shape)}"
        )
    if scales.device != q.device:
        raise ValueError(f"scales must be on {q.device} like q, got {scales.device}")
    if dtype not in _ACTIVATION_DTYPES:
        raise TypeError(f"dtype must be one of {_ACTIVATION_DTYPES}, got {dtype}")
    return enc


# ----------------------------------------------------------------------------------------------
# Reference: one token (block) at a time, written for clarity. Tests compare every other
# implementation against it bit for bit.


def quantize_reference(x: torch.Tensor, encoding: Encoding) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop-per-token reference of :func:`quantize` (same result, bit for bit)."""
    check_activations(x)
    enc = _check_encoding(encoding, QUANTIZED_ENCODINGS)
    t, h = x.shape
    block = SCALE_BLOCK if enc == Encoding.FP8_E4M3_B128 else h
    q = torch.empty(t, h, dtype=_WIRE_DTYPE[enc], device=x.device)
    scales = torch.empty(t, scales_per_token(enc, h), dtype=torch.float32, device=x.device)
    for i in range(t):
        for b, start in enumerate(range(0, h, block)):
            chunk = x[i, start : start + block].float()
            amax = chunk.abs().max()
            s = amax / _QMAX[enc] if amax != 0 else torch.tensor(ZERO_SCALE)
            q[i, start : start + block] = _round_to_grid(chunk / s, enc)
            scales[i, b] = s
    return q, scales


def dequantize_reference(
    q: torch.Tensor, scales: torch.Tensor, encoding: Encoding, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Loop-per-token reference of :func:`dequantize`."""
    enc = _check_quantized_pair(q, scales, encoding, dtype)
    t, h = q.shape
    block = SCALE_BLOCK if enc == Encoding.FP8_E4M3_B128 else h
    out = torch.empty(t, h, dtype=dtype, device=q.device)
    for i in range(t):
        for b, start in enumerate(range(0, h, block)):
            out[i, start : start + block] = (q[i, start : start + block].float() * scales[i, b]).to(
                dtype
            )
    return out
