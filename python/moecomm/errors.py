"""Exceptions raised by moecomm, and the shared ones themselves.

Every exception moecomm and moecomm_serving define derives from :class:`MoecommError`, is named
``…Error``, and also derives from the builtin a caller would catch anyway (``TimeoutError``,
``ConnectionError``, ``ValueError``, ...). docs/errors.md lists them all, with what each means and
what to do about it. This module holds the ones more than one layer raises: the native ones
(created by moecomm._C, so that errors thrown in C++ arrive as these classes) and the errors of a
peer's answer. An error only one part raises is defined beside the code that raises it.
"""

from __future__ import annotations

from moecomm._C import (
    DeadlineExceededError,
    MoecommError,
    PeerLostError,
    ProtocolError,
    SegmentNotFoundError,
    SystemCallError,
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
    "DeadlineExceededError",
    "MoecommError",
    "PeerLostError",
    "PeerOfflineError",
    "ProtocolError",
    "RemoteError",
    "SegmentNotFoundError",
    "SystemCallError",
]
