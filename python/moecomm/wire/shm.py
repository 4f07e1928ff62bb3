"""Transports and their regions, with zero-copy torch views over region memory."""

from __future__ import annotations

import os

import torch

from moecomm import _C

Region = _C.Region
Transport = _C.Transport
ShmTransport = _C.ShmTransport
SignalOp = _C.SignalOp
WaitOp = _C.WaitOp
WaitStatus = _C.WaitStatus


_ITEMSIZE = {
    d: torch.empty((), dtype=d).element_size()
    for d in (
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
    )
}


def region_bytes_view(region: Region) -> torch.Tensor:
    """The whole region as a uint8 tensor sharing its memory. The tensor keeps the region (and
    so its mapping) alive."""
    return torch.frombuffer(region, dtype=torch.uint8)


def view(
    region_bytes: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """A typed tensor of `shape` at byte `offset` of a region's uint8 view (zero copy)."""
    itemsize = _ITEMSIZE.get(dtype) or torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    nbytes = n * itemsize
    if offset < 0 or offset + nbytes > region_bytes.numel():
        raise ValueError(
            f"view of {nbytes} bytes at offset {offset} exceeds the region "
            f"({region_bytes.numel()} bytes)"
        )
    if offset % itemsize:
        raise ValueError(f"offset {offset} is not aligned to the {itemsize}-byte {dtype}")
    return region_bytes[offset : offset + nbytes].view(dtype).view(shape)


def reap_stale_segments(pid: int = 0) -> int:
    """Removes shm segments whose owning process is gone (all of them, or those of `pid`)."""
    return _C.shm_reap_stale_segments(pid)


def list_segments(pid: int = 0) -> list[str]:
    """Names of moecomm shm segments in /dev/shm (all, or those of `pid`)."""
    return list(_C.shm_list_segments(pid))


class RegionViews:
    """Typed zero-copy views of one region, cached by (offset, shape, dtype): a serving loop asks
    for the same few shapes over and over, and building a view costs several µs of Python."""

    # Far above slots x distinct batch shapes in practice; the bound only stops unbounded growth.
    MAX_ENTRIES = 4096

    def __init__(self, region: Region):
        self.bytes = region_bytes_view(region)
        self._cache: dict = {}

    def get(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (offset, shape, dtype)
        v = self._cache.get(key)
        if v is None:
            if len(self._cache) >= self.MAX_ENTRIES:
                self._cache.clear()
            v = self._cache[key] = view(self.bytes, offset, shape, dtype)
        return v


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


# What `transport=` accepts across the runtime and the CLI: one backend, or "auto" (shm with
# peers that share this host's /dev/shm, nixl with everyone else).
TRANSPORT_CHOICES = ("shm", "nixl", "auto")


def make_transport(
    name: str, host: str | None = None, xfer_timeout_s: float | None = None
) -> Transport:
    """A new transport of backend `name` ("shm" or "nixl"). `host`: the address this process
    serves on (nixl carries bytes over that interface); `xfer_timeout_s`: how long a nixl write
    may wait for a peer that does not take it (stopped, unreachable)."""
    if name == "shm":
        return ShmTransport(spin_ns=shm_spin_ns())
    if name == "nixl":
        from moecomm.nixl import NixlTransport  # optional: pip install 'moecomm[nixl]'

        return NixlTransport(host=host, xfer_timeout_s=xfer_timeout_s)
    raise ValueError(f"unknown transport {name!r}: one of shm, nixl")
