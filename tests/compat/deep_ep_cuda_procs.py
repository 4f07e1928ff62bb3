"""Rank processes of test_deep_ep_cuda.py: moecomm.compat.deep_ep.Buffer with CUDA tensors (the
device kernels over CUDA IPC), every rank a process on the same node (one GPU is enough: the
ranks share it). Each rank regenerates every rank's inputs from the seed, so it checks its own
results against an independent reference without exchanging tensors, and against the host path
(a second Buffer on CPU tensors, same inputs).

DeepEP's shape scaled down: hidden 2048, 16 experts, top-4, 32 tokens per rank; and the
contract scenarios walk the host contract test's flags and configs (deep_ep_ll_contract_procs,
shrink mode aside: refused on CUDA tensors) on CUDA tensors.
"""

from __future__ import annotations

import time
import traceback

import deep_ep_ll_contract_procs as contract
import deep_ep_procs
import torch

M, HIDDEN, TOPK, NUM_EXPERTS = 32, 2048, 4, 16
TIMEOUT_S = 30.0


def make_inputs(seed: int, rank: int, num_tokens: int, masked: int = 3):
    return deep_ep_procs.make_inputs(
        seed, rank, num_tokens, NUM_EXPERTS, masked, hidden=HIDDEN, topk=TOPK
    )


expert_output = deep_ep_procs.expert_output


def check_dispatch(rank, nr, inputs, recv_x, count, handle, use_fp8: bool) -> torch.Tensor:
    """Checks the receive against the reference; returns y on the device: the expert outputs
    of the *source* rows (not of the received ones, so the combine check is exact under fp8
    too), NaN past the counts (reading one would show)."""
    num_local = NUM_EXPERTS // nr
    count, src_info, layout_range = count.cpu(), handle[0].cpu(), handle[1].cpu()
    assert tuple(handle[2:]) == (M, HIDDEN, NUM_EXPERTS)
    y = torch.full((num_local, nr * M, HIDDEN), float("nan"), dtype=torch.bfloat16)
    if use_fp8:
        data, scales = recv_x
        assert data.dtype == torch.float8_e4m3fn and data.is_cuda
        assert tuple(scales.shape) == (num_local, nr * M, HIDDEN // 128)
        assert scales.stride(1) == 1, "scales must be column-major in the last two dims"
        data, scales = data.cpu(), scales.cpu()
    else:
        assert recv_x.dtype == torch.bfloat16 and recv_x.is_cuda
        data = recv_x.cpu()
    for e in range(num_local):
        ge = rank * num_local + e
        want = [(p, t) for p in range(nr) for t in range(inputs[p][1].shape[0])]
        want = [(p, t) for p, t in want if ge in inputs[p][1][t].tolist()]
        n = len(want)
        assert int(count[e]) == n, f"expert {ge}: count {int(count[e])}, expected {n}"
        assert src_info[e, :n].tolist() == [t for _, t in want], f"expert {ge}: src_info"
        assert bool((src_info[e, n:] == -1).all())
        begin = 0
        for p in range(nr):
            c = sum(1 for q, _ in want if q == p)
            assert int(layout_range[e, p]) == (begin << 32) | c, f"layout_range[{e}, {p}]"
            begin += c
        if not n:
            continue
        src = torch.stack([inputs[p][0][t] for p, t in want])
        if use_fp8:  # DeepEP's cast, bit for bit
            q, inv, _ = deep_ep_procs.deepep_fp8(src)
            assert torch.equal(data[e, :n].view(torch.uint8), q.view(torch.uint8)), f"{ge}: fp8"
            assert torch.equal(scales[e, :n], inv), f"expert {ge}: fp8 scales"
        else:
            assert torch.equal(data[e, :n].view(torch.int16), src.view(torch.int16))
        y[e, :n] = expert_output(src.float(), ge)
    return y.to(recv_x[0].device if use_fp8 else recv_x.device)


def check_combine(rank, inputs, out: torch.Tensor) -> None:
    x, idx, w = inputs[rank]
    ref = torch.zeros(x.shape[0], HIDDEN)
    for t in range(x.shape[0]):
        for k in range(TOPK):
            e = int(idx[t, k])
            if e >= 0:
                ref[t] = ref[t] + w[t, k] * expert_output(x[t].float(), e).float()
    assert out.is_cuda and out.dtype == torch.bfloat16 and tuple(out.shape) == (x.shape[0], HIDDEN)
    assert torch.equal(out.cpu(), ref.to(torch.bfloat16)), "combine differs from the reference"


def _on(dev, inputs):
    return [tuple(t.to(dev) for t in inp) for inp in inputs]


def check_round(ctx, seed: int, sizes: list[int], use_fp8: bool, *, hook: bool = False):
    buf, cpu_buf, dev = ctx["buf"], ctx["cpu"], ctx["device"]
    r, nr = buf.rank, buf.num_ranks
    inputs = [make_inputs(seed, p, sizes[p]) for p in range(nr)]
    x, idx, w = _on(dev, inputs)[r]
    recv_x, count, handle, event, h = buf.low_latency_dispatch(
        x, idx, M, NUM_EXPERTS, use_fp8=use_fp8, async_finish=True, return_recv_hook=hook
    )
    event.current_stream_wait()
    assert (h is not None) == hook
    if hook:
        h()
        h()  # a second call is a no-op
    y = check_dispatch(r, nr, inputs, recv_x, count, handle, use_fp8)
    out, event, h = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook)
    if hook:
        h()
    with event:
        pass
    check_combine(r, inputs, out)
    # The host path, same inputs: same counts, src_info, layout_range, bf16 rows, combine bits.
    cx, cidx, cw = inputs[r]
    c_recv, c_count, c_handle, _, _ = cpu_buf.low_latency_dispatch(
        cx, cidx, M, NUM_EXPERTS, use_fp8=use_fp8
    )
    assert torch.equal(c_count, count.cpu())
    assert torch.equal(c_handle[0], handle[0].cpu())
    assert torch.equal(c_handle[1], handle[1].cpu())
    for e in range(c_count.shape[0]):
        k = int(c_count[e])
        if use_fp8:  # the same cast (DeepEP's) on both paths: same bytes, same scales
            got = recv_x[0][e, :k].cpu().view(torch.uint8)
            assert torch.equal(c_recv[0][e, :k].view(torch.uint8), got)
            assert torch.equal(c_recv[1][e, :k], recv_x[1][e, :k].cpu())
        else:
            got = recv_x[e, :k].cpu().view(torch.int16)
            assert torch.equal(c_recv[e, :k].view(torch.int16), got)
    c_out, _, _ = cpu_buf.low_latency_combine(y.cpu(), cidx, cw, c_handle)
    assert torch.equal(c_out, out.cpu()), "CUDA and host combines differ"
    return hash(out.cpu().view(torch.int16).numpy().tobytes())


