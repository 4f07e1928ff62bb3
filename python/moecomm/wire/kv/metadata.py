"""What KV pools and transfers tell each other, as JSON checked once on arrival: a pool's
description (:class:`KvPoolInfo`: transport, region handles, layout) and a receiver's request
(:class:`KvTransferRequest`: its pool, completion slot, sequence number, destination blocks).
Anything malformed raises :class:`~moecomm.wire.kv.layout.BlockTransferError`."""

from __future__ import annotations

import json
from dataclasses import dataclass

from moecomm.wire.kv.layout import MAX_BLOCKS, BlockTransferError, KvLayout, json_int

KV_FORMAT_VERSION = 1


# Where a pool's KV bytes live, as its info says: in the transport region `data` (the pool
# allocated them; peers attach and write), in the owning process's own memory at `addresses`
# (an engine's tensors on shm: a peer on the same host writes them with process_vm_writev), or
# in one registered region per part, `part_handles` (an engine's tensors registered with a
# network transport, nixl).
MEMORY_REGION = "region"
MEMORY_PROCESS = "process"
MEMORY_PARTS = "parts"
MEMORY_KINDS = (MEMORY_REGION, MEMORY_PROCESS, MEMORY_PARTS)
MAX_HANDLE = 4096
# A pid or address read from a peer is a non-negative 64-bit value.
MAX_U64 = (1 << 64) - 1
MAX_HOST_ID = 256


@dataclass(frozen=True)
class KvPoolInfo:
    """What a pool tells its peers (JSON): its transport, its regions' handles, its layout;
    its process (`pid`, and `host`: boot id and PID namespace) and where its KV bytes live
    (`memory`: "region"; "process" with per part the (address, block stride in bytes) of
    the engine's tensor in `addresses`; "parts": those, and per part the handle of the
    registered region holding the tensor in `part_handles`)."""

    transport: str
    data_handle: str
    control_handle: str
    doorbell_handle: str
    max_transfers: int
    layout: KvLayout
    pid: int = 0
    host: str = ""
    memory: str = MEMORY_REGION
    addresses: tuple[tuple[int, int], ...] = ()
    part_handles: tuple[str, ...] = ()

    def to_json(self) -> str:
        d = {
            "version": KV_FORMAT_VERSION,
            "transport": self.transport,
            "data": self.data_handle,
            "control": self.control_handle,
            "doorbell": self.doorbell_handle,
            "max_transfers": self.max_transfers,
            "layout": self.layout.to_dict(),
            "pid": self.pid,
            "host": self.host,
            "memory": self.memory,
        }
        if self.memory != MEMORY_REGION:
            d["addresses"] = [list(a) for a in self.addresses]
        if self.memory == MEMORY_PARTS:
            d["part_handles"] = list(self.part_handles)
        return json.dumps(d)

    def check(self) -> None:
        """Raises BlockTransferError naming the first field out of bounds."""
        if not 1 <= self.max_transfers <= 1 << 16:
            raise BlockTransferError(
                f"kv pool info: max_transfers {self.max_transfers} out of range"
            )
        if not 0 <= self.pid <= MAX_U64:
            raise BlockTransferError(f"kv pool info: pid {self.pid} out of range")
        if self.memory not in MEMORY_KINDS:
            raise BlockTransferError(
                f"kv pool info: memory {self.memory[:32]!r} is not one of {MEMORY_KINDS}"
            )
        if self.memory == MEMORY_REGION:
            if self.addresses or self.part_handles:
                raise BlockTransferError("kv pool info: addresses given for region memory")
            return
        if self.memory == MEMORY_PROCESS and self.pid < 1:
            raise BlockTransferError("kv pool info: process memory without the process's pid")
        parts = self.layout.parts
        if len(self.part_handles) != (len(parts) if self.memory == MEMORY_PARTS else 0):
            raise BlockTransferError(
                f"kv pool info: {len(self.part_handles)} part handles for {len(parts)} parts "
                f"of {self.memory} memory"
            )
        if len(self.addresses) != len(parts):
            raise BlockTransferError(
                f"kv pool info: {len(self.addresses)} addresses for {len(parts)} parts"
            )
        for p, (address, stride) in zip(parts, self.addresses, strict=True):
            end = address + stride * (self.layout.num_blocks - 1) + p.block_bytes
            if address < 1 or stride < p.block_bytes or end > MAX_U64:
                raise BlockTransferError(
                    f"kv pool info: layer {p.layer} part {p.name!r} at {address:#x} with "
                    f"block stride {stride} cannot hold {self.layout.num_blocks} blocks of "
                    f"{p.block_bytes} bytes"
                )

    @staticmethod
    def from_json(text: str | bytes) -> KvPoolInfo:
        try:
            d = json.loads(text)
            if d.get("version") != KV_FORMAT_VERSION:
                raise BlockTransferError(
                    f"kv pool info: version {d.get('version')!r}, this side "
                    f"speaks {KV_FORMAT_VERSION}"
                )
            addresses = d.get("addresses", [])
            handles = d.get("part_handles", [])
            bound = len(d["layout"]["parts"])
            for what, v in (("addresses", addresses), ("part_handles", handles)):
                if not isinstance(v, list) or len(v) > bound:
                    raise BlockTransferError(f"kv pool info: {what} must be a list, one per part")
            info = KvPoolInfo(
                str(d["transport"]),
                str(d["data"]),
                str(d["control"]),
                str(d["doorbell"]),
                json_int(d["max_transfers"]),
                KvLayout.from_dict(d["layout"]),
                json_int(d.get("pid", 0)),
                str(d.get("host", ""))[:MAX_HOST_ID],
                str(d.get("memory", MEMORY_REGION))[:32],
                tuple((json_int(a), json_int(s)) for a, s in addresses),
                tuple(str(h)[:MAX_HANDLE] for h in handles),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, BlockTransferError):
                raise
            raise BlockTransferError(f"kv pool info: malformed ({exc})") from None
        info.check()
        return info


@dataclass(frozen=True)
class KvTransferRequest:
    """What a receiver hands its sender (JSON): which pool and completion slot, the
    transfer's sequence number, the destination blocks and the layers to expect."""

    pool: str  # the receiver's control handle: the sender checks it is connected to that pool
    slot: int
    seq: int
    dst_blocks: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": KV_FORMAT_VERSION,
                "pool": self.pool,
                "slot": self.slot,
                "seq": self.seq,
                "dst": list(self.dst_blocks),
            }
        )

    @staticmethod
    def from_json(text: str | bytes) -> KvTransferRequest:
        try:
            d = json.loads(text)
            if d.get("version") != KV_FORMAT_VERSION:
                raise BlockTransferError(f"kv request: version {d.get('version')!r}")
            dst = d["dst"]
            if not isinstance(dst, list) or len(dst) > MAX_BLOCKS:
                raise BlockTransferError("kv request: dst must be a list of block indices")
            return KvTransferRequest(
                str(d["pool"]),
                json_int(d["slot"]),
                json_int(d["seq"]),
                tuple(json_int(b) for b in dst),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise BlockTransferError(f"kv request: malformed ({exc})") from None
