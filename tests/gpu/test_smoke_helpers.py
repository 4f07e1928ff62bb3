"""The host half of the loopback smoke test (smoke_helpers.py), checked without a device, so
that its first GPU run compares against a reference that is known to be right:

- the host path's expectations (request payload, layout, expert outputs, the whole layer)
  against an independent per-copy computation (quantize_reference, explicit loops);
- the exact response and combine expectations against moecomm's host references;
- the comparison itself: a perfect device, emulated from the host path, passes it, and each
  single change is caught and named;
- the expert-MLP glue (workspace views, fp8 scales gathered by src_token) under the Triton
  interpreter, against the reference;
- on a machine without a device, every launcher accepts the step's arguments: each fails only
  at its first CUDA call, never at an argument check.
"""

from __future__ import annotations

import os

import moecomm.wire.cuda
import pytest
import smoke_helpers as sh
import torch
import torch.nn.functional as F
from moecomm.ops.quant import dequantize_reference, quantize_reference

Encoding = sh.Encoding
SMALL = {
    "fp8": sh.Case("small_fp8", 16, 4, 256, 8, 32, Encoding.FP8_E4M3_B128, seed=5),
    "bf16": sh.Case("small_bf16", 12, 3, 256, 8, 32, Encoding.BF16, seed=6),
    "fp8_prequantized": sh.Case(
        "small_fp8_pre", 16, 4, 256, 8, 32, Encoding.FP8_E4M3_B128, prequantized=True, seed=7
    ),
}


def _host(case):
    x, ids, w = sh.make_inputs(case)
    w13, w2 = sh.make_weights(case)
    return x, ids, w, w13, w2, sh.host_step(case, x, ids, w, w13, w2)


def _layouts(k, case):
    region = torch.zeros(sh.ring_plan(case).region_bytes, dtype=torch.uint8)
    step = sh.LoopbackStep(k, case, "cpu", region.data_ptr())
    return step.c_layout, step.s_layout


# ---------------------------------------------------------------------------- inputs
def test_cases_are_the_brief():
    one = sh.CASES["one_token_top1_bf16"]
    assert (one.tokens, one.topk) == (1, 1)
    for name in ("deepep_fp8_kernel_cast", "deepep_fp8_caller_cast"):
        c = sh.CASES[name]
        assert (c.tokens, c.topk, c.hidden, c.encoding) == (128, 8, 7168, Encoding.FP8_E4M3_B128)
        assert c.num_experts in (16, 32) and c.inter <= 256
    assert sh.CASES["deepep_fp8_caller_cast"].prequantized


def test_inputs_cover_the_edge_cases():
    case = sh.CASES["deepep_fp8_kernel_cast"]
    x, ids, w = sh.make_inputs(case)
    assert x.dtype == torch.bfloat16 and ids.dtype == torch.int64 and w.dtype == torch.float32
    for t in range(case.tokens):
        routed = [e for e in ids[t].tolist() if e >= 0]
        assert len(routed) == len(set(routed)), "distinct experts per token"
    assert bool((ids[5] == -1).all()), "a token routed nowhere"
    assert bool((ids == -1).any(dim=1).sum() > 5), "some -1 entries"
    assert not x[1, 128:256].any(), "an all-zero scale block"
    amax = x.float().view(case.tokens, -1, 128).abs().amax(dim=2)
    assert float(amax[0].max() / amax[0].min()) > 16, "blocks of very different magnitudes"


