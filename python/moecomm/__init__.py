"""moecomm: communication and kernels for Mixture-of-Experts serving with disaggregated experts.

Attention clients keep the KV cache; expert servers keep only weights. They talk through
one-sided writes into slot buffers and signal words (see ClientChannel / ServerChannel), with no
collective and no static process group.
"""

import importlib

from moecomm.errors import (
    DeadlineExceededError,
    MoecommError,
    PeerLostError,
    ProtocolError,
    RemoteError,
    SegmentNotFoundError,
    SystemCallError,
)

# The rest needs torch: loaded on first use, so light processes (the membership monitor) start
# without importing it.
_LAZY = {
    "Encoding": "moecomm.wire.protocol",
    "SlotLayout": "moecomm.wire.protocol",
    "SlotState": "moecomm.wire.protocol",
    "ValidateCode": "moecomm.wire.protocol",
    "ClientChannel": "moecomm.wire.client",
    "Request": "moecomm.wire.server",
    "Response": "moecomm.wire.client",
    "ServerChannel": "moecomm.wire.server",
    "ShmTransport": "moecomm.wire.shm",
    "list_segments": "moecomm.wire.shm",
    "reap_stale_segments": "moecomm.wire.shm",
}


_SUBMODULES = {"eplb", "membership", "ops", "runtime", "testing", "wire"}


def __getattr__(name: str):
    if name in _SUBMODULES:  # `import moecomm; moecomm.ops.quantize(...)` keeps working
        return importlib.import_module(f"moecomm.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'moecomm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "ClientChannel",
    "DeadlineExceededError",
    "Encoding",
    "MoecommError",
    "PeerLostError",
    "ProtocolError",
    "RemoteError",
    "Request",
    "Response",
    "SegmentNotFoundError",
    "ServerChannel",
    "ShmTransport",
    "SlotLayout",
    "SlotState",
    "SystemCallError",
    "ValidateCode",
    "list_segments",
    "reap_stale_segments",
]
