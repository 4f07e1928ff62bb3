"""Writes into another process's memory on the same host: Linux cross-memory attach
(``process_vm_writev``), the path to KV tensors an engine allocated itself (vLLM, SGLang), which
no shared-memory region can expose. One syscall moves a whole layer (one iovec per contiguous
run and part, up to the kernel's IOV_MAX per call): each KV byte is copied once, from the
sender's memory into the receiver's, by the kernel.

The kernel allows it when the sender may ptrace the receiver: same uid (and the receiver
dumpable), or CAP_SYS_PTRACE (root). Under Yama ``ptrace_scope=1`` a non-root sender also needs
the receiver to name it with ``prctl(PR_SET_PTRACER, sender_pid)`` (:func:`allow_writer`, called
by the receiving pool when it connects to a sender and when it expects a transfer). The process
identity a peer is checked against (:func:`host_id`) is the boot id and the PID namespace: a pid
means the same process only inside both."""

from __future__ import annotations

import ctypes
import errno
import os
from array import array
from collections.abc import Sequence

from moecomm.errors import PeerLostError
from moecomm.wire.kv.layout import BlockTransferError

# Linux's UIO_MAXIOV: the most iovecs one process_vm_writev takes on either side.
IOV_MAX = 1024
# prctl option of Yama (include/uapi/linux/prctl.h): "let this pid ptrace me".
PR_SET_PTRACER = 0x59616D61
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_writev = _libc.process_vm_writev
_writev.restype = ctypes.c_ssize_t
_writev.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(_Iovec),
    ctypes.c_ulong,
    ctypes.POINTER(_Iovec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_prctl = _libc.prctl
_prctl.restype = ctypes.c_int
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class CmaError(BlockTransferError):
    """A cross-memory write the kernel refused (permission, or an address the receiver does
    not map); `errno` says which."""

    def __init__(self, message: str, err: int):
        super().__init__(message)
        self.errno = err


def host_id() -> str:
    """This host's boot id and this process's PID namespace: two pools may use each other's
    pids (and write into each other's memory) only when these are equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError as exc:  # not Linux, or /proc hidden: no same-host path then
        return f"unknown:{exc.errno}"
    return f"{boot}/{pidns}"


def yama_scope() -> int | None:
    """Yama's ptrace_scope (None: Yama is not in this kernel)."""
    try:
        with open(YAMA_SCOPE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def allow_writer(pid: int) -> None:
    """Lets process `pid` write into this one's memory under Yama ptrace_scope=1. Yama keeps
    one such pid per process: the last call wins. A kernel without Yama needs nothing."""
    if pid <= 0 or pid == os.getpid():
        return
    if _prctl(PR_SET_PTRACER, pid, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:  # EINVAL: no Yama, nothing to allow
            raise CmaError(f"kv: prctl(PR_SET_PTRACER, {pid}) failed: {os.strerror(err)}", err)


def write(pid: int, pieces: Sequence[tuple[int, int, int]]) -> int:
    """Copies each (local address, remote address, bytes) piece into process `pid`; returns the
    bytes written. Raises PeerLostError when `pid` is gone, CmaError when the kernel refuses
    (EPERM: not allowed to; EFAULT: an address the receiver does not map)."""
    total_written = 0
    for start in range(0, len(pieces), IOV_MAX):
        batch = pieces[start : start + IOV_MAX]
        n = len(batch)
        # iovec arrays straight from flat (base, len) arrays: building n ctypes Structures one
        # by one costs more than the copy itself for a layer of small scattered blocks.
        local_flat = array("Q", [v for src, _, size in batch for v in (src, size)])
        remote_flat = array("Q", [v for _, dst, size in batch for v in (dst, size)])
        local = (_Iovec * n).from_buffer(local_flat)
        remote = (_Iovec * n).from_buffer(remote_flat)
        want = sum(size for _, _, size in batch)
        got = _writev(pid, local, n, remote, n, 0)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.ESRCH:
                raise PeerLostError(f"kv: the receiving process {pid} is gone (ESRCH)")
            raise CmaError(_explain(pid, err), err)
        if got != want:
            # The kernel stops at the first remote iovec it cannot write.
            raise CmaError(
                f"kv: process_vm_writev into pid {pid} wrote {got} of {want} bytes: the "
                "receiver's pool info names memory it does not map",
                errno.EFAULT,
            )
        total_written += got
    return total_written


def _explain(pid: int, err: int) -> str:
    what = f"kv: process_vm_writev into pid {pid} failed: {errno.errorcode.get(err, err)} "
    what += f"({os.strerror(err)})"
    if err == errno.EPERM:
        scope = yama_scope()
        what += (
            ": this process may not write the receiver's memory (it needs the receiver's uid, "
            "or CAP_SYS_PTRACE"
        )
        if scope == 1:
            what += "; under Yama ptrace_scope=1 the receiver must allow this pid, which its "
            what += "KvPeer does on connect/expect"
        elif scope is not None and scope >= 2:
            what += f"; Yama ptrace_scope={scope} allows only CAP_SYS_PTRACE"
        what += ")"
    elif err == errno.EFAULT:
        what += ": an address in the receiver's pool info is not mapped there"
    return what
