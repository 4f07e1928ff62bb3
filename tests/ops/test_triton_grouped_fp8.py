"""Triton grouped MLP over quantized activations (fp8 e4m3 per token / per 128 channels, int8
per token) against ``dequantize`` + the float32 torch references.

Without a GPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1) on CPU tensors
with float32/float16 weights (the interpreter computes bfloat16 dots wrongly); bfloat16 weights
run compiled on a GPU (tests marked ``gpu``).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: it decides how kernels are built.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from moecomm._C import SCALE_BLOCK, Encoding
from moecomm.ops import triton_moe
from moecomm.ops.grouped_gemm import expert_forward_reference, grouped_mlp_contiguous_reference
from moecomm.ops.quant import dequantize, quantize
from moecomm.ops.reorg import combine_rows, reorganize
from moecomm.ops.triton_moe import triton_grouped_mlp_contiguous

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

# H = 200: two scale blocks of 128 channels, the last one partial (72), and neither a multiple
# of the 32-wide K tile; I = 24 is not a multiple of the 32-wide N tile.
HIDDEN, INTER = 200, 24
# The output against the float32 reference on the dequantized x, as (rtol, atol relative to the
# largest |output|): float32 weights differ only by where the scale multiplies (exact q · w,
# then · s, versus (q · s) · w); half weights add the rounding of h and of the output. The
# outputs reach ~170 here (the 8x channels), hence the atol relative to the output's size.
TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 1e-3), torch.bfloat16: (4e-2, 8e-3)}
ENCODINGS = [Encoding.FP8_E4M3, Encoding.FP8_E4M3_B128, Encoding.INT8]
COUNTS = [[0, 0], [5, 0, 0, 17, 1], [16, 16, 15, 17]]


def weights(experts, dtype, hidden=HIDDEN, inter=INTER, seed=1):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    return w13.to(dtype).to(DEVICE), w2.to(dtype).to(DEVICE)


def activations(rows, hidden, encoding, seed):
    """Quantized rows with channels of very different magnitudes, so that per-block scales
    differ from the per-token one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    x[:, :SCALE_BLOCK] *= 8.0
    q, s = quantize(x.to(DEVICE), encoding)
    return q, s


def offsets_of(counts):
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(counts).cumsum(0)
    return offsets.to(DEVICE)


