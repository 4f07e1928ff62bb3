"""Expert weights moved between servers over the transport (for live re-placement).

The server that hosts an expert exports a copy into a region of its transport (w1 | w3 | w2,
contiguous) and answers the region's handle; the server that loads the expert attaches the region,
copies the weights out and tells the exporter to release it. A batch of experts travels the same
way in one region (one export, one read, one release for all of them). Over shm that is one
memcpy on the same host; over a network transport the same exchange becomes a one-sided READ of
registered memory, with no weights in the HTTP messages. An export nobody releases (the reader
died) is freed after EXPORT_TTL_S.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time

import httpx
import torch

from moecomm.runtime.experts import ExpertWeights
from moecomm.wire.transport import Region, Transport
from moecomm.wire.views import region_bytes_view, view

# An export is freed this long after it was made even if its reader never released it.
EXPORT_TTL_S = 60.0
# At most this many exports live at once: each holds a copy of an expert.
MAX_EXPORTS = 64
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WeightExports:
    """The exporting side: regions holding copies of hosted experts until their reader is done."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._lock = threading.Lock()
        self._live: dict[str, tuple[Region, float]] = {}

    def export(self, w: ExpertWeights, transport: Transport | None = None) -> dict:
        parts = (w.w1, w.w3, w.w2)
        nbytes = sum(t.numel() * t.element_size() for t in parts)
        with self._lock:
            self._expire()
            if len(self._live) >= MAX_EXPORTS:
                raise RuntimeError(f"{MAX_EXPORTS} weight exports are already waiting for readers")
        region = (transport or self.transport).create_region(nbytes)
        raw, offset = region_bytes_view(region), 0
        for t in parts:
            dst = view(raw, offset, tuple(t.shape), t.dtype)
            dst.copy_(t)
            offset += t.numel() * t.element_size()
        export_id = secrets.token_hex(8)
        with self._lock:
            self._live[export_id] = (region, time.monotonic() + EXPORT_TTL_S)
        return {
            "export_id": export_id,
            "handle": region.handle,
            "dtype": _dtype_name(w.w1.dtype),
            "intermediate": w.intermediate,
            "hidden": w.hidden,
            "bytes": nbytes,
        }

    def export_many(self, ws: list[ExpertWeights], transport: Transport | None = None) -> dict:
        """Copies every expert of `ws` into one region, back to back (each w1 | w3 | w2);
        answers the handle and, per expert, its offset and shape."""
        if not ws:
            raise ValueError("no expert to export")
        with self._lock:
            self._expire()
            if len(self._live) >= MAX_EXPORTS:
                raise RuntimeError(f"{MAX_EXPORTS} weight exports are already waiting for readers")
        parts_of = [(w.w1, w.w3, w.w2) for w in ws]
        sizes = [sum(t.numel() * t.element_size() for t in parts) for parts in parts_of]
        region = (transport or self.transport).create_region(sum(sizes))
        raw, offset, experts = region_bytes_view(region), 0, []
        for w, parts, size in zip(ws, parts_of, sizes, strict=True):
            experts.append(
                {
                    "offset": offset,
                    "bytes": size,
                    "dtype": _dtype_name(w.w1.dtype),
                    "intermediate": w.intermediate,
                    "hidden": w.hidden,
                }
            )
            for t in parts:
                view(raw, offset, tuple(t.shape), t.dtype).copy_(t)
                offset += t.numel() * t.element_size()
        export_id = secrets.token_hex(8)
        with self._lock:
            self._live[export_id] = (region, time.monotonic() + EXPORT_TTL_S)
        return {
            "export_id": export_id,
            "handle": region.handle,
            "bytes": sum(sizes),
            "experts": experts,
        }

    def release(self, export_id: str) -> bool:
        with self._lock:
            entry = self._live.pop(export_id, None)
        if entry is not None:
            entry[0].close()
        return entry is not None

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, (_, until) in self._live.items() if until <= now]:
            self._live.pop(key)[0].close()

    def close(self) -> None:
        with self._lock:
            live, self._live = self._live, {}
        for region, _ in live.values():
            region.close()


def _shape(info: dict) -> tuple[torch.dtype, int, int]:
    dtype = _DTYPES.get(str(info["dtype"]))
    if dtype is None:
        raise ValueError(f"exported weights have an unknown dtype {info['dtype']!r}")
    i, h = int(info["intermediate"]), int(info["hidden"])
    if i <= 0 or h <= 0:
        raise ValueError(f"exported weights have a bad shape: intermediate {i}, hidden {h}")
    return dtype, i, h


