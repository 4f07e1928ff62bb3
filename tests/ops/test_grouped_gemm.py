"""Group-shrink and the grouped expert MLP (masked and contiguous) against their references.

Group-shrink is integer bookkeeping: compared exactly. The MLP reduces values: compared with
tolerances chosen per dtype.
"""

from __future__ import annotations

import subprocess
import sys

import moecomm.ops.grouped_gemm as gg
import pytest
import torch
import torch.nn.functional as F
from moecomm.ops.grouped_gemm import (
    ShrunkGroups,
    expert_forward,
    expert_forward_reference,
    group_shrink,
    group_shrink_reference,
    grouped_mlp_contiguous,
    grouped_mlp_contiguous_reference,
    grouped_mlp_masked,
    grouped_mlp_masked_reference,
    stack_gate_up,
)

HIDDEN, INTER = 40, 24  # neither a multiple of 128 nor of each other
# Per-dtype (rtol, atol) for MLP outputs; bf16 keeps 8 mantissa bits.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def weights(num_experts, dtype=torch.float32, seed=0, hidden=HIDDEN, inter=INTER):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def counts_to_offsets(counts):
    off = torch.zeros(len(counts) + 1, dtype=torch.int64)
    off[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    return off


COUNTS = [
    [0],
    [1],
    [0, 0, 0],
    [5, 0, 0, 17, 1],
    [0, 0, 33, 0],  # one expert holds every row
    [16, 16, 15, 17],  # tile boundaries
]


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_group_shrink_matches_reference(counts, block_m):
    c = torch.tensor(counts, dtype=torch.int32)
    got, want = group_shrink(c, block_m), group_shrink_reference(c, block_m)
    for name in ("active_experts", "tile_counts", "tile_offsets"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.num_active == sum(1 for x in counts if x)
    assert got.num_tiles == sum(-(-x // block_m) for x in counts)


def test_group_shrink_rejects_bad_arguments():
    with pytest.raises(TypeError, match=r"int32 or torch\.int64"):
        group_shrink(torch.zeros(3))
    with pytest.raises(ValueError, match="1 dimensions"):
        group_shrink(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="non-negative"):
        group_shrink(torch.tensor([1, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match="positive int"):
        group_shrink(torch.tensor([1], dtype=torch.int32), block_m=0)


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_scores", [True, False])
def test_contiguous_matches_reference(counts, dtype, with_scores):
    e = len(counts)
    w13, w2 = weights(e, dtype)
    g = torch.Generator().manual_seed(1)
    n = sum(counts)
    x = torch.randn(n, HIDDEN, generator=g).to(dtype)
    scores = torch.rand(n, generator=g) if with_scores else None
    off = counts_to_offsets(counts)
    x_before = x.clone()
    got = grouped_mlp_contiguous(x, off, w13, w2, scores)
    want = grouped_mlp_contiguous_reference(x, off, w13, w2, scores)
    assert got.dtype == dtype and got.shape == (n, HIDDEN)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert torch.equal(x, x_before), "inputs must not be modified"
    # Walking every group, empty ones included, gives the same rows.
    every = group_shrink_reference(torch.ones(e, dtype=torch.int32))
    walked = grouped_mlp_contiguous(x, off, w13, w2, scores, groups=every)
    torch.testing.assert_close(walked, got, rtol=0, atol=0)


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_matches_reference_and_contiguous(counts, dtype):
    e, m_max = len(counts), max(max(counts), 1) + 3
    w13, w2 = weights(e, dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    # Non-contiguous input: every other row of a wider buffer.
    x = torch.randn(e, 2 * m_max, HIDDEN, generator=g).to(dtype)[:, ::2]
    assert not x.is_contiguous()
    scores = torch.rand(e, m_max, generator=g)
    c = torch.tensor(counts, dtype=torch.int32)
    got = grouped_mlp_masked(x, c, w13, w2, scores)
    want = grouped_mlp_masked_reference(x, c, w13, w2, scores)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    for i, k in enumerate(counts):
        assert not got[i, k:].any(), "padding rows come out zero"
    # The same rows in the contiguous layout give the same results.
    xc = torch.cat([x[i, :k] for i, k in enumerate(counts)])
    sc = torch.cat([scores[i, :k] for i, k in enumerate(counts)])
    contiguous = grouped_mlp_contiguous(xc, counts_to_offsets(counts), w13, w2, sc)
    masked_rows = torch.cat([got[i, :k] for i, k in enumerate(counts)])
    torch.testing.assert_close(masked_rows, contiguous, rtol=rtol, atol=atol)


def test_stack_gate_up_matches_separate_hf_projections():
    g = torch.Generator().manual_seed(4)
    w1 = torch.randn(2, INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w3 = torch.randn(2, INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(2, HIDDEN, INTER, generator=g) / INTER**0.5
    x = torch.randn(5, HIDDEN, generator=g)
    off = counts_to_offsets([2, 3])
    got = grouped_mlp_contiguous(x, off, stack_gate_up(w1, w3), w2)
    hf = [F.linear(F.silu(F.linear(x[s:t], w1[e])) * F.linear(x[s:t], w3[e]), w2[e])
          for e, (s, t) in enumerate([(0, 2), (2, 5)])]  # fmt: skip
    torch.testing.assert_close(got, torch.cat(hf), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="like w1"):
        stack_gate_up(w1, w3[:, :-1])


ROUTINGS = [
    # (batch sizes, experts, topk, routing)
    ([0], 3, 2, "random"),
    ([1], 3, 1, "random"),
    ([4, 0, 6, 1], 5, 3, "random"),
    ([5, 3], 4, 2, "one_expert"),
    ([3, 2], 4, 2, "none_here"),
]


def routed_batches(sizes, experts, topk, routing, seed=5):
    g = torch.Generator().manual_seed(seed)
    xs, ids, scores = [], [], []
    for n in sizes:
        xs.append(torch.randn(n, HIDDEN, generator=g))
        if routing == "random":
            i = torch.randint(-1, experts, (n, topk), generator=g)
        elif routing == "one_expert":
            i = torch.zeros(n, topk, dtype=torch.int64)
        else:
            i = torch.full((n, topk), -1)
        ids.append(i.to(torch.int32))
        scores.append(torch.rand(n, topk, generator=g))
    return xs, ids, scores


@pytest.mark.parametrize(("sizes", "experts", "topk", "routing"), ROUTINGS)
def test_expert_forward_matches_per_token_reference(sizes, experts, topk, routing):
    xs, ids, scores = routed_batches(sizes, experts, topk, routing)
    w13, w2 = weights(experts, seed=6)
    before = [t.clone() for t in xs + ids + scores]
    got = expert_forward(xs, ids, scores, w13, w2)
    want = expert_forward_reference(xs, ids, scores, w13, w2)
    assert [y.shape for y in got] == [x.shape for x in xs]
    for y, w in zip(got, want, strict=True):
        torch.testing.assert_close(y, w, rtol=1e-5, atol=1e-5)
    for t, b in zip(xs + ids + scores, before, strict=True):
        assert torch.equal(t, b), "inputs must not be modified"
    if routing == "none_here":
        assert not any(y.any() for y in got)


def test_contiguous_rejects_bad_arguments():
    w13, w2 = weights(2)
    x = torch.randn(3, HIDDEN)
    off = counts_to_offsets([1, 2])
    cases = [
        ((x.double(), off, w13, w2), TypeError, "expected dtype"),
        ((x[:, :-1], off, w13, w2), ValueError, rf"w13: expected shape \[E, 2\*I, {HIDDEN - 1}\]"),
        ((x, off, w13, w2[:, :, :-1]), ValueError, rf"w2: expected shape \[2, {HIDDEN}, {INTER}\]"),
        ((x, off, w13[:, :-1], w2), ValueError, "w13: expected shape"),
        ((x, off, w13.double(), w2), TypeError, "w13: expected dtype torch.float32"),
        ((x, off[:-1], w13, w2), ValueError, r"offsets: expected shape \[3\]"),
        ((x, counts_to_offsets([1, 1]), w13, w2), ValueError, "from 0 to N=3"),
        ((x, off.float(), w13, w2), TypeError, "offsets: expected dtype"),
        ((x, off, w13, w2, torch.rand(4)), ValueError, r"scores: expected shape \[3\]"),
        ((x, off, w13, w2, torch.rand(3).double()), TypeError, "scores: expected dtype"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            grouped_mlp_contiguous(*args)
    w13_3, w2_3 = weights(3)
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_mlp_contiguous(x, torch.tensor([0, 2, 1, 3]), w13_3, w2_3)
    with pytest.raises(ValueError, match="groups: expected experts in"):
        bad = ShrunkGroups(torch.tensor([5], dtype=torch.int32), torch.ones(1), torch.ones(2), 1)
        grouped_mlp_contiguous(x, off, w13, w2, groups=bad)


def test_masked_rejects_bad_arguments():
    w13, w2 = weights(2)
    x = torch.randn(2, 4, HIDDEN)
    c = torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="3 dimensions"):
        grouped_mlp_masked(x[0], c, w13, w2)
    with pytest.raises(ValueError, match="expected 2 experts in dim 0"):
        grouped_mlp_masked(x[:1], c, w13, w2)
    with pytest.raises(ValueError, match=r"counts: expected shape \[2\]"):
        grouped_mlp_masked(x, c[:1], w13, w2)
    with pytest.raises(ValueError, match=r"values in \[0, M_max=4\]"):
        grouped_mlp_masked(x, torch.tensor([1, 5], dtype=torch.int32), w13, w2)
    with pytest.raises(ValueError, match=r"scores: expected shape \[2, 4\]"):
        grouped_mlp_masked(x, c, w13, w2, torch.rand(2, 3))
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        grouped_mlp_masked(x.tolist(), c, w13, w2)


NATIVE_COUNTS = [1, 2, 7, 16, 17, 0, 40]  # both sides of a 16-row split, and an empty expert


@pytest.mark.parametrize("max_rows", [0, 16, 1000])  # torch only, split, native only
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_native_and_torch_paths_match_reference(monkeypatch, max_rows, layout):
    if gg._native_module() is None:
        pytest.skip("the native kernel needs moecomm._C built and an AVX2+FMA CPU")
    monkeypatch.setattr(gg, "NATIVE_MAX_ROWS", max_rows)
    hidden, inter = 37, 13  # tails in every loop of the AVX2 kernel (8 lanes, 4 columns)
    e = len(NATIVE_COUNTS)
    w13, w2 = weights(e, hidden=hidden, inter=inter, seed=8)
    g = torch.Generator().manual_seed(9)
    if layout == "contiguous":
        x = torch.randn(sum(NATIVE_COUNTS), hidden, generator=g)
        sc = torch.rand(x.shape[0], generator=g)
        off = counts_to_offsets(NATIVE_COUNTS)
        got = grouped_mlp_contiguous(x, off, w13, w2, sc)
        want = grouped_mlp_contiguous_reference(x, off, w13, w2, sc)
    else:
        x = torch.randn(e, max(NATIVE_COUNTS), hidden, generator=g)
        sc = torch.rand(e, max(NATIVE_COUNTS), generator=g)
        c = torch.tensor(NATIVE_COUNTS, dtype=torch.int32)
        got = grouped_mlp_masked(x, c, w13, w2, sc)
        want = grouped_mlp_masked_reference(x, c, w13, w2, sc)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_native_path_is_thread_count_invariant(monkeypatch):
    if gg._native_module() is None:
        pytest.skip("the native kernel needs moecomm._C built and an AVX2+FMA CPU")
    monkeypatch.setattr(gg, "NATIVE_MAX_ROWS", 1000)  # every expert in the native kernel
    w13, w2 = weights(len(NATIVE_COUNTS), seed=10)
    x = torch.randn(sum(NATIVE_COUNTS), HIDDEN, generator=torch.Generator().manual_seed(11))
    off = counts_to_offsets(NATIVE_COUNTS)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = grouped_mlp_contiguous(x, off, w13, w2)
        torch.set_num_threads(3)
        three = grouped_mlp_contiguous(x, off, w13, w2)
    finally:
        torch.set_num_threads(threads)
    # Each expert is computed by one thread in a fixed order: the split changes nothing.
    assert torch.equal(one, three)


def test_grouped_mlp_rejects_weights_on_another_device():
    w13, w2 = weights(2)
    x = torch.randn(3, HIDDEN)
    off = counts_to_offsets([1, 2])
    with pytest.raises(ValueError, match="w13: expected device cpu, got meta"):
        grouped_mlp_contiguous(x, off, w13.to("meta"), w2)
    with pytest.raises(ValueError, match="offsets: expected device cpu, got meta"):
        grouped_mlp_contiguous(x, off.to("meta"), w13, w2)
    with pytest.raises(ValueError, match="w2: expected device cpu, got meta"):
        grouped_mlp_masked(x.view(1, 3, HIDDEN).expand(2, 3, HIDDEN), torch.tensor([1, 2],
                           dtype=torch.int32), w13, w2.to("meta"))  # fmt: skip


def test_ops_import_without_triton():
    # Triton is imported lazily: the CPU path must work where it is not installed.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, moecomm.ops, moecomm.ops.triton_moe\n"
        "from moecomm.ops import group_shrink\n"
        "assert group_shrink(torch.tensor([0, 3], dtype=torch.int32)).num_active == 1\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_native_kernel_rejects_bad_sizes_with_value_error():
    native = gg._native_module()
    if native is None:
        pytest.skip("the native kernel needs moecomm._C built and an AVX2+FMA CPU")
    with pytest.raises(ValueError, match=r"expected hidden, inter > 0, got 0, 4"):
        native.expert_mlp_f32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 1)
    with pytest.raises(ValueError, match=r"expected threads >= 1, got 0"):
        native.expert_mlp_f32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8, 4, 0)


# (40, 24): every depth a multiple of 8; (67, 13): 16-float steps, an 8-float step and scalar
# tails in both projections.
@pytest.mark.parametrize(("hidden", "inter"), [(HIDDEN, INTER), (67, 13)])
def test_expert_forward_is_batch_invariant_in_float32(hidden, inter):
    if gg._native_module() is None:
        pytest.skip("the native kernel needs moecomm._C built and an AVX2+FMA CPU")
    # A token's result must not depend on which other tokens share the step.
    w13, w2 = weights(3, seed=12, hidden=hidden, inter=inter)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(80, hidden, generator=g)
    ids = torch.randint(0, 3, (80, 2), generator=g, dtype=torch.int32)
    sc = torch.rand(80, 2, generator=g)
    (full,) = expert_forward([x], [ids], [sc], w13, w2)
    for n in (1, 5, 17, 40):
        rows = torch.randperm(80, generator=g)[:n]
        (part,) = expert_forward([x[rows]], [ids[rows]], [sc[rows]], w13, w2)
        assert torch.equal(part, full[rows]), f"{n} rows"
