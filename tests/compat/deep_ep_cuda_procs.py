"""Rank processes of test_deep_ep_cuda.py: moecomm.compat.deep_ep.Buffer with CUDA tensors (the
device kernels over CUDA IPC), every rank a process on the same node (one GPU is enough: the
ranks share it). Each rank regenerates every rank's inputs from the seed, so it checks its own
results against an independent reference without exchanging tensors, and against the host path
(a second Buffer on CPU tensors, same inputs).

DeepEP's shape scaled down: hidden 2048, 16 experts, top-4, 32 tokens per rank; and the
contract scenarios walk the host contract test's flags and configs (deep_ep_ll_contract_procs,
shrink mode aside: refused on CUDA tensors) on CUDA tensors.

Each scenario is reported on its own (run_scenarios): one group of rank processes runs the
scenarios in order, each with fresh Buffers; a scenario's failure is caught in the ranks, which
then meet at a barrier (so a rank that failed early waits for the others to finish or time out)
and go on with the next one. A scenario has its own deadline in the parent: one that does not
finish in time is reported as timed out by name, the group is killed and a new one runs the
scenarios after it. So is a rank that dies, or whose CUDA context a failure broke.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import multiprocessing.connection
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import deep_ep_ll_contract_procs as contract
import deep_ep_procs
import moecomm
import moecomm.wire.cuda
import torch
from moecomm import prefork

M, HIDDEN, TOPK, NUM_EXPERTS = 32, 2048, 4, 16
# The Buffers' own deadline (every wait in the adapter), scaled like every device deadline.
TIMEOUT_S = 30.0
# Each scenario's cap in the parent, from when the previous one ended everywhere (or the group
# was ready); scaled by MOECOMM_DEVICE_DEADLINE_SCALE. Sized so that the set-up and every
# scenario fit the gpu-check's deepep stage (tools/gpu_check_plan.py: 110 s, less this file's
# 8 s margin; tests/tools/test_gpu_check.py checks the sum): a hang costs its own cap, not the
# stage.
# The core scenarios run first (SCENARIOS' order), the contract walks after them.
DEFAULT_SCENARIO_TIMEOUT_S = 6.0
SCENARIO_TIMEOUT_S = {
    "bf16": 6.0,
    "fp8": 6.0,
    "hooks": 6.0,
    "ragged": 6.0,
    "stats_and_out": 6.0,
    "misuse": 6.0,
    "pressure": 10.0,
    "contract_main": 10.0,
    "contract_logfmt": 10.0,
    "contract_h7168": 10.0,
}
# Spawn, import torch, the CUDA context, every kernel preloaded, the store: until every rank
# said it is ready. Each rank's set-up time is printed (never measured before 2026-12).
SETUP_TIMEOUT_S = 20.0


def deadline_scale() -> float:
    return moecomm.wire.cuda.deadline_scale()


def buffer_timeout() -> float:
    return TIMEOUT_S * deadline_scale()


def setup_timeout(kind: str = "cuda") -> float:
    """Until every rank of a group is ready: the stand-in ranks of the driver's own test run on
    a shared CPU machine, where spawning and importing torch alone can take longer."""
    if kind != "cuda":
        return SELFTEST_SETUP_TIMEOUT_S
    return SETUP_TIMEOUT_S * deadline_scale()


def scenario_timeout(name: str, kind: str = "cuda") -> float:
    if kind != "cuda":
        return SELFTEST_TIMEOUT_S
    return SCENARIO_TIMEOUT_S.get(name, DEFAULT_SCENARIO_TIMEOUT_S) * deadline_scale()


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
    kw = dict(
        low_latency_mode=True, rank=r, num_ranks=nr, store=ctx["store"], timeout=buffer_timeout()
    )
    prefix = ctx["prefix"]
    buf = Buffer(None, **kw, store_prefix=f"{prefix}/cuda-{name}")
    twin = Buffer(None, **kw, store_prefix=f"{prefix}/cpu-{name}")
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


def _buffers(store, dev, rank: int, num_ranks: int, prefix: str) -> dict:
    """A scenario's context: fresh Buffers (CUDA and its host twin), unique store prefixes."""
    from moecomm.compat.deep_ep import Buffer

    kw = dict(
        low_latency_mode=True,
        rank=rank,
        num_ranks=num_ranks,
        store=store,
        timeout=buffer_timeout(),
    )
    return {
        "store": store,
        "device": dev,
        "prefix": prefix,
        "buf": Buffer(None, **kw, store_prefix=f"{prefix}/cuda"),
        "cpu": Buffer(None, **kw, store_prefix=f"{prefix}/cpu-twin"),
    }


