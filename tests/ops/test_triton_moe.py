"""Triton kernels of the expert path against the torch references.

Without a GPU they run under the Triton interpreter (TRITON_INTERPRET=1) on CPU tensors, in
float32 and float16 only: the interpreter computes bfloat16 dots wrongly. The bfloat16 case runs
compiled on a GPU (marked ``gpu``). Reorganization is compared bit-exactly, the MLP with
tolerances.
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
    grouped_mlp_masked_reference,
)
from moecomm.ops.reorg import (
    combine_rows_reference,
    gather_tokens,
    reorganize,
)
from moecomm.ops.triton_moe import (
    triton_combine,
    triton_expert_forward,
    triton_group_shrink,
    triton_grouped_mlp_contiguous,
    triton_grouped_mlp_masked,
    triton_reorganize,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

HIDDEN, INTER = 40, 24  # not multiples of the 32-wide N/K blocks: tails are masked
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}
LAYOUT_FIELDS = ("counts", "offsets", "src_batch", "src_row", "src_k", "src_token", "scores",
                 "slot_of", "batch_offsets")  # fmt: skip


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


REORG_CASES = [
    # (batch sizes, experts, topk, routing): 150 copies span three 64-copy programs and 70
    # experts span two 64-expert chunks, so cross-program prefixes are exercised.
    ([0], 4, 2, "random"),
    ([1], 4, 1, "random"),
    ([3, 0, 50, 1], 70, 3, "random"),
    ([9, 4], 5, 8, "one_expert"),
    ([6, 2], 5, 2, "none_here"),
]


@pytest.mark.parametrize(("sizes", "experts", "topk", "routing"), REORG_CASES)
def test_reorganize_is_bit_exact(sizes, experts, topk, routing):
    xs, ids, scores = routed(sizes, experts, topk, routing)
    want = reorganize(ids, scores, experts)
    x = torch.cat(xs)
    # Non-contiguous activations: every other column of a wider buffer.
    wide = torch.zeros(x.shape[0], 2 * HIDDEN, device=DEVICE)
    wide[:, ::2] = x
    before = [t.clone() for t in (wide, *ids, *scores)]
    got, rows = triton_reorganize(
        wide[:, ::2], torch.cat(ids), torch.cat(scores), want.batch_offsets, experts
    )
    for name in LAYOUT_FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(rows, gather_tokens(xs, want))
    for t, b in zip((wide, *ids, *scores), before, strict=True):
        assert torch.equal(t, b), "inputs must not be modified"


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


@pytest.mark.parametrize("counts", MLP_COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_masked_matches_reference(counts, dtype):
    e, m_max = len(counts), max(counts) + 2
    w13, w2 = weights(e, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(e, 2 * m_max, HIDDEN, generator=g).to(dtype).to(DEVICE)[:, 1::2]
    scores = torch.rand(e, m_max, generator=g).to(DEVICE)
    c = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    got = triton_grouped_mlp_masked(x, c, w13, w2, scores)
    want = grouped_mlp_masked_reference(x, c, w13, w2, scores)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    for i, k in enumerate(counts):
        assert not got[i, k:].any(), "padding rows come out zero"


@pytest.mark.parametrize(("sizes", "experts", "topk", "routing"), REORG_CASES[:4])
def test_combine_and_expert_forward(sizes, experts, topk, routing):
    xs, ids, scores = routed(sizes, experts, topk, routing, seed=5)
    layout = reorganize(ids, scores, experts)
    rows = torch.randn(layout.num_rows, HIDDEN, generator=torch.Generator().manual_seed(6))
    rows = rows.to(DEVICE)
    got = triton_combine(rows, layout).split(sizes)
    for g_, w in zip(got, combine_rows_reference(rows, layout), strict=True):
        # Both sum in k order in float32: identical.
        assert torch.equal(g_, w)
    w13, w2 = weights(experts, torch.float32, seed=7)
    ys = triton_expert_forward(
        torch.cat(xs), torch.cat(ids), torch.cat(scores), layout.batch_offsets, w13, w2
    )
    for y, w in zip(ys, expert_forward_reference(xs, ids, scores, w13, w2), strict=True):
        torch.testing.assert_close(y, w, rtol=1e-4, atol=1e-4)


def test_triton_entry_points_reject_bad_arguments():
    xs, ids, scores = routed([4], 3, 2)
    bo = torch.tensor([0, 4], device=DEVICE)
    with pytest.raises(TypeError, match=r"ids: expected dtype torch\.int32"):
        triton_reorganize(xs[0], ids[0].long(), scores[0], bo, 3)
    with pytest.raises(ValueError, match=r"shape \[4, K\] like x"):
        triton_reorganize(xs[0], ids[0][:3], scores[0][:3], bo, 3)
    with pytest.raises(TypeError, match=r"batch_offsets: expected dtype torch\.int64"):
        triton_reorganize(xs[0], ids[0], scores[0], bo.int(), 3)
    with pytest.raises(TypeError, match=r"counts: expected dtype torch\.int32"):
        triton_group_shrink(torch.zeros(3, dtype=torch.int64, device=DEVICE))
    w13, w2 = weights(3, torch.float32)
    with pytest.raises(ValueError, match=r"offsets: expected shape \[4\]"):
        triton_grouped_mlp_contiguous(xs[0], torch.zeros(3, dtype=torch.int64), w13, w2)
    with pytest.raises(TypeError, match=r"w13: expected dtype torch\.float16"):
        triton_grouped_mlp_masked(xs[0].half()[None].expand(3, 4, HIDDEN), bo.int(), w13, w2)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="bf16 needs a compiled GPU run; the interpreter is wrong")
def test_bf16_on_gpu():
    xs, ids, scores = routed([7, 0, 30], 9, 4, seed=8, dtype=torch.bfloat16)
    w13, w2 = weights(9, torch.bfloat16, seed=9)
    layout = reorganize(ids, scores, 9)
    ys = triton_expert_forward(
        torch.cat(xs), torch.cat(ids), torch.cat(scores), layout.batch_offsets, w13, w2
    )
    rtol, atol = TOL[torch.bfloat16]
    for y, w in zip(ys, expert_forward_reference(xs, ids, scores, w13, w2), strict=True):
        torch.testing.assert_close(y, w, rtol=rtol, atol=atol)
