"""Registered tensors over the nixl transport: zero-copy puts from a tensor into a peer's
tensor, ordered by a signal word in host memory. On the CPU here (DRAM registration); the same
code with CUDA tensors registers VRAM and moves GPU memory over UCX (NVLink, RDMA) — those tests
are marked gpu and run where a device exists."""

from __future__ import annotations

import pytest
import torch
from moecomm import prefork
from moecomm.wire.nixl import TensorRegion, available, open_nixl_transport
from moecomm.wire.transport import WaitOp

ok, why = available()
pytestmark = pytest.mark.skipif(not ok, reason=f"NIXL is not installed: {why}")
WAIT_NS = 20_000_000_000
FLAG = 0


def _receiver(conn, device: str, numel: int, rounds: int) -> None:
    t = open_nixl_transport()
    flags = t.create_region(64)
    dst = torch.zeros(numel, dtype=torch.float16, device=device)
    reg = TensorRegion(t, dst)
    conn.send((flags.handle, reg.handle))
    for r in range(1, rounds + 1):
        t.wait(flags, FLAG, WaitOp.EQUAL, r, timeout_ns=WAIT_NS)
        # The sender's pattern for round r: the signal ordered it before the word.
        want = (torch.arange(numel) % 251 + r).to(torch.float16)
        conn.send(bool(torch.equal(dst.cpu(), want)))
    conn.recv()


def _roundtrip(device: str) -> list[bool]:
    numel, rounds = 1 << 16, 5
    ctx = prefork.process_context()
    a, b = ctx.Pipe()
    p = ctx.Process(target=_receiver, args=(b, device, numel, rounds), daemon=True)
    p.start()
    try:
        t = open_nixl_transport()
        flags_h, dst_h = a.recv()
        flags, dst = t.attach(flags_h), t.attach(dst_h)
        src = torch.empty(numel, dtype=torch.float16, device=device)
        reg = TensorRegion(t, src)
        seen = []
        for r in range(1, rounds + 1):
            src.copy_((torch.arange(numel) % 251 + r).to(torch.float16))
            if device == "cuda":
                torch.cuda.synchronize()
            # A part of the tensor in two puts, then the signal: both land before the word.
            half = reg.nbytes // 2
            t.put_region(dst, 0, reg.region, 0, half)
            t.put_region(dst, half, reg.region, half, reg.nbytes - half)
            t.signal(flags, FLAG, r)
            assert a.poll(30)
            seen.append(a.recv())
        a.send("done")
        p.join(30)
        return seen
    finally:
        if p.is_alive():
            p.kill()
            p.join(10)


@pytest.mark.timeout(120)
def test_tensor_to_tensor_puts_land_before_their_signal_on_the_cpu():
    assert _roundtrip("cpu") == [True] * 5


def test_register_refuses_what_it_cannot_send():
    t = open_nixl_transport()
    with pytest.raises(ValueError, match="contiguous"):
        TensorRegion(t, torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="host or cuda"):
        t.register_external(torch.zeros(4).data_ptr(), 16, "tpu", 0)
    reg = TensorRegion(t, torch.zeros(8))
    mine = t.create_region(64)
    with pytest.raises(ValueError, match="outside"):
        t.put_region(mine, 0, reg.region, 16, 32)


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_gpu_tensor_to_gpu_tensor_over_nixl():
    """VRAM registration: a CUDA tensor put into a peer's CUDA tensor (on one GPU here: both
    processes on device 0; UCX uses CUDA IPC or staging, across nodes RDMA)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert _roundtrip("cuda") == [True] * 5