def _barrier(store, key: str, rank: int, num_ranks: int, timeout_s: float) -> None:
    store.set(f"{key}/{rank}", "1")
    store.wait([f"{key}/{p}" for p in range(num_ranks)], timedelta(seconds=timeout_s))


def _context_error(dev) -> str | None:
    """None when the CUDA context still works after a failed scenario, else why not (a sticky
    error such as an illegal address poisons every later CUDA call of the process)."""
    try:
        torch.cuda.synchronize(dev)
        torch.ones(1, device=dev).add_(1).item()
    except BaseException as exc:
        return repr(exc)
    return None


class _CudaRank:
    """What rank_main needs of the CUDA scenarios."""

    def __init__(self, rank: int, num_ranks: int):
        self.rank, self.num_ranks = rank, num_ranks
        torch.set_num_threads(1)
        self.dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(self.dev)
        torch.ones(1, device=self.dev).item()  # the CUDA context, before "ready"
        # Every kernel loaded before "ready": the two ranks share GPU 0, and a rank that loads
        # a module while the other's wait spins is the join case of the IPC test.
        import moecomm._cuda as kernels
        from moecomm.runtime.device_preload import preload_kernels

        preload_kernels(kernels, self.dev.index)

    def context(self, store, prefix: str) -> dict:
        return _buffers(store, self.dev, self.rank, self.num_ranks, prefix)

    def run(self, name: str, ctx: dict) -> None:
        SCENARIOS[name](ctx)
        torch.cuda.synchronize(self.dev)

    def broken(self, name: str) -> str | None:
        return _context_error(self.dev)

    def release(self, ctx: dict) -> None:
        ctx["buf"].destroy()
        ctx["cpu"].destroy()


class _SelfTestRank:
    """Stand-in scenarios on the host, for the driver's own test (test_deep_ep_cuda.py): each
    name says what one rank does — pass, fail, hang, die, or break its context."""

    def __init__(self, rank: int, num_ranks: int):
        self.rank = rank

    def context(self, store, prefix: str) -> dict:
        return {}

    def run(self, name: str, ctx: dict) -> None:
        verb, _, who = name.partition("_rank")
        if not who or int(who) != self.rank:
            time.sleep(0.2)  # the others: a short scenario that passes
            return
        if verb.startswith(("fail", "broken")):
            raise AssertionError(f"{name}: this rank fails")
        if verb.startswith("hang"):
            time.sleep(3600)
        if verb.startswith("die"):
            os._exit(3)

    def broken(self, name: str) -> str | None:
        return "stand-in for a sticky CUDA error" if name.startswith("broken") else None

    def release(self, ctx: dict) -> None:
        pass


RANK_KINDS = {"cuda": _CudaRank, "selftest": _SelfTestRank}
SELFTEST_TIMEOUT_S = 5.0
SELFTEST_SETUP_TIMEOUT_S = 180.0


