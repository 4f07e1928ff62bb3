"""What KV pools and transfers tell each other, as JSON checked once on arrival: a pool's
description (:class:`KvPoolInfo`: transport, region handles, layout) and a receiver's request
(:class:`KvTransferRequest`: its pool, completion slot, sequence number, destination blocks).
Anything malformed raises :class:`~moecomm.wire.kv.layout.BlockTransferError`."""

from __future__ import annotations

import json
from dataclasses import dataclass

from moecomm.wire.kv.layout import MAX_BLOCKS, BlockTransferError, KvLayout, json_int

KV_FORMAT_VERSION = 1


@dataclass(frozen=True)
class KvPoolInfo:
    """What a pool tells its peers (JSON): its transport, its regions' handles, its layout."""

    transport: str
    data_handle: str
    control_handle: str
    doorbell_handle: str
    max_transfers: int
    layout: KvLayout

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": KV_FORMAT_VERSION,
                "transport": self.transport,
                "data": self.data_handle,
                "control": self.control_handle,
                "doorbell": self.doorbell_handle,
                "max_transfers": self.max_transfers,
                "layout": self.layout.to_dict(),
            }
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
            info = KvPoolInfo(
                str(d["transport"]),
                str(d["data"]),
                str(d["control"]),
                str(d["doorbell"]),
                json_int(d["max_transfers"]),
                KvLayout.from_dict(d["layout"]),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise BlockTransferError(f"kv pool info: malformed ({exc})") from None
        if not 1 <= info.max_transfers <= 1 << 16:
            raise BlockTransferError(
                f"kv pool info: max_transfers {info.max_transfers} out of range"
            )
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
