"""The host side of two rules of the GPU path, checked without a device:

- no device-wide synchronisation while a kernel may spin: the device path's frees are
  stream-ordered (cudaFreeAsync) or put off (csrc/transport/device/deferred_free.h); the
  deferred list is built and exercised here with g++, and no cudaFree is left in the CUDA-IPC
  transport or the kernels outside the two named places;
- every process that may put or wait on a shared GPU loads its kernels before it says ready
  (moecomm.runtime.device_preload): the GPU expert server, the DeviceClient, the DeepEP adapter's
  CUDA path and the tests' peer helper call it before they create their transport, and the real
  moecomm._cuda.preload_kernels answers a machine without a device with a clear error.

On a device, tests/gpu/test_ipc_gpu.py::test_the_free_path_does_not_wait_for_a_spinning_kernel
and tools/probe/join_leave_diag.py check the same rules in action."""

from __future__ import annotations

import ast
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GXX = shutil.which("g++")

DEFERRED_CHECK = r"""
#include <cstdio>
#include <thread>
#include <vector>
#include "transport/device/deferred_free.h"

using moecomm::transport::DeferredFrees;

int main() {
  DeferredFrees frees;
  int cells[64];
  frees.defer(0, nullptr);  // ignored
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 16; ++i) frees.defer(t, &cells[t * 16 + i]);
    });
  }
  for (auto& th : threads) th.join();
  if (frees.pending() != 64) { std::printf("pending %zu\n", frees.pending()); return 1; }
  std::vector<int> seen(64, 0);
  // A free that defers again (a destructor run by a free) must not deadlock: drain frees
  // outside the lock; what it defers waits for the next drain.
  const size_t n = frees.drain([&](int device, void* p) {
    const int i = static_cast<int>(static_cast<int*>(p) - cells);
    if (i / 16 != device) std::printf("pointer %d on device %d\n", i, device);
    seen[i] += 1;
    if (i == 0) frees.defer(9, &cells[0]);
  });
  if (n != 64) { std::printf("drained %zu\n", n); return 1; }
  for (int i = 0; i < 64; ++i) {
    if (seen[i] != 1) {
      std::printf("cell %d freed %d times\n", i, seen[i]);
      return 1;
    }
  }
  if (frees.pending() != 1) { std::printf("re-deferred %zu\n", frees.pending()); return 1; }
  int last_device = -1;
  size_t again = frees.drain([&](int device, void*) { last_device = device; });
  if (again != 1 || last_device != 9 || frees.pending() != 0) return 1;
  if (frees.drain([](int, void*) {}) != 0) return 1;
  std::printf("DEFERRED-OK\n");
  return 0;
}
"""