def rank_main(
    rank: int, num_ranks: int, store_path: str, names: list[str], conn, kind: str = "cuda"
) -> None:
    """One rank: runs `names` in order and reports each over `conn` as it goes:
    ("ready",), then per scenario ("start", name) and ("end", name, outcome, seconds) with
    outcome "ok" or a traceback, finally ("done",). ("setup", traceback) when it cannot start,
    ("fatal", name, why) when it cannot go on after `name`. "ready" carries the seconds this rank
    spent setting up once running (the spawn and the interpreter's start are the parent's to
    measure)."""
    t_setup = time.monotonic()
    try:
        import torch.distributed as dist

        runner = RANK_KINDS[kind](rank, num_ranks)
        store = dist.FileStore(store_path, num_ranks)
    except BaseException:
        conn.send(("setup", traceback.format_exc()))
        return
    conn.send(("ready", time.monotonic() - t_setup))
    for i, name in enumerate(names):
        conn.send(("start", name))
        t0 = time.monotonic()
        ctx = None
        try:
            ctx = runner.context(store, f"{i}-{name}")
            runner.run(name, ctx)
            outcome = "ok"
        except BaseException:
            outcome = traceback.format_exc()
        conn.send(("end", name, outcome, time.monotonic() - t0))
        broken = runner.broken(name) if outcome != "ok" else None
        if broken is not None:
            conn.send(("fatal", name, f"the CUDA context is unusable after {name}: {broken}"))
            return
        try:
            # Every rank is done with this scenario (or failed it) before any Buffer goes: a
            # rank that failed early must not free what a peer still waits on.
            _barrier(store, f"end/{i}-{name}", rank, num_ranks, scenario_timeout(name, kind))
            if ctx is not None:
                runner.release(ctx)
        except BaseException:
            conn.send(("fatal", name, "barrier or destroy after it: " + traceback.format_exc()))
            return
    conn.send(("done",))


class _Group:
    """One launch of `num_ranks` rank processes over `names`, driven by deadlines."""

    def __init__(self, num_ranks: int, store_path: str, names: list[str], kind: str):
        ctx = prefork.process_context()
        self.names, self.kind, self.procs, self.conns = names, kind, [], []
        self.launched = time.monotonic()
        for r in range(num_ranks):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=rank_main,
                args=(r, num_ranks, store_path, names, child, kind),
                daemon=True,
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def _messages(self, until: float, once: bool = False):
        """(rank, message) as they come until `until`; message None: the rank's pipe closed.
        `once`: one message per rank at most (the others stay in the pipe)."""
        live = {c: r for r, c in enumerate(self.conns)}
        while live:
            left = until - time.monotonic()
            if left <= 0:
                return
            for c in mp.connection.wait(list(live), timeout=left):
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    yield live.pop(c), None
                    continue
                yield (live.pop(c) if once else live[c]), msg

    def _exit(self, rank: int) -> str:
        p = self.procs[rank]
        p.join(5)
        return f"rank {rank} died (exit code {p.exitcode})"

    def run(self, results: dict, end: float) -> tuple[int, str]:
        """Runs until every scenario is reported, the group cannot go on, or the run's time
        (`end`, monotonic) is up; fills `results` {name: [(outcome, seconds) per rank]} and
        returns (how many of `names` it settled, why it stopped early or ""). The rest run in
        a new group."""
        n = len(self.procs)
        ready: set[int] = set()
        setup_s = setup_timeout(self.kind)
        why = f"the ranks were not ready within {setup_s:.0f} s"
        # Each rank's first message only: its scenario messages may follow at once.
        until = min(time.monotonic() + setup_s, end)
        for rank, msg in self._messages(until, once=True):
            if msg is None:
                why = self._exit(rank) + " while setting up"
                break
            if msg[0] == "setup":
                why = f"rank {rank} could not set up:\n{msg[1]}"
                break
            ready.add(rank)
            own = f" ({msg[1]:.1f} s of it in the rank's own set-up)" if len(msg) > 1 else ""
            print(
                f"[deep_ep_cuda] rank {rank} ready {time.monotonic() - self.launched:.1f} s after "
                f"its launch{own}",
                flush=True,
            )
            if len(ready) == n:
                break
        if len(ready) < n:
            waited = time.monotonic() - self.launched
            missing = [r for r in range(n) if r not in ready]
            print(
                f"[deep_ep_cuda] ranks {missing} not ready {waited:.1f} s after their launch "
                f"(set-up cap {setup_s:.0f} s, run time left "
                f"{max(end - time.monotonic(), 0):.1f} s)",
                flush=True,
            )
            if time.monotonic() >= end:
                why = (
                    f"the run's time ran out while the ranks set up ({waited:.1f} s after their "
                    "launch)"
                )
            for name in self.names:
                results[name] = [(why, 0.0)] * n
            return len(self.names), why
        # Messages of the next scenario read while waiting for the last end of this one.
        backlog: list = []
        for idx, name in enumerate(self.names):
            if time.monotonic() >= end:
                return idx, "the run's time ran out"
            got: dict[int, tuple[str, float]] = {}
            gone: dict[int, str] = {}  # ranks that will report nothing more, and why
            started: set[int] = set()
            t0 = time.monotonic()
            limit = scenario_timeout(name, self.kind)
            cut = t0 + limit > end  # the run's time ends first
            early, backlog = backlog, []
            for rank, msg in itertools.chain(early, self._messages(min(t0 + limit, end))):
                if msg is None:
                    gone.setdefault(rank, self._exit(rank))
                elif msg[0] in ("start", "end") and msg[1] != name:
                    backlog.append((rank, msg))
                elif msg[0] == "start":
                    started.add(rank)
                elif msg[0] == "end":
                    got[rank] = (msg[2], msg[3])
                elif msg[0] == "fatal":
                    gone[rank] = f"rank {rank} after {msg[1]}: {msg[2]}"
                if all(r in got or r in gone for r in range(n)):
                    break  # every rank ended it, or can say nothing more about it
                if gone and not started:
                    break  # a rank left between scenarios: nobody gets past the barrier
            trouble = next((gone[r] for r in sorted(gone)), None)
            if len(got) == n:
                results[name] = [got[r] for r in range(n)]
                if trouble is None:
                    continue
                return idx + 1, trouble  # every rank ended it; one of them cannot go on
            if trouble is not None and not started and not got:
                return idx, trouble  # stopped between scenarios: this one was not run
            timed_out = (
                f"timed out: no result within {time.monotonic() - t0:.0f} s, when the run's "
                "time (pytest-timeout, less a margin) ran out"
                if cut
                else f"timed out: no result within {limit:.0f} s (scenario deadline)"
            )
            results[name] = [
                got.get(r) or (gone.get(r, timed_out), time.monotonic() - t0) for r in range(n)
            ]
            return idx + 1, trouble or timed_out
        return len(self.names), ""

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()  # a forked one may be reaped already
            p.join(5)
            moecomm.reap_stale_segments(p.pid)
        for c in self.conns:
            c.close()


