"""moecomm: communication and kernels for Mixture-of-Experts serving with disaggregated experts.

Attention clients keep the KV cache; expert servers keep only weights. They talk through
one-sided writes into slot buffers and signal words (see ClientChannel / ServerChannel), with no
collective and no static process group.
"""

from moecomm.errors import (
    MoecommError,
    PeerLostError,
    ProtocolError,
    RemoteError,
    SegmentNotFoundError,
    SystemCallError,
    TimeoutError,
)
from moecomm.protocol import Encoding, SlotLayout, SlotState, ValidateCode
from moecomm.slots import ClientChannel, Request, Response, ServerChannel
from moecomm.transport import ShmTransport, list_segments, reap_stale_segments

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
