"""A KV pool: an engine's paged KV cache in transport memory (or the engine's own tensors,
registered), which peers write blocks into, with the completion slots of the transfers it
receives (claimed by :meth:`KvPeer.expect`, freed by :meth:`KvRecv.release`) and the doorbell
its senders ring."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from moecomm.wire.kv.cma import host_id
from moecomm.wire.kv.layout import DTYPES, BlockTransferError, KvLayout
from moecomm.wire.kv.metadata import MEMORY_PARTS, MEMORY_PROCESS, MEMORY_REGION, KvPoolInfo
from moecomm.wire.kv.words import MAX_SEQ, Geometry
from moecomm.wire.mailbox import Doorbells
from moecomm.wire.transport import Region, SignalOp, Transport
from moecomm.wire.views import region_bytes_view, view

if TYPE_CHECKING:
    from moecomm.wire.kv.transfer import KvPeer

# Transfers a pool can receive at once (each holds one completion slot). An engine keeps a few
# requests in flight per peer; 256 is far above that and costs 256 small slots.
DEFAULT_MAX_TRANSFERS = 256
# The transports a pool can live on: shm (one host) and nixl (across hosts).
TRANSPORTS = ("shm", "nixl")


def check_tensors(layout: KvLayout, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The engine's tensors, one per part of `layout`, checked to hold its blocks: host memory,
    the part's dtype and shape ``[num_blocks, *block_shape]``, each block contiguous and blocks
    apart by at least a block (strided blocks are fine); BlockTransferError naming the first
    that does not."""
    tensors = list(tensors)
    if len(tensors) != len(layout.parts):
        raise BlockTransferError(
            f"kv pool: {len(tensors)} tensors for {len(layout.parts)} parts (one tensor per "
            "part, in layout order: every layer's parts, layer by layer)"
        )
    for t, p in zip(tensors, layout.parts, strict=True):
        where = f"kv pool: the tensor of layer {p.layer} part {p.name!r}"
        if not isinstance(t, torch.Tensor):
            raise BlockTransferError(f"{where} is a {type(t).__name__}, not a torch.Tensor")
        if t.device.type != "cpu":
            raise BlockTransferError(
                f"{where}: {t.device.type} tensors are not supported by KV pools yet "
                "(host pools only)"
            )
        want = (layout.num_blocks, *p.block_shape)
        if t.dtype != DTYPES[p.dtype] or tuple(t.shape) != want:
            raise BlockTransferError(
                f"{where} is {list(t.shape)} {str(t.dtype).removeprefix('torch.')}, the layout "
                f"says {list(want)} {p.dtype}"
            )
        if not t[0].is_contiguous() or t.stride(0) * t.element_size() < p.block_bytes:
            raise BlockTransferError(
                f"{where}: its blocks are not contiguous and disjoint (strides {list(t.stride())})"
            )
    return tensors