# ---------------------------------------------------------------------------- scenarios
def sc_bf16(ctx):
    check_round(ctx, 1, [M, 17], False)


def sc_fp8(ctx):
    check_round(ctx, 2, [M, M], True)


def sc_hooks(ctx):
    check_round(ctx, 3, [M, 9], True, hook=True)
    # Two dispatches in flight, received and combined through hooks in a mixed order.
    buf, dev = ctx["buf"], ctx["device"]
    nr, r = buf.num_ranks, buf.rank
    rounds = []
    for seed in (4, 5):
        inputs = [make_inputs(seed, p, M - 3 * p) for p in range(nr)]
        x, idx, _ = _on(dev, inputs)[r]
        got = buf.low_latency_dispatch(x, idx, M, NUM_EXPERTS, return_recv_hook=True)
        rounds.append((inputs, *got))
    for i in (1, 0):
        rounds[i][5]()
    pending = []
    for inputs, recv_x, count, handle, _, _ in rounds:
        y = check_dispatch(r, nr, inputs, recv_x, count, handle, True)
        _, idx, w = _on(dev, inputs)[r]
        out, _, h = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
        pending.append((inputs, out, h))
    for inputs, out, h in reversed(pending):
        h()
        check_combine(r, inputs, out)


def sc_ragged(ctx):
    # No tokens on rank 0; then a rank whose every entry is -1.
    check_round(ctx, 6, [0, 5], True)
    buf, dev = ctx["buf"], ctx["device"]
    nr, r = buf.num_ranks, buf.rank
    inputs = [make_inputs(7, p, 4) for p in range(nr)]
    inputs[0][1].fill_(-1)
    x, idx, w = _on(dev, inputs)[r]
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, NUM_EXPERTS)
    y = check_dispatch(r, nr, inputs, recv_x, count, handle, True)
    out, _, _ = buf.low_latency_combine(y, idx, w, handle)
    check_combine(r, inputs, out)
    if r == 0:
        assert bool((out == 0).all())


def sc_stats_and_out(ctx):
    buf, dev = ctx["buf"], ctx["device"]
    nr, r = buf.num_ranks, buf.rank
    num_local = NUM_EXPERTS // nr
    stats = torch.zeros(num_local, dtype=torch.int32, device=dev)
    total = torch.zeros_like(stats)
    for seed in (8, 9):
        x, idx, w = _on(dev, [make_inputs(seed, r, M)])[0]
        _, count, handle, _, _ = buf.low_latency_dispatch(
            x, idx, M, NUM_EXPERTS, cumulative_local_expert_recv_stats=stats
        )
        total += count
        y = torch.zeros(num_local, nr * M, HIDDEN, dtype=torch.bfloat16, device=dev)
        out = torch.full((M, HIDDEN), 5.0, dtype=torch.bfloat16, device=dev)
        got, _, _ = buf.low_latency_combine(y, idx, w, handle, out=out)
        assert got is out and bool((out == 0).all())
    assert torch.equal(stats, total) and int(total.sum()) > 0