# ---------------------------------------------------------------------------- the host path
@pytest.mark.parametrize("which", ["fp8", "bf16"])
def test_host_step_matches_an_independent_computation(which):
    case = SMALL[which]
    x, ids, w, w13, w2, host = _host(case)
    t, k, h, i = case.tokens, case.topk, case.hidden, case.inter
    # The wire rows: moecomm's loop reference of the quantization (or the bf16 rows).
    if case.quantized:
        q, s = quantize_reference(x, case.encoding)
        deq = dequantize_reference(q, s, case.encoding)
    else:
        q, s, deq = x, None, x.float()
    sent = [r for r in range(t) if bool((ids[r] >= 0).any())]
    b = host.batch
    assert b.token_index.tolist() == sent
    # The payload, parsed back part by part.
    lay = sh.ring_plan(case).layout.request_payload(len(sent))
    assert len(host.payload) == lay["total"]

    def at(name, n):
        return host.payload[lay[f"{name}_offset"] : lay[f"{name}_offset"] + n]

    rows = torch.tensor(sent)
    assert at("act", lay["act_bytes"]) == sh.as_bytes(q[rows])
    if s is not None:
        assert at("scale", lay["scale_bytes"]) == sh.as_bytes(s[rows])
    want_ids = ids[rows].to(torch.int32)  # every expert on server 0, local = logical
    assert at("ids", lay["ids_bytes"]) == sh.as_bytes(want_ids)
    want_scores = torch.where(ids[rows] >= 0, w[rows], 0.0)
    assert at("scores", lay["scores_bytes"]) == sh.as_bytes(want_scores)
    # The layout: copies sorted by (expert, request row, k).
    copies = sorted(
        (int(ids[r, j]), n, j) for n, r in enumerate(sent) for j in range(k) if ids[r, j] >= 0
    )
    assert host.layout.num_rows == len(copies)
    for row, (e, n, j) in enumerate(copies):
        assert int(host.layout.src_token[row]) == n and int(host.layout.src_k[row]) == j
        assert int(host.layout.slot_of[n, j]) == row
        assert torch.equal(host.rows[row].view(torch.uint8), q[sent[n]].view(torch.uint8))
        assert float(host.layout.scores[row]) == float(w[sent[n], j])
        assert int(host.layout.offsets[e]) <= row < int(host.layout.offsets[e + 1])
    # The expert outputs and the layer: per copy, score * w2 @ (silu(w1 x) * (w3 x)).
    y = torch.zeros(t, h)
    for row, (e, n, j) in enumerate(copies):
        hh = deq[sent[n]] @ w13[e].float().t()
        out = (F.silu(hh[:i]) * hh[i:]) @ w2[e].float().t() * w[sent[n], j]
        torch.testing.assert_close(host.mlp_ref[row], out, rtol=1e-5, atol=1e-5)
    for r in range(t):
        for j in range(k):
            e = int(ids[r, j])
            if e >= 0:
                hh = deq[r] @ w13[e].float().t()
                y[r] += w[r, j] * ((F.silu(hh[:i]) * hh[i:]) @ w2[e].float().t())
    torch.testing.assert_close(host.y_ref, y, rtol=1e-5, atol=1e-5)


def test_host_step_runs_at_the_smoke_shapes():
    w13, w2 = sh.make_weights(sh.CASES["deepep_fp8_kernel_cast"])
    for case in sh.CASES.values():
        x, ids, w = sh.make_inputs(case)
        host = sh.host_step(case, x, ids, w, w13, w2)
        n = host.batch.num_tokens
        assert n == int((ids >= 0).any(dim=1).sum())
        assert host.layout.num_rows == int((ids >= 0).sum())
        assert len(host.payload) == sh.ring_plan(case).layout.request_payload(n)["total"]
        assert bool(torch.isfinite(host.y_ref).all()) and bool(host.y_ref.abs().max() > 0)
        if case.tokens > 5:
            assert not host.y_ref[5].any(), "a token routed nowhere comes back zero"


def test_exact_expectations_match_the_host_kernels():
    from moecomm.ops.combine import combine_reference
    from moecomm.ops.reorg import combine_rows_reference

    case = SMALL["fp8"]
    *_, host = _host(case)
    lay = host.layout
    g = torch.Generator().manual_seed(3)
    out = (torch.randn(lay.num_rows + 5, case.hidden, generator=g) * 3).to(torch.bfloat16)
    response = sh.expected_response(out, lay.slot_of)
    want = combine_rows_reference(out[: lay.num_rows], lay)[0]
    assert response.dtype == torch.bfloat16
    assert torch.equal(response.view(torch.int16), want.view(torch.int16))
    y = sh.expected_y(response, host.batch.token_index, case.tokens)
    ref = combine_reference([response], [host.batch.token_index], case.tokens,
                            hidden=case.hidden, dtype=torch.bfloat16)  # fmt: skip
    assert torch.equal(y.view(torch.int16), ref.view(torch.int16))


