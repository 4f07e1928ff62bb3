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
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from moecomm import _C
from moecomm.errors import (
    DeadlineExceededError,
    MoecommError,
    PeerLostError,
    ProtocolError,
    RemoteError,
)
from moecomm.wire.channel import DEFAULT_TIMEOUT_S, timeout_ns
from moecomm.wire.shm import reap_stale_segments
from moecomm.wire.transport import SignalOp, Transport, WaitOp
from moecomm.wire.views import region_bytes_view, view

KV_FORMAT_VERSION = 1
# Each part of the pool starts on its own page: a run's copy never shares a page with another
# part, and page-aligned copies take the kernel's and libc's fastest paths.
PART_ALIGN = 4096
# Transfers a pool can receive at once (each holds one completion slot). An engine keeps a few
# requests in flight per peer; 256 is far above that and costs 256 small slots.
DEFAULT_MAX_TRANSFERS = 256
# Bounds on what a layout read from a peer may claim, checked before anything is allocated or
# attached: far above real models (DeepSeek-V3: 61 layers, one MLA part) yet small enough that a
# malformed description cannot ask for absurd memory.
MAX_LAYERS = 1024
MAX_PARTS_PER_LAYER = 8
MAX_BLOCKS = 1 << 24
MAX_BLOCK_BYTES = 1 << 30
MAX_DIMS = 8
# The reason a failing sender leaves in the slot; longer reasons are cut (a multiple of LINE).
REASON_BYTES = 256
# A signal word's line: the shm transport keeps its futex sleeper count beside the word.
LINE = 64  # kSignalWordAlign, csrc/transport/transport.h
# A word is ``seq << SEQ_SHIFT | state``; the sequence number takes the upper 56 bits.
SEQ_SHIFT = 8
STATE_MASK = (1 << SEQ_SHIFT) - 1
SEQ_MASK = ~STATE_MASK & ((1 << 64) - 1)
MAX_SEQ = (1 << (64 - SEQ_SHIFT)) - 1
# Longest single sleep of a wait before it re-checks its deadline and the sender's liveness
# (a futex wait also ends at once when the sender dies; this bounds the poll-only mode).
WAIT_SLICE_S = 0.5

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.uint8,
    )
}


class BlockTransferError(MoecommError, ValueError):
    """A KV transfer that cannot be done as asked: block indices out of range or duplicated,
    pools whose layouts do not match, a request for another pool or slot."""


class WordState(IntEnum):
    """The low byte of a completion word."""

    IDLE = 0
    LAYER_DONE = 1  # a layer word: every block of that layer is written
    DONE = 2  # the status word: every layer is written
    FAILED = 3  # the sender gave up; the slot's reason says why


class KvState(IntEnum):
    """What :meth:`KvRecv.poll` reports (SGLang's poll states, without bootstrapping)."""

    WAITING = 0  # no layer arrived yet
    TRANSFERRING = 1  # some layers arrived
    DONE = 2
    FAILED = 3