def _expert_at(raw: torch.Tensor, offset: int, info: dict) -> ExpertWeights:
    """The expert stored at `offset` of `raw` (view() checks every part against its size)."""
    dtype, i, h = _shape(info)
    item = torch.empty((), dtype=dtype).element_size()
    w1 = view(raw, offset, (i, h), dtype)
    w3 = view(raw, offset + i * h * item, (i, h), dtype)
    w2 = view(raw, offset + 2 * i * h * item, (h, i), dtype)
    return ExpertWeights(w1, w3, w2)


def read_export_many(transport: Transport, info: dict) -> list[ExpertWeights]:
    """Attaches a batch export (WeightExports.export_many) and copies it out in one read."""
    shapes = info.get("experts")
    if not isinstance(shapes, list) or not shapes:
        raise ValueError("a batch export lists no experts")
    region = transport.attach(str(info["handle"]))
    try:
        raw = torch.empty(region.size, dtype=torch.uint8)
        transport.read(region, 0, raw.data_ptr(), region.size)
    finally:
        region.close()
    return [_expert_at(raw, int(e["offset"]), e) for e in shapes]


def read_export(transport: Transport, info: dict) -> ExpertWeights:
    """Attaches an exported region and copies the expert out (the region can go right after)."""
    dtype = _DTYPES.get(str(info["dtype"]))
    if dtype is None:
        raise ValueError(f"exported weights have an unknown dtype {info['dtype']!r}")
    i, h = int(info["intermediate"]), int(info["hidden"])
    if i <= 0 or h <= 0:
        raise ValueError(f"exported weights have a bad shape: intermediate {i}, hidden {h}")
    region = transport.attach(str(info["handle"]))
    try:
        # One copy through the transport (of mapped memory on shm, one-sided READs over nixl)
        # into memory of our own, which the three weights then view. view() checks every part
        # against the region's size.
        raw = torch.empty(region.size, dtype=torch.uint8)
        transport.read(region, 0, raw.data_ptr(), region.size)
        item = torch.empty((), dtype=dtype).element_size()
        w1 = view(raw, 0, (i, h), dtype)
        w3 = view(raw, i * h * item, (i, h), dtype)
        w2 = view(raw, 2 * i * h * item, (h, i), dtype)
    finally:
        region.close()
    return ExpertWeights(w1, w3, w2)


def pull_from_peer(
    transport: Transport, peer_url: str, layer: int, expert: int, token: str, timeout: float
) -> ExpertWeights:
    """Asks the server at `peer_url` to export (layer, expert) and reads it over `transport`."""
    body = {"layer": layer, "expert": expert, "token": token, "transport": transport.name}
    r = httpx.post(f"{peer_url}/experts/export", json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"{peer_url} cannot export layer {layer} expert {expert}: {r.text}")
    info = r.json()
    try:
        return read_export(transport, info)
    finally:
        release = {"export_id": info.get("export_id", ""), "token": token}
        # A release that does not arrive is freed by the exporter after EXPORT_TTL_S.
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{peer_url}/experts/export/release", json=release, timeout=timeout)


def pull_many_from_peer(
    transport: Transport,
    peer_url: str,
    items: list[tuple[int, int]],
    token: str,
    timeout: float,
) -> list[ExpertWeights]:
    """Asks the server at `peer_url` to export every (layer, expert) of `items` into one region
    and reads them over `transport` in one read; the weights in the order asked."""
    body = {
        "experts": [{"layer": la, "expert": e} for la, e in items],
        "token": token,
        "transport": transport.name,
    }
    with httpx.Client(timeout=timeout) as http:
        r = http.post(f"{peer_url}/experts/export_batch", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{peer_url} cannot export {items}: {r.text}")
        info = r.json()
        try:
            ws = read_export_many(transport, info)
        finally:
            release = {"export_id": info.get("export_id", ""), "token": token}
            # A release that does not arrive is freed by the exporter after EXPORT_TTL_S.
            with contextlib.suppress(httpx.HTTPError):
                http.post(f"{peer_url}/experts/export/release", json=release)
    if len(ws) != len(items):
        raise RuntimeError(f"{peer_url} exported {len(ws)} experts, {len(items)} asked for")
    return ws