def run_scenarios(
    num_ranks: int,
    tmp_dir: Path,
    names: list[str],
    kind: str = "cuda",
    budget_s: float | None = None,
) -> dict:
    """{name: [(outcome, seconds) per rank]} for every name: "ok", a traceback, or why there is
    no result (timed out, a rank died, not run). A new group of ranks (a new store) takes over
    the scenarios after one that hung or left a rank unable to go on; a scenario that a group
    could not start twice in a row is reported with the reason instead of being tried again.
    `budget_s`: the whole run's time (the caller's test timeout, less a margin): a scenario
    still running then is reported as timed out, the ones after it as not run."""
    results: dict[str, list] = {}
    end = time.monotonic() + (budget_s if budget_s is not None else float("inf"))
    pending, attempt, unstarted = list(names), 0, None
    while pending:
        if time.monotonic() >= end:
            for name in pending:
                results[name] = [(f"not run: the run's time ({budget_s:.0f} s) ran out", 0.0)] * (
                    num_ranks
                )
            break
        attempt += 1
        group = _Group(num_ranks, str(Path(tmp_dir) / f"store{attempt}"), pending, kind)
        try:
            settled, why = group.run(results, end)
        finally:
            group.kill()
        if settled == 0:
            if unstarted == pending[0]:
                results[pending[0]] = [(f"not run: {why}", 0.0)] * num_ranks
                settled = 1
            unstarted = pending[0]
        pending = pending[settled:]
    return results
