"""Triton quantize kernel against the torch reference, bit for bit. Runs under the Triton
interpreter on the CPU (fp16/fp32 only: the interpreter computes bf16 wrong); the GPU test runs
the compiled kernel, bf16 included, when a device is present and the interpreter is off."""

import os
import subprocess
import sys

import pytest
import torch
from moecomm._C import Encoding
from moecomm.ops.quant import QUANTIZED_ENCODINGS, quantize_reference

triton = pytest.importorskip("triton")
from moecomm.ops.triton_quant import triton_quantize  # noqa: E402

# Small on purpose: the interpreter runs every program in Python.
SHAPES = [(0, 64), (1, 1), (1, 128), (3, 200), (5, 300), (2, 2100)]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def make_x(t: int, h: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g) * 3
    if t > 1:
        x[1] = 0  # all-zero token: scale 1
    if t > 2:
        x[2, : min(h, 7)] = 1e-3  # values that land on e4m3 subnormals after scaling
        x[2, 7:14] = -1e-6  # negative values that round to -0: the sign of zero must survive
        x[2, 14:15] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("enc", QUANTIZED_ENCODINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference(shape, dtype, enc):
    x = make_x(*shape, dtype, seed=sum(shape))
    before = x.clone()
    q, s = triton_quantize(x, enc)
    q_ref, s_ref = quantize_reference(x, enc)
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.equal(bits(q), bits(q_ref))
    assert torch.equal(s, s_ref)
    assert torch.equal(x, before)


@pytest.mark.parametrize("enc", QUANTIZED_ENCODINGS)
def test_triton_strided_inputs(enc):
    base = make_x(8, 300, torch.float32, seed=3)
    rows = base[::2, 5:264]  # row stride 600, unit channel stride: used as is
    q, s = triton_quantize(rows, enc)
    q_ref, s_ref = quantize_reference(rows, enc)
    assert torch.equal(bits(q), bits(q_ref)) and torch.equal(s, s_ref)
    cols = base[:, :40].t()  # channel stride 300: copied first
    q, s = triton_quantize(cols, enc)
    q_ref, s_ref = quantize_reference(cols, enc)
    assert torch.equal(bits(q), bits(q_ref)) and torch.equal(s, s_ref)


def test_triton_rejects_bad_arguments():
    x = torch.zeros(2, 8, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"dtype bfloat16, float16 or float32, got torch.int8"):
        triton_quantize(x.to(torch.int8), Encoding.INT8)
    with pytest.raises(ValueError, match=r"one of INT8, FP8_E4M3, FP8_E4M3_B128, got"):
        triton_quantize(x, Encoding.FP16)
    with pytest.raises(ValueError, match=r"shape \[T, H\] with H >= 1, got \(2, 8, 1\)"):
        triton_quantize(x[..., None], Encoding.INT8)


def test_importing_moecomm_ops_does_not_import_triton():
    code = "import sys, moecomm.ops; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED,
    reason="needs a CUDA device and TRITON_INTERPRET=0",
)
@pytest.mark.parametrize("enc", QUANTIZED_ENCODINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_on_gpu_matches_reference(enc, dtype):
    x = make_x(257, 7168 + 64, dtype, seed=5)
    q, s = triton_quantize(x.cuda(), enc)
    q_ref, s_ref = quantize_reference(x, enc)
    assert torch.equal(bits(q.cpu()), bits(q_ref)) and torch.equal(s.cpu(), s_ref)