def check_close(got, want, dtype):
    assert got.dtype == dtype
    rtol, atol = TOL[dtype]
    atol *= max(1.0, float(want.abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)


def test_scale_block_matches_the_wire():
    assert triton_moe._SCALE_BLOCK == SCALE_BLOCK
    assert SCALE_BLOCK % triton_moe._BLOCK_K == 0


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("encoding", ENCODINGS, ids=lambda e: e.name)
def test_contiguous_quantized_matches_reference(encoding, dtype, counts):
    w13, w2 = weights(len(counts), dtype)
    n = sum(counts)
    q, s = activations(n, HIDDEN, encoding, seed=2)
    scores = torch.rand(n, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    offsets = offsets_of(counts)
    x_ref = dequantize(q, s, encoding)
    want = grouped_mlp_contiguous_reference(x_ref, offsets, w13.float(), w2.float(), scores)
    got = triton_grouped_mlp_contiguous(q, offsets, w13, w2, scores, x_scales=s)
    check_close(got, want, dtype)
    if s.shape[1] == 1:
        # Per-token scales may also come as [N]: same launch, same bits.
        again = triton_grouped_mlp_contiguous(q, offsets, w13, w2, scores, x_scales=s[:, 0])
        assert torch.equal(got, again)


@pytest.mark.parametrize("hidden", [40, 128, 300])
def test_block_scales_any_hidden_without_scores(hidden):
    """One partial block, exactly one block, three blocks (last partial); no scores."""
    counts = [3, 0, 20]
    w13, w2 = weights(len(counts), torch.float32, hidden=hidden, seed=7)
    q, s = activations(sum(counts), hidden, Encoding.FP8_E4M3_B128, seed=8)
    offsets = offsets_of(counts)
    want = grouped_mlp_contiguous_reference(dequantize(q, s, Encoding.FP8_E4M3_B128),
                                            offsets, w13, w2)  # fmt: skip
    got = triton_grouped_mlp_contiguous(q, offsets, w13, w2, x_scales=s)
    check_close(got, want, torch.float32)


@pytest.mark.parametrize("encoding", ENCODINGS, ids=lambda e: e.name)
def test_server_step_quantized(encoding):
    """The GPU server's step: quantized rows reorganized as they are, their scales gathered
    alongside (runtime/device_server.py), the Triton MLP, the per-token sum."""
    sizes, experts, topk = [3, 0, 9], 5, 2
    g = torch.Generator().manual_seed(13)
    n = sum(sizes)
    q, s = activations(n, HIDDEN, encoding, seed=14)
    ids = torch.randint(-1, experts, (n, topk), generator=g, dtype=torch.int32).to(DEVICE)
    scores = torch.rand(n, topk, generator=g).to(DEVICE)
    ids_b, scores_b = list(ids.split(sizes)), list(scores.split(sizes))
    layout = reorganize(ids_b, scores_b, experts)
    w13, w2 = weights(experts, torch.float16, seed=15)
    src = layout.src_token
    rows = triton_grouped_mlp_contiguous(
        q.index_select(0, src), layout.offsets, w13, w2, layout.scores,
        x_scales=s.index_select(0, src),
    )  # fmt: skip
    ys = combine_rows(rows, layout)
    xs = list(dequantize(q, s, encoding).split(sizes))
    wants = expert_forward_reference(xs, ids_b, scores_b, w13.float(), w2.float())
    for y, want in zip(ys, wants, strict=True):
        check_close(y, want, torch.float16)


def test_quantized_arguments_are_checked():
    w13, w2 = weights(3, torch.float32)
    offsets = offsets_of([2, 0, 2])
    q, s = activations(4, HIDDEN, Encoding.FP8_E4M3_B128, seed=9)
    x = dequantize(q, s, Encoding.FP8_E4M3_B128)
    mlp = triton_grouped_mlp_contiguous
    with pytest.raises(ValueError, match=r"x_scales: torch\.float8_e4m3fn activations need"):
        mlp(q, offsets, w13, w2)
    with pytest.raises(ValueError, match=r"x_scales: only float8_e4m3fn or int8 activations"):
        mlp(x, offsets, w13, w2, x_scales=s)
    with pytest.raises(ValueError, match=r"x_scales: expected shape \[4\] or \[4, 1\] .* or "
                       r"\[4, 2\] \(per 128 channels of H=200\), got \[4, 3\]"):  # fmt: skip
        mlp(q, offsets, w13, w2, x_scales=torch.ones(4, 3, device=DEVICE))
    with pytest.raises(ValueError, match=r"x_scales: expected shape .* got \[3, 2\]"):
        mlp(q, offsets, w13, w2, x_scales=s[:3])
    with pytest.raises(TypeError, match=r"x_scales: expected dtype torch\.float32"):
        mlp(q, offsets, w13, w2, x_scales=s.half())
    with pytest.raises(TypeError, match=r"x: expected dtype"):
        mlp(q.to(torch.float8_e5m2), offsets, w13, w2, x_scales=s)
    with pytest.raises(TypeError, match=r"w13: expected dtype"):
        mlp(q, offsets, w13.to(torch.float8_e4m3fn), w2, x_scales=s)
    with pytest.raises(TypeError, match=r"w2: expected dtype torch\.float32"):
        mlp(q, offsets, w13, w2.half(), x_scales=s)
    with pytest.raises(ValueError, match=r"x_scales: expected shape \[4\] or"):
        mlp(q, offsets, w13, w2, x_scales=s[:, :1].T)
    # Float activations keep their old contract: the weights must have x's dtype.
    with pytest.raises(TypeError, match=r"w13: expected dtype torch\.float32"):
        mlp(x, offsets, w13.half(), w2.half())


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="compiled kernels need a GPU (interpreter: no bf16)")
@pytest.mark.parametrize("encoding", ENCODINGS, ids=lambda e: e.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantized_on_gpu(encoding, dtype):
    """Compiled kernels against torch in float32, at a DeepSeek-like H (56 scale blocks)."""
    hidden, inter = 7168, 256
    counts = [0, 1, 37, 0, 130, 16, 3, 64]
    w13, w2 = weights(len(counts), dtype, hidden=hidden, inter=inter, seed=10)
    n = sum(counts)
    q, s = activations(n, hidden, encoding, seed=11)
    scores = torch.rand(n, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    offsets = offsets_of(counts)
    x_ref = dequantize(q, s, encoding)
    want = grouped_mlp_contiguous_reference(x_ref, offsets, w13.float(), w2.float(), scores)
    got = triton_grouped_mlp_contiguous(q, offsets, w13, w2, scores, x_scales=s)
    check_close(got, want, dtype)
