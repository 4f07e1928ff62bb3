"""GPU transport tests. Tests marked ``gpu`` need a CUDA device as moecomm sees it (the root
conftest skips them otherwise, with the reason); everything else here runs on any machine."""

from __future__ import annotations

import moecomm.wire.cuda
import pytest


@pytest.fixture
def cuda_native():
    """moecomm._cuda, or a skip when it was not built (no nvcc when moecomm was installed)."""
    if not moecomm.wire.cuda.built("_cuda"):
        pytest.skip("moecomm._cuda was not built (no nvcc at build time)")
    return moecomm.wire.cuda.cuda_module(need_device=False)


@pytest.fixture
def nvshmem_native():
    if not moecomm.wire.cuda.built("_nvshmem"):
        pytest.skip("moecomm._nvshmem was not built (no nvcc or NVSHMEM at build time)")
    return moecomm.wire.cuda.nvshmem_module(need_device=False)
