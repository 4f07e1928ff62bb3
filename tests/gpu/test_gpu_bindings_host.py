"""Host-side checks of the GPU bindings that need no device: NVSHMEM's transport settings, the
symmetric-workspace rule of the NVSHMEM launchers, the peer tables' kernel views, and the
MOECOMM_REQUIRE_GPU switch that turns a skipped gpu test into a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import moecomm.wire.cuda
import pytest

NO_GPU = not moecomm.wire.cuda.available()
ROOT = Path(__file__).resolve().parents[2]
IBGDA_ENV = ("NVSHMEM_IB_ENABLE_IBGDA", "NVSHMEM_IBGDA_NUM_RC_PER_PE", "NVSHMEM_QP_DEPTH")


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*IBGDA_ENV, "MOECOMM_NVSHMEM_IBGDA"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_ibgda_is_enabled_and_sized_by_default(nvshmem_native, clean_env):
    got = dict(nvshmem_native.transport_env_defaults())
    assert got == {
        "NVSHMEM_IB_ENABLE_IBGDA": "1",
        "NVSHMEM_IBGDA_NUM_RC_PER_PE": str(nvshmem_native.IBGDA_RC_PER_PE),
        "NVSHMEM_QP_DEPTH": str(nvshmem_native.QP_DEPTH),
    }
    assert nvshmem_native.IBGDA_RC_PER_PE >= 1 and nvshmem_native.QP_DEPTH >= 64


def test_user_settings_win_and_the_opt_out_sets_nothing(nvshmem_native, clean_env):
    clean_env.setenv("NVSHMEM_QP_DEPTH", "4096")
    clean_env.setenv("NVSHMEM_IB_ENABLE_IBGDA", "0")
    assert dict(nvshmem_native.transport_env_defaults()) == {
        "NVSHMEM_IBGDA_NUM_RC_PER_PE": str(nvshmem_native.IBGDA_RC_PER_PE)
    }
    clean_env.setenv("MOECOMM_NVSHMEM_IBGDA", "0")
    assert nvshmem_native.transport_env_defaults() == []


def test_nvshmem_launchers_are_bound_and_refuse_a_non_symmetric_workspace(
    nvshmem_native, cuda_native
):
    """Before any CUDA call: a put source outside the symmetric heap is a clear ValueError."""
    nv, k = nvshmem_native, cuda_native
    peers = nv.NvshmemPeers()
    assert (peers.local_base, peers.peer_pe, peers.alive, peers.max_peers) == (0, 0, 0, 0)
    assert not nv.is_symmetric(0, 8)
    ccfg, scfg = k.ClientConfig(), k.ServerConfig()
    with pytest.raises(ValueError, match=r"client workspace .* not inside an NvshmemRegion"):
        nv.client_dispatch(peers, ccfg, k.DispatchArgs())
    with pytest.raises(ValueError, match=r"server workspace .* not inside an NvshmemRegion"):
        nv.server_respond(peers, scfg, k.ServerRespondArgs())
    for launch, cfg, args in (
        (nv.client_combine, ccfg, k.CombineArgs()),
        (nv.server_gather, scfg, k.ServerGatherArgs()),
    ):
        with pytest.raises(ValueError, match="must be non-null"):
            launch(peers, cfg, args)


def test_peer_tables_give_the_kernels_their_view_directly(nvshmem_native, cuda_native):
    assert hasattr(cuda_native.IpcPeerTable, "kernel_peers")
    assert hasattr(nvshmem_native.NvshmemPeerTable, "kernel_peers")
    doc = cuda_native.IpcPeerTable.remove_peer.__doc__
    assert "streams" in doc and "= 0" not in doc.split("->")[0], doc


def test_both_peer_views_carry_the_debug_wait_trace(nvshmem_native, cuda_native):
    """MOECOMM_DEVICE_DEBUG hands its trace ring to the kernels through the peers view; null
    (no recording) unless set."""
    for peers in (cuda_native.IpcPeers(), nvshmem_native.NvshmemPeers()):
        assert peers.wait_trace == 0
        peers.wait_trace = 0x7F00_0000_1000
        assert peers.wait_trace == 0x7F00_0000_1000
    assert cuda_native.DEVICE_DEBUG_ENV == "MOECOMM_DEVICE_DEBUG"


@pytest.mark.skipif(not NO_GPU, reason="checks what a GPU-less run of a gpu test reports")
def test_require_gpu_turns_a_skipped_gpu_test_into_a_failure(nvshmem_native):
    test = "tests/gpu/test_nvshmem_gpu.py::test_single_pe_put_signal_and_wait_outcomes"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.pop("MOECOMM_REQUIRE_GPU", None)
    skipped = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout
    env["MOECOMM_REQUIRE_GPU"] = "1"
    failed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    # A skip in setup (the marker's) reports as an error, one in the call as a failure.
    assert failed.returncode == 1 and "1 skipped" not in failed.stdout, failed.stdout
    assert "MOECOMM_REQUIRE_GPU=1 and this gpu test would be skipped" in failed.stdout
