"""Zero-copy torch views of region memory: of any region (:class:`RegionViews`), and of the
payload parts of a request in a peer's slot, which a writer fills in place.

A client packs its request straight into the server's request slot and a server computes its
answer straight into the client's response slot, when the transport maps the peer's memory
(shm does; nixl does not — there the channel's `send`/`respond` copy from local tensors). The
writer fills the views, then *commits*: the header and the release signal go out only after
every payload byte (`_C.commit_request` / `_C.commit_response`), so the reader sees the same
protocol as for a copied message. The views stay valid while the channel is open, but a writer
must only fill a slot it owns: before the previous answer in that slot was read (client) or
while the request in that slot is being served (server).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecomm import _C
from moecomm.wire.protocol import ENCODING_DTYPE, PAYLOAD_OFFSET, Encoding, scales_per_token
from moecomm.wire.transport import Region

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


# Distinct (tokens, topk, encoding) shapes a loop sends; each layout costs a C++ call to compute.
_LAYOUT_CACHE_MAX = 4096
_layouts: dict[tuple[int, int, int, Encoding], dict] = {}


def request_layout(num_tokens: int, hidden: int, topk: int, encoding: Encoding) -> dict:
    """Byte offsets of a request's payload parts (cached: the serving loop asks for few)."""
    key = (num_tokens, hidden, topk, encoding)
    lay = _layouts.get(key)
    if lay is None:
        if len(_layouts) >= _LAYOUT_CACHE_MAX:
            _layouts.clear()
        lay = _layouts[key] = _C.request_payload_layout(num_tokens, hidden, topk, encoding)
    return lay


def mapped_views(region: Region) -> RegionViews | None:
    """Views of a peer's region when this process maps it, else None (a remote nixl peer)."""
    try:
        return RegionViews(region)
    except (BufferError, RuntimeError, ValueError, TypeError):
        return None


@dataclass
class RequestViews:
    """Where a request's parts go in the server's slot: fill every row of each, then commit."""

    activations: torch.Tensor  # [n, H] in the encoding's wire dtype
    scales: torch.Tensor | None  # [n, S] f32 when quantized
    expert_ids: torch.Tensor  # [n, K] int32
    scores: torch.Tensor  # [n, K] f32


def request_views(
    views: RegionViews, slot_offset: int, n: int, hidden: int, k: int, enc: Encoding
) -> RequestViews:
    """The payload views of an `n`-token request in the slot at `slot_offset`."""
    lay = request_layout(n, hidden, k, enc)
    base = slot_offset + PAYLOAD_OFFSET
    s = scales_per_token(enc, hidden)
    return RequestViews(
        views.get(base + lay["act_offset"], (n, hidden), ENCODING_DTYPE[enc]),
        views.get(base + lay["scale_offset"], (n, s), torch.float32) if s else None,
        views.get(base + lay["ids_offset"], (n, k), torch.int32),
        views.get(base + lay["scores_offset"], (n, k), torch.float32),
    )


def check_request_shape(n: int, k: int, max_tokens: int, max_topk: int, where: str) -> None:
    """The checks a view is made under (commit checks them again before the header goes out)."""
    if not 1 <= n <= max_tokens:
        raise ValueError(f"{where}: a request of {n} tokens is outside [1, {max_tokens}]")
    if not 1 <= k <= max_topk:
        raise ValueError(f"{where}: topk {k} is outside [1, {max_topk}]")
