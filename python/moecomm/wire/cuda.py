"""The GPU side of moecomm: is there a device, and the native GPU modules, loaded lazily.

``moecomm`` imports on a machine without CUDA; this module too. Device discovery goes through
cuda-python (``cuda.bindings.runtime``), which returns an error tuple rather than raising when
there is no driver, and falls back to ``moecomm._cuda`` when cuda-python is not installed.

``cuda_module()`` / ``nvshmem_module()`` return ``moecomm._cuda`` / ``moecomm._nvshmem`` or
raise :class:`GpuUnavailableError` saying which of two things is wrong: the module was not
built (no nvcc, or no NVSHMEM, when moecomm was installed), or it was built but this process
sees no device.
"""

from __future__ import annotations

import ctypes
import importlib
import os
from types import ModuleType

from moecomm.errors import MoecommError

# sizeof(cudaIpcMemHandle_t) (CUDA_IPC_HANDLE_SIZE).
IPC_HANDLE_BYTES = 64
# Multiplies every device-side deadline (client combine waits, the server's arrival wait, the
# adapter's gathers). Device deadlines count wall time, so a process run under compute-sanitizer
# (10-100x slower kernels) or a debugger would otherwise time out and evict healthy peers.
DEADLINE_SCALE_ENV = "MOECOMM_DEVICE_DEADLINE_SCALE"
# How long a server-side gather (the GPU expert server's, the DeepEP adapter's) waits for the
# payload of a request whose header already arrived before leaving it for the next pass (a chunk
# in flight over NVLink lands in microseconds); times the deadline scale, see arrival_timeout_ns.
ARRIVAL_TIMEOUT_NS = 20_000

_BUILD_HINT = {
    "_cuda": "nvcc was not found when moecomm was built; install a CUDA toolkit and rebuild "
    "(MOECOMM_WITH_CUDA=ON turns a missing nvcc into a build error)",
    "_nvshmem": "nvcc or NVSHMEM was not found when moecomm was built; install "
    "nvidia-nvshmem-cu13 (or -cu12, or set NVSHMEM_HOME) and rebuild",
}


class GpuUnavailableError(MoecommError):
    """A GPU feature was asked for where it cannot run: the native module was not built, or
    there is no usable CUDA device."""


