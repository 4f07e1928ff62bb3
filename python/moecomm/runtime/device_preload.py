"""Loading moecomm's device kernels before a process says it is ready: ``preload_kernels``.

With lazy module loading (CUDA's default since 12.2) a kernel is loaded on its first launch.
On a GPU shared with another process whose kernel spins on a device wait (a server's client
combining, a second DeepEP rank waiting, a test's probe), a process that joins cold then loads
modules, maps IPC memory and launches for the first time while that kernel runs; on 2026-11-28
such a join was never seen by the spinning wait (tests/gpu/test_ipc_gpu.py, join/leave; the
diagnostic tools/probe/join_leave_diag.py compares cold and warm joins). So every process that
may put or wait on a shared GPU calls this before it says ready: the GPU expert server, the
DeviceClient, the DeepEP adapter's CUDA path and the tests' probe helpers.

Once per (process, device); ``MOECOMM_PRELOAD_KERNELS=0`` turns it off (the diagnostic's cold
variant runs the same code paths without it).
"""

from __future__ import annotations

import os
import threading
from types import ModuleType

PRELOAD_ENV = "MOECOMM_PRELOAD_KERNELS"
_lock = threading.Lock()
_done: dict[int, dict] = {}


def enabled() -> bool:
    """Whether preloading is on (the default; ``MOECOMM_PRELOAD_KERNELS=0`` turns it off)."""
    return os.environ.get(PRELOAD_ENV, "1").strip() not in ("0", "false", "no", "off")


def preload_kernels(kernels: ModuleType, device: int) -> dict | None:
    """Loads every kernel of ``kernels`` (``moecomm._cuda``) on ``device`` now, once per process
    and device; its report ({device, functions, loaded_now, seconds, how}), or None when turned
    off. Never synchronises the device. Raises what the module raises (no device: a clear
    error)."""
    if not enabled():
        return None
    with _lock:
        if device not in _done:
            _done[device] = dict(kernels.preload_kernels(device))
        return _done[device]


def preloaded(device: int) -> dict | None:
    """The report of this process's preload of ``device``, or None when it has not run."""
    with _lock:
        return _done.get(device)