# ---------------------------------------------------------------------------- the comparison
@pytest.mark.parametrize("which", ["fp8", "bf16"])
def test_check_step_passes_a_perfect_device_and_names_each_change(which, cuda_native):
    case = SMALL[which]
    *_, host = _host(case)
    c_layout, s_layout = _layouts(cuda_native, case)
    status_names = {v: n for n, v in cuda_native.SERVER_STATUS.items()}

    def check(res):
        return sh.check_step(case, host, res, c_layout, s_layout, status_names)

    assert check(sh.emulate_device(case, host, c_layout, s_layout)) == []
    plan = sh.ring_plan(case)

    def changed(edit) -> list[str]:
        res = sh.emulate_device(case, host, c_layout, s_layout)
        edit(res)
        return check(res)

    def region_edit(res, offset):
        raw = bytearray(res.region)
        raw[offset] ^= 0x10
        res.region = bytes(raw)

    def ws_edit(ws, layout, name, index=0):
        ws[layout[name] + index] ^= 0x10

    cases = {
        "request payload in the region": lambda r: region_edit(
            r, plan.request_slot(sh.SLOT) + sh.PAYLOAD_OFFSET + 3
        ),
        "response payload in the region": lambda r: region_edit(
            r, plan.response_slot(sh.SLOT) + sh.PAYLOAD_OFFSET + 1
        ),
        "response slot signal": lambda r: region_edit(r, plan.response_slot(sh.SLOT)),
        "request slot signal": lambda r: region_edit(r, plan.request_slot(sh.SLOT)),
        "client staging payload": lambda r: ws_edit(r.c_ws, c_layout, "staging", 5),
        "client count": lambda r: ws_edit(r.c_ws, c_layout, "count"),
        "client pos": lambda r: ws_edit(r.c_ws, c_layout, "pos"),
        "client_combine status": lambda r: ws_edit(r.c_ws, c_layout, "status"),
        "gather entry (client 0, slot 0)": lambda r: ws_edit(r.s_ws, s_layout, "entries"),
        "gathered activations": lambda r: ws_edit(r.s_ws, s_layout, "x", 7),
        "gathered ids": lambda r: ws_edit(r.s_ws, s_layout, "ids"),
        "gathered scores": lambda r: ws_edit(r.s_ws, s_layout, "scores", 2),
        "layout counts": lambda r: ws_edit(r.s_ws, s_layout, "counts"),
        "layout src_token": lambda r: ws_edit(r.s_ws, s_layout, "src_token"),
        "layout slot_of": lambda r: ws_edit(r.s_ws, s_layout, "slot_of"),
        "layout rows": lambda r: ws_edit(r.s_ws, s_layout, "rows", 11),
        "y (client combine)": lambda r: r.y.view(torch.int16).__setitem__((0, 0), 12345),
    }
    if case.quantized:
        cases["gathered scales"] = lambda r: ws_edit(r.s_ws, s_layout, "scales", 1)
    for what, edit in cases.items():
        found = changed(edit)
        assert any(line.startswith(what) for line in found), (what, found)
    # The expert outputs: a row far off is outside the tolerance, and the response computed
    # from the original outputs no longer matches the device's own sums.
    found = changed(lambda r: r.expert_out[0].mul_(3))
    assert any(line.startswith("expert outputs") for line in found), found
    assert any(line.startswith("response payload") for line in found), found


