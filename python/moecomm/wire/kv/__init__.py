"""KV moved block to block: registered KV pools and one-sided block transfers between them.

A :class:`KvPool` is an engine's paged KV cache in transport memory: for every layer, one or
more parts (K and V, or one MLA latent), each ``[num_blocks, *block_shape]`` of one dtype, laid
out by a :class:`KvLayout`. On shm the library allocates the pool in a shared-memory region and
hands out torch views of it (:meth:`KvPool.view`); the engine uses those views as its cache, so
a peer that attaches the region writes KV straight into it.

A transfer moves source blocks of one pool into destination blocks of another, in SGLang's
shape: the receiver first reserves its destination blocks (:meth:`KvPeer.expect`, which also
claims a completion slot of its pool) and hands the resulting :class:`KvTransferRequest` to the
sender by whatever side channel the engine already has (JSON); the sender writes each
contiguous run of blocks from its pool into the receiver's (on shm one ``memcpy`` per run and
part: each KV byte is copied once, never staged), then sets the run's layer word in the
receiver's memory with a release store and a futex wake, and rings the receiver's doorbell
(``_C.ring_doorbell``), as every moecomm message does. Layers may go one at a time
(:meth:`KvSend.layer`, as soon as a layer's KV exists), the receiver may wait per layer
(:meth:`KvRecv.wait_layer`).

Every word the sender sets carries the transfer's sequence number (``seq << 8 | state``), so a
late or stray write of an earlier transfer in the same slot is never taken for this one. Every
wait has a deadline and names the sender's region as its peer, so a sender that dies ends the
wait at once with :class:`~moecomm.errors.PeerLostError`. Bad metadata (indices out of range,
duplicated destinations, a layout that does not match the peer's) raises
:class:`BlockTransferError` on the side that finds it; a sender that finds it after the receiver
armed the slot marks the slot FAILED with its reason, which the receiver raises as
:class:`~moecomm.errors.RemoteError`.

The package, one module a role:

- layout.py    KvLayout / KvPart, the bounds a peer's layout must respect, block index checks
- words.py     completion words (seq-stamped states) and the byte geometry of a pool's regions
- metadata.py  the JSON the two ends exchange: KvPoolInfo, KvTransferRequest
- pool.py      KvPool: the registered memory, completion slots, doorbell
- transfer.py  KvPeer, KvSend, KvRecv: the transfer itself
"""

from moecomm.wire.kv.layout import (
    MAX_BLOCK_BYTES,
    MAX_BLOCKS,
    MAX_DIMS,
    MAX_LAYERS,
    MAX_PARTS_PER_LAYER,
    BlockTransferError,
    KvLayout,
    KvPart,
    block_runs,
    check_blocks,
)
from moecomm.wire.kv.metadata import KV_FORMAT_VERSION, KvPoolInfo, KvTransferRequest
from moecomm.wire.kv.pool import DEFAULT_MAX_TRANSFERS, KvPool
from moecomm.wire.kv.transfer import WAIT_SLICE_S, KvPeer, KvRecv, KvSend
from moecomm.wire.kv.words import (
    LINE,
    MAX_SEQ,
    PART_ALIGN,
    REASON_BYTES,
    SEQ_MASK,
    SEQ_SHIFT,
    STATE_MASK,
    KvState,
    WordState,
)

__all__ = [
    "DEFAULT_MAX_TRANSFERS",
    "KV_FORMAT_VERSION",
    "LINE",
    "MAX_BLOCKS",
    "MAX_BLOCK_BYTES",
    "MAX_DIMS",
    "MAX_LAYERS",
    "MAX_PARTS_PER_LAYER",
    "MAX_SEQ",
    "PART_ALIGN",
    "REASON_BYTES",
    "SEQ_MASK",
    "SEQ_SHIFT",
    "STATE_MASK",
    "WAIT_SLICE_S",
    "BlockTransferError",
    "KvLayout",
    "KvPart",
    "KvPeer",
    "KvPool",
    "KvPoolInfo",
    "KvRecv",
    "KvSend",
    "KvState",
    "KvTransferRequest",
    "WordState",
    "block_runs",
    "check_blocks",
]