def sc_misuse(ctx):
    buf, dev = ctx["buf"], ctx["device"]
    nr, r = buf.num_ranks, buf.rank
    x, idx, w = _on(dev, [make_inputs(10, r, M)])[0]
    d, c = buf.low_latency_dispatch, buf.low_latency_combine
    _raises(ValueError, lambda: d(x, idx.cpu(), M, NUM_EXPERTS), "on the host")
    _raises(TypeError, lambda: d(x.float(), idx, M, NUM_EXPERTS), "bfloat16")
    _raises(ValueError, lambda: d(x, idx, M, NUM_EXPERTS + nr), "set up for")
    _raises(RuntimeError, lambda: d(x.cpu(), idx.cpu(), M, NUM_EXPERTS), "runs on CUDA tensors")
    ra = d(x, idx, M, NUM_EXPERTS, return_recv_hook=True)
    y = torch.zeros(NUM_EXPERTS // nr, nr * M, HIDDEN, dtype=torch.bfloat16, device=dev)
    _raises(RuntimeError, lambda: c(y, idx, w, ra[2]), "receive hook")
    ra[4]()
    d(x, idx, M, NUM_EXPERTS)
    d(x, idx, M, NUM_EXPERTS)  # reuses ra's slot: ra was never combined (legal, as in DeepEP)
    _raises(ValueError, lambda: c(y[:, :-1], idx, w, ra[2]), "must be bf16")
    _raises(ValueError, lambda: c(y, idx, w.double(), ra[2]), "float32")
    cost = torch.zeros(nr, dtype=torch.int64, device=dev)
    _raises(
        NotImplementedError,
        lambda: c(y, idx, w, ra[2], combine_wait_recv_cost_stats=cost),
        "inside a kernel",
    )
    first = c(y, idx, w, ra[2])[0]
    assert torch.equal(c(y, idx, w, ra[2])[0], first)  # combined again, after its slot's reuse
    check_round(ctx, 11, [M] * nr, True)


def _contract(ctx, name: str) -> None:
    """The host contract test's flag matrix (deep_ep_ll_contract_procs.test_main, shrink aside)
    on CUDA tensors, in a Buffer of that config's shape: hooks or not; bf16, fp8, round_scale,
    use_ue8m0; every other dispatch left uncombined; stats and wait-cost stats on the device;
    each handle combined twice, plainly and zero_copy (LogFMT where the config has it).
    Receive bit for bit against the reference (DeepEP's fp8 cast); combine bit for bit against
    the reference and the host path (LogFMT: within DeepEP's tolerance)."""
    from moecomm.compat.deep_ep import Buffer

    hidden, num_experts, num_tokens, num_topk, use_logfmt, _ = contract.CONFIGS[name]
    dev, nr, r = ctx["device"], ctx["buf"].num_ranks, ctx["buf"].rank
    kw = dict(low_latency_mode=True, rank=r, num_ranks=nr, store=ctx["store"], timeout=TIMEOUT_S)
    buf = Buffer(None, **kw, store_prefix=f"cuda-{name}")
    twin = Buffer(None, **kw, store_prefix=f"cpu-{name}")
    args = (1, num_tokens, hidden, num_experts, num_topk, use_logfmt)
    inputs = [contract.rank_inputs(args[0], p, *args[1:]) for p in range(nr)]
    x_list, idx, w = inputs[r]
    idx_d, w_d, num_local = idx.to(dev), w.to(dev), num_experts // nr
    cctx = {"rank": r, "num_ranks": nr, "num_local": num_local, "all_idx": [i[1] for i in inputs]}
    flags = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))
    n = 0
    try:
        for xi, x in enumerate(x_list):
            cur_xs = [i[0][xi] for i in inputs]
            for hook, (fp8, rs, ue) in ((h, f) for h in (False, True) for f in flags):
                n += 1
                stats = torch.zeros(num_local, dtype=torch.int32, device=dev)
                cost = torch.zeros(nr, dtype=torch.int64, device=dev)
                for _ in range(n % 2 + 1):  # once or twice: the first one never combined
                    recv, count, handle, event, h = buf.low_latency_dispatch(
                        x.to(dev), idx_d, num_tokens, num_experts, stats, cost, fp8, rs, ue,
                        async_finish=not hook, return_recv_hook=hook,
                    )  # fmt: skip
                    h() if hook else event.current_stream_wait()
                assert bool((cost.cpu() > 0).all()), "every rank's request was waited for"
                assert torch.equal(stats.cpu(), count.cpu() * (n % 2 + 1))
                recv_c = tuple(t.cpu() for t in recv) if fp8 else recv.cpu()
                handle_c = (handle[0].cpu(), handle[1].cpu())
                live = [True] * nr
                contract.check_dispatch_reference(
                    cctx, recv_c, count.cpu(), handle_c, cur_xs, fp8, rs, ue, live
                )
                if fp8:
                    data, sc = recv_c[0], recv_c[1].contiguous()
                    y = contract.per_token_cast_back(
                        data.view(-1, hidden), sc.view(-1, sc.shape[-1])
                    ).view(data.shape)
                else:
                    y = recv_c
                y_d = y.to(dev)
                yref = deep_ep_procs.deepep_fp8(x, rs)[2].to(torch.bfloat16) if fp8 else x
                ref = contract.combine_reference(yref, idx, w, torch.zeros_like(idx, dtype=bool))
                _, _, c_handle, _, _ = twin.low_latency_dispatch(
                    x, idx, num_tokens, num_experts, use_fp8=fp8, round_scale=rs, use_ue8m0=ue
                )
                c_out = twin.low_latency_combine(y, idx, w, c_handle, use_logfmt=use_logfmt)[0]
                for zero_copy in (False,) if use_logfmt else (False, True):
                    for _ in range(2):  # the same handle, combined again
                        if zero_copy:
                            buf.get_next_low_latency_combine_buffer(handle).copy_(y_d)
                        out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=dev)
                        got, event, h = buf.low_latency_combine(
                            torch.zeros_like(y_d) if zero_copy else y_d, idx_d, w_d, handle,
                            use_logfmt=use_logfmt, zero_copy=zero_copy,
                            async_finish=not hook, return_recv_hook=hook, out=out,
                        )  # fmt: skip
                        h() if hook else event.current_stream_wait()
                        assert got is out
                        got = out.cpu()
                        if use_logfmt:  # torch's log2/exp2 may round apart on the two devices
                            assert contract.calc_diff(ref, got) < 1e-5
                            assert contract.calc_diff(c_out, got) < 1e-6
                        else:
                            assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
                            assert torch.equal(got.view(torch.int16), c_out.view(torch.int16))
    finally:
        buf.destroy()
        twin.destroy()


