"""ExpertWorkspace and caller-owned outputs: same bits as the plain step, no allocation when warm.

The allocation counter is the torch profiler's memory events (``profile_memory=True``): every
storage the CPU allocator hands out is a ``[memory]`` event with positive bytes. It is shown to
catch the plain step's allocations before it is trusted to find none in the warm one.
"""

from __future__ import annotations

import json

import pytest
import torch
from moecomm.ops import (
    ExpertWorkspace,
    combine_rows,
    dequantize,
    expert_forward,
    gather_tokens,
    group_shrink,
    grouped_mlp_contiguous,
    quantize,
    reorganize,
)
from moecomm.ops import grouped_gemm as gg
from moecomm.ops import workspace as wsmod
from moecomm.ops.quant import QUANTIZED_ENCODINGS
from moecomm.runtime.experts import LayerExperts, random_experts
from torch.profiler import ProfilerActivity, profile

# Awkward sizes: H not a multiple of 8 (vector tails in the native kernel), small I.
HIDDEN, INTER, EXPERTS, TOPK = 37, 13, 5, 3
# An allocation at or above this size counts as one "proportional to tokens or H" (a page).
ALLOC_THRESHOLD = 4096
# Small metadata allocations a warm step may still make: check_batches' min/max (a 0-dim tensor
# each) per non-empty batch.
SMALL_ALLOCS_PER_BATCH = 2

ROUTINGS = [
    # (batch sizes, routing)
    ([0], "random"),
    ([1], "random"),
    ([4, 0, 6, 1], "random"),
    ([5, 3], "one_expert"),
    ([3, 2], "none_here"),
    ([7, 9, 2], "random"),
]


def weights(dtype=torch.float32, experts=EXPERTS, hidden=HIDDEN, inter=INTER, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    return w13, w2


def batches(sizes, routing, dtype=torch.float32, hidden=HIDDEN, experts=EXPERTS, seed=1):
    g = torch.Generator().manual_seed(seed)
    xs, ids, scores = [], [], []
    for n in sizes:
        xs.append(torch.randn(n, hidden, generator=g).to(dtype))
        if routing == "random":
            i = torch.randint(-1, experts, (n, TOPK), generator=g)
        elif routing == "one_expert":
            i = torch.full((n, TOPK), 2)
        else:
            i = torch.full((n, TOPK), -1)
        ids.append(i.to(torch.int32))
        scores.append(torch.rand(n, TOPK, generator=g))
    return xs, ids, scores


def caller_outputs(sizes, dtype, hidden=HIDDEN):
    """Per-batch outputs as rows of one larger NaN-filled buffer (row stride > H), the way a
    response slot lays them out: nothing may be read from them, every element gets written."""
    total = sum(sizes)
    slab = torch.full((total, hidden + 3), float("nan"), dtype=dtype)[:, :hidden]
    return list(slab.split(list(sizes)))


def poison(ws: ExpertWorkspace) -> None:
    """Fills every buffer with garbage: a step must not depend on what the last one left."""
    for buf in ws._buf.values():
        buf.fill_(float("nan") if buf.is_floating_point() else 1_000_003)


def assert_same_bits(got, want, dtype=None):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        w = w if dtype is None else w.to(dtype)
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w), (g - w).abs().max()