@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_deferred_frees_free_each_pointer_once_outside_the_lock(tmp_path):
    src = tmp_path / "deferred_check.cc"
    src.write_text(DEFERRED_CHECK)
    exe = tmp_path / "deferred_check"
    build = subprocess.run(
        [GXX, "-std=c++17", "-O1", "-pthread", f"-I{ROOT / 'csrc'}", str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and run.stdout.strip() == "DEFERRED-OK", run.stdout + run.stderr


# The device path: the CUDA-IPC transport and the kernels. Its only cudaFree calls are the
# fallback of stream_free (a device without the stream-ordered allocator) and the deferred frees'
# release, both in cuda_util.h.
DEVICE_PATH = ["csrc/transport/cuda_ipc", "csrc/kernels/cuda"]
CUDA_FREE = re.compile(r"\bcudaFree\s*\(")


def _code(path: Path) -> str:
    """The source without comments (a comment may name cudaFree to say why it is not used)."""
    text = path.read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def test_no_cudafree_on_the_device_path():
    found = []
    for folder in DEVICE_PATH:
        for path in sorted((ROOT / folder).glob("*")):
            if path.suffix in (".cu", ".cuh", ".cc", ".h") and CUDA_FREE.search(_code(path)):
                found.append(path.relative_to(ROOT).as_posix())
    assert found == [], f"cudaFree synchronises the device; use stream_free or defer: {found}"
    util = _code(ROOT / "csrc/transport/device/cuda_util.h")
    assert len(CUDA_FREE.findall(util)) == 3  # DeviceBuffer, stream_free fallback, release
    assert "cudaFreeAsync" in util


def test_the_ipc_region_defers_and_the_probe_and_put_free_in_stream_order():
    ipc = _code(ROOT / "csrc/transport/cuda_ipc/ipc_transport.cu")
    dtor = ipc[ipc.index("IpcRegion::~IpcRegion()") :]
    dtor = dtor[: dtor.index("\n}\n")]
    assert "deferred_frees().defer(device_, ptr_)" in dtor
    probe = _code(ROOT / "csrc/transport/cuda_ipc/ipc_probe.cu")
    release = probe[probe.index("void DeviceWaitProbe::release()") :]
    release = release[: release.index("\n}\n")]
    assert "stream_free(result_dev_" in release
    put = probe[probe.index("void device_put_signal(") :]
    # The staging buffer is the stream-ordered DeviceBuffer (bytes, stream, device).
    assert re.search(r"DeviceBuffer>\([^;]*,\s*s,\s*table\.device\(\)\)", put)


# --- preloading -----------------------------------------------------------------------------


def _first_call_line(source: str, func_path: tuple[str, ...], names: set[str]) -> dict:
    """{name: line of its first call} inside the function at func_path (class, method)."""
    tree = ast.parse(source)
    node = tree
    for part in func_path:
        node = next(
            n
            for n in ast.walk(node)
            if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part
        )
    lines: dict = {}
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in names:
                lines[name] = min(lines.get(name, n.lineno), n.lineno)
    return lines


@pytest.mark.parametrize(
    ("path", "func"),
    [
        ("python/moecomm/runtime/device_server.py", ("DeviceExpertServer", "__init__")),
        ("python/moecomm/runtime/device_client.py", ("DeviceClient", "__init__")),
        ("python/moecomm/compat/low_latency/device.py", ("_Lane", "__init__")),
        ("tests/gpu/ipc_procs.py", ("peer",)),
        ("tools/probe/join_leave_diag.py", ("main",)),
    ],
)
def test_each_process_on_a_shared_gpu_preloads_before_its_transport(path, func):
    """The preload comes before the process's IpcTransport (and so before it hands out a handle
    or says it listens)."""
    got = _first_call_line((ROOT / path).read_text(), func, {"preload_kernels", "IpcTransport"})
    assert "preload_kernels" in got, f"{path}: no preload_kernels call in {func}"
    assert "IpcTransport" in got, f"{path}: no IpcTransport in {func}"
    assert got["preload_kernels"] < got["IpcTransport"], got


def test_preload_without_a_device_says_why_and_can_be_turned_off(monkeypatch):
    """The real module on this machine: no device, a clear error; turned off, nothing runs."""
    cuda = pytest.importorskip("moecomm.wire.cuda")
    if not cuda.built("_cuda"):
        pytest.skip("moecomm._cuda was not built here (no nvcc)")
    if cuda.available():
        pytest.skip("a device is present: test_ipc_gpu.py covers the preload there")
    from moecomm.errors import MoecommError
    from moecomm.runtime import device_preload

    kernels = importlib.import_module("moecomm._cuda")
    monkeypatch.delenv(device_preload.PRELOAD_ENV, raising=False)
    with pytest.raises(MoecommError, match="cuda"):
        device_preload.preload_kernels(kernels, 0)
    assert device_preload.preloaded(0) is None
    monkeypatch.setenv(device_preload.PRELOAD_ENV, "0")
    assert not device_preload.enabled()
    assert device_preload.preload_kernels(kernels, 0) is None


def test_the_join_leave_diagnostic_without_a_device_says_why():
    cuda = pytest.importorskip("moecomm.wire.cuda")
    if cuda.available():
        pytest.skip("a device is present: the gpu-check's joinleave stage runs it")
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools/probe/join_leave_diag.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("JOIN-LEAVE-DIAG "))
    info = json.loads(line.split(" ", 1)[1])
    assert info["variants"] == [] and "no CUDA device" in info["error"]
