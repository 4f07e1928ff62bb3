"""Loopback smoke test of the GPU data path: one process, no HTTP, no second process, no
NVSHMEM; small enough for CUDA_LAUNCH_BLOCKING=1 and compute-sanitizer --tool memcheck.

The client's CUDA-IPC region is its own peer (smoke_helpers.py: one IpcTransport region holds
the request ring and the response ring; the kernels' IpcPeers has one peer, that region, built
by hand because CUDA cannot open a process's own IPC handle). One step, on the current stream,
each launch synchronized and named if it fails:

    client_dispatch -> server_gather -> the GPU server's grouped expert MLP (Triton, bf16
    weights, as DeviceExpertServer runs it) -> server_respond -> client_combine

for 1 token top-1 (bf16 on the wire), then DeepEP's decode shape (128 tokens, top-8, hidden
7168, 16 local experts with intermediate 128), fp8 with per-128 scales, cast by the pack kernel
and cast by the caller (DispatchArgs.x_scales). Compared with the host path (moecomm.ops on the
CPU): bit for bit where data only moves (payload bytes and scales, the gathered batch, the
per-expert layout and its rows, the signal words, the response and y against the device's own
expert outputs), within the documented tolerance where the GEMMs reduce (expert outputs, y
against the float32 layer). smoke_helpers.check_step lists every difference at once.

Last, DeepEP's adapter (moecomm.compat.deep_ep.Buffer) with one rank: its CUDA path is that
rank's client and server over its own region (the same loopback), against the host path's
Buffer on the same inputs, bit for bit.

Every deadline the test passes (the combine's wait, the gather's payload wait, the Buffer's
timeout) is multiplied by moecomm.wire.cuda.deadline_scale() (MOECOMM_DEVICE_DEADLINE_SCALE: the
sanitizer run sets it). test_smoke_helpers.py checks the host half of all this without a device.
"""

from __future__ import annotations

import contextlib
import time

import moecomm.wire.cuda
import pytest
import smoke_helpers as sh
import torch

pytestmark = pytest.mark.gpu

# The Buffer's timeout in the adapter test (every wait of its CUDA path), before scaling.
ADAPTER_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of torch that sees the device")
    return moecomm.wire.cuda.cuda_module()


@pytest.fixture(scope="module")
def device(kernels):
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def model(device):
    """The experts every case shares: (w13, w2) on the host and on the device, bf16."""
    w13, w2 = sh.make_weights(sh.CASES["deepep_fp8_kernel_cast"])
    return (w13, w2), (w13.to(device), w2.to(device))


def _sync_quietly(device) -> None:
    with contextlib.suppress(Exception):  # after a sticky error: report the first one
        torch.cuda.synchronize(device)


@pytest.mark.parametrize("name", list(sh.CASES))
def test_loopback_step_matches_the_host_path(name, kernels, device, model):
    case = sh.CASES[name]
    (w13, w2), (w13_d, w2_d) = model
    x, ids, w = sh.make_inputs(case)
    host = sh.host_step(case, x, ids, w, w13, w2)
    scale = moecomm.wire.cuda.deadline_scale()
    arrival_ns = int(sh.ARRIVAL_TIMEOUT_S * scale * 1e9)
    combine_ns = int(sh.COMBINE_TIMEOUT_S * scale * 1e9)

    plan = sh.ring_plan(case)
    transport = kernels.IpcTransport(device.index)
    region = transport.create_region(plan.region_bytes)  # zero-filled: idle slots
    step = sh.LoopbackStep(kernels, case, device, region.device_ptr)
    stream = torch.cuda.current_stream(device).cuda_stream
    x_d, ids_d, w_d = x.to(device), ids.to(device), w.to(device)
    cast = {}
    if case.prequantized:
        q, s = sh.caller_cast(x)
        cast = {"x_q": q.to(device), "x_scales": s.to(device)}
    # NaN: a row the combine does not write shows.
    y = torch.full((case.tokens, case.hidden), float("nan"), dtype=sh.OUT_DTYPE, device=device)
    timings: dict[str, float] = {}

    def phase(what: str, launch):
        t0 = time.perf_counter()
        try:
            out = launch()
            torch.cuda.synchronize(device)
        except Exception as exc:
            raise AssertionError(f"{name}: {what} failed: {type(exc).__name__}: {exc}") from exc
        timings[what] = time.perf_counter() - t0
        return out

    try:
        phase("client_dispatch", lambda: step.dispatch(stream, x_d, ids_d, w_d, **cast))
        phase("server_gather", lambda: step.gather(stream, arrival_ns))
        expert_out = phase("expert MLP (Triton)", lambda: step.mlp(w13_d, w2_d))
        phase("server_respond", lambda: step.respond(stream, expert_out))
        phase("client_combine", lambda: step.combine(stream, y, combine_ns))
        res = sh.DeviceResult(
            c_ws=step.c_ws.cpu(),
            s_ws=step.s_ws.cpu(),
            region=transport.read(region, 0, plan.region_bytes),
            expert_out=expert_out.cpu(),
            y=y.cpu(),
        )
    finally:
        _sync_quietly(device)  # nothing in flight once the region and workspaces go
    print(f"{name}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in timings.items()))
    names = {v: n for n, v in kernels.SERVER_STATUS.items()}
    problems = sh.check_step(case, host, res, step.c_layout, step.s_layout, names)
    assert not problems, f"{name}: the device step differs from the host path:\n" + "\n".join(
        problems
    )


def test_deep_ep_single_rank_loopback(tmp_path, device):
    """deep_ep.Buffer with one rank on CUDA tensors (client and server of itself over its own
    region: compat/_ll_device.py) against the host path's Buffer on the same inputs: receive
    (counts, src_info, layout_range, fp8 bytes and scales, bf16 rows) and combine bit for bit,
    for an fp8 and a bf16 dispatch (two lanes)."""
    import torch.distributed as dist
    from moecomm.compat.deep_ep import Buffer

    case = sh.CASES["deepep_fp8_kernel_cast"]
    x, ids, w = sh.make_inputs(case)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    kw = dict(
        low_latency_mode=True,
        rank=0,
        num_ranks=1,
        store=store,
        timeout=ADAPTER_TIMEOUT_S * moecomm.wire.cuda.deadline_scale(),
    )
    buf = Buffer(None, **kw, store_prefix="smoke-cuda")
    twin = Buffer(None, **kw, store_prefix="smoke-host")
    problems: list[str] = []
    try:
        for use_fp8 in (True, False):
            problems += sh.deep_ep_round(buf, twin, x, ids, w, case.num_experts, use_fp8, device)
    finally:
        _sync_quietly(device)
        for b in (buf, twin):
            with contextlib.suppress(Exception):
                b.destroy()
    assert not problems, "deep_ep.Buffer, one rank, CUDA vs host:\n" + "\n".join(problems)
