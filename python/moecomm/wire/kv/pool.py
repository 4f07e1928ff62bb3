"""A KV pool: an engine's paged KV cache in transport memory, which peers write blocks into,
with the completion slots of the transfers it receives (claimed by :meth:`KvPeer.expect`,
freed by :meth:`KvRecv.release`) and the doorbell its senders ring."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from moecomm import _C
from moecomm.wire.channel import timeout_ns
from moecomm.wire.kv.layout import DTYPES, BlockTransferError, KvLayout
from moecomm.wire.kv.metadata import KvPoolInfo
from moecomm.wire.kv.words import MAX_SEQ, Geometry
from moecomm.wire.transport import SignalOp, Transport
from moecomm.wire.views import region_bytes_view, view

if TYPE_CHECKING:
    from moecomm.wire.kv.transfer import KvPeer

# Transfers a pool can receive at once (each holds one completion slot). An engine keeps a few
# requests in flight per peer; 256 is far above that and costs 256 small slots.
DEFAULT_MAX_TRANSFERS = 256


class KvPool:
    """An engine's KV cache in transport memory, which peers write blocks into.

    `transport`: the shm transport (its regions are what a peer maps). `tensors`: None (the
    pool allocates; use :meth:`view` as the cache) or the engine's own tensors to register —
    refused on shm, which can only expose memory it allocated (CUDA tensors: not supported by
    this transport yet)."""

    def __init__(
        self,
        transport: Transport,
        layout: KvLayout,
        max_transfers: int = DEFAULT_MAX_TRANSFERS,
        tensors: Sequence[torch.Tensor] | None = None,
    ):
        layout.check()
        if tensors is not None:
            devices = {t.device.type for t in tensors}
            if devices - {"cpu"}:
                raise BlockTransferError(
                    f"kv pool: {'/'.join(sorted(devices - {'cpu'}))} tensors are not supported by "
                    f"the {transport.name} transport yet (host pools only)"
                )
            raise BlockTransferError(
                f"kv pool: the {transport.name} transport can only expose memory it allocated; "
                "create the pool without tensors and use pool.view(layer, part) as the cache"
            )
        if transport.name != "shm":
            raise BlockTransferError(
                f"kv pool: the {transport.name} transport is not supported yet (shm only)"
            )
        if not 1 <= max_transfers <= 1 << 16:
            raise BlockTransferError(f"kv pool: max_transfers {max_transfers} not in [1, 65536]")
        self.transport = transport
        self.layout = layout
        self.max_transfers = max_transfers
        self.geometry = Geometry(layout, max_transfers)
        made = []
        try:  # all three regions or none: a failure (say /dev/shm full) frees what was made
            for size in (self.geometry.data_bytes, self.geometry.control_bytes, _C.DOORBELL_BYTES):
                made.append(transport.create_region(size))
        except BaseException:
            for r in made:
                r.close()
            raise
        self.data, self.control, self.doorbell = made
        self._bytes = region_bytes_view(self.data)
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
            self.data.handle,
            self.control.handle,
            self.doorbell.handle,
            self.max_transfers,
            self.layout,
        )

    def view(self, layer: int, part: str | int = 0) -> torch.Tensor:
        """The cache tensor ``[num_blocks, *block_shape]`` of `layer`'s part (by name or
        index within the layer), sharing the pool's memory."""
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
        p = self.layout.parts[i]
        return view(
            self._bytes,
            self.geometry.part_offsets[i],
            (self.layout.num_blocks, *p.block_shape),
            DTYPES[p.dtype],
        )

    def part_address(self, i: int) -> int:
        return self.data.address + self.geometry.part_offsets[i]

    def connect(self, peer: KvPoolInfo | str) -> KvPeer:
        """Attaches a peer pool (its info or that info's JSON) after checking the layouts
        match; the result both sends to it and expects from it."""
        from moecomm.wire.kv.transfer import KvPeer  # transfer.py builds on this module

        return KvPeer(self, KvPoolInfo.from_json(peer) if isinstance(peer, str) else peer)

    def wait_any(self, seen: int, timeout: float) -> int:
        """Sleeps until a sender rings this pool's doorbell past `seen` (or `timeout`);
        returns the doorbell's value (pass it as the next `seen`)."""
        _, value = _C.wait_doorbell(self.transport, self.doorbell, seen, timeout_ns(timeout), None)
        return value

    def doorbell_value(self) -> int:
        return self.transport.load(self.doorbell, 0)

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
        """Frees the pool's regions (their names; views taken keep their mapping)."""
        self.closed = True
        for r in (self.data, self.control, self.doorbell):
            r.close()

    def __enter__(self) -> KvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