def sc_contract_main(ctx):
    _contract(ctx, "main_h2048")


def sc_contract_logfmt(ctx):
    _contract(ctx, "logfmt_h4096")


def sc_contract_h7168(ctx):
    _contract(ctx, "ragged_h7168")


def sc_pressure(ctx):
    # The same seed twice gives the same bits; bf16 and fp8 lanes interleaved.
    sizes = [M] * ctx["buf"].num_ranks
    digests = [check_round(ctx, 100 + i % 3, sizes, i % 2 == 0) for i in range(6)]
    assert digests[:3] == digests[3:]


def _raises(exc, fn, match: str):
    try:
        fn()
    except exc as e:
        assert match in str(e), f"{exc.__name__} without {match!r}: {e}"
        return
    raise AssertionError(f"expected {exc.__name__} ({match})")


SCENARIOS = {
    "bf16": sc_bf16,
    "fp8": sc_fp8,
    "hooks": sc_hooks,
    "ragged": sc_ragged,
    "stats_and_out": sc_stats_and_out,
    "misuse": sc_misuse,
    "pressure": sc_pressure,
    "contract_main": sc_contract_main,
    "contract_logfmt": sc_contract_logfmt,
    "contract_h7168": sc_contract_h7168,
}


def rank_main(rank: int, num_ranks: int, store_path: str, names: list[str], conn) -> None:
    results = {}
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist
        from moecomm.compat.deep_ep import Buffer

        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        store = dist.FileStore(store_path, num_ranks)
        kw = dict(
            low_latency_mode=True, rank=rank, num_ranks=num_ranks, store=store, timeout=TIMEOUT_S
        )
        ctx = {
            "store": store,
            "device": dev,
            "buf": Buffer(None, **kw),
            "cpu": Buffer(None, **kw, store_prefix="cpu-twin"),
        }
    except BaseException:
        conn.send({"setup": (traceback.format_exc(), 0.0)})
        return
    for name in names:
        t0 = time.monotonic()
        try:
            SCENARIOS[name](ctx)
            torch.cuda.synchronize(dev)
            results[name] = ("ok", time.monotonic() - t0)
        except BaseException:
            results[name] = (traceback.format_exc(), time.monotonic() - t0)
            break  # the other ranks may now be out of step: stop here
    ctx["buf"].destroy()
    ctx["cpu"].destroy()
    conn.send(results)


def launch(num_ranks: int, store_path: str, names: list[str], reaper, timeout: float) -> list:
    return deep_ep_procs.launch(num_ranks, store_path, names, reaper, timeout, target=rank_main)
