"""Triton kernels of the expert path against the torch references.

Without a GPU they run under the Triton interpreter (TRITON_INTERPRET=1) on CPU tensors, in
float32 and float16 only: the interpreter computes bfloat16 dots wrongly. The bfloat16 case runs
compiled on a GPU (marked ``gpu``). Group-shrink is compared exactly, the MLP with tolerances.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: it decides how kernels are built.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from moecomm.ops.grouped_gemm import (
    expert_forward_reference,
    group_shrink_reference,
    grouped_mlp_contiguous_reference,
)
from moecomm.ops.reorg import combine_rows, gather_tokens, reorganize
from moecomm.ops.triton_moe import triton_group_shrink, triton_grouped_mlp_contiguous

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

HIDDEN, INTER = 40, 24  # not multiples of the 32-wide N/K blocks: tails are masked
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}


def routed(sizes, experts, topk, routing="random", seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    xs, ids, scores = [], [], []
    for b, n in enumerate(sizes):
        x = torch.randn(n, HIDDEN, generator=g)
        x[:, 0] = b  # origin readable from the data
        x[:, 1] = torch.arange(n, dtype=torch.float32)
        if routing == "random":
            i = torch.randint(-1, experts, (n, topk), generator=g)
        elif routing == "one_expert":
            i = torch.full((n, topk), experts - 1)
        else:
            i = torch.full((n, topk), -1)
        xs.append(x.to(dtype).to(DEVICE))
        ids.append(i.to(torch.int32).to(DEVICE))
        scores.append(torch.rand(n, topk, generator=g).to(DEVICE))
    return xs, ids, scores


def weights(experts, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(experts, HIDDEN, INTER, generator=g) / INTER**0.5
    return w13.to(dtype).to(DEVICE), w2.to(dtype).to(DEVICE)


@pytest.mark.parametrize("counts", [[0], [3], [0, 0, 0], [5, 0, 0, 17, 1, 16], [0] * 69 + [40]])
def test_group_shrink_and_tile_map(counts):
    c = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    block_m = 16
    want = group_shrink_reference(c, block_m)
    max_tiles = want.num_tiles + 3  # an upper bound, as the GEMM launches use
    got = triton_group_shrink(c, block_m, max_tiles=max_tiles)
    a = want.num_active
    assert got.totals.tolist() == [a, want.num_tiles]
    assert torch.equal(got.groups.active_experts[:a], want.active_experts)
    assert torch.equal(got.groups.tile_counts[:a], want.tile_counts)
    assert torch.equal(got.groups.tile_offsets[: a + 1], want.tile_offsets)
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(counts).cumsum(0)
    assert torch.equal(got.offsets.cpu(), offsets)
    tile_expert = [e for e, k in enumerate(counts) for _ in range(-(-k // block_m))]
    tile_mblock = [m for k in counts for m in range(-(-k // block_m))]
    pad = max_tiles - len(tile_expert)
    assert got.tile_expert.tolist() == tile_expert + [-1] * pad
    assert got.tile_mblock.tolist() == tile_mblock + [0] * pad


MLP_COUNTS = [[0, 0], [1], [5, 0, 0, 17, 1], [0, 0, 33, 0], [16, 16, 15, 17]]


@pytest.mark.parametrize("counts", MLP_COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_contiguous_matches_reference(counts, dtype):
    w13, w2 = weights(len(counts), dtype)
    g = torch.Generator().manual_seed(2)
    n = sum(counts)
    x = torch.randn(n, HIDDEN, generator=g).to(dtype).to(DEVICE)
    scores = torch.rand(n, generator=g).to(DEVICE)
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(counts).cumsum(0)
    offsets = offsets.to(DEVICE)
    rtol, atol = TOL[dtype]
    for sc in (scores, None):
        got = triton_grouped_mlp_contiguous(x, offsets, w13, w2, sc)
        want = grouped_mlp_contiguous_reference(x, offsets, w13, w2, sc)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_triton_entry_points_reject_bad_arguments():
    xs, _, _ = routed([4], 3, 2)
    with pytest.raises(TypeError, match=r"counts: expected dtype torch\.int32"):
        triton_group_shrink(torch.zeros(3, dtype=torch.int64, device=DEVICE))
    w13, w2 = weights(3, torch.float32)
    with pytest.raises(ValueError, match=r"offsets: expected shape \[4\]"):
        triton_grouped_mlp_contiguous(xs[0], torch.zeros(3, dtype=torch.int64), w13, w2)
    with pytest.raises(TypeError, match=r"w13: expected dtype torch\.float16"):
        triton_grouped_mlp_contiguous(xs[0].half(), torch.zeros(4, dtype=torch.int64), w13, w2)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="bf16 needs a compiled GPU run; the interpreter is wrong")
def test_bf16_on_gpu():
    xs, ids, scores = routed([7, 0, 30], 9, 4, seed=8, dtype=torch.bfloat16)
    w13, w2 = weights(9, torch.bfloat16, seed=9)
    # The GPU server's step: rows reorganized per expert, the Triton MLP, the per-token sum.
    layout = reorganize(ids, scores, 9)
    rows = triton_grouped_mlp_contiguous(
        gather_tokens(xs, layout), layout.offsets, w13, w2, layout.scores
    )
    ys = combine_rows(rows, layout)
    rtol, atol = TOL[torch.bfloat16]
    for y, w in zip(ys, expert_forward_reference(xs, ids, scores, w13, w2), strict=True):
        torch.testing.assert_close(y, w, rtol=rtol, atol=atol)
