"""NVSHMEM transport on one GPU (needs a GPU; skipped cleanly without one). A one-PE job
exercises the bootstrap, the symmetric region, the device put_signal path and the device wait
with a deadline; multi-PE runs need one GPU per PE and are not covered here."""

from __future__ import annotations

import multiprocessing as mp

import nvshmem_procs
import pytest
from moecomm import _C

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]


def test_single_pe_put_signal_and_wait_outcomes(nvshmem_native):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=nvshmem_procs.single_pe, args=(child,), daemon=True)
    p.start()
    try:
        assert parent.poll(120), "NVSHMEM child did not answer"
        out = parent.recv()
        assert not (isinstance(out, tuple) and out[0] == "error"), out
        assert out["pe"] == (0, 1)
        assert out["ok"] == (int(_C.WaitStatus.OK), 5, True)
        status, elapsed = out["timeout"]
        assert status == int(_C.WaitStatus.TIMEOUT) and elapsed >= nvshmem_procs.SHORT_DEADLINE_NS
        status, elapsed = out["lost"]
        assert status == int(_C.WaitStatus.PEER_LOST) and elapsed < nvshmem_procs.SECOND
    finally:
        if p.is_alive():
            p.kill()
        p.join(10)
