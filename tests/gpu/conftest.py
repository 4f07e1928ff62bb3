"""GPU transport tests. Tests marked ``gpu`` need a CUDA device as moecomm sees it
(``moecomm.cuda.available()``, through cuda-python or moecomm._cuda), not torch's view: torch may
be a CPU build on a GPU machine. Everything else here runs on any machine."""

from __future__ import annotations

import moecomm.cuda
import pytest


def pytest_collection_modifyitems(config, items):
    reason = moecomm.cuda.why_unavailable()
    for item in items:
        if "tests/gpu/" in item.nodeid and item.get_closest_marker("gpu") and reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA device: {reason}"))


@pytest.fixture
def cuda_native():
    """moecomm._cuda, or a skip when it was not built (no nvcc when moecomm was installed)."""
    if not moecomm.cuda.built("_cuda"):
        pytest.skip("moecomm._cuda was not built (no nvcc at build time)")
    return moecomm.cuda.cuda_module(need_device=False)


@pytest.fixture
def nvshmem_native():
    if not moecomm.cuda.built("_nvshmem"):
        pytest.skip("moecomm._nvshmem was not built (no nvcc or NVSHMEM at build time)")
    return moecomm.cuda.nvshmem_module(need_device=False)
