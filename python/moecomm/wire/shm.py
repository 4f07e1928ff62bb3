"""The shared-memory transport: the slot protocol between processes of one host, over /dev/shm
segments, with futex waits; and the reaping of segments whose owner died.

A waiter notices its peer's death through the peer's life word (csrc/transport/shm/process.h):
a robust futex the kernel marks and wakes as the peer dies, slept on together with the waited
word, so a death ends a wait at once. ``MOECOMM_SHM_DEATH_WATCH=poll`` turns that off in this
process (and the processes it starts): death is then seen by the 20 ms liveness poll alone,
the detection before life words (bench/recovery/chaos_reroute.py measures the two side by side)."""

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


# How a waiting process notices its shm peer's death: "futex" (default: the peer's life word wakes
# it) or "poll" (the /proc liveness poll every 20 ms only).
SHM_DEATH_WATCH_ENV = "MOECOMM_SHM_DEATH_WATCH"
DEATH_WATCH_MODES = ("futex", "poll")


def death_watch_mode() -> str:
    """This process's MOECOMM_SHM_DEATH_WATCH (default "futex"); a bad value is an error."""
    raw = os.environ.get(SHM_DEATH_WATCH_ENV, "") or "futex"
    if raw not in DEATH_WATCH_MODES:
        raise ValueError(f"{SHM_DEATH_WATCH_ENV} must be one of {DEATH_WATCH_MODES}, got {raw!r}")
    return raw


# Read once, when the transport module loads: every ShmTransport made afterwards follows it.
_C.shm_set_default_watch_death(death_watch_mode() == "futex")
