"""The CUDA compile check CI relies on: where nvcc is present, the package build compiled every
library .cu (a broken one fails `make build`), and the GPU check programs under tests/ that only
run on a device still compile here, so they cannot rot on machines without one."""

from __future__ import annotations

import importlib
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA compiler)")
# The first target of the GPU path (see CMakeLists.txt: MOECOMM_CUDA_ARCHITECTURES).
ARCH = "sm_90"


def _nvshmem_include() -> Path | None:
    try:
        import nvidia.nvshmem as wheel
    except ImportError:
        return None
    inc = Path(next(iter(wheel.__path__))) / "include"
    return inc if (inc / "nvshmem.h").exists() else None


@needs_nvcc
def test_cuda_module_was_built_and_imports_without_a_device():
    """With nvcc at build time the package must carry moecomm._cuda; it imports and reports the
    device count instead of failing on a machine with no driver."""
    mod = importlib.import_module("moecomm._cuda")
    count = mod.device_count()
    assert count >= 0
    if count == 0:
        assert mod.no_device_reason()  # says why: no driver, or no device
    assert mod.runtime_version >= 12000


@needs_nvcc
def test_nvshmem_module_was_built_when_nvshmem_is_installed():
    if _nvshmem_include() is None:
        pytest.skip("NVSHMEM (nvidia-nvshmem-cu13 / -cu12) is not installed in this Python")
    importlib.import_module("moecomm._nvshmem")


CHECK_PROGRAMS = sorted(ROOT.glob("tests/**/*.cu"))


@needs_nvcc
@pytest.mark.parametrize("source", CHECK_PROGRAMS, ids=[p.name for p in CHECK_PROGRAMS])
def test_gpu_check_program_compiles(source, tmp_path):
    cmd = [NVCC, "-std=c++17", f"-arch={ARCH}", "-rdc=true", f"-I{ROOT / 'csrc'}", "-c"]
    inc = _nvshmem_include()
    if inc is not None:
        cmd.append(f"-I{inc}")
    run = subprocess.run(
        [*cmd, str(source), "-o", str(tmp_path / "check.o")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
