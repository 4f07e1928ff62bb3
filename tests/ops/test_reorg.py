"""Token reorganization and combine against their plain-Python references.

Reorganization only moves data, so every comparison is bit-exact. Inputs carry their origin:
x_b[r, 0] = b, x_b[r, 1] = r, so a gathered row says where it came from.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moecomm.ops.reorg import (
    combine_rows,
    combine_rows_reference,
    gather_tokens,
    reorganize,
    reorganize_reference,
)

HIDDEN = 37  # not a multiple of any vector width: tails are exercised


def make_batches(sizes, num_experts, topk, *, routing="random", seed=0, hidden=HIDDEN):
    g = torch.Generator().manual_seed(seed)
    xs, ids, scores = [], [], []
    for b, n in enumerate(sizes):
        x = torch.randn(n, hidden, generator=g)
        x[:, 0] = b
        x[:, 1] = torch.arange(n, dtype=torch.float32)
        if routing == "random":  # -1 included: copies for other servers
            i = torch.randint(-1, num_experts, (n, topk), generator=g)
        elif routing == "one_expert":  # every copy on the last expert
            i = torch.full((n, topk), num_experts - 1)
        elif routing == "none_here":
            i = torch.full((n, topk), -1)
        else:
            raise AssertionError(routing)
        xs.append(x)
        ids.append(i.to(torch.int32))
        scores.append(torch.rand(n, topk, generator=g))
    return xs, ids, scores


def assert_layouts_equal(a, b):
    assert a.num_experts == b.num_experts and a.topk == b.topk
    for name in (
        "counts",
        "offsets",
        "src_batch",
        "src_row",
        "src_k",
        "src_token",
        "scores",
        "batch_offsets",
        "slot_of",
    ):
        va, vb = getattr(a, name), getattr(b, name)
        assert va.dtype == vb.dtype, name
        assert torch.equal(va, vb), name


CASES = [
    # (batch sizes, experts, topk, routing)
    ([0], 4, 2, "random"),
    ([1], 4, 1, "random"),
    ([3, 0, 5, 1], 6, 3, "random"),
    ([0, 0, 7], 3, 8, "random"),
    ([40, 13, 0, 25], 64, 8, "random"),
    ([9, 4], 5, 4, "one_expert"),
    ([6, 2], 5, 2, "none_here"),
    ([1, 1, 1], 1, 1, "random"),
]


@pytest.mark.parametrize(("sizes", "experts", "topk", "routing"), CASES)
def test_reorganize_matches_reference(sizes, experts, topk, routing):
    _, ids, scores = make_batches(sizes, experts, topk, routing=routing)
    before = [t.clone() for t in ids + scores]
    layout = reorganize(ids, scores, experts)
    assert_layouts_equal(layout, reorganize_reference(ids, scores, experts))
    for t, c in zip(ids + scores, before, strict=True):
        assert torch.equal(t, c), "inputs must not be modified"


@pytest.mark.parametrize(("sizes", "experts", "topk", "routing"), CASES)
def test_layout_is_consistent_with_inputs(sizes, experts, topk, routing):
    xs, ids, scores = make_batches(sizes, experts, topk, routing=routing)
    layout = reorganize(ids, scores, experts)
    all_ids = torch.cat([i.reshape(-1) for i in ids])
    assert layout.num_rows == int((all_ids >= 0).sum())
    assert int(layout.offsets[-1]) == layout.num_rows
    # Every row of expert e holds a copy routed to e, with that copy's score, in flat order.
    for e in range(experts):
        lo, hi = int(layout.offsets[e]), int(layout.offsets[e + 1])
        assert hi - lo == int(layout.counts[e])
        for i in range(lo, hi):
            b, r, k = int(layout.src_batch[i]), int(layout.src_row[i]), int(layout.src_k[i])
            assert int(ids[b][r, k]) == e
            assert layout.scores[i] == scores[b][r, k]
            assert int(layout.slot_of[layout.src_token[i], k]) == i
        flat = layout.src_token[lo:hi] * topk + layout.src_k[lo:hi]
        assert bool((flat[1:] > flat[:-1]).all()), "rows of an expert keep the flat order"
    rows = gather_tokens(xs, layout)
    assert rows.shape == (layout.num_rows, HIDDEN)
    assert torch.equal(rows[:, 0], layout.src_batch.float())
    assert torch.equal(rows[:, 1], layout.src_row.float())
    for i in range(layout.num_rows):
        assert torch.equal(rows[i], xs[int(layout.src_batch[i])][int(layout.src_row[i])])


def test_gather_and_reorganize_accept_non_contiguous_inputs():
    xs, ids, scores = make_batches([5, 0, 8], 7, 3, seed=3)
    wide = [torch.randn(x.shape[0], 2 * HIDDEN) for x in xs]
    for w, x in zip(wide, xs, strict=True):
        w[:, ::2] = x
    xs_nc = [w[:, ::2] for w in wide]
    ids_nc = [i.t().contiguous().t() for i in ids]  # column-major
    scores_nc = [s.t().contiguous().t() for s in scores]
    assert not xs_nc[0].is_contiguous() and not ids_nc[0].is_contiguous()
    layout = reorganize(ids_nc, scores_nc, 7)
    assert_layouts_equal(layout, reorganize(ids, scores, 7))
    assert torch.equal(gather_tokens(xs_nc, layout), gather_tokens(xs, layout))


@pytest.mark.parametrize(("sizes", "experts", "topk", "routing"), CASES)
def test_combine_matches_reference(sizes, experts, topk, routing):
    _, ids, scores = make_batches(sizes, experts, topk, routing=routing, seed=1)
    layout = reorganize(ids, scores, experts)
    rows = torch.randn(layout.num_rows, HIDDEN, generator=torch.Generator().manual_seed(2))
    got = combine_rows(rows, layout)
    want = combine_rows_reference(rows, layout)
    assert [g.shape[0] for g in got] == list(sizes)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    # Half-precision rows are summed in float32 and rounded once: at most one bf16 ulp apart
    # from the reference, whose float32 sum runs in k order instead of layout order.
    got16 = combine_rows(rows.bfloat16(), layout)
    for g, w in zip(got16, combine_rows_reference(rows.bfloat16(), layout), strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w, rtol=2**-8, atol=1e-6)
    # A token with no copy here comes back exactly zero.
    here = (layout.slot_of >= 0).any(dim=1)
    assert not torch.cat(got)[~here].any()


def _bad(ids=None, scores=None, num_experts=4):
    _, good_ids, good_scores = make_batches([3, 2], 4, 2)
    return (
        good_ids if ids is None else ids,
        good_scores if scores is None else scores,
        num_experts,
    )


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        (_bad(ids=[torch.zeros(3, 2, dtype=torch.int64)] * 2), TypeError, "int32"),
        (_bad(scores=[torch.zeros(3, 2, dtype=torch.float64)] * 2), TypeError, "float32"),
        (_bad(ids=[torch.zeros(6, dtype=torch.int32)] * 2), ValueError, "2 dimensions"),
        (
            _bad(ids=[torch.zeros(3, 2, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32)]),
            ValueError,
            "topk 2",
        ),
        (
            _bad(scores=[torch.zeros(3, 2), torch.zeros(2, 3)]),
            ValueError,
            r"expected shape \[2, 2\]",
        ),
        (_bad(ids=[torch.full((3, 2), 4, dtype=torch.int32)] * 2), ValueError, r"\[-1, 4\)"),
        (_bad(ids=[torch.full((3, 2), -2, dtype=torch.int32)] * 2), ValueError, r"\[-1, 4\)"),
        (_bad(num_experts=0), ValueError, "positive"),
        (_bad(num_experts=2.0), TypeError, "int"),
        (_bad(scores=[torch.zeros(3, 2)]), ValueError, "as many score tensors"),
        (_bad(ids=torch.zeros(3, 2, dtype=torch.int32)), TypeError, "list of per-batch"),
        (([], [], 4), ValueError, "at least one batch"),
    ],
)
def test_reorganize_rejects_bad_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        reorganize(*args)


def test_gather_and_combine_reject_bad_arguments():
    xs, ids, scores = make_batches([3, 2], 4, 2)
    layout = reorganize(ids, scores, 4)
    with pytest.raises(ValueError, match="expected 2 activation tensors"):
        gather_tokens(xs[:1], layout)
    with pytest.raises(ValueError, match=r"expected shape \[2, H\]"):
        gather_tokens([xs[0], xs[0]], layout)
    with pytest.raises(ValueError, match=f"expected hidden {HIDDEN}"):
        gather_tokens([xs[0], torch.zeros(2, 5)], layout)
    with pytest.raises(TypeError, match="floating dtype"):
        gather_tokens([xs[0].to(torch.int32), xs[1]], layout)
    with pytest.raises(TypeError, match="like x\\[0\\]"):
        gather_tokens([xs[0], xs[1].double()], layout)
    with pytest.raises(ValueError, match=rf"expected shape \[{layout.num_rows}, H\]"):
        combine_rows(torch.zeros(layout.num_rows + 1, 4), layout)
    with pytest.raises(TypeError, match="floating"):
        combine_rows(torch.zeros(layout.num_rows, 4, dtype=torch.int32), layout)


@pytest.mark.gpu
def test_cuda_reorg_and_scan(nvcc_program):
    """Builds tests/ops/cuda/reorg_scan_check.cu with the kernels (once per test run: the session
    fixture in tests/conftest.py) and runs it on the device: the CUDA reorganization,
    group-shrink and tile map must match a host reference bit-exactly."""
    root = Path(__file__).resolve().parents[2]
    kernels = root / "csrc" / "kernels" / "cuda"
    sources = [Path(__file__).parent / "cuda" / "reorg_scan_check.cu", kernels / "reorg.cu",
               kernels / "scan.cu"]  # fmt: skip
    exe = nvcc_program("reorg_scan_check", sources, ["-arch=native"])
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=False, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "OK"


def test_reorganize_and_gather_reject_mixed_devices():
    # The meta device stands in for "another device" on a machine without a GPU.
    xs, ids, scores = make_batches([3, 2], 4, 2)
    with pytest.raises(ValueError, match="scores\\[1\\]: expected device cpu, got meta"):
        reorganize(ids, [scores[0], scores[1].to("meta")], 4)
    with pytest.raises(ValueError, match="ids\\[1\\]: expected device cpu, got meta"):
        reorganize([ids[0], ids[1].to("meta")], scores, 4)
    layout = reorganize(ids, scores, 4)
    with pytest.raises(ValueError, match="x\\[0\\]: expected device cpu, got meta"):
        gather_tokens([xs[0].to("meta"), xs[1]], layout)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=5),
    experts=st.integers(1, 9),
    topk=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_reorganize_property(sizes, experts, topk, seed):
    # Any batch list: same layout as the reference, and combine(gather) sums each token's copies.
    xs, ids, scores = make_batches(sizes, experts, topk, seed=seed)
    layout = reorganize(ids, scores, experts)
    assert_layouts_equal(layout, reorganize_reference(ids, scores, experts))
    rows = gather_tokens(xs, layout)
    per_token = torch.cat(combine_rows(rows, layout))
    copies_here = (layout.slot_of >= 0).sum(dim=1, keepdim=True).float()
    torch.testing.assert_close(per_token, torch.cat(xs) * copies_here, rtol=1e-6, atol=1e-5)
