"""DeepEP's normal (high-throughput) mode on moecomm (``moecomm.compat.normal.mode.NormalMode``)
between real processes (2 and 4 ranks, spawned, FileStore rendezvous), against a plain-torch
reference of DeepEP's documented semantics (``deep_ep/buffers/legacy.py``,
``tests/legacy/test_intranode.py``, ``csrc/kernels/legacy/intranode.cu``) written here.

Every rank regenerates every rank's inputs from seeds, so the reference needs no
communication. The scenarios of one rank count run in one spawned group; each is reported as
its own test."""

import json
import os
import time
import traceback
from datetime import timedelta

import moecomm
import pytest
import torch
from scenario_groups import run_groups

HIDDEN = 2048
GROUP_TIMEOUT_S = 90
TIMEOUT_S = 20.0
# (num_ranks) -> (tokens per rank, num_experts, num_topk); one rank has 0 tokens.
SHAPES = {2: ([0, 48], 16, 4), 4: ([37, 0, 48, 5], 32, 8)}


# ---------------------------------------------------------------------------- inputs
def make_inputs(seed: int, rank: int, num_ranks: int):
    sizes, num_experts, num_topk = SHAPES[num_ranks]
    n = sizes[rank]
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16)
    scores = torch.rand((n, num_experts), generator=g) + 0.1
    idx = torch.topk(scores, num_topk, dim=-1, sorted=False).indices.to(torch.int64)
    masked = torch.rand((n, num_topk), generator=g) < 0.15  # some -1 selections
    idx = idx.masked_fill(masked, -1)
    w = torch.rand((n, num_topk), generator=g)
    return x, idx, w