class KvPool:
    """An engine's KV cache, registered so that peers write blocks into it.

    `transport`: shm (processes of one host: its regions are what a peer maps) or nixl
    (across hosts: its regions are registered with the process's NIXL agent). `tensors`:

    - None: the pool allocates its KV in a region of the transport; use :meth:`view` as the
      cache.
    - the engine's own host tensors, one per part in layout order (``layout.parts``: layer by
      layer, each layer's parts in order), each ``[num_blocks, *block_shape]`` of the part's
      dtype with every block contiguous (blocks may be strided: vLLM's ``kv[0]`` / ``kv[1]``
      of a ``[2, num_blocks, ...]`` layer tensor, or of ``[num_blocks, 2, ...]``, both work).
      On shm a peer on the same host writes them straight into this process's memory
      (``process_vm_writev``, see :mod:`moecomm.wire.kv.cma`); on nixl each is registered
      with the agent and peers WRITE into it. Completion words and liveness stay in the
      pool's small control region either way.

    CUDA tensors are not supported yet: a clear error."""

    def __init__(
        self,
        transport: Transport,
        layout: KvLayout,
        max_transfers: int = DEFAULT_MAX_TRANSFERS,
        tensors: Sequence[torch.Tensor] | None = None,
    ):
        layout.check()
        if transport.name not in TRANSPORTS:
            raise BlockTransferError(
                f"kv pool: the {transport.name} transport is not supported yet "
                f"({', '.join(TRANSPORTS)} only)"
            )
        if not 1 <= max_transfers <= 1 << 16:
            raise BlockTransferError(f"kv pool: max_transfers {max_transfers} not in [1, 65536]")
        self.tensors = None if tensors is None else check_tensors(layout, tensors)
        # Engine tensors: written by cross-memory attach on shm (same host), registered with
        # the transport (one region per part) where the transport reaches other hosts.
        if tensors is None:
            self.memory = MEMORY_REGION
        else:
            self.memory = MEMORY_PROCESS if transport.name == "shm" else MEMORY_PARTS
        self.transport = transport
        self.layout = layout
        self.max_transfers = max_transfers
        self.geometry = Geometry(layout, max_transfers)
        self.data: Region | None = None
        self.control = None
        self.bells = None
        # nixl: each part of engine tensors as a registered region (peers WRITE into it, and it
        # is the zero-copy source of our own sends).
        self.part_regions: list[Region] = []
        try:  # every region or none: a failure (say /dev/shm full) frees what was made
            if self.tensors is None:
                self.data = transport.create_region(self.geometry.data_bytes)
            elif self.memory == MEMORY_PARTS:
                for t, p in zip(self.tensors, layout.parts, strict=True):
                    span = t.stride(0) * t.element_size() * (layout.num_blocks - 1)
                    self.part_regions.append(
                        transport.register_external(t.data_ptr(), span + p.block_bytes, "host", 0)
                    )
            self.control = transport.create_region(self.geometry.control_bytes)
            self.bells = Doorbells(transport, "kv pool")
        except BaseException:
            for r in (self.data, self.control, self.bells, *self.part_regions):
                if r is not None:
                    r.close()
            raise
        self.doorbell: Region = self.bells.region
        if self.tensors is None:
            self._bytes = region_bytes_view(self.data)
            self._parts = [
                (self.data.address + off, p.block_bytes)
                for off, p in zip(self.geometry.part_offsets, layout.parts, strict=True)
            ]
        else:
            self._parts = [(t.data_ptr(), t.stride(0) * t.element_size()) for t in self.tensors]
        self._control_bytes = region_bytes_view(self.control)
        self._lock = threading.Lock()
        self._free_slots = list(range(max_transfers - 1, -1, -1))
        self._reserved: dict[int, int] = {}  # destination block -> slot that reserved it
        # Sequence numbers start from the clock so that a pool re-created in the same region
        # name space never repeats a recent one (the words are seq-stamped).
        self._seq = time.monotonic_ns() & ((1 << 40) - 1) | 1
        self.closed = False

    def info(self) -> KvPoolInfo:
        return KvPoolInfo(
            self.transport.name,
            "" if self.data is None else self.data.handle,
            self.control.handle,
            self.doorbell.handle,
            self.max_transfers,
            self.layout,
            pid=os.getpid(),
            host=host_id(),
            memory=self.memory,
            addresses=() if self.tensors is None else tuple(self._parts),
            part_handles=tuple(r.handle for r in self.part_regions),
        )

    def view(self, layer: int, part: str | int = 0) -> torch.Tensor:
        """The cache tensor ``[num_blocks, *block_shape]`` of `layer`'s part (by name or
        index within the layer), sharing the pool's memory (the engine's own tensor when the
        pool registered the engine's tensors)."""
        idx = self.layout.layer_parts(layer)
        if not idx:
            raise BlockTransferError(f"kv pool: no layer {layer} (has {self.layout.num_layers})")
        if isinstance(part, str):
            named = [i for i in idx if self.layout.parts[i].name == part]
            if not named:
                raise BlockTransferError(f"kv pool: layer {layer} has no part {part!r}")
            i = named[0]
        else:
            if not 0 <= part < len(idx):
                raise BlockTransferError(f"kv pool: layer {layer} has {len(idx)} parts, not {part}")
            i = idx[part]
        if self.tensors is not None:
            return self.tensors[i]
        p = self.layout.parts[i]
        return view(
            self._bytes,
            self.geometry.part_offsets[i],
            (self.layout.num_blocks, *p.block_shape),
            DTYPES[p.dtype],
        )

    def part_address(self, i: int) -> int:
        """The address, in this process, of block 0 of part `i` (index into layout.parts)."""
        return self._parts[i][0]

    def block_stride(self, i: int) -> int:
        """Bytes from one block of part `i` to the next (its block size unless strided)."""
        return self._parts[i][1]

    def source(self, i: int) -> tuple[Region | None, int]:
        """Where a send reads part `i` from: (a region of ours and the offset of block 0 in it)
        for a network transport, which writes only from registered memory without a copy;
        (None, the address of block 0) for shm, which copies from any address."""
        if self.transport.name == "shm":
            return None, self.part_address(i)
        if self.data is not None:
            return self.data, self.geometry.part_offsets[i]
        return self.part_regions[i], 0

    def connect(self, peer: KvPoolInfo | str) -> KvPeer:
        """Attaches a peer pool (its info or that info's JSON) after checking the layouts
        match; the result both sends to it and expects from it."""
        from moecomm.wire.kv.transfer import KvPeer  # transfer.py builds on this module

        return KvPeer(self, KvPoolInfo.from_json(peer) if isinstance(peer, str) else peer)

    def wait_any(self, seen: int, timeout: float) -> int:
        """Sleeps until a sender rings this pool's doorbell past `seen` (or `timeout`);
        returns the doorbell's value (pass it as the next `seen`)."""
        return self.bells.wait_value(seen, timeout)

    def doorbell_value(self) -> int:
        return self.bells.value()

    def _claim(self, dst: list[int]) -> tuple[int, int]:
        with self._lock:
            if self.closed:
                raise BlockTransferError("kv pool: closed")
            busy = [b for b in dst if b in self._reserved]
            if busy:
                raise BlockTransferError(
                    f"kv pool: destination block {busy[0]} is already reserved by another "
                    "transfer in flight"
                )
            if not self._free_slots:
                raise BlockTransferError(f"kv pool: all {self.max_transfers} transfer slots in use")
            slot = self._free_slots.pop()
            self._seq = self._seq + 1 if self._seq < MAX_SEQ else 1
            for b in dst:
                self._reserved[b] = slot
            return slot, self._seq

    def _release(self, slot: int, dst: list[int]) -> None:
        with self._lock:
            # Disarm first: a sender that checks the armed word stops writing into these blocks.
            self.transport.signal(self.control, self.geometry.armed(slot), 0, SignalOp.SET)
            for b in dst:
                if self._reserved.get(b) == slot:
                    del self._reserved[b]
            self._free_slots.append(slot)

    def close(self) -> None:
        """Frees the pool's regions (their names; views taken keep their mapping). Registered
        engine tensors stay the engine's."""
        self.closed = True
        for r in (self.data, self.control, self.bells, *self.part_regions):
            if r is not None:
                r.close()

    def __enter__(self) -> KvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
