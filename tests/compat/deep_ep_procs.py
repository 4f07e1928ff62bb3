"""Rank processes and a pure-torch reference of DeepEP's low-latency semantics, for
test_deep_ep.py. Every rank regenerates every rank's inputs from the seed, so each can check its
own results against the reference without exchanging tensors.

Reference semantics (DeepEP's, with our deterministic order): local expert ``e`` of rank ``r``
(global expert ``r*L + e``) receives every (rank p, token t) whose ``topk_idx[p][t]`` holds it,
source rank major, token ascending; fp8 values are DeepEP's cast of the source row (deepep_fp8).
Combine: ``out[t] = Σ_k w[t, k] · y(t, k)`` in f32, k ascending, skipping ``-1``, cast to bf16.
"""

from __future__ import annotations

import time
import traceback

import torch
from moecomm import prefork

M, HIDDEN, TOPK, EXPERTS_PER_RANK = 8, 256, 3, 4
TIMEOUT_S = 20.0


def make_inputs(
    seed: int,
    rank: int,
    num_tokens: int,
    num_experts: int,
    masked: int = 2,
    hidden=HIDDEN,
    topk=TOPK,
):
    """x [T, H] bf16, topk_idx [T, K] int64 (distinct experts, `masked` entries -1), w f32."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = (torch.randn(num_tokens, hidden, generator=g) * (1 + rank)).to(torch.bfloat16)
    perms = [torch.randperm(num_experts, generator=g)[:topk] for _ in range(num_tokens)]
    idx = torch.stack(perms) if perms else torch.empty(0, topk, dtype=torch.int64)
    idx = idx.reshape(num_tokens, topk).to(torch.int64)
    for _ in range(masked if num_tokens else 0):
        t = int(torch.randint(num_tokens, (1,), generator=g))
        idx[t, int(torch.randint(topk, (1,), generator=g))] = -1
    w = torch.rand(num_tokens, topk, generator=g)
    return x, idx, w


def expert_output(rows_f32: torch.Tensor, expert: int) -> torch.Tensor:
    """The simulated expert: a per-expert scale, rounded to bf16."""
    return (rows_f32 * (1.0 + expert / 8.0)).to(torch.bfloat16)


def deepep_fp8(x: torch.Tensor, round_scale: bool = False):
    """DeepEP's low-latency fp8 cast (internode_ll.cu + calculate_fp8_scales), written apart from
    the adapter's: per 128 channels amax = max(|x|, 1e-4); scale 448/amax and scale_inv
    amax*(1/448 in f32), or with round_scale 2^-e and 2^e, e = ceil(log2(amax/448)); q = e4m3 of
    x*scale, saturated. Returns (q, scale_inv [n, H/128] f32, dequantized f32)."""
    n, h = x.shape
    v = x.float().reshape(n, h // 128, 128)
    amax = v.abs().amax(dim=2).clamp(min=1e-4)
    ratio = amax * torch.tensor(1 / 448, dtype=torch.float32)
    if round_scale:
        mant, ex = torch.frexp(ratio)  # ratio = mant * 2^ex, mant in [0.5, 1)
        e = torch.where(mant == 0.5, ex - 1, ex)
        one = torch.ones_like(ratio)
        scale, inv = torch.ldexp(one, -e), torch.ldexp(one, e)
    else:
        scale, inv = torch.tensor(448.0) / amax, ratio
    q = (v * scale[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = q.float() * inv[:, :, None]
    return q.reshape(n, h), inv, deq.reshape(n, h)


def _source_rows(x: torch.Tensor, use_fp8: bool):
    """(wire values, scales, f32 dequantized values) of every row of one source rank."""
    if not use_fp8:
        return x, None, x.float()
    return deepep_fp8(x)


def check_round(buf, seed: int, sizes: list[int], use_fp8: bool, *, hook: bool = False):
    """One dispatch + combine on every rank, checked against the reference. Returns a digest."""
    r, nr = buf.rank, buf.num_ranks
    e_total = EXPERTS_PER_RANK * nr
    inputs = [make_inputs(seed, p, sizes[p], e_total) for p in range(nr)]
    x, idx, w = inputs[r]
    recv_x, count, handle, event, h = buf.low_latency_dispatch(
        x, idx, M, e_total, use_fp8=use_fp8, return_recv_hook=hook
    )
    event.current_stream_wait()
    assert (h is not None) == hook
    if hook:
        h()
    y = check_dispatch(buf, inputs, recv_x, count, handle, use_fp8)
    out, _, h = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook)
    if hook:
        h()
        h()  # a second call is a no-op
    check_combine(r, inputs, out, use_fp8)
    return hash(out.view(torch.int16).numpy().tobytes())


def check_dispatch(buf, inputs, recv_x, count, handle, use_fp8: bool) -> torch.Tensor:
    """Checks what this rank received; returns the expert outputs to combine (rows past the
    counts are NaN, so reading one would show in the combine)."""
    r, nr = buf.rank, buf.num_ranks
    rows_total = nr * M
    sources = [_source_rows(x, use_fp8) for x, _, _ in inputs]
    y = torch.full((EXPERTS_PER_RANK, rows_total, HIDDEN), float("nan"), dtype=torch.bfloat16)
    src_info, layout_range = handle[0], handle[1]
    assert tuple(handle[2:]) == (M, HIDDEN, EXPERTS_PER_RANK * nr)
    for e in range(EXPERTS_PER_RANK):
        ge = r * EXPERTS_PER_RANK + e
        want = [(p, t) for p in range(nr) for t in range(inputs[p][1].shape[0])]
        want = [(p, t) for p, t in want if ge in inputs[p][1][t].tolist()]
        n = len(want)
        assert int(count[e]) == n, f"expert {ge}: count {int(count[e])}, expected {n}"
        assert src_info[e, :n].tolist() == [t for _, t in want]
        assert bool((src_info[e, n:] == -1).all())
        begin = 0
        for p in range(nr):
            c = sum(1 for q, _ in want if q == p)
            assert int(layout_range[e, p]) == (begin << 32) | c, f"layout_range[{e}, {p}]"
            begin += c
        if not n:
            continue
        wire = torch.stack([sources[p][0][t] for p, t in want])
        if use_fp8:
            data, scales = recv_x
            assert tuple(scales.shape) == (EXPERTS_PER_RANK, rows_total, HIDDEN // 128)
            assert scales.stride(1) == 1, "scales must be column-major in the last two dims"
            assert torch.equal(data[e, :n].view(torch.uint8), wire.view(torch.uint8))
            assert torch.equal(scales[e, :n], torch.stack([sources[p][1][t] for p, t in want]))
            got = torch.stack([sources[p][2][t] for p, t in want])
        else:
            assert torch.equal(recv_x[e, :n].view(torch.int16), wire.view(torch.int16))
            got = recv_x[e, :n].float()
        y[e, :n] = expert_output(got, ge)
    return y


def check_combine(r: int, inputs, out: torch.Tensor, use_fp8: bool) -> None:
    x, idx, w = inputs[r]
    _, _, deq = _source_rows(x, use_fp8)
    ref = torch.zeros(x.shape[0], HIDDEN)
    for t in range(x.shape[0]):
        for k in range(TOPK):
            e = int(idx[t, k])
            if e >= 0:
                ref[t] = ref[t] + w[t, k] * expert_output(deq[t], e).float()
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (x.shape[0], HIDDEN)
    assert torch.equal(out, ref.to(torch.bfloat16)), "combine differs from the reference"


# ---------------------------------------------------------------------------- scenarios
def sc_fp8(buf):
    check_round(buf, 1, [M, 5, 7][: buf.num_ranks], True)


def sc_bf16(buf):
    check_round(buf, 2, [6, M, 3][: buf.num_ranks], False)


def sc_hooks(buf):
    check_round(buf, 3, [M, 4, 2][: buf.num_ranks], True, hook=True)
    # Two dispatches in flight, received and combined through hooks in a mixed order.
    nr, r = buf.num_ranks, buf.rank
    e_total = EXPERTS_PER_RANK * nr
    rounds = []
    for seed in (4, 5):
        inputs = [make_inputs(seed, p, M - p, e_total) for p in range(nr)]
        x, idx, _ = inputs[r]
        rounds.append(
            (inputs, *buf.low_latency_dispatch(x, idx, M, e_total, return_recv_hook=True))
        )
    for i in (1, 0):
        rounds[i][5]()
    pending = []
    for inputs, recv_x, count, handle, _, _ in rounds:
        y = check_dispatch(buf, inputs, recv_x, count, handle, True)
        _, idx, w = inputs[r]
        out, _, h = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
        pending.append((inputs, out, h))
    for inputs, out, h in pending:
        h()
        check_combine(r, inputs, out, True)


def sc_ragged(buf):
    # No tokens on rank 0, fewer than the maximum elsewhere; then a rank whose every entry is -1.
    check_round(buf, 6, [0, 3, 1][: buf.num_ranks], True)
    nr, r = buf.num_ranks, buf.rank
    e_total = EXPERTS_PER_RANK * nr
    inputs = [make_inputs(7, p, 4, e_total) for p in range(nr)]
    inputs[0][1].fill_(-1)
    x, idx, w = inputs[r]
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, e_total)
    y = check_dispatch(buf, inputs, recv_x, count, handle, True)
    out, _, _ = buf.low_latency_combine(y, idx, w, handle)
    check_combine(r, inputs, out, True)
    if r == 0:
        assert torch.equal(out, torch.zeros_like(out))


def sc_stats(buf):
    nr, r = buf.num_ranks, buf.rank
    e_total = EXPERTS_PER_RANK * nr
    stats = torch.zeros(EXPERTS_PER_RANK, dtype=torch.int32)
    total = torch.zeros_like(stats)
    for seed in (8, 9):
        x, idx, w = make_inputs(seed, r, M, e_total)
        _, count, handle, _, _ = buf.low_latency_dispatch(
            x, idx, M, e_total, cumulative_local_expert_recv_stats=stats
        )
        total += count
        y = torch.zeros(EXPERTS_PER_RANK, nr * M, HIDDEN, dtype=torch.bfloat16)
        buf.low_latency_combine(y, idx, w, handle)
    assert torch.equal(stats, total) and int(total.sum()) > 0


def _raises(exc, fn, match: str):
    try:
        fn()
    except exc as e:
        assert match in str(e), f"{exc.__name__} without {match!r}: {e}"
        return
    raise AssertionError(f"expected {exc.__name__} ({match})")


def sc_bad_inputs(buf):
    nr, r = buf.num_ranks, buf.rank
    e_total = EXPERTS_PER_RANK * nr
    x, idx, w = make_inputs(10, r, M, e_total)
    d = buf.low_latency_dispatch
    _raises(TypeError, lambda: d(x.float(), idx, M, e_total), "bfloat16")
    _raises(
        ValueError,
        lambda: d(torch.cat([x, x[:1]]), torch.cat([idx, idx[:1]]), M, e_total),
        "more than num_max",
    )
    _raises(TypeError, lambda: d(x, idx.int(), M, e_total), "int64")
    bad = idx.clone()
    bad[0, 0] = e_total
    _raises(ValueError, lambda: d(x, bad, M, e_total), "[-1,")
    bad[0, :2] = 1
    _raises(ValueError, lambda: d(x, bad, M, e_total), "same expert twice")
    _raises(ValueError, lambda: d(x, idx, M, e_total + nr), "set up for")
    _raises(ValueError, lambda: d(x[:, :128].contiguous(), idx, M, e_total), "set up for")
    # A different top-k is legal (per call, as in DeepEP): test_deep_ep_surface.py checks it.
    _raises(ValueError, lambda: d(x.to("meta"), idx, M, e_total), "CPU tensor")
    _raises(ValueError, lambda: d(x, idx, M, e_total, use_ue8m0=True), "round_scale")
    _raises(ValueError, lambda: d(x[:, :128].contiguous(), idx, M, e_total), "set up for")
    _raises(ValueError, lambda: d(x[:, :100].contiguous(), idx, M, e_total), "multiple of 128")
    # Combine misuse, around real dispatches.
    ra = d(x, idx, M, e_total, return_recv_hook=True)
    y = torch.zeros(EXPERTS_PER_RANK, nr * M, HIDDEN, dtype=torch.bfloat16)
    c = buf.low_latency_combine
    _raises(RuntimeError, lambda: c(y, idx, w, ra[2]), "receive hook")
    ra[4]()
    rb = d(x, idx, M, e_total)
    _raises(ValueError, lambda: c(y[:, :-1], idx, w, ra[2]), "must be bf16")
    _raises(ValueError, lambda: c(y, idx.flip(0), w, ra[2]), "topk_idx must be the one")
    _raises(ValueError, lambda: c(y, idx, w.double(), ra[2]), "float32")
    bad = idx.clone()
    bad[idx == -1] = 0  # an expert the dispatch did not send to
    if bool((idx == -1).any()):
        _raises(ValueError, lambda: c(y, bad, w, ra[2]), "topk_idx must be the one")
    _raises(ValueError, lambda: c(y, idx, w, ("not", "a", "handle")), "handle")
    _raises(ValueError, lambda: c(y, idx, w, ra[2], out=torch.empty(M, 7)), "out must be")
    # DeepEP's contract: a handle may be combined again, giving the same result.
    first = c(y, idx, w, ra[2])[0].clone()
    assert torch.equal(c(y, idx, w, ra[2])[0], first)
    out = torch.empty(M, HIDDEN, dtype=torch.bfloat16)
    got, _, _ = c(y, idx, w, rb[2], out=out)
    assert got is out and torch.equal(out, torch.zeros_like(out))
    # Still working after all of that.
    check_round(buf, 11, [M] * nr, True)


def sc_pressure(buf):
    # The same seed twice gives the same bits; different seeds each match the reference.
    digests = [check_round(buf, 100 + i % 4, [M] * buf.num_ranks, True) for i in range(8)]
    assert digests[:4] == digests[4:]


def sc_process_group(buf, store_path: str):
    """A second buffer built from a gloo process group, set up at its first dispatch."""
    import torch.distributed as dist
    from moecomm.compat.deep_ep import Buffer

    nr, r = buf.num_ranks, buf.rank
    store = dist.FileStore(store_path + ".pg", nr)
    dist.init_process_group("gloo", store=store, rank=r, world_size=nr)
    try:
        with Buffer(dist.group.WORLD, 0, 1 << 20, low_latency_mode=True, timeout=TIMEOUT_S) as b2:
            assert b2.shape is None
            check_round(b2, 12, [M, 2, 5][:nr], True)
            assert b2.shape is not None
        assert b2._destroyed
    finally:
        dist.destroy_process_group()


SCENARIOS = {
    "fp8": sc_fp8,
    "bf16": sc_bf16,
    "hooks": sc_hooks,
    "ragged": sc_ragged,
    "stats": sc_stats,
    "bad_inputs": sc_bad_inputs,
    "pressure": sc_pressure,
    "process_group": sc_process_group,
}


def rank_main(rank: int, num_ranks: int, store_path: str, names: list[str], conn) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from moecomm.compat.deep_ep import Buffer

    results = {}
    store = dist.FileStore(store_path, num_ranks)
    buf = Buffer(
        None,
        low_latency_mode=True,
        rank=rank,
        num_ranks=num_ranks,
        store=store,
        num_max_dispatch_tokens_per_rank=M,
        hidden=HIDDEN,
        num_experts=EXPERTS_PER_RANK * num_ranks,
        num_topk=TOPK,
        timeout=TIMEOUT_S,
    )
    for name in names:
        t0 = time.monotonic()
        try:
            fn = SCENARIOS[name]
            fn(buf, store_path) if name == "process_group" else fn(buf)
            results[name] = ("ok", time.monotonic() - t0)
        except BaseException:
            results[name] = (traceback.format_exc(), time.monotonic() - t0)
            break  # the other ranks may now be out of step: stop here
    buf.destroy()
    conn.send(results)


def launch(
    num_ranks: int, store_path: str, names: list[str], reaper, timeout: float, target=None
) -> list:
    """Runs `names` on `num_ranks` spawned ranks (each `target(rank, num_ranks, store_path,
    names, conn)`, rank_main by default); returns each rank's results (killing them all at the
    deadline, whatever happens)."""
    target = rank_main if target is None else target
    ctx = prefork.process_context()
    conns, procs = [], []
    for r in range(num_ranks):
        parent, child = ctx.Pipe()
        p = reaper.process(
            ctx.Process(target=target, args=(r, num_ranks, store_path, names, child), daemon=True)
        )
        p.start()
        child.close()
        conns.append(parent)
        procs.append(p)
    deadline = time.monotonic() + timeout
    results = []
    for r, conn in enumerate(conns):
        if not conn.poll(max(deadline - time.monotonic(), 0.0)):
            for p in procs:
                if p.is_alive():
                    p.kill()  # a forked one may be reaped already
            raise AssertionError(f"rank {r} of {num_ranks} gave no result within {timeout} s")
        results.append(conn.recv())
    for p in procs:
        p.join(10)
    return results
