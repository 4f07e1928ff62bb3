"""The shared-memory transport: the slot protocol between processes of one host, over /dev/shm
segments, with futex waits; and the reaping of segments whose owner died."""

from __future__ import annotations

import os

from moecomm import _C

ShmTransport = _C.ShmTransport


def reap_stale_segments(pid: int = 0) -> int:
    """Removes shm segments whose owning process is gone (all of them, or those of `pid`)."""
    return _C.shm_reap_stale_segments(pid)


def list_segments(pid: int = 0) -> list[str]:
    """Names of moecomm shm segments in /dev/shm (all, or those of `pid`)."""
    return list(_C.shm_list_segments(pid))


# How long an shm waiter spins before it sleeps on the futex, in µs (default: the transport's,
# 50 µs). Spinning pays off when every waiting process has a core of its own; on a host with
# fewer cores than busy processes a spinning waiter takes the core its peer needs.
SHM_SPIN_ENV = "MOECOMM_SHM_SPIN_US"


def shm_spin_ns() -> int:
    """The shm spin of this process: MOECOMM_SHM_SPIN_US, else the transport's default."""
    raw = os.environ.get(SHM_SPIN_ENV, "")
    if not raw:
        return int(_C.SHM_DEFAULT_SPIN_NS)
    try:
        us = float(raw)
    except ValueError:
        raise ValueError(f"{SHM_SPIN_ENV} must be a number of µs, got {raw!r}") from None
    if not 0 <= us <= 1e6:
        raise ValueError(f"{SHM_SPIN_ENV} must be in [0, 1e6] µs, got {raw!r}")
    return int(us * 1000)
