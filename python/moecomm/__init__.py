"""moecomm: communication and kernels for Mixture-of-Experts serving with disaggregated experts.

Attention clients keep the KV cache; expert servers keep only weights. They talk through
one-sided writes into slot buffers and signal words (see ClientChannel / ServerChannel), with no
collective and no static process group.
"""

import importlib

from moecomm.errors import (
    MoecommError,
    PeerLostError,
    ProtocolError,
    RemoteError,
    SegmentNotFoundError,
    SystemCallError,
    TimeoutError,
)

# The rest needs torch: loaded on first use, so light processes (the membership monitor) start
# without importing it.
_LAZY = {
    "Encoding": "moecomm.protocol",
    "SlotLayout": "moecomm.protocol",
    "SlotState": "moecomm.protocol",
    "ValidateCode": "moecomm.protocol",
    "ClientChannel": "moecomm.slots",
    "Request": "moecomm.slots",
    "Response": "moecomm.slots",
    "ServerChannel": "moecomm.slots",
    "ShmTransport": "moecomm.transport",
    "list_segments": "moecomm.transport",
    "reap_stale_segments": "moecomm.transport",
}


_SUBMODULES = {
    "cuda",
    "eplb",
    "membership",
    "ops",
    "protocol",
    "runtime",
    "slots",
    "testing",
    "transport",
}


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
    "TimeoutError",
    "ValidateCode",
    "list_segments",
    "reap_stale_segments",
]
