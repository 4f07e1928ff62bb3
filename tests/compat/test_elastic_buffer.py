"""DeepEP V2's ``ElasticBuffer`` dispatch/combine on moecomm (``moecomm.compat.elastic``)
between real processes (2 and 4 ranks, spawned, FileStore rendezvous), against a plain-torch
port of DeepEP's own references (``deep_ep/utils/refs.py``: ``dispatch``, ``combine`` with its
grouped reduction, ``generate_pre_combine_data``) and the checks of ``tests/elastic/test_ep.py``.

Every rank regenerates every rank's inputs from seeds, so the reference needs no
communication. The scenarios of one rank count run in one spawned group."""

import math
import time
import traceback

import pytest
import torch
from scenario_groups import run_groups

HIDDEN = 2048
GROUP_TIMEOUT_S = 90
TIMEOUT_S = 20.0
# num_ranks -> (tokens per rank, num_max_tokens_per_rank, num_experts, num_topk)
SHAPES = {2: ([40, 0], 48, 16, 4), 4: ([0, 23, 48, 7], 48, 32, 8)}


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# ---------------------------------------------------------------------------- inputs
def make_inputs(seed: int, rank: int, num_ranks: int):
    sizes, _, num_experts, num_topk = SHAPES[num_ranks]
    n = sizes[rank]
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16)
    scores = torch.rand((n, num_experts), generator=g) + 0.1
    w, idx = torch.topk(scores, num_topk, dim=-1, sorted=False)
    idx = idx.to(torch.int64)
    masked = torch.rand((n, num_topk), generator=g) < 0.15
    idx = idx.masked_fill(masked, -1)
    w = w.masked_fill(idx < 0, 0)  # as test_ep.py does with --masked-ratio
    return x, idx, w


