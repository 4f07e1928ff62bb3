"""NVSHMEM transport on a GPU (skipped cleanly without one; fails instead under
MOECOMM_REQUIRE_GPU=1). A one-PE job exercises the bootstrap, the symmetric region, the device
put_signal path and the device wait with a deadline; a two-PE job runs the real device kernels
(client dispatch, server gather and respond, client combine) through moecomm._nvshmem.

Every PE is on this node: the children force IBGDA off, start no remote transport and bootstrap
over the loopback interface (nvshmem_procs.SINGLE_NODE_ENV says which variables and why). The
two PEs take one GPU each when there are two; on one GPU they need CUDA MPS, so without it the
two-PE test is skipped as the machine's limit ("one GPU and no MPS", a skip that
MOECOMM_REQUIRE_GPU=1 lets through: tests/conftest.py, skip_for_machine). The rules themselves
are checked here without a device."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from pathlib import Path
from types import SimpleNamespace

import device_step as ds
import moecomm.wire.cuda
import numpy as np
import nvshmem_procs
import pytest
from moecomm import _C

SPAWN = mp.get_context("spawn")  # NVSHMEM is initialised once per process: fresh ones


def recv(conn, timeout=120.0):
    timeout *= moecomm.wire.cuda.deadline_scale()
    assert conn.poll(timeout), f"NVSHMEM child did not answer within {timeout:.0f} s"
    msg = conn.recv()
    assert not (isinstance(msg, tuple) and msg and msg[0] == "error"), f"child failed: {msg}"
    return msg


def check_single_node_env(env: dict) -> None:
    for name, value in nvshmem_procs.SINGLE_NODE_ENV.items():
        assert env.get(name) == value, f"child ran with {name}={env.get(name)!r}, not {value!r}"


# ------------------------------------------------------------------------------ no device needed
def test_single_node_env_forces_ibgda_off_and_loopback_bootstrap(monkeypatch):
    monkeypatch.setenv("NVSHMEM_IB_ENABLE_IBGDA", "1")  # a machine that exports it: overridden
    monkeypatch.setenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "eth0")
    for name in nvshmem_procs.SINGLE_NODE_ENV:
        monkeypatch.setenv(name, "x")  # restored by monkeypatch after the test
    env = nvshmem_procs.apply_single_node_env()
    check_single_node_env(env)
    assert env["NVSHMEM_IB_ENABLE_IBGDA"] == "0" and env["MOECOMM_NVSHMEM_IBGDA"] == "0"
    assert env["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "lo"
    assert env["NVSHMEM_REMOTE_TRANSPORT"] == "none"


def test_single_node_env_leaves_moecomm_no_ibgda_default(monkeypatch, nvshmem_native):
    """Under the single-node settings moecomm's init adds no IBGDA setting of its own."""
    for name in nvshmem_procs.SINGLE_NODE_ENV:
        monkeypatch.setenv(name, "x")
    nvshmem_procs.apply_single_node_env()
    assert nvshmem_native.transport_env_defaults() == []


def test_mps_detection(tmp_path):
    proc = tmp_path / "proc"
    (proc / "12").mkdir(parents=True)
    (proc / "12" / "comm").write_text("python3\n")
    pipe = tmp_path / "mps"
    assert nvshmem_procs.mps_active(str(pipe), str(proc)) is None
    pipe.mkdir()
    (pipe / "control").write_text("")
    assert "control" in nvshmem_procs.mps_active(str(pipe), str(proc))
    (pipe / "control").unlink()
    (proc / "40").mkdir()
    (proc / "40" / "comm").write_text("nvidia-cuda-mps\n")  # comm keeps 15 characters
    assert "pid 40" in nvshmem_procs.mps_active(str(pipe), str(proc))


def test_two_pes_need_two_gpus_or_mps():
    reason = nvshmem_procs.two_pe_skip_reason(1, None)
    assert reason is not None and reason.startswith("one GPU and no MPS")
    assert "two NVSHMEM PEs cannot share it" in reason
    assert nvshmem_procs.two_pe_skip_reason(2, None) is None
    assert nvshmem_procs.two_pe_skip_reason(1, "MPS control pipe /tmp/nvidia-mps/control") is None


def _root_conftest(config):
    root = Path(__file__).resolve().parents[1] / "conftest.py"
    for plugin in config.pluginmanager.get_plugins():
        f = getattr(plugin, "__file__", None)
        if f and Path(f).resolve() == root:
            return plugin
    pytest.fail("tests/conftest.py is not loaded as a plugin")


def test_require_gpu_lets_only_a_machine_skip_through(request, monkeypatch):
    """MOECOMM_REQUIRE_GPU=1 turns a skipped gpu test into a failure unless the skip came from
    skip_for_machine (the one GPU without MPS of the two-PE test)."""
    conftest = _root_conftest(request.config)
    monkeypatch.setattr(conftest, "REQUIRE_GPU", True)

    def report_of(why: str):
        report = SimpleNamespace(skipped=True, outcome="skipped", longrepr=("t.py", 1, why))
        item = SimpleNamespace(get_closest_marker=lambda m: object() if m == "gpu" else None)
        hook = conftest.pytest_runtest_makereport(item, None)
        next(hook)
        with contextlib.suppress(StopIteration):
            hook.send(SimpleNamespace(get_result=lambda: report))
        return report

    with pytest.raises(pytest.skip.Exception) as skipped:
        conftest.skip_for_machine(nvshmem_procs.TWO_PE_ONE_GPU_REASON)
    machine = report_of(f"Skipped: {skipped.value.msg}")
    assert machine.outcome == "skipped", machine.longrepr
    other = report_of("Skipped: needs a CUDA device (no driver)")
    assert other.outcome == "failed"
    assert "MOECOMM_REQUIRE_GPU=1 and this gpu test would be skipped" in other.longrepr


# ------------------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_single_pe_put_signal_and_wait_outcomes(nvshmem_native):
    parent, child = SPAWN.Pipe()
    p = SPAWN.Process(target=nvshmem_procs.single_pe, args=(child,), daemon=True)
    p.start()
    try:
        out = recv(parent)
        check_single_node_env(out["env"])
        assert out["defaults"] == [], "moecomm would still set IBGDA defaults"
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


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_two_pes_dispatch_gather_respond_combine(nvshmem_native, cuda_native, skip_for_machine):
    """The unique id goes from rank 0 to rank 1 through this process (as over moecomm's control
    plane); then one full step, checked against numpy: the server gathered exactly the client's
    activations, and the client's combine is sum_k w[t, k] * x[t] (identity expert)."""
    reason = nvshmem_procs.two_pe_skip_reason(
        moecomm.wire.cuda.device_count(), nvshmem_procs.mps_active()
    )
    if reason is not None:
        skip_for_machine(reason)
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
        check_single_node_env(c["env"])
        check_single_node_env(s["env"])
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
