"""Per-token quantization: fast path against the loop reference (bit for bit), the documented
error bounds, the rounding rule against an independent enumeration of the grids, and argument
checks."""

import pytest
import torch
from moecomm._C import SCALE_BLOCK, Encoding, encoding_scales_per_token
from moecomm.ops.quant import (
    FP8_E4M3_MAX,
    INT8_MAX,
    QUANTIZED_ENCODINGS,
    dequantize,
    dequantize_reference,
    encoding_dtype,
    quantize,
    quantize_reference,
    scales_per_token,
)

SHAPES = [(0, 64), (1, 1), (1, 128), (3, 200), (9, 256), (4, 1000)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Slack of the documented bounds (module docstring of moecomm.ops.quant).
INT8_BOUND = 0.5 + 2.0**-15
FP8_REL_BOUND = 2.0**-4 * (1 + 2.0**-16)
FP8_ABS_BOUND = 2.0**-10 * (1 + 2.0**-16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def make_x(t: int, h: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random activations with the cases quantizers get wrong: a zero token, a token with one
    huge outlier, tiny values (fp8 subnormals after scaling), and a wide dynamic range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g) * torch.logspace(-3, 2, max(t, 1))[:t, None]
    if t > 1:
        x[1] = 0
    if t > 2:
        x[2, h // 2] = 1e4
    if t > 3:
        x[3, : min(h, 10)] = 1e-6
        x[3, 10:20] = -1e-7  # rounds to -0: the sign of zero is part of the bits compared
        x[3, 20:21] = -0.0
    return x.to(dtype)


def per_element_scale(scales: torch.Tensor, enc: Encoding, h: int) -> torch.Tensor:
    if enc == Encoding.FP8_E4M3_B128:
        return scales.repeat_interleave(SCALE_BLOCK, dim=1)[:, :h]
    return scales.expand(-1, h)


@pytest.mark.parametrize("enc", QUANTIZED_ENCODINGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fast_path_matches_reference_bit_for_bit(shape, dtype, enc):
    x = make_x(*shape, dtype)
    q, s = quantize(x, enc)
    q_ref, s_ref = quantize_reference(x, enc)
    assert q.dtype == encoding_dtype(enc) and q.shape == x.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.is_contiguous()
    assert s.shape == (shape[0], encoding_scales_per_token(enc, shape[1]))
    assert torch.equal(bits(q), bits(q_ref))
    assert torch.equal(s, s_ref)
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize(q, s, enc, out), dequantize_reference(q, s, enc, out))


@pytest.mark.parametrize("enc", QUANTIZED_ENCODINGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[1:])
def test_round_trip_error_within_documented_bound(shape, dtype, enc):
    x = make_x(*shape, dtype, seed=1)
    q, s = quantize(x, enc)
    xf = x.float()
    err = (dequantize(q, s, enc) - xf).abs()
    se = per_element_scale(s, enc, shape[1])
    if enc == Encoding.INT8:
        bound = se * INT8_BOUND
    else:
        bound = xf.abs() * FP8_REL_BOUND + se * FP8_ABS_BOUND
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"


@pytest.mark.parametrize("enc", QUANTIZED_ENCODINGS)
def test_scale_maps_group_amax_onto_grid_max(enc):
    x = make_x(6, 300, torch.float32, seed=2)
    q, s = quantize(x, enc)
    qmax = INT8_MAX if enc == Encoding.INT8 else FP8_E4M3_MAX
    group = SCALE_BLOCK if enc == Encoding.FP8_E4M3_B128 else x.shape[1]
    for t in range(x.shape[0]):
        for b, start in enumerate(range(0, x.shape[1], group)):
            chunk, qc = x[t, start : start + group], q[t, start : start + group].float()
            amax = chunk.abs().max()
            if amax == 0:
                assert s[t, b] == 1.0 and not bool(qc.any())
                continue
            # s is amax / qmax rounded once to f32; the largest element lands exactly on qmax.
            assert s[t, b] == torch.tensor(amax.double().item() / qmax, dtype=torch.float32)
            assert qc.abs().max().item() == qmax


def e4m3_grid() -> torch.Tensor:
    """Every finite float8_e4m3fn value, decoded independently of torch's fp8 cast."""
    codes = torch.arange(256, dtype=torch.int64)
    sign = torch.where(codes >= 128, -1.0, 1.0).double()
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    normal = (1 + man / 8.0) * torch.pow(2.0, exp.double() - 7)
    sub = man / 8.0 * 2.0**-6
    val = sign * torch.where(exp == 0, sub, normal)
    finite = (codes & 0x7F) != 0x7F  # exponent 15 with mantissa 7 is NaN in the fn variant
    return val[finite], codes[finite]


def round_to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3 value, ties to the even code, saturating: the rule the encoders claim."""
    grid, codes = e4m3_grid()
    d = (y.double()[:, None] - grid[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    tie_ok = (d == best) & ((codes[None, :] & 1) == 0)
    pick = torch.where(tie_ok.any(dim=1), tie_ok.double().argmax(dim=1), d.argmin(dim=1))
    return grid[pick].float()


def test_fp8_rounding_is_nearest_even_on_the_e4m3_grid():
    g = torch.Generator().manual_seed(3)
    sorted_grid = torch.sort(e4m3_grid()[0]).values.float()
    ties = (sorted_grid[1:] + sorted_grid[:-1]) / 2  # exact midpoints between neighbours
    y = torch.cat([torch.randn(400, generator=g) * 100, torch.rand(100, generator=g) * 0.02, ties])
    y = y[y.abs() <= FP8_E4M3_MAX]
    # Quantize one token whose amax is exactly 448, so s == 1 and q == R(y).
    x = torch.cat([y, torch.tensor([FP8_E4M3_MAX])])[None, :]
    q, s = quantize(x, Encoding.FP8_E4M3)
    assert s.item() == 1.0
    assert torch.equal(q.float()[0, :-1], round_to_e4m3(y))


def test_int8_rounding_is_half_to_even():
    ties = torch.arange(-20, 21, dtype=torch.float32) + 0.5
    x = torch.cat([ties, torch.tensor([INT8_MAX])])[None, :]  # s == 1
    q, s = quantize(x, Encoding.INT8)
    assert s.item() == 1.0
    expected = torch.tensor([round(v) for v in ties.tolist()], dtype=torch.int8)  # banker's
    assert torch.equal(q[0, :-1], expected)


@pytest.mark.parametrize("enc", QUANTIZED_ENCODINGS)
def test_non_contiguous_input_same_result_and_inputs_untouched(enc):
    base = make_x(300, 8, torch.float32, seed=4)
    x = base.t()  # [8, 300], channel stride 8
    assert not x.is_contiguous()
    before = base.clone()
    q, s = quantize(x, enc)
    q_c, s_c = quantize(x.contiguous(), enc)
    assert torch.equal(bits(q), bits(q_c)) and torch.equal(s, s_c)
    assert q.is_contiguous() and s.is_contiguous()
    strided = make_x(6, 400, torch.float16, seed=5)[::2, :259]
    q2, s2 = quantize(strided, enc)
    q2r, s2r = quantize_reference(strided.contiguous(), enc)
    assert torch.equal(bits(q2), bits(q2r)) and torch.equal(s2, s2r)
    dequantize(q, s, enc)
    assert torch.equal(base, before)


def test_dequantize_leaves_inputs_untouched():
    x = make_x(5, 130, torch.float32, seed=6)
    q, s = quantize(x, Encoding.FP8_E4M3_B128)
    q0, s0 = q.clone(), s.clone()
    dequantize(q, s, Encoding.FP8_E4M3_B128, torch.bfloat16)
    assert torch.equal(bits(q), bits(q0)) and torch.equal(s, s0)


def test_scales_per_token_mirrors_the_wire_header():
    for enc in Encoding.__members__.values():
        for h in (1, 127, 128, 129, 7168):
            assert scales_per_token(enc, h) == encoding_scales_per_token(enc, h)


def test_quantize_rejects_bad_arguments():
    x = torch.zeros(2, 8)
    with pytest.raises(TypeError, match=r"dtype bfloat16, float16 or float32, got torch.int32"):
        quantize(x.int(), Encoding.INT8)
    with pytest.raises(ValueError, match=r"shape \[T, H\] with H >= 1, got \(16,\)"):
        quantize(x.flatten(), Encoding.INT8)
    with pytest.raises(ValueError, match=r"got \(2, 0\)"):
        quantize(x[:, :0], Encoding.INT8)
    with pytest.raises(TypeError, match=r"must be a moecomm._C.Encoding, got str"):
        quantize(x, "int8")
    with pytest.raises(ValueError, match=r"one of INT8, FP8_E4M3, FP8_E4M3_B128, got BF16"):
        quantize(x, Encoding.BF16)
    with pytest.raises(TypeError, match=r"must be a torch.Tensor, got list"):
        quantize([[1.0]], Encoding.INT8)


def test_dequantize_rejects_bad_arguments():
    q, s = quantize(torch.ones(3, 200), Encoding.FP8_E4M3_B128)
    with pytest.raises(TypeError, match=r"q must have dtype torch.int8 for INT8, got"):
        dequantize(q, s, Encoding.INT8)
    with pytest.raises(ValueError, match=r"scales must have shape \(3, 2\) .* got \(3, 1\)"):
        dequantize(q, s[:, :1], Encoding.FP8_E4M3_B128)
    with pytest.raises(TypeError, match=r"scales must have dtype float32, got torch.float64"):
        dequantize(q, s.double(), Encoding.FP8_E4M3_B128)
    with pytest.raises(TypeError, match=r"dtype must be one of"):
        dequantize(q, s, Encoding.FP8_E4M3_B128, torch.int32)


def test_the_removed_triton_quantize_forwards_to_quantize():
    import moecomm.ops

    with pytest.warns(DeprecationWarning, match="moecomm.ops.quantize"):
        alias = moecomm.ops.triton_quantize
    assert alias is moecomm.ops.quantize