def to_fp8(x: torch.Tensor):
    """DeepEP's per_token_cast_to_fp8 (128-channel groups), scales column-major as in its test."""
    n = x.shape[0]
    xv = x.float().view(n, HIDDEN // 128, 128)
    amax = xv.abs().amax(dim=2).clamp(min=1e-4)
    q = (xv * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(n, HIDDEN)
    scales = amax / 448.0
    return q, scales.T.contiguous().T


def dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n = q.shape[0]
    return (q.float().view(n, HIDDEN // 128, 128) * s.unsqueeze(2)).view(n, HIDDEN)


# ---------------------------------------------------------------------------- reference
def ref_layout(idx: torch.Tensor, num_experts: int, num_ranks: int):
    """As test_intranode.py builds it."""
    per = num_experts // num_ranks
    n = idx.shape[0]
    rank_idx = torch.where(idx >= 0, idx // per, -1)
    ntr = torch.zeros(num_ranks, dtype=torch.int32)
    in_rank = torch.zeros((n, num_ranks), dtype=torch.bool)
    for r in range(num_ranks):
        sel = (rank_idx == r).any(dim=1)
        ntr[r] = sel.sum()
        in_rank[:, r] = sel
    nte = torch.zeros(num_experts, dtype=torch.int32)
    for e in range(num_experts):
        nte[e] = (idx == e).sum()
    return ntr, nte, in_rank


def ref_dispatch(all_inputs, me: int, num_experts: int, num_ranks: int, alignment: int):
    """Tokens for rank `me`, source rank major, token index ascending."""
    per = num_experts // num_ranks
    xs, idxs, ws, srcs, counts = [], [], [], [], []
    expert_counts = torch.zeros(per, dtype=torch.int64)
    for x, idx, w in all_inputs:
        rank_idx = torch.where(idx >= 0, idx // per, -1)
        rows = (rank_idx == me).any(dim=1).nonzero().flatten()
        local = rank_idx[rows] == me
        xs.append(x[rows])
        idxs.append(torch.where(local, idx[rows] - me * per, -1))
        ws.append(torch.where(local, w[rows], 0.0))
        srcs.append(rows.to(torch.int32))
        counts.append(rows.numel())
        for e in range(per):
            expert_counts[e] += (idx == me * per + e).sum()
    aligned = [(c + alignment - 1) // alignment * alignment for c in expert_counts.tolist()]
    return torch.cat(xs), torch.cat(idxs), torch.cat(ws), torch.cat(srcs), counts, aligned


def expert_fn(rows: torch.Tensor, r: int) -> torch.Tensor:
    """What rank `r`'s "experts" return for the rows it received (bf16)."""
    return (rows.float() * (r + 1) - 0.25 * r).to(torch.bfloat16)


def ref_combine(x, idx, num_experts, num_ranks, bias=None):
    """DeepEP's intranode combine: f32(bias_0)+f32(bias_1), then + f32(y_r[t]) for every rank
    r holding t, ranks ascending, cast to bf16 once."""
    per = num_experts // num_ranks
    n = x.shape[0]
    rank_idx = torch.where(idx >= 0, idx // per, -1)
    out = []
    for t in range(n):
        acc = torch.zeros(HIDDEN, dtype=torch.float32)
        if bias is not None:
            for b in bias:
                acc = acc + b[t].float()
        for r in range(num_ranks):
            if (rank_idx[t] == r).any():
                acc = acc + expert_fn(x[t : t + 1], r)[0].float()
        out.append(acc.to(torch.bfloat16))
    return torch.stack(out) if out else torch.empty((0, HIDDEN), dtype=torch.bfloat16)


# ---------------------------------------------------------------------------- scenarios
def _all(seed, num_ranks):
    return [make_inputs(seed, r, num_ranks) for r in range(num_ranks)]


def sc_layout(nm, me, num_ranks):
    _, num_experts, _ = SHAPES[num_ranks]
    _, idx, _ = make_inputs(1, me, num_ranks)
    ntr, rdma, nte, itr, event = nm.get_dispatch_layout(idx, num_experts)
    rntr, rnte, ritr = ref_layout(idx, num_experts, num_ranks)
    assert rdma is None
    assert torch.equal(ntr, rntr) and ntr.dtype == torch.int32
    assert torch.equal(nte, rnte) and nte.dtype == torch.int32
    assert torch.equal(itr, ritr)
    event.current_stream_wait()


def _dispatch(nm, x, idx, w, num_experts, **kw):
    ntr, _, nte, itr, _ = nm.get_dispatch_layout(idx, num_experts)
    return nm.dispatch(
        x,
        num_tokens_per_rank=ntr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=idx,
        topk_weights=w,
        **kw,
    )


def sc_bf16_roundtrip(nm, me, num_ranks):
    """dispatch with top-k (alignment 4), cached dispatch of a new x, combine with weights."""
    _, num_experts, _ = SHAPES[num_ranks]
    inputs = _all(2, num_ranks)
    x, idx, w = inputs[me]
    recv_x, recv_idx, recv_w, lst, handle, event = _dispatch(
        nm, x, idx, w, num_experts, expert_alignment=4
    )
    event.current_stream_wait()
    rx, ridx, rw, rsrc, counts, aligned = ref_dispatch(inputs, me, num_experts, num_ranks, 4)
    assert torch.equal(recv_x, rx)
    assert torch.equal(recv_idx, ridx)
    assert torch.equal(recv_w, rw)
    assert lst == aligned
    assert len(handle) == 6
    rank_prefix_matrix, _, _, recv_src_idx, is_token_in_rank, send_head = handle
    assert torch.equal(recv_src_idx, rsrc)
    assert rank_prefix_matrix[:, me].tolist() == torch.tensor(counts).cumsum(0).tolist()
    assert torch.equal(is_token_in_rank, ref_layout(idx, num_experts, num_ranks)[2])
    assert send_head.shape == (x.shape[0], num_ranks)
    # cached dispatch: same routing, new x, no top-k outputs
    new_inputs = _all(3, num_ranks)
    new_all = [(nx, i, ww) for (nx, _, _), (_, i, ww) in zip(new_inputs, inputs, strict=True)]
    out = nm.dispatch(new_all[me][0], handle=handle)
    assert out[1:5] == (None, None, None, None)
    assert torch.equal(out[0], ref_dispatch(new_all, me, num_experts, num_ranks, 1)[0])
    # combine with weights: sum of every rank's expert output, weights come back
    y = expert_fn(recv_x, me)
    combined, combined_w, event = nm.combine(y, handle, topk_weights=recv_w)
    event.current_stream_wait()
    assert torch.equal(combined, ref_combine(x, idx, num_experts, num_ranks))
    assert torch.equal(combined_w, torch.where(idx >= 0, w, 0.0))


def sc_bias_and_no_topk(nm, me, num_ranks):
    """dispatch without top-k (layout only), combine with two biases and no weights."""
    _, num_experts, _ = SHAPES[num_ranks]
    inputs = _all(4, num_ranks)
    x, idx, _ = inputs[me]
    ntr, _, nte, itr, _ = nm.get_dispatch_layout(idx, num_experts)
    recv_x, recv_idx, recv_w, lst, handle, _ = nm.dispatch(
        x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte
    )
    rx, _, _, _, _, aligned = ref_dispatch(inputs, me, num_experts, num_ranks, 1)
    assert recv_idx is None and recv_w is None
    assert torch.equal(recv_x, rx) and lst == aligned
    g = torch.Generator().manual_seed(40 + me)
    bias = tuple(torch.randn((x.shape[0], HIDDEN), generator=g).bfloat16() for _ in range(2))
    combined, combined_w, _ = nm.combine(expert_fn(recv_x, me), handle, bias=bias)
    assert combined_w is None
    assert torch.equal(combined, ref_combine(x, idx, num_experts, num_ranks, bias))
    combined1, _, _ = nm.combine(expert_fn(recv_x, me), handle, bias=bias[0])
    assert torch.equal(combined1, ref_combine(x, idx, num_experts, num_ranks, bias[:1]))


def sc_fp8(nm, me, num_ranks):
    """(x_fp8, scales) in, (recv_fp8, recv_scales) out, bytes unchanged; cached fp8 too."""
    _, num_experts, _ = SHAPES[num_ranks]
    inputs = _all(5, num_ranks)
    fp8 = [to_fp8(x) for x, _, _ in inputs]
    x, idx, w = inputs[me]
    recv, _, _, _, handle, _ = _dispatch(nm, fp8[me], idx, w, num_experts)
    assert isinstance(recv, tuple)
    q_all = [(q.view(torch.uint8), i, ww) for (q, _), (_, i, ww) in zip(fp8, inputs, strict=True)]
    s_all = [(s.contiguous(), i, ww) for (_, s), (_, i, ww) in zip(fp8, inputs, strict=True)]
    rq = ref_dispatch(q_all, me, num_experts, num_ranks, 1)[0]
    rs = ref_dispatch(s_all, me, num_experts, num_ranks, 1)[0]
    assert recv[0].dtype == torch.float8_e4m3fn and torch.equal(recv[0].view(torch.uint8), rq)
    assert recv[1].dtype == torch.float32 and torch.equal(recv[1], rs)
    cached = nm.dispatch(fp8[me], handle=handle)[0]
    assert torch.equal(cached[0].view(torch.uint8), rq) and torch.equal(cached[1], rs)
    # combine of the dequantized rows
    deq = dequant(*recv)
    combined, _, _ = nm.combine(deq.bfloat16(), handle)
    per = num_experts // num_ranks
    want = torch.zeros((x.shape[0], HIDDEN))
    q, s = fp8[me]
    mine = dequant(q, s).bfloat16()
    for r in range(num_ranks):
        sel = (torch.where(idx >= 0, idx // per, -1) == r).any(1)
        want[sel] += mine[sel].float()
    assert torch.equal(combined, want.bfloat16())


def sc_worst_tokens(nm, me, num_ranks):
    sizes, num_experts, _ = SHAPES[num_ranks]
    inputs = _all(6, num_ranks)
    x, idx, w = inputs[me]
    worst = max(sizes) * num_ranks
    recv_x, recv_idx, recv_w, lst, handle, _ = _dispatch(
        nm, x, idx, w, num_experts, num_worst_tokens=worst
    )
    rx, ridx, rw, _, _, _ = ref_dispatch(inputs, me, num_experts, num_ranks, 1)
    n = rx.shape[0]
    assert lst == []
    assert recv_x.shape[0] == recv_idx.shape[0] == recv_w.shape[0] == worst
    assert torch.equal(recv_x[:n], rx) and torch.equal(recv_idx[:n], ridx)
    assert torch.equal(recv_w[:n], rw)
    assert bool((recv_idx[n:] == -1).all())
    cached = nm.dispatch(x, handle=handle)[0]
    assert cached.shape[0] == worst and torch.equal(cached[:n], rx)
    combined, _, _ = nm.combine(expert_fn(recv_x, me), handle)
    assert torch.equal(combined, ref_combine(x, idx, num_experts, num_ranks))


def sc_large_packages(nm, me, num_ranks):
    """Packages of 6 MiB per pair of ranks (more chunks than slots, every rank sending to every
    other at once): the sends must interleave with the receives."""
    _, num_experts, _ = SHAPES[num_ranks]
    n, per = 1536, num_experts // num_ranks
    g = torch.Generator().manual_seed(500)  # the same on every rank: token t goes everywhere
    x_all = torch.randn((num_ranks, n, HIDDEN), generator=g).bfloat16()
    idx = (torch.arange(num_ranks) * per).repeat(n, 1)  # one expert on every rank
    w = torch.ones((n, num_ranks))
    recv_x, _, _, _, handle, _ = _dispatch(nm, x_all[me], idx, w, num_experts)
    assert torch.equal(recv_x, x_all.reshape(num_ranks * n, HIDDEN))
    combined, _, _ = nm.combine(expert_fn(recv_x, me), handle)
    want = torch.zeros((n, HIDDEN))
    for r in range(num_ranks):
        want += expert_fn(x_all[me], r).float()
    assert torch.equal(combined, want.bfloat16())


def sc_bad_inputs(nm, me, num_ranks):
    """Rejected before anything is sent: every rank raises locally, the buffer stays usable."""
    _, num_experts, _ = SHAPES[num_ranks]
    x, idx, w = make_inputs(7, me, num_ranks)
    ntr, _, nte, itr, _ = nm.get_dispatch_layout(idx, num_experts)
    _, _, _, _, handle, _ = nm.dispatch(
        x,
        num_tokens_per_rank=ntr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=idx,
        topk_weights=w,
    )
    for fn, exc, match in (
        (lambda: nm.dispatch(x, handle=handle, topk_idx=idx), ValueError, "cached"),
        (lambda: nm.dispatch(x, num_tokens_per_rank=ntr), ValueError, "is_token_in_rank"),
        (lambda: nm.get_dispatch_layout(idx.int(), num_experts), ValueError, "int64"),
        (lambda: nm.get_dispatch_layout(idx, num_experts + 1), ValueError, "multiple"),
        (lambda: nm.combine(x.float(), handle), ValueError, "bf16"),
        (lambda: nm.combine(x, ("not", "a", "handle")), ValueError, "handle"),
    ):
        try:
            fn()
        except exc as e:
            assert match in str(e), str(e)
        else:
            raise AssertionError(f"no {exc.__name__} ({match})")
    # still in step afterwards
    nm.barrier()
    sc_bf16_roundtrip(nm, me, num_ranks)


def sc_silent_then_dead_peer(nm, me, num_ranks):
    """The last scenario: rank 0 waits on a silent peer (TimeoutError at its deadline), then on a
    dead one (PeerLostError long before the deadline). The other ranks sleep, then exit."""
    if me != 0:
        time.sleep(3.0)
        return "exit"
    nm._mailbox.timeout = 1.0
    t0 = time.monotonic()
    try:
        nm.barrier()
    except moecomm.DeadlineExceededError as e:
        assert "no package from ranks" in str(e), str(e)
        assert 0.9 < time.monotonic() - t0 < 2.5
    else:
        raise AssertionError("no TimeoutError")
    nm._mailbox.timeout = 30.0
    t0 = time.monotonic()
    try:
        nm.barrier()
    except moecomm.PeerLostError as e:
        assert "died" in str(e), str(e)
        assert time.monotonic() - t0 < 10
    else:
        raise AssertionError("no PeerLostError")
    return None


SCENARIOS = {
    "layout": sc_layout,
    "bf16_roundtrip": sc_bf16_roundtrip,
    "bias_and_no_topk": sc_bias_and_no_topk,
    "fp8": sc_fp8,
    "worst_tokens": sc_worst_tokens,
    "large_packages": sc_large_packages,
    "bad_inputs": sc_bad_inputs,
    "silent_then_dead_peer": sc_silent_then_dead_peer,
}


# ---------------------------------------------------------------------------- harness
def store_exchange(store, rank, num_ranks, prefix, timeout):
    def exchange(mine):
        keys = [f"{prefix}/{p}" for p in range(num_ranks)]
        store.set(keys[rank], json.dumps(mine))
        store.wait(keys, timedelta(seconds=timeout))
        return [json.loads(store.get(k)) for k in keys]

    return exchange


def rank_main(rank: int, num_ranks: int, store_path: str, conn) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from moecomm.compat.normal.mode import NormalMode
    from moecomm.wire.shm import ShmTransport

    results = {}
    store = dist.FileStore(store_path, num_ranks)
    try:
        nm = NormalMode(
            rank,
            num_ranks,
            store_exchange(store, rank, num_ranks, "normal", TIMEOUT_S),
            ShmTransport(),
            timeout=TIMEOUT_S,
        )
    except BaseException:
        conn.send({"setup": (traceback.format_exc(), 0.0)})
        return
    for name, fn in SCENARIOS.items():
        t0 = time.monotonic()
        try:
            if fn(nm, rank, num_ranks) == "exit":  # die without destroy(): the peers see it
                results[name] = ("ok", time.monotonic() - t0)
                conn.send(results)
                conn.close()
                os._exit(0)
            results[name] = ("ok", time.monotonic() - t0)
        except BaseException:
            results[name] = (traceback.format_exc(), time.monotonic() - t0)
            break  # the other ranks may now be out of step
    nm.destroy()
    conn.send(results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_groups(rank_main, SHAPES, SCENARIOS, tmp_path_factory, "normal", GROUP_TIMEOUT_S)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("num_ranks", "name"), [(n, s) for n in SHAPES for s in SCENARIOS])
def test_scenario(runs, num_ranks, name):
    for rank, res in enumerate(runs[num_ranks, name]):
        assert res[0] == "ok", f"rank {rank} of {num_ranks}, scenario {name}:\n{res[0]}"


def test_single_rank_and_pack_roundtrip(tmp_path):
    import torch.distributed as dist
    from moecomm.compat.normal.mailbox import pack, unpack
    from moecomm.compat.normal.mode import NormalMode
    from moecomm.wire.shm import ShmTransport

    ts = [
        torch.arange(5, dtype=torch.int32),
        None,
        torch.empty((0, 3)),
        torch.ones(2, 2).bfloat16(),
    ]
    back = unpack(pack(ts))
    assert back[1] is None and back[2].shape == (0, 3)
    assert torch.equal(back[0], ts[0]) and torch.equal(back[3], ts[3])
    store = dist.FileStore(str(tmp_path / "s"), 1)
    nm = NormalMode(0, 1, store_exchange(store, 0, 1, "one", 5.0), ShmTransport(), timeout=5.0)
    x, idx, w = make_inputs(0, 1, 2)
    recv_x, _, recv_w, _, handle, _ = _dispatch(nm, x, idx, w, 16)
    assert torch.equal(recv_x, x[(idx >= 0).any(1)])
    out, cw, _ = nm.combine(recv_x, handle, topk_weights=recv_w)
    assert torch.equal(cw, torch.where(idx >= 0, w, 0.0))
    sent = (idx >= 0).any(1)
    assert torch.equal(out[sent], x[sent]) and bool((out[~sent] == 0).all())
    nm.destroy()
    with pytest.raises(RuntimeError, match="destroy"):
        nm.barrier()


def test_constructor_checks():
    from moecomm.compat.normal.mode import NormalMode

    with pytest.raises(ValueError, match="rank"):
        NormalMode(2, 2, lambda m: [m], None)
    with pytest.raises(ValueError, match="timeout"):
        NormalMode(0, 1, lambda m: [m], None, timeout=0)