def to_fp8(x: torch.Tensor):
    n = x.shape[0]
    xv = x.float().view(n, HIDDEN // 128, 128)
    amax = xv.abs().amax(dim=2).clamp(min=1e-4)
    q = (xv * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(n, HIDDEN)
    return q, amax / 448.0


def pre_combine_data(gidx: torch.Tensor, m: int, num_ranks: int, num_topk: int) -> torch.Tensor:
    """refs.generate_pre_combine_data: y[i, j, k] from the token's global index (seed 0)."""
    seeds = gidx.to(torch.int64).unsqueeze(1) * num_topk + torch.arange(num_topk).unsqueeze(0)
    max_seed = num_ranks * m * num_topk
    h = torch.arange(1, HIDDEN + 1, dtype=torch.float32).broadcast_to(1, 1, HIDDEN)
    base = (((seeds * 131071 % max_seed).float() + 1) / max_seed).unsqueeze(-1)
    return torch.sin(base * h + math.sin(0.0)).to(torch.bfloat16)


# ---------------------------------------------------------------------------- reference
def ref_dispatch(all_inputs, me, num_ranks):
    """refs.dispatch: tokens of every rank with an expert on `me`, by global index; top-k
    indices local or -1, weights as sent (compare them masked)."""
    _, m, num_experts, _ = SHAPES[num_ranks]
    per = num_experts // num_ranks
    xs, idxs, ws, gs, counts = [], [], [], [], []
    for s, (x, idx, w) in enumerate(all_inputs):
        lo, hi = me * per, (me + 1) * per
        rows = ((idx >= lo) & (idx < hi)).any(1).nonzero().flatten()
        sel = idx[rows]
        xs.append(x[rows])
        idxs.append(torch.where((sel >= lo) & (sel < hi), sel - lo, -1))
        ws.append(w[rows])
        gs.append((rows + s * m).to(torch.int32))
        counts.append(rows.numel())
    return torch.cat(xs), torch.cat(idxs), torch.cat(ws), torch.cat(gs), counts


def ref_combine(y, topk_idx, num_ranks, num_experts, bias, reduce_in_local: bool):
    """refs.combine (scaleout 1): optional grouped reduction per rank, then an ordered
    accumulation over k from the f32 bias sum."""
    n, k, hidden = y.shape

    def grouped_reduce(data, group_id):
        group_id, src = torch.sort(group_id, dim=-1, stable=True)
        flat = (src + torch.arange(n).unsqueeze(-1) * k).flatten()
        data = data.reshape(-1, hidden)[flat].view(n, k, hidden)
        acc = torch.zeros((n, hidden))
        for i in range(k):
            brk = (
                torch.ones(n, dtype=torch.bool)
                if i == k - 1
                else group_id[:, i] != group_id[:, i + 1]
            )
            acc += data[:, i].float()
            b = torch.where(brk)[0]
            data[b, i] = acc[b].to(data.dtype)
            acc[b] = 0.0
            nb = torch.where(~brk)[0]
            data[nb, i] = 0.0
        out = torch.empty_like(data)
        out.view(-1, hidden)[flat] = data.view(-1, hidden)
        return out.view(n, k, hidden)

    per = num_experts // num_ranks
    if reduce_in_local:
        y = grouped_reduce(y.clone(), topk_idx // per)
    if isinstance(bias, tuple):
        result = bias[0].float() + bias[1].float()
    elif bias is not None:
        result = bias.float().clone()
    else:
        result = torch.zeros((n, hidden))
    for i in range(k):
        result += y[:, i].float()
    return result.to(torch.bfloat16)


# ---------------------------------------------------------------------------- scenarios
def _all(seed, num_ranks):
    return [make_inputs(seed, r, num_ranks) for r in range(num_ranks)]


def _bias(num_bias, n, seed):
    g = torch.Generator().manual_seed(seed)
    bs = tuple(torch.randn((n, HIDDEN), generator=g).bfloat16() for _ in range(num_bias))
    return None if num_bias == 0 else bs[0] if num_bias == 1 else bs


def _check_dispatch(buf, me, num_ranks, inputs, out, alignment, fp8):
    _, m, num_experts, _ = SHAPES[num_ranks]
    per = num_experts // num_ranks
    recv_x, recv_idx, recv_w, handle, event = out
    event.current_stream_wait()
    rx, ridx, rw, rg, counts = ref_dispatch(inputs, me, num_ranks)
    if fp8:
        q_all = [(to_fp8(x)[0].view(torch.uint8), i, w) for x, i, w in inputs]
        s_all = [(to_fp8(x)[1], i, w) for x, i, w in inputs]
        assert torch.equal(recv_x[0].view(torch.uint8), ref_dispatch(q_all, me, num_ranks)[0])
        assert torch.equal(recv_x[1], ref_dispatch(s_all, me, num_ranks)[0])
    else:
        assert torch.equal(recv_x, rx)
    assert torch.equal(recv_idx, ridx)
    assert torch.equal(recv_w.masked_fill(ridx < 0, 0), rw.masked_fill(ridx < 0, 0))
    assert torch.equal(handle.recv_src_metadata[:, 0], rg)
    assert handle.num_recv_tokens == rx.shape[0]
    assert (
        handle.psum_num_recv_tokens_per_scaleup_rank.tolist()
        == torch.tensor(counts).cumsum(0).tolist()
    )
    ref_counts = [int((ridx == e).sum()) for e in range(per)]
    assert handle.num_recv_tokens_per_expert_list == [align(c, alignment) for c in ref_counts]
    psum = [0, *handle.psum_num_recv_tokens_per_expert.tolist()]
    for e in range(per):
        assert psum[e + 1] - psum[e] == align(ref_counts[e], alignment)
    assert handle.num_max_tokens_per_rank == m
    return ref_counts


def sc_dispatch_combine(buf, me, num_ranks):
    """Plain layout, bf16 and fp8, alignment 1 and 4, 0/1/2 biases; cached dispatch; stats."""
    _, m, num_experts, num_topk = SHAPES[num_ranks]
    per = num_experts // num_ranks
    for case, (fp8, alignment, num_bias) in enumerate(((0, 1, 0), (1, 4, 1), (0, 4, 2))):
        inputs = _all(10 + case, num_ranks)
        x, idx, w = inputs[me]
        xin = to_fp8(x) if fp8 else x
        stats = torch.zeros(per, dtype=torch.int32)
        out = buf.dispatch(
            xin,
            topk_idx=idx,
            topk_weights=w,
            num_experts=num_experts,
            expert_alignment=alignment,
            cumulative_local_expert_recv_stats=stats,
            do_handle_copy=bool(case % 2 == 0),
        )
        ref_counts = _check_dispatch(buf, me, num_ranks, inputs, out, alignment, fp8)
        assert stats.tolist() == ref_counts
        recv_x, recv_idx, recv_w, handle, _ = out
        if idx.numel():
            assert (handle.topk_idx.data_ptr() != idx.data_ptr()) == (case % 2 == 0)
        # cached: same routing, same outputs, the same handle back
        cached = buf.dispatch(xin, handle=handle)
        if fp8:
            assert torch.equal(cached[0][0].view(torch.uint8), recv_x[0].view(torch.uint8))
            assert torch.equal(cached[0][1], recv_x[1])
        else:
            assert torch.equal(cached[0], recv_x)
        assert torch.equal(cached[1], recv_idx) and cached[2] is None and cached[3] is handle
        # combine: each rank reduces its experts' outputs per token (test_ep.py), sends back
        n_recv = handle.num_recv_tokens
        gidx = handle.recv_src_metadata[:, 0]
        local_y = pre_combine_data(gidx, m, num_ranks, num_topk)
        local_y[recv_idx == -1] = 0
        acc = torch.zeros((n_recv, HIDDEN))
        for k in range(num_topk):
            acc += local_y[:, k].float()
        bias = _bias(num_bias, x.shape[0], 100 + me)
        combined, combined_w, event = buf.combine(
            acc.bfloat16(), handle, topk_weights=recv_w, bias=bias
        )
        event.current_stream_wait()
        ref_y = pre_combine_data(torch.arange(x.shape[0]) + me * m, m, num_ranks, num_topk)
        ref_y[idx == -1] = 0
        want = ref_combine(ref_y, idx, num_ranks, num_experts, bias, True)
        assert torch.equal(combined, want)
        assert torch.equal(combined_w, w)


def sc_expand(buf, me, num_ranks):
    """Expanded layout (alignment 4), cached expanded dispatch with weights, reduced combine."""
    _, m, num_experts, num_topk = SHAPES[num_ranks]
    per, alignment = num_experts // num_ranks, 4
    inputs = _all(20, num_ranks)
    x, idx, w = inputs[me]
    plain = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts)
    recv_x, recv_idx = plain[0], plain[1]
    ex_x, ex_idx, ex_w, ex_h, _ = buf.dispatch(
        x,
        topk_idx=idx,
        topk_weights=w,
        num_experts=num_experts,
        expert_alignment=alignment,
        do_expand=True,
    )
    assert ex_idx is None and ex_w.dim() == 1
    n_recv = ex_h.num_recv_tokens
    assert n_recv == plain[3].num_recv_tokens
    slots = ex_h.recv_src_metadata[:, 2:]
    valid = slots >= 0
    assert torch.equal(valid, recv_idx >= 0)
    # each (token, k) row holds the token; weights per row; blocks per expert, aligned
    tok = valid.nonzero(as_tuple=True)[0]
    assert torch.equal(ex_x[slots[valid].long()], recv_x[tok])
    assert torch.equal(ex_w[slots[valid].long()], plain[2][valid])
    psum = ex_h.psum_num_recv_tokens_per_expert.tolist()
    start = 0
    for e in range(per):
        count = int((recv_idx == e).sum())
        assert psum[e] - start == count
        rows = slots[recv_idx == e]
        assert sorted(rows.tolist()) == list(range(start, start + count))
        assert bool((ex_x[psum[e] : align(psum[e], alignment)] == 0).all())
        start = align(psum[e], alignment)
    assert ex_x.shape[0] == ex_h.num_expanded_tokens == start
    assert ex_h.num_recv_tokens_per_expert_list == [
        align(int((recv_idx == e).sum()), alignment) for e in range(per)
    ]
    # cached expanded with weights
    c_x, _, c_w, c_h, _ = buf.dispatch(x, topk_weights=w, handle=ex_h, do_expand=True)
    assert c_h is ex_h and torch.equal(c_x, ex_x) and torch.equal(c_w, ex_w)
    # reduced combine: y per (token, k) in the expanded rows
    y = pre_combine_data(ex_h.recv_src_metadata[:, 0], m, num_ranks, num_topk)
    ex_in = torch.zeros((ex_x.shape[0] + 1, HIDDEN), dtype=torch.bfloat16)
    ex_in[slots.long().flatten()] = y.view(-1, HIDDEN)
    ex_in = ex_in[:-1]
    bias = _bias(1, x.shape[0], 200 + me)
    combined, combined_w, _ = buf.combine(ex_in, ex_h, topk_weights=ex_w, bias=bias)
    ref_y = pre_combine_data(torch.arange(x.shape[0]) + me * m, m, num_ranks, num_topk)
    ref_y[idx == -1] = 0
    assert torch.equal(combined, ref_combine(ref_y, idx, num_ranks, num_experts, bias, True))
    assert torch.equal(combined_w, w)
    return ex_in, ex_h, x, idx, bias


def sc_single_reduction(buf, me, num_ranks, store_path):
    """allow_multiple_reduction=False: every (token, k) row goes back, summed k ascending."""
    import torch.distributed as dist
    from moecomm.compat.elastic import ElasticBuffer

    _, m, num_experts, num_topk = SHAPES[num_ranks]
    store = dist.FileStore(store_path + ".single", num_ranks)  # its own file (FileStore refcounts)
    with ElasticBuffer(
        rank=me,
        num_ranks=num_ranks,
        store=store,
        store_prefix="single",
        num_max_tokens_per_rank=m,
        hidden=HIDDEN,
        allow_multiple_reduction=False,
        timeout=TIMEOUT_S,
    ) as b2:
        inputs = _all(30, num_ranks)
        x, idx, w = inputs[me]
        ex_x, _, _, ex_h, _ = b2.dispatch(
            x, topk_idx=idx, topk_weights=w, num_experts=num_experts, do_expand=True
        )
        slots = ex_h.recv_src_metadata[:, 2:]
        y = pre_combine_data(ex_h.recv_src_metadata[:, 0], m, num_ranks, num_topk)
        ex_in = torch.zeros((ex_x.shape[0] + 1, HIDDEN), dtype=torch.bfloat16)
        ex_in[slots.long().flatten()] = y.view(-1, HIDDEN)
        bias = _bias(2, x.shape[0], 300 + me)
        combined, _, _ = b2.combine(ex_in[:-1], ex_h, bias=bias)
        ref_y = pre_combine_data(torch.arange(x.shape[0]) + me * m, m, num_ranks, num_topk)
        ref_y[idx == -1] = 0
        assert torch.equal(combined, ref_combine(ref_y, idx, num_ranks, num_experts, bias, False))


def sc_refusals(buf, me, num_ranks):
    for name, args in (
        ("engram_write", (None,)),
        ("engram_fetch", (None,)),
        ("pp_set_config", (1, 1)),
        ("pp_send", (None, 0)),
        ("pp_recv", (None, 0)),
        ("create_agrs_session", ()),
        ("destroy_agrs_session", ()),
        ("agrs_new_session", ()),
        ("agrs_set_config", (1,)),
        ("agrs_get_inplace_tensor", (None,)),
        ("all_gather", (None,)),
        ("get_comm_stream", ()),
        ("get_engram_storage_size_hint", (1, 1, 1)),
        ("get_pp_buffer_size_hint", (1, 1)),
        ("get_agrs_num_max_session_bytes", (None, (1,), torch.bfloat16)),
        ("get_agrs_buffer_size_hint", (None, 1)),
    ):
        try:
            getattr(buf, name)(*args)
        except NotImplementedError as e:
            assert f"ElasticBuffer.{name} " in str(e), str(e)
        else:
            raise AssertionError(f"{name} did not raise NotImplementedError")
    # misuse, rejected locally
    x, idx, w = make_inputs(40, me, num_ranks)
    _, _, num_experts, _ = SHAPES[num_ranks]
    h = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts)[3]
    for fn, match in (
        (lambda: buf.dispatch(x, topk_idx=idx, handle=h), "no topk_idx"),
        (lambda: buf.dispatch(x, handle=h, do_cpu_sync=True), "CPU sync"),
        (lambda: buf.dispatch(x, handle=h, expert_alignment=8), "expert_alignment"),
        (lambda: buf.combine(x.float(), h), "bf16"),
    ):
        try:
            fn()
        except ValueError as e:
            assert match in str(e), str(e)
        else:
            raise AssertionError(f"no ValueError ({match})")
    buf.barrier()
    assert buf.get_logical_domain_size() == (1, num_ranks)


SCENARIOS = {
    "dispatch_combine": sc_dispatch_combine,
    "expand": sc_expand,
    "single_reduction": sc_single_reduction,
    "refusals": sc_refusals,
}


# ---------------------------------------------------------------------------- harness
def rank_main(rank: int, num_ranks: int, store_path: str, conn) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from moecomm.compat.elastic import ElasticBuffer

    results = {}
    _, m, _, _ = SHAPES[num_ranks]
    store = dist.FileStore(store_path, num_ranks)
    try:
        buf = ElasticBuffer(
            rank=rank,
            num_ranks=num_ranks,
            store=store,
            num_max_tokens_per_rank=m,
            hidden=HIDDEN,
            explicitly_destroy=True,
            timeout=TIMEOUT_S,
        )
    except BaseException:
        conn.send({"setup": (traceback.format_exc(), 0.0)})
        return
    for name, fn in SCENARIOS.items():
        t0 = time.monotonic()
        try:
            if name == "single_reduction":
                fn(buf, rank, num_ranks, store_path)
            else:
                fn(buf, rank, num_ranks)
            results[name] = ("ok", time.monotonic() - t0)
        except BaseException:
            results[name] = (traceback.format_exc(), time.monotonic() - t0)
            break
    buf.destroy()
    conn.send(results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_groups(rank_main, SHAPES, SCENARIOS, tmp_path_factory, "elastic", GROUP_TIMEOUT_S)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("num_ranks", "name"), [(n, s) for n in SHAPES for s in SCENARIOS])
def test_scenario(runs, num_ranks, name):
    for rank, res in enumerate(runs[num_ranks, name]):
        assert res[0] == "ok", f"rank {rank} of {num_ranks}, scenario {name}:\n{res[0]}"


def test_constructor(tmp_path):
    import torch.distributed as dist
    from moecomm.compat.elastic import ElasticBuffer

    with pytest.raises(ValueError, match="rank=, num_ranks= and store="):
        ElasticBuffer(rank=0, num_ranks=1)
    store = dist.FileStore(str(tmp_path / "s"), 1)
    with pytest.raises(NotImplementedError, match="Engram"):
        ElasticBuffer(num_bytes=4 << 20, num_cpu_bytes=2 << 20, rank=0, num_ranks=1, store=store)
    buf = ElasticBuffer(rank=0, num_ranks=1, store=store, num_max_tokens_per_rank=8, timeout=5)
    x, idx, w = make_inputs(0, 0, 2)
    x, idx, w = x[:8], idx[:8], w[:8]
    recv_x, _, recv_w, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=16)
    out, cw, _ = buf.combine(recv_x, h, topk_weights=recv_w)
    sent = (idx >= 0).any(1)
    assert torch.equal(out[sent], x[sent]) and torch.equal(cw, w)
    with pytest.raises(ValueError, match="exceed"):
        buf.dispatch(
            torch.zeros((9, HIDDEN), dtype=torch.bfloat16),
            topk_idx=torch.zeros((9, 4), dtype=torch.int64),
            num_experts=16,
        )
    buf.destroy()
    with pytest.raises(RuntimeError, match="destroy"):
        buf.barrier()
