"""Exceptions raised by moecomm, and the shared ones themselves.

Every exception moecomm and moecomm_serving define derives from :class:`MoecommError`, is named
``…Error``, and also derives from the builtin a caller would catch anyway (``TimeoutError``,
``ConnectionError``, ``ValueError``, ...). docs/errors.md lists them all, with what each means and
what to do about it. This module holds the ones more than one layer raises: the native ones
(created by moecomm._C, so that errors thrown in C++ arrive as these classes) and the errors of a
peer's answer. An error only one part raises is defined beside the code that raises it.

A renamed error keeps its old name as a deprecated alias: :func:`deprecated_aliases` builds the
module-level ``__getattr__`` that answers the old name with the new class and a warning.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

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


# {module: {old name: new name}} of every alias deprecated_aliases() has installed, for the test
# that checks each one warns and answers the very class.
DEPRECATED_ALIASES: dict[str, dict[str, str]] = {}


def deprecated_aliases(module: str, renamed: dict[str, str]) -> Callable[[str], object]:
    """A module-level ``__getattr__`` for `module` (its ``__name__``) answering each old name of
    `renamed` with the object the module now holds under the new name, with a
    DeprecationWarning; any other name raises AttributeError as a module would. A module with a
    ``__getattr__`` of its own calls it last, with ``stacklevel=3`` (the warning then names the
    importing line, not that ``__getattr__``)."""
    DEPRECATED_ALIASES[module] = dict(renamed)

    def __getattr__(name: str, stacklevel: int = 2) -> object:
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is deprecated; use {module}.{new}",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        return getattr(sys.modules[module], new)

    return __getattr__


__getattr__ = deprecated_aliases(__name__, {"TimeoutError": "DeadlineExceededError"})

__all__ = [
    "DeadlineExceededError",
    "MoecommError",
    "PeerLostError",
    "PeerOfflineError",
    "ProtocolError",
    "RemoteError",
    "SegmentNotFoundError",
    "SystemCallError",
    "deprecated_aliases",
]