# ---------------------------------------------------------------------------- the MLP glue
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the Triton kernels under the interpreter (a machine without a GPU)",
)
def test_server_mlp_reads_the_gathered_workspace_like_the_reference(cuda_native):
    """server_mlp on an emulated gather workspace (f32 weights: the interpreter computes bf16
    dots wrongly) against the host reference: the views (rows, offsets, row scores) and the fp8
    scales gathered by src_token are what the reference assumes."""
    pytest.importorskip("triton")
    case = SMALL["fp8"]
    _, _, _, w13, w2, host = _host(case)
    c_layout, s_layout = _layouts(cuda_native, case)
    res = sh.emulate_device(case, host, c_layout, s_layout)
    out = sh.server_mlp(res.s_ws, s_layout, case, w13.float(), w2.float())
    assert out.shape == (s_layout["max_rows"], case.hidden) and out.dtype == torch.float32
    want = host.mlp_ref
    atol = 1e-5 * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(out[: host.layout.num_rows], want, rtol=1e-4, atol=atol)


# ---------------------------------------------------------------------------- the launchers
@pytest.mark.parametrize("which", ["fp8", "bf16", "fp8_prequantized"])
def test_every_launcher_accepts_the_step_arguments(which, cuda_native):
    """On the host: the step's configs and argument structs pass every check of the four
    launchers, which then fail at their first CUDA call (no device). A ValueError here is a
    wrong argument the GPU run would have hit."""
    if cuda_native.device_count() > 0 or moecomm.wire.cuda.available():
        pytest.skip("a device is present: a launch with host pointers would fault")
    case = SMALL[which]
    x, ids, w = sh.make_inputs(case)
    region = torch.zeros(sh.ring_plan(case).region_bytes, dtype=torch.uint8)
    step = sh.LoopbackStep(cuda_native, case, "cpu", region.data_ptr())
    expert_out = torch.zeros(step.s_layout["max_rows"], case.hidden, dtype=torch.bfloat16)
    y = torch.zeros(case.tokens, case.hidden, dtype=torch.bfloat16)
    if case.prequantized:
        q, s = sh.caller_cast(x)
        dispatch = lambda: step.dispatch(0, x, ids, w, x_q=q, x_scales=s)  # noqa: E731
    else:
        dispatch = lambda: step.dispatch(0, x, ids, w)  # noqa: E731
    launches = {
        "client_dispatch": dispatch,
        "server_gather": lambda: step.gather(0, 10**9),
        "server_respond": lambda: step.respond(0, expert_out),
        "client_combine": lambda: step.combine(0, y, 10**9),
    }
    for name, launch in launches.items():
        with pytest.raises(RuntimeError) as err:
            launch()
        assert not isinstance(err.value, ValueError), f"{name}: {err.value}"
        assert "CUDA" in str(err.value), f"{name}: {err.value}"


def test_deep_ep_round_compares_everything_it_should(tmp_path):
    """deep_ep_round between two host-path Buffers (one rank each): nothing differs; then a
    twin that hands back other outputs is caught."""
    import torch.distributed as dist
    from moecomm.compat.deep_ep import Buffer

    case = SMALL["fp8"]
    x, ids, w = sh.make_inputs(case)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    kw = dict(low_latency_mode=True, rank=0, num_ranks=1, store=store, timeout=10.0)
    a, b = Buffer(None, **kw, store_prefix="a"), Buffer(None, **kw, store_prefix="b")
    try:
        for use_fp8 in (True, False):
            assert sh.deep_ep_round(a, b, x, ids, w, case.num_experts, use_fp8, "cpu") == []

        class Skewed:
            """b, with its combine off by one bf16 ulp in one value."""

            def low_latency_dispatch(self, *args, **kw):
                return b.low_latency_dispatch(*args, **kw)

            def low_latency_combine(self, *args, **kw):
                out, *rest = b.low_latency_combine(*args, **kw)
                out = out.clone()
                out.view(torch.int16)[0, 0] += 1
                return (out, *rest)

        found = sh.deep_ep_round(a, Skewed(), x, ids, w, case.num_experts, True, "cpu")
        assert len(found) == 1 and found[0].startswith("fp8 combine"), found
    finally:
        a.destroy()
        b.destroy()