def _runtime():
    """cuda.bindings.runtime, or None when cuda-python is not installed."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    return runtime


def _import_native(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"moecomm.{name}")
    except ModuleNotFoundError:
        return None


def _device_count_and_reason() -> tuple[int, str]:
    rt = _runtime()
    if rt is not None:
        err, n = rt.cudaGetDeviceCount()
        if err != rt.cudaError_t.cudaSuccess:
            _, text = rt.cudaGetErrorString(err)
            return 0, f"{err.name}: {text.decode() if isinstance(text, bytes) else text}"
        return (n, "") if n > 0 else (0, "no CUDA device visible")
    native = _import_native("_cuda")
    if native is not None:
        n = native.device_count()
        return n, native.no_device_reason() if n == 0 else ""
    return 0, "neither cuda-python (cuda-bindings) nor moecomm._cuda is available"


def device_count() -> int:
    """CUDA devices visible to this process; 0 without a driver or device."""
    return _device_count_and_reason()[0]


def available() -> bool:
    """True when at least one CUDA device is usable."""
    return device_count() > 0


def why_unavailable() -> str | None:
    """Why no GPU can be used (the CUDA error, or what is missing); None when one can."""
    n, reason = _device_count_and_reason()
    return None if n > 0 else reason


def deadline_scale() -> float:
    """The factor ``MOECOMM_DEVICE_DEADLINE_SCALE`` sets on every device deadline (1.0 when
    unset). Read at each call, so a test can set it for one process; a value that is not a
    positive number is an error, not a silent 1.0."""
    raw = os.environ.get(DEADLINE_SCALE_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"{DEADLINE_SCALE_ENV} must be a positive number, got {raw!r}")
    return scale


def arrival_timeout_ns() -> int:
    """A gather's payload wait (``ARRIVAL_TIMEOUT_NS``) scaled by :func:`deadline_scale`
    (sanitizers and debuggers slow the writer down)."""
    return int(ARRIVAL_TIMEOUT_NS * deadline_scale())


def built(name: str = "_cuda") -> bool:
    """Whether the native module `name` ('_cuda' or '_nvshmem') was built into this install."""
    _check_name(name)
    return _import_native(name) is not None


def _check_name(name: str) -> None:
    if name not in _BUILD_HINT:
        raise ValueError(f"unknown native GPU module {name!r}; expected one of {list(_BUILD_HINT)}")


def _load(name: str, need_device: bool) -> ModuleType:
    module = _import_native(name)
    if module is None:
        raise GpuUnavailableError(f"moecomm.{name} was not built: {_BUILD_HINT[name]}")
    if need_device:
        reason = why_unavailable()
        if reason is not None:
            raise GpuUnavailableError(f"moecomm.{name} is built, but there is no device: {reason}")
    return module


def cuda_module(need_device: bool = True) -> ModuleType:
    """moecomm._cuda (CUDA-IPC transport, device kernels). With need_device=False the module is
    returned on a machine without a GPU too (its functions then raise clear errors)."""
    return _load("_cuda", need_device)


def nvshmem_module(need_device: bool = True) -> ModuleType:
    """moecomm._nvshmem (NVSHMEM bootstrap, symmetric regions, peer table)."""
    return _load("_nvshmem", need_device)


def _check(result: tuple, what: str):
    rt = _runtime()
    err, *rest = result
    if err != rt.cudaError_t.cudaSuccess:
        _, text = rt.cudaGetErrorString(err)
        msg = text.decode() if isinstance(text, bytes) else text
        raise GpuUnavailableError(f"{what} failed: {err.name}: {msg}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def _require_runtime():
    rt = _runtime()
    if rt is None:
        raise GpuUnavailableError("cuda-python is not installed (pip install 'cuda-bindings>=13')")
    return rt


def ipc_handle(ptr: int) -> bytes:
    """The 64-byte CUDA IPC handle of device allocation `ptr` (cudaIpcGetMemHandle). The raw
    handle; moecomm's transport handles (IpcTransport regions) also carry node and owner."""
    if not isinstance(ptr, int) or ptr <= 0:
        raise ValueError(f"ptr must be a positive device address, got {ptr!r}")
    rt = _require_runtime()
    handle = _check(rt.cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def open_ipc_handle(handle: bytes) -> int:
    """Maps another process's allocation (cudaIpcOpenMemHandle, lazy peer access); returns the
    device address. Close it with close_ipc_handle. Not for a handle of this same process."""
    if not isinstance(handle, (bytes, bytearray)) or len(handle) != IPC_HANDLE_BYTES:
        size = len(handle) if isinstance(handle, (bytes, bytearray)) else type(handle).__name__
        raise ValueError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, got {size}")
    rt = _require_runtime()
    h = rt.cudaIpcMemHandle_t()
    ctypes.memmove(h.getPtr(), bytes(handle), IPC_HANDLE_BYTES)
    ptr = _check(
        rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"
    )
    return int(ptr)


def close_ipc_handle(ptr: int) -> None:
    """Unmaps an address returned by open_ipc_handle."""
    rt = _require_runtime()
    _check((*rt.cudaIpcCloseMemHandle(ptr), None), "cudaIpcCloseMemHandle")


__all__ = [
    "IPC_HANDLE_BYTES",
    "GpuUnavailableError",
    "available",
    "built",
    "close_ipc_handle",
    "cuda_module",
    "deadline_scale",
    "device_count",
    "ipc_handle",
    "nvshmem_module",
    "open_ipc_handle",
    "why_unavailable",
]
