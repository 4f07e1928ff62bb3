"""The transport interface every backend implements (csrc/transport/transport.h): regions a peer
attaches to by handle, one-sided puts, 64-bit signal words, waits with deadlines. The backends are
shm.py (one host), nixl.py (across hosts) and the CUDA-IPC / NVSHMEM transports of cuda.py."""

from __future__ import annotations

from moecomm import _C

Region = _C.Region
Transport = _C.Transport
SignalOp = _C.SignalOp
WaitOp = _C.WaitOp
WaitStatus = _C.WaitStatus