@dataclass(frozen=True)
class KvPart:
    """One tensor of one layer: ``[num_blocks, *block_shape]`` of `dtype` (named e.g. "k")."""

    layer: int
    name: str
    block_shape: tuple[int, ...]
    dtype: str

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * _DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class KvLayout:
    """How a pool lays out its KV: `num_blocks` blocks, and per layer its parts. Two pools can
    exchange blocks when their layouts agree on everything but `num_blocks`."""

    num_layers: int
    num_blocks: int
    parts: tuple[KvPart, ...]

    @staticmethod
    def paged(
        num_layers: int,
        num_blocks: int,
        dtype: torch.dtype | str,
        parts: dict[str, Sequence[int]],
    ) -> KvLayout:
        """A layout with the same parts in every layer: ``parts={"k": (heads, block_tokens,
        k_dim), "v": (heads, block_tokens, v_dim)}`` (the reference serving's and vLLM's
        paged caches), or one part for an MLA latent."""
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        layout = KvLayout(
            int(num_layers),
            int(num_blocks),
            tuple(
                KvPart(layer, str(n), tuple(int(s) for s in shape), name)
                for layer in range(int(num_layers))
                for n, shape in parts.items()
            ),
        )
        layout.check()
        return layout

    def check(self) -> None:
        """Raises BlockTransferError naming the first field out of bounds."""
        if not 1 <= self.num_layers <= MAX_LAYERS:
            raise BlockTransferError(
                f"kv layout: num_layers {self.num_layers} not in [1, {MAX_LAYERS}]"
            )
        if not 1 <= self.num_blocks <= MAX_BLOCKS:
            raise BlockTransferError(
                f"kv layout: num_blocks {self.num_blocks} not in [1, {MAX_BLOCKS}]"
            )
        if not self.parts or len(self.parts) > self.num_layers * MAX_PARTS_PER_LAYER:
            raise BlockTransferError(
                f"kv layout: {len(self.parts)} parts for {self.num_layers} layers"
            )
        seen = set()
        for p in self.parts:
            if not 0 <= p.layer < self.num_layers:
                raise BlockTransferError(
                    f"kv layout: part {p.name!r} of layer {p.layer} is outside "
                    f"the {self.num_layers} layers"
                )
            if (p.layer, p.name) in seen:
                raise BlockTransferError(f"kv layout: layer {p.layer} has two parts {p.name!r}")
            seen.add((p.layer, p.name))
            if p.dtype not in _DTYPES:
                raise BlockTransferError(
                    f"kv layout: unknown dtype {p.dtype!r} (known: {sorted(_DTYPES)})"
                )
            if not 1 <= len(p.block_shape) <= MAX_DIMS or any(s < 1 for s in p.block_shape):
                raise BlockTransferError(
                    f"kv layout: bad block shape {list(p.block_shape)} of "
                    f"layer {p.layer} part {p.name!r}"
                )
            if p.block_bytes > MAX_BLOCK_BYTES:
                raise BlockTransferError(
                    f"kv layout: a block of layer {p.layer} part {p.name!r} "
                    f"holds {p.block_bytes} bytes (max {MAX_BLOCK_BYTES})"
                )
        if len({p.layer for p in self.parts}) != self.num_layers:
            raise BlockTransferError("kv layout: a layer has no part")

    def mismatch(self, other: KvLayout) -> str | None:
        """Why blocks cannot move between pools of `self` and `other` (None: they can)."""
        if self.num_layers != other.num_layers:
            return f"{self.num_layers} layers here, {other.num_layers} there"
        if len(self.parts) != len(other.parts):
            return f"{len(self.parts)} parts here, {len(other.parts)} there"
        for a, b in zip(self.parts, other.parts, strict=True):
            if a != b:
                return (
                    f"layer {a.layer} part {a.name!r} {list(a.block_shape)} {a.dtype} here, "
                    f"layer {b.layer} part {b.name!r} {list(b.block_shape)} {b.dtype} there"
                )
        return None

    def layer_parts(self, layer: int) -> list[int]:
        return [i for i, p in enumerate(self.parts) if p.layer == layer]

    @property
    def block_bytes(self) -> int:
        """The bytes of one block over every layer and part."""
        return sum(p.block_bytes for p in self.parts)

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "parts": [[p.layer, p.name, list(p.block_shape), p.dtype] for p in self.parts],
        }

    @staticmethod
    def from_dict(d: dict) -> KvLayout:
        """The layout a peer described, checked (BlockTransferError on anything malformed)."""
        try:
            parts = d["parts"]
            if not isinstance(parts, list) or len(parts) > MAX_LAYERS * MAX_PARTS_PER_LAYER:
                raise BlockTransferError("kv layout: parts must be a bounded list")
            layout = KvLayout(
                _int(d["num_layers"]),
                _int(d["num_blocks"]),
                tuple(
                    KvPart(
                        _int(layer),
                        str(name)[:64],
                        tuple(_int(s) for s in shape[: MAX_DIMS + 1]),
                        str(dtype)[:32],
                    )
                    for layer, name, shape, dtype in parts
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, BlockTransferError):
                raise
            raise BlockTransferError(f"kv layout: malformed description ({exc})") from None
        layout.check()
        return layout


def _int(x) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise BlockTransferError(f"kv: expected an integer, got {x!r}")
    return x


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
                _int(d["max_transfers"]),
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
                str(d["pool"]), _int(d["slot"]), _int(d["seq"]), tuple(_int(b) for b in dst)
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise BlockTransferError(f"kv request: malformed ({exc})") from None


def check_blocks(blocks: Iterable[int], num_blocks: int, what: str, unique: bool) -> list[int]:
    """`blocks` as a list of ints, each in [0, num_blocks) (and distinct when `unique`)."""
    out = [int(b) for b in blocks]
    for b in out:
        if not 0 <= b < num_blocks:
            raise BlockTransferError(f"{what} block {b} is out of range [0, {num_blocks})")
    if unique and len(set(out)) != len(out):
        dup = next(b for b in out if out.count(b) > 1)
        raise BlockTransferError(f"{what} block {dup} appears more than once")
    return out


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of each run where both sides are consecutive: one copy
    (one WRITE over a network) per run and part."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class _Geometry:
    """Byte offsets in a pool's regions, the same on both ends (computed from the layout)."""

    def __init__(self, layout: KvLayout, max_transfers: int):
        self.part_offsets = []
        offset = 0
        for p in layout.parts:
            self.part_offsets.append(offset)
            offset += -(-p.block_bytes * layout.num_blocks // PART_ALIGN) * PART_ALIGN
        self.data_bytes = offset
        # Control region: per slot, the armed word (the receiver's), the status word, one word
        # per layer, each on its own signal line (the transport's futex bookkeeping shares the
        # line), then the reason; slots span whole lines.
        self.num_layers = layout.num_layers
        self.slot_bytes = LINE * (2 + layout.num_layers) + REASON_BYTES
        self.control_bytes = self.slot_bytes * max_transfers

    def armed(self, slot: int) -> int:
        return slot * self.slot_bytes

    def status(self, slot: int) -> int:
        return slot * self.slot_bytes + LINE

    def layer(self, slot: int, layer: int) -> int:
        return slot * self.slot_bytes + LINE * (2 + layer)

    def reason(self, slot: int) -> int:
        return slot * self.slot_bytes + LINE * (2 + self.num_layers)


def _word(seq: int, state: WordState) -> int:
    return (seq << SEQ_SHIFT) | int(state)


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
        self.geometry = _Geometry(layout, max_transfers)
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
            _DTYPES[p.dtype],
        )

    def part_address(self, i: int) -> int:
        return self.data.address + self.geometry.part_offsets[i]

    def connect(self, peer: KvPoolInfo | str) -> KvPeer:
        """Attaches a peer pool (its info or that info's JSON) after checking the layouts
        match; the result both sends to it and expects from it."""
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


class KvPeer:
    """A connection from a pool to a peer pool: :meth:`expect` blocks from it, :meth:`send`
    blocks to it."""

    def __init__(self, pool: KvPool, info: KvPoolInfo):
        if info.transport != pool.transport.name:
            raise BlockTransferError(
                f"kv peer: it speaks {info.transport}, this pool {pool.transport.name}"
            )
        why = pool.layout.mismatch(info.layout)
        if why is not None:
            raise BlockTransferError(f"kv peer: layouts do not match: {why}")
        self.pool = pool
        self.info = info
        self.geometry = _Geometry(info.layout, info.max_transfers)
        regions = []
        try:
            for handle, size in (
                (info.data_handle, self.geometry.data_bytes),
                (info.control_handle, self.geometry.control_bytes),
                (info.doorbell_handle, _C.DOORBELL_BYTES),
            ):
                r = pool.transport.attach(handle)
                regions.append(r)
                if r.size < size:
                    raise BlockTransferError(
                        f"kv peer: its region {handle} holds {r.size} bytes, "
                        f"its layout needs {size}"
                    )
        except BaseException:
            for r in regions:
                r.close()
            raise
        self.data, self.control, self.doorbell = regions

    def alive(self) -> bool:
        return self.pool.transport.peer_alive(self.control)

    def expect(self, dst_blocks: Iterable[int]) -> KvRecv:
        """Reserves `dst_blocks` of our pool for a transfer from this peer; hand
        ``.request`` to the sender."""
        dst = check_blocks(dst_blocks, self.pool.layout.num_blocks, "destination", unique=True)
        slot, seq = self.pool._claim(dst)
        g = self.pool.geometry
        t = self.pool.transport
        for word in [g.status(slot)] + [g.layer(slot, i) for i in range(g.num_layers)]:
            t.signal(self.pool.control, word, 0, SignalOp.SET)
        t.signal(self.pool.control, g.armed(slot), seq, SignalOp.SET)
        return KvRecv(self, slot, seq, dst)

    def send(self, request: KvTransferRequest | str, src_blocks: Iterable[int]) -> None:
        """Writes every layer of `src_blocks` into the request's destination blocks."""
        s = self.start(request, src_blocks)
        for layer in range(self.pool.layout.num_layers):
            s.layer(layer)
        s.finish()

    def start(self, request: KvTransferRequest | str, src_blocks: Iterable[int]) -> KvSend:
        """Checks a request against both pools and returns the send, to write layer by layer.
        A request that fails the checks is reported to the receiver too (its slot FAILED)
        when it names a slot of the receiver's pool."""
        req = KvTransferRequest.from_json(request) if isinstance(request, str) else request
        return KvSend(self, req, src_blocks)

    def close(self) -> None:
        for r in (self.data, self.control, self.doorbell):
            r.close()


class KvSend:
    """One transfer on the sending side: :meth:`layer` per layer (any order, each once), then
    :meth:`finish`; :meth:`fail` reports an error to the receiver instead."""

    def __init__(self, peer: KvPeer, req: KvTransferRequest, src_blocks: Iterable[int]):
        self.peer = peer
        self.req = req
        self.done_layers: set[int] = set()
        self.finished = False
        try:
            if req.pool != peer.info.control_handle:
                raise BlockTransferError(
                    f"kv send: the request is for pool {req.pool}, this peer "
                    f"is {peer.info.control_handle}"
                )
            if not 0 <= req.slot < peer.info.max_transfers:
                raise BlockTransferError(
                    f"kv send: slot {req.slot} not in [0, {peer.info.max_transfers})"
                )
            if not 1 <= req.seq <= MAX_SEQ:
                raise BlockTransferError(f"kv send: sequence number {req.seq} out of range")
            src = check_blocks(src_blocks, peer.pool.layout.num_blocks, "source", unique=False)
            dst = check_blocks(
                req.dst_blocks, peer.info.layout.num_blocks, "destination", unique=True
            )
            if len(src) != len(dst):
                raise BlockTransferError(
                    f"kv send: {len(src)} source blocks for {len(dst)} destination blocks"
                )
        except BlockTransferError as exc:
            # Reported into the slot only when the receiver armed it for this very transfer: a
            # request naming another transfer's slot must not overwrite that transfer's words.
            if (
                req.pool == peer.info.control_handle
                and 0 <= req.slot < peer.info.max_transfers
                and self._armed()
            ):
                self._mark_failed(str(exc))
            raise
        self.runs = block_runs(src, dst)

    def _armed(self) -> bool:
        t = self.peer.pool.transport
        return t.load(self.peer.control, self.peer.geometry.armed(self.req.slot)) == self.req.seq

    def layer(self, layer: int) -> None:
        """Writes `layer`'s blocks (every part) and signals that layer done."""
        pool, peer, g = self.peer.pool, self.peer, self.peer.geometry
        if self.finished:
            raise BlockTransferError("kv send: already finished")
        if not 0 <= layer < pool.layout.num_layers or layer in self.done_layers:
            raise BlockTransferError(
                f"kv send: layer {layer} not in [0, {pool.layout.num_layers}) or already sent"
            )
        if not self._armed():
            self._check_alive()
            raise BlockTransferError(
                f"kv send: the receiver no longer expects transfer "
                f"{self.req.seq} in slot {self.req.slot} (released or reused)"
            )
        t = pool.transport
        for i in pool.layout.layer_parts(layer):
            bb = pool.layout.parts[i].block_bytes
            src_base = pool.part_address(i)
            dst_base = g.part_offsets[i]
            for s, d, n in self.runs:
                t.put(peer.data, dst_base + d * bb, src_base + s * bb, n * bb)
        t.signal(
            peer.control,
            g.layer(self.req.slot, layer),
            _word(self.req.seq, WordState.LAYER_DONE),
            SignalOp.SET,
        )
        _C.ring_doorbell(t, peer.doorbell)
        self.done_layers.add(layer)

    def finish(self) -> None:
        """Signals the whole transfer done (every layer must have been sent); raises
        PeerLostError if the receiver died meanwhile."""
        n = self.peer.pool.layout.num_layers
        if len(self.done_layers) != n:
            missing = sorted(set(range(n)) - self.done_layers)
            raise BlockTransferError(f"kv send: finish before layers {missing} were sent")
        t = self.peer.pool.transport
        t.signal(
            self.peer.control,
            self.peer.geometry.status(self.req.slot),
            _word(self.req.seq, WordState.DONE),
            SignalOp.SET,
        )
        _C.ring_doorbell(t, self.peer.doorbell)
        self.finished = True
        self._check_alive()

    def fail(self, reason: str) -> None:
        """Tells the receiver this transfer will not complete, with `reason`."""
        self._mark_failed(reason)
        self.finished = True

    def _check_alive(self) -> None:
        if not self.peer.alive():
            reap_stale_segments()
            raise PeerLostError(
                f"kv send: the receiving process died ({self.peer.control.describe()})"
            )

    def _mark_failed(self, reason: str) -> None:
        peer, g, req = self.peer, self.peer.geometry, self.req
        t = peer.pool.transport
        raw = reason.encode("utf-8", "replace")[: REASON_BYTES - 1] + b"\0"
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        t.put(peer.control, g.reason(req.slot), buf.data_ptr(), len(raw))
        word = _word(req.seq & MAX_SEQ, WordState.FAILED)
        for off in [g.layer(req.slot, i) for i in range(g.num_layers)] + [g.status(req.slot)]:
            t.signal(peer.control, off, word, SignalOp.SET)
        _C.ring_doorbell(t, peer.doorbell)


class KvRecv:
    """One transfer on the receiving side: its destination blocks stay reserved until
    :meth:`release` (or the end of a ``with`` block)."""

    def __init__(self, peer: KvPeer, slot: int, seq: int, dst: list[int]):
        self.peer = peer
        self.slot = slot
        self.seq = seq
        self.dst = dst
        self.released = False
        self.request = KvTransferRequest(peer.pool.control.handle, slot, seq, tuple(dst))

    def _read(self, offset: int) -> int:
        return self.peer.pool.transport.load(self.peer.pool.control, offset)

    def _judge(self, value: int, what: str) -> bool:
        """Whether `value` (a word of ours) says `what` arrived; raises on FAILED or on a word
        of this transfer's sequence with a state that word cannot hold."""
        if value >> SEQ_SHIFT != self.seq:
            return False
        state = value & STATE_MASK
        expected = WordState.DONE if what == "transfer" else WordState.LAYER_DONE
        if state == expected:
            return True
        if state == WordState.FAILED:
            off = self.peer.pool.geometry.reason(self.slot)
            raw = bytes(self.peer.pool._control_bytes[off : off + REASON_BYTES].tolist())
            raise RemoteError(
                int(WordState.FAILED),
                raw.split(b"\0")[0].decode("utf-8", "replace"),
                f"kv transfer {self.seq} (slot {self.slot}): ",
            )
        raise ProtocolError(
            f"kv transfer {self.seq} (slot {self.slot}): {what} word holds "
            f"state {state}, expected {int(expected)}"
        )

    def _wait(self, offset: int, what: str, timeout: float) -> None:
        if self.released:
            raise BlockTransferError("kv recv: released")
        t = self.peer.pool.transport
        deadline = time.monotonic() + timeout
        while not self._judge(self._read(offset), what):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceededError(
                    f"kv transfer {self.seq} (slot {self.slot}): {what} "
                    f"did not arrive within {timeout:.3f} s"
                )
            try:
                t.wait(
                    self.peer.pool.control,
                    offset,
                    WaitOp.EQUAL,
                    self.seq << SEQ_SHIFT,
                    SEQ_MASK,
                    timeout_ns(min(remaining, WAIT_SLICE_S)),
                    self.peer.control,
                )
            except DeadlineExceededError:
                # A slice ended: the word, the deadline and, as a safety net beside the wait's
                # own death watch, the sender's liveness are checked again (the /proc read costs
                # tens of µs, so only here, never on a wait that was answered).
                lost = not self.peer.alive()
            except PeerLostError:
                lost = True
            else:
                lost = False
            if lost and not self._judge(self._read(offset), what):
                reap_stale_segments()
                raise PeerLostError(
                    f"kv transfer {self.seq} (slot {self.slot}): the sending "
                    f"process died before {what} arrived"
                )

    def wait_layer(self, layer: int, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Waits until `layer`'s blocks are all written."""
        g = self.peer.pool.geometry
        if not 0 <= layer < g.num_layers:
            raise BlockTransferError(f"kv recv: no layer {layer}")
        self._wait(g.layer(self.slot, layer), f"layer {layer}", timeout)

    def wait(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Waits until the whole transfer is written."""
        self._wait(self.peer.pool.geometry.status(self.slot), "transfer", timeout)

    def poll(self) -> KvState:
        """Where the transfer stands, without waiting (FAILED: :meth:`wait` raises why)."""
        g = self.peer.pool.geometry
        try:
            if self._judge(self._read(g.status(self.slot)), "transfer"):
                return KvState.DONE
            layers = sum(
                self._judge(self._read(g.layer(self.slot, i)), f"layer {i}")
                for i in range(g.num_layers)
            )
        except (RemoteError, ProtocolError):
            return KvState.FAILED
        if not self.peer.alive():
            return KvState.FAILED
        return KvState.TRANSFERRING if layers else KvState.WAITING

    def release(self) -> None:
        """Frees the slot and the destination blocks' reservation (the blocks' contents stay)."""
        if not self.released:
            self.released = True
            self.peer.pool._release(self.slot, self.dst)

    def __enter__(self) -> KvRecv:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = [
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
    "block_runs",
    "check_blocks",
]