@pytest.mark.parametrize(("sizes", "routing"), ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_workspace_step_matches_plain_bit_for_bit(sizes, routing, dtype, out_dtype):
    w13, w2 = weights(dtype)
    xs, ids, scores = batches(sizes, routing, dtype)
    want = expert_forward(xs, ids, scores, w13, w2)
    ws = ExpertWorkspace(sum(sizes) * TOPK, HIDDEN, INTER, EXPERTS, sum(sizes), dtype)
    poison(ws)
    out = None if out_dtype is None else caller_outputs(sizes, out_dtype)
    got = expert_forward(xs, ids, scores, w13, w2, workspace=ws, out=out)
    if out is not None:
        assert got is out
    assert_same_bits(got, want, out_dtype)
    # Caller-owned outputs without a workspace: the plain step, written into out.
    if out_dtype is not None:
        out2 = caller_outputs(sizes, out_dtype)
        assert_same_bits(expert_forward(xs, ids, scores, w13, w2, out=out2), want, out_dtype)


def test_sizes_change_every_step_and_leftovers_do_not_leak():
    w13, w2 = weights()
    # Starts too small on purpose: some steps grow it (an allocation, then warm again).
    ws = ExpertWorkspace(4, HIDDEN, INTER, EXPERTS, 2)
    steps = [([3, 1], "random"), ([12, 0, 9], "random"), ([1], "random"), ([0, 0], "none_here"),
             ([6, 6, 6, 6], "one_expert"), ([30], "random"), ([2, 5], "random")]  # fmt: skip
    for seed, (sizes, routing) in enumerate(steps):
        xs, ids, scores = batches(sizes, routing, seed=seed + 20)
        want = expert_forward(xs, ids, scores, w13, w2)
        poison(ws)
        assert_same_bits(expert_forward(xs, ids, scores, w13, w2, workspace=ws), want)
        poison(ws)
        out = caller_outputs(sizes, torch.float32)
        assert_same_bits(expert_forward(xs, ids, scores, w13, w2, workspace=ws, out=out), want)
    assert ws.max_tokens >= 30 and ws.max_rows >= 30 * TOPK - 30 * TOPK


def test_workspace_layout_matches_reorganize():
    _, ids, scores = batches([4, 0, 6, 1, 3], "random", seed=3)
    want = reorganize(ids, scores, EXPERTS)
    ws = ExpertWorkspace(1, HIDDEN, INTER, EXPERTS, 1)
    poison(ws)
    got = ws.layout(ids, scores, EXPERTS)
    for field in ("counts", "offsets", "src_batch", "src_row", "src_k", "src_token", "scores",
                  "batch_offsets", "slot_of"):  # fmt: skip
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and torch.equal(a, b), field
    assert (got.num_experts, got.topk) == (want.num_experts, want.topk)


def test_layout_falls_back_without_the_native_kernel(monkeypatch):
    monkeypatch.setattr(wsmod, "_layout_kernel", lambda: None)
    w13, w2 = weights()
    xs, ids, scores = batches([4, 0, 6], "random")
    want = expert_forward(xs, ids, scores, w13, w2)
    ws = ExpertWorkspace(30, HIDDEN, INTER, EXPERTS, 10)
    assert_same_bits(expert_forward(xs, ids, scores, w13, w2, workspace=ws), want)


def test_two_threads_share_the_native_scratch_bit_exactly():
    if gg._native_module() is None:
        pytest.skip("the native kernel needs moecomm._C built and an AVX2+FMA CPU")
    w13, w2 = weights(experts=4)
    xs, ids, scores = batches([40, 25], "random", experts=4, seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = expert_forward(xs, ids, scores, w13, w2)
        torch.set_num_threads(2)
        ws = ExpertWorkspace(65 * TOPK, HIDDEN, INTER, 4, 65)
        poison(ws)
        got = expert_forward(xs, ids, scores, w13, w2, workspace=ws)
    finally:
        torch.set_num_threads(threads)
    assert_same_bits(got, want)


def test_ops_write_into_out():
    w13, w2 = weights()
    xs, ids, scores = batches([4, 0, 6, 1], "random")
    layout = reorganize(ids, scores, EXPERTS)
    x_rows = gather_tokens(xs, layout)
    buf = torch.full((layout.num_rows, HIDDEN), float("nan"))
    assert gather_tokens(xs, layout, out=buf) is buf and torch.equal(buf, x_rows)
    rows = grouped_mlp_contiguous(x_rows, layout.offsets, w13, w2, layout.scores)
    got = grouped_mlp_contiguous(x_rows, layout.offsets, w13, w2, layout.scores, out=buf.fill_(7))
    assert got is buf and torch.equal(buf, rows)
    ws = ExpertWorkspace(1, HIDDEN, INTER, EXPERTS, 1)
    poison(ws)
    got = ws.grouped_mlp(x_rows, layout.offsets, w13, w2, layout.scores)
    assert torch.equal(got, rows)
    assert torch.equal(ws.gather_tokens(xs, layout), x_rows)
    # With explicit groups, rows of experts not visited come out zero (out is zeroed first).
    counts = layout.counts.clone()
    counts[int(layout.counts.argmax())] = 0
    groups = group_shrink(counts)
    want = grouped_mlp_contiguous(x_rows, layout.offsets, w13, w2, groups=groups)
    got = grouped_mlp_contiguous(x_rows, layout.offsets, w13, w2, groups=groups, out=buf.fill_(7))
    assert torch.equal(got, want)
    out = caller_outputs(layout.batch_sizes, torch.bfloat16)
    assert_same_bits(
        combine_rows(rows, layout, out=out), combine_rows(rows, layout), torch.bfloat16
    )


def test_workspace_keywords_of_the_ops_still_work_with_a_deprecation_warning():
    w13, w2 = weights()
    xs, ids, scores = batches([4, 0, 6, 1], "random")
    layout = reorganize(ids, scores, EXPERTS)
    x_rows = gather_tokens(xs, layout)
    rows = grouped_mlp_contiguous(x_rows, layout.offsets, w13, w2, layout.scores)
    ws = ExpertWorkspace(1, HIDDEN, INTER, EXPERTS, 1)
    with pytest.warns(DeprecationWarning, match=r"ws\.layout"):
        got = reorganize(ids, scores, EXPERTS, workspace=ws)
    assert torch.equal(got.slot_of, layout.slot_of)
    with pytest.warns(DeprecationWarning, match=r"ws\.gather_tokens"):
        assert torch.equal(gather_tokens(xs, layout, workspace=ws), x_rows)
    with pytest.warns(DeprecationWarning, match=r"ws\.grouped_mlp"):
        got = grouped_mlp_contiguous(x_rows, layout.offsets, w13, w2, layout.scores, workspace=ws)
    assert torch.equal(got, rows)
    with pytest.warns(DeprecationWarning, match=r"ws\.combine_rows"):
        assert_same_bits(combine_rows(rows, layout, workspace=ws), combine_rows(rows, layout))
    want = expert_forward(xs, ids, scores, w13, w2)
    with pytest.warns(DeprecationWarning, match="expert_forward_into"):
        assert_same_bits(wsmod.expert_forward_into(xs, ids, scores, w13, w2, ws=ws, out=None), want)
    with pytest.warns(DeprecationWarning, match="grouped_mlp_into"):
        got = wsmod.grouped_mlp_into(
            x_rows, layout.offsets, w13, w2, layout.scores, groups=None, out=None, ws=ws
        )
    assert torch.equal(got, rows)


def test_out_arguments_are_checked():
    w13, w2 = weights()
    xs, ids, scores = batches([4, 2], "random")
    layout = reorganize(ids, scores, EXPERTS)
    rows = gather_tokens(xs, layout)
    with pytest.raises(ValueError, match=r"out: expected a list of 2 per-batch tensors"):
        combine_rows(rows, layout, out=[torch.empty(4, HIDDEN)])
    with pytest.raises(ValueError, match=r"out\[1\]: expected shape \[2, 37\]"):
        combine_rows(rows, layout, out=[torch.empty(4, HIDDEN), torch.empty(3, HIDDEN)])
    with pytest.raises(TypeError, match=r"out\[0\]: expected a floating torch.Tensor"):
        combine_rows(rows, layout, out=[torch.empty(4, HIDDEN, dtype=torch.int32)] * 2)
    with pytest.raises(ValueError, match=r"out: expected a torch.float32 tensor of shape"):
        gather_tokens(xs, layout, out=torch.empty(layout.num_rows + 1, HIDDEN))
    with pytest.raises(ValueError, match=r"with unit column stride"):
        grouped_mlp_contiguous(rows, layout.offsets, w13, w2, out=torch.empty(HIDDEN, 99).t())
    with pytest.raises(ValueError, match=r"max_rows: expected an int >= 0"):
        ExpertWorkspace(-1, HIDDEN, INTER, EXPERTS, 1)
    with pytest.raises(TypeError, match=r"dtype: expected one of"):
        ExpertWorkspace(1, HIDDEN, INTER, EXPERTS, 1, torch.int32)


def test_ensure_grows_and_nbytes_counts_it():
    ws = ExpertWorkspace(8, HIDDEN, INTER, EXPERTS, 4)
    before = ws.nbytes
    assert before > 8 * HIDDEN * 4 * 3  # rows in, rows out, tokens+acc at least
    assert not ws.ensure(rows=8, tokens=4)
    assert ws.ensure(rows=100)
    assert ws.max_rows >= 100 and ws.nbytes > before
    assert ws.ensure(dtype=torch.bfloat16) and ws.dtype == torch.bfloat16


@pytest.mark.parametrize("encoding", QUANTIZED_ENCODINGS, ids=lambda e: e.name)
@pytest.mark.parametrize("hidden", [37, 128, 200])
def test_dequantize_into_workspace_then_step(encoding, hidden):
    # The server flow: dequantize each request into the workspace's token views, then the step
    # gathers from that buffer without concatenating it.
    sizes = [3, 0, 5]
    w13, w2 = weights(hidden=hidden)
    xs, ids, scores = batches(sizes, "random", hidden=hidden, seed=9)
    wire = [quantize(x * 4, encoding) for x in xs]
    plain = [dequantize(q, s, encoding) for q, s in wire]
    want = expert_forward(plain, ids, scores, w13, w2)
    ws = ExpertWorkspace(8 * TOPK, hidden, INTER, EXPERTS, 8)
    poison(ws)
    views = ws.token_views(sizes)
    got_x = [dequantize(q, s, encoding, out=v) for (q, s), v in zip(wire, views, strict=True)]
    assert_same_bits(got_x, plain)
    assert_same_bits(expert_forward(got_x, ids, scores, w13, w2, workspace=ws), want)
    for dt in (torch.bfloat16, torch.float16):
        o = torch.full((3, hidden + 1), float("nan"), dtype=dt)[:, :hidden]
        assert torch.equal(
            dequantize(*wire[0], encoding, dt, out=o), dequantize(*wire[0], encoding, dt)
        )


def test_layer_experts_forward_passes_workspace_and_out():
    experts = random_experts(1, 6, HIDDEN, INTER, seed=4)[0]
    full = LayerExperts(0, experts)
    # Expert 2 retired: local indices are no longer storage rows (the remap path).
    layer = full.without_expert(2)
    assert not layer.contiguous
    xs, ids, scores = batches([5, 0, 4], "random", experts=6, seed=11)
    ids = [torch.where(i == 2, -1, i).to(torch.int32) for i in ids]
    xs16 = [x.to(torch.bfloat16) for x in xs]  # a dtype conversion into the workspace too
    for lay in (full, layer):
        want = lay.forward(xs16, ids, scores)
        ws = ExpertWorkspace(9 * TOPK, HIDDEN, INTER, 6, 9)
        poison(ws)
        assert_same_bits(lay.forward(xs16, ids, scores, workspace=ws), want)
        out = caller_outputs([5, 0, 4], torch.float32)
        assert lay.forward(xs16, ids, scores, workspace=ws, out=out) is out
        assert_same_bits(out, want)


def allocations(step, calls: int, tmp_path) -> list[tuple[int, list[str]]]:
    """(bytes, names of the ops running at the time) of every storage the CPU allocator handed
    out during ``calls`` calls of step."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(calls):
            step()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X"]
    found = []
    for e in events:
        if e.get("name") == "[memory]" and e["args"]["Bytes"] > 0:
            t = e["ts"]
            inside = [o["name"] for o in ops if o["ts"] <= t <= o["ts"] + o["dur"]]
            found.append((e["args"]["Bytes"], inside))
    return found


def big(found, allowed_inside: str | None = None) -> list:
    """The allocations of at least a page, except those made inside op ``allowed_inside``."""
    return [
        (b, ops)
        for b, ops in found
        if b >= ALLOC_THRESHOLD and (allowed_inside is None or allowed_inside not in ops)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warm_step_allocates_nothing_proportional_to_tokens(tmp_path, dtype):
    # Big enough that every per-token buffer is well over the threshold: 64 tokens × 256 f32.
    hidden, inter, experts, calls = 256, 64, 8, 3
    sizes = [24, 0, 30, 10]
    w13, w2 = weights(dtype, experts=experts, hidden=hidden, inter=inter)
    xs, ids, scores = batches(sizes, "random", dtype, hidden=hidden, experts=experts)
    tokens = sum(sizes)

    def plain():
        return expert_forward(xs, ids, scores, w13, w2)

    ws = ExpertWorkspace(tokens * TOPK, hidden, inter, experts, tokens, dtype)
    out = caller_outputs(sizes, torch.float32, hidden)

    def warm():
        return expert_forward(xs, ids, scores, w13, w2, workspace=ws, out=out)

    # The counter works: the plain step allocates its rows and outputs every call (outside
    # any GEMM: gather, MLP output, combine accumulator...).
    assert len(big(allocations(plain, calls, tmp_path), "aten::mm")) >= 4 * calls
    warm()
    warm()
    found = allocations(warm, calls, tmp_path)
    if dtype == torch.float32:
        assert big(found) == []
        busy_batches = sum(1 for n in sizes if n)
        assert len(found) <= SMALL_ALLOCS_PER_BATCH * busy_batches * calls, found
    else:
        # bf16 experts run torch's GEMM, which allocates its own scratch inside aten::mm; the
        # step itself allocates nothing big.
        assert big(found, "aten::mm") == []
    assert_same_bits(out, plain(), torch.float32)


def test_layer_experts_warm_step_with_remap_allocates_nothing_big(tmp_path):
    hidden, inter = 256, 64
    layer = LayerExperts(0, random_experts(1, 6, hidden, inter, seed=4)[0]).without_expert(2)
    xs, ids, scores = batches([40, 24], "random", hidden=hidden, experts=6, seed=11)
    ids = [torch.where(i == 2, -1, i).to(torch.int32) for i in ids]
    ws = ExpertWorkspace(64 * TOPK, hidden, inter, 6, 64)
    out = caller_outputs([40, 24], torch.float32, hidden)

    def warm():
        return layer.forward(xs, ids, scores, workspace=ws, out=out)

    warm()
    assert big(allocations(warm, 3, tmp_path)) == []
    assert_same_bits(out, layer.forward(xs, ids, scores))
