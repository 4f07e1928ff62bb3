"""Exceptions raised by moecomm. The native ones are created by moecomm._C so that errors thrown
in C++ arrive as these classes; each also derives from the builtin a caller would catch anyway."""

from moecomm._C import (
    MoecommError,
    PeerLostError,
    ProtocolError,
    SegmentNotFoundError,
    SystemCallError,
    TimeoutError,
)


class RemoteError(MoecommError):
    """The peer answered with an error response (its status and reason are attached)."""

    def __init__(self, status: int, reason: str, where: str = ""):
        self.status = status
        self.reason = reason
        super().__init__(f"{where}remote error {status}: {reason}")


class PeerOfflineError(PeerLostError):
    """The peer is alive but marked our slots OFFLINE: it stopped serving us (it is stopping,
    its loop failed, or it dropped our session). A client may reconnect at once."""


__all__ = [
    "MoecommError",
    "PeerLostError",
    "PeerOfflineError",
    "ProtocolError",
    "RemoteError",
    "SegmentNotFoundError",
    "SystemCallError",
    "TimeoutError",
]
