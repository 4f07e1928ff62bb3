"""NVSHMEM transport on a GPU (skipped cleanly without one; fails instead under
MOECOMM_REQUIRE_GPU=1). A one-PE job exercises the bootstrap, the symmetric region, the device
put_signal path and the device wait with a deadline; a two-PE job runs the real device kernels
(client dispatch, server gather and respond, client combine) through moecomm._nvshmem. The two
PEs take one GPU each when there are two, else share GPU 0 (NVSHMEM's multiple-PEs-per-GPU
mode, which supports the point-to-point puts and signals used here)."""

from __future__ import annotations

import multiprocessing as mp

import device_step as ds
import numpy as np
import nvshmem_procs
import pytest
from moecomm import _C

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

SPAWN = mp.get_context("spawn")  # NVSHMEM is initialised once per process: fresh ones


def recv(conn, timeout=120.0):
    assert conn.poll(timeout), "NVSHMEM child did not answer in time"
    msg = conn.recv()
    assert not (isinstance(msg, tuple) and msg and msg[0] == "error"), f"child failed: {msg}"
    return msg


def test_single_pe_put_signal_and_wait_outcomes(nvshmem_native):
    parent, child = SPAWN.Pipe()
    p = SPAWN.Process(target=nvshmem_procs.single_pe, args=(child,), daemon=True)
    p.start()
    try:
        out = recv(parent)
        assert out["pe"] == (0, 1)
        assert out["ok"] == (int(_C.WaitStatus.OK), 5, True)
        status, elapsed = out["timeout"]
        assert status == int(_C.WaitStatus.TIMEOUT) and elapsed >= nvshmem_procs.SHORT_DEADLINE_NS
        assert "needs a deadline" in out["endless"], out["endless"]
        status, elapsed = out["lost"]
        assert status == int(_C.WaitStatus.PEER_LOST) and elapsed < nvshmem_procs.SECOND
    finally:
        if p.is_alive():
            p.kill()
        p.join(10)


def test_two_pes_dispatch_gather_respond_combine(nvshmem_native, cuda_native):
    """The unique id goes from rank 0 to rank 1 through this process (as over moecomm's control
    plane); then one full step, checked against numpy: the server gathered exactly the client's
    activations, and the client's combine is sum_k w[t, k] * x[t] (identity expert)."""
    pipes = [SPAWN.Pipe() for _ in range(2)]
    procs = [
        SPAWN.Process(target=nvshmem_procs.two_pe, args=(child, rank), daemon=True)
        for rank, (_, child) in enumerate(pipes)
    ]
    for p in procs:
        p.start()
    client, server = pipes[0][0], pipes[1][0]
    try:
        tag, uid = recv(client)
        assert tag == "uid" and len(uid) == nvshmem_native.UNIQUE_ID_BYTES
        client.send(uid)
        server.send(uid)
        assert recv(client) == ("dispatched", None)
        server.send("go")
        assert recv(server) == ("responded", None)
        client.send("go")
        for conn in (client, server):
            conn.send("finish")
        (_, c), (_, s) = recv(client), recv(server)
        x, _, w, _, _ = ds.inputs(1)
        assert c["pe"] == (0, 2) and s["pe"] == (1, 2)
        assert c["count"] == [ds.NUM_TOKENS]
        assert s["action"] == ds.SERVE
        assert np.array_equal(s["x"], x), "the server did not gather the client's activations"
        assert c["status"] == [cuda_native.SERVER_STATUS["OK"]]
        assert np.array_equal(c["y"], ds.expected_y(x, w))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
