"""One-sided KV block transfers between two pools: :class:`KvPeer` (a pool's connection to a
peer pool), :class:`KvSend` (the sending side, layer by layer) and :class:`KvRecv` (the
receiving side: wait, wait per layer, poll, release)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from moecomm import _C
from moecomm.errors import DeadlineExceededError, PeerLostError, ProtocolError, RemoteError
from moecomm.wire.channel import DEFAULT_TIMEOUT_S, timeout_ns
from moecomm.wire.kv import cma
from moecomm.wire.kv.cma import host_id
from moecomm.wire.kv.layout import BlockTransferError, block_runs, check_blocks
from moecomm.wire.kv.metadata import (
    MEMORY_PARTS,
    MEMORY_PROCESS,
    MEMORY_REGION,
    KvPoolInfo,
    KvTransferRequest,
)
from moecomm.wire.kv.words import (
    MAX_SEQ,
    REASON_BYTES,
    SEQ_MASK,
    SEQ_SHIFT,
    STATE_MASK,
    Geometry,
    KvState,
    WordState,
    make_word,
)
from moecomm.wire.mailbox import WAIT_SLICE_S, peer_lost, ring, wait_for
from moecomm.wire.shm import reap_stale_segments
from moecomm.wire.transport import Region, SignalOp, WaitOp

# WAIT_SLICE_S (re-exported): the longest sleep of a wait before it re-checks its deadline and
# the sender's liveness, the shared mailbox's.
__all__ = ["WAIT_SLICE_S", "KvPeer", "KvRecv", "KvSend"]


class KvPeer:
    """A connection from a pool to a peer pool: :meth:`expect` blocks from it, :meth:`send`
    blocks to it. Made by ``KvPool.connect``; ``pool`` is that local KvPool (left unannotated:
    pool.py builds peers from this module, so naming its class here would be an import circle,
    even a type-only one)."""

    def __init__(self, pool, info: KvPoolInfo):
        if info.transport != pool.transport.name:
            raise BlockTransferError(
                f"kv peer: it speaks {info.transport}, this pool {pool.transport.name}"
            )
        why = pool.layout.mismatch(info.layout)
        if why is not None:
            raise BlockTransferError(f"kv peer: layouts do not match: {why}")
        # Engine-owned memory on either side is reached with process_vm_writev: a pid means
        # the same process only on the same host and in the same PID namespace.
        if MEMORY_PROCESS in (pool.memory, info.memory) and info.host != host_id():
            raise BlockTransferError(
                "kv peer: engine-owned tensors are written with process_vm_writev, which needs "
                f"both pools on one host (this one is {host_id()}, the peer says "
                f"{info.host[:80]!r}); across hosts both pools need the nixl transport"
            )
        # The peer writes into our engine-owned tensors: under Yama ptrace_scope=1 it may do so
        # only once we name it (renewed by every expect(): Yama keeps one pid per process).
        if pool.memory == MEMORY_PROCESS:
            cma.allow_writer(info.pid)
        self.pool = pool
        self.info = info
        self.geometry = Geometry(info.layout, info.max_transfers)
        wanted = [
            (info.control_handle, self.geometry.control_bytes),
            (info.doorbell_handle, _C.DOORBELL_BYTES),
        ]
        if info.memory == MEMORY_REGION:
            wanted.insert(0, (info.data_handle, self.geometry.data_bytes))
        elif info.memory == MEMORY_PARTS:
            if pool.transport.name == "shm":
                raise BlockTransferError(
                    "kv peer: its pool is registered part by part with a network transport, "
                    "this one speaks shm"
                )
            for h, (_, stride), p in zip(
                info.part_handles, info.addresses, info.layout.parts, strict=True
            ):
                wanted.append((h, stride * (info.layout.num_blocks - 1) + p.block_bytes))
        elif pool.transport.name != "shm":
            raise BlockTransferError(
                f"kv peer: its engine tensors are reachable by cross-memory attach only, "
                f"not over {pool.transport.name}"
            )
        regions = []
        try:
            for handle, size in wanted:
                r = pool.transport.attach(handle)
                regions.append(r)
                if r.size < size:
                    raise BlockTransferError(
                        f"kv peer: its region {handle[:80]} holds {r.size} bytes, "
                        f"its layout needs {size}"
                    )
        except BaseException:
            for r in regions:
                r.close()
            raise
        first = 1 if info.memory == MEMORY_REGION else 0
        self.data: Region | None = regions[0] if info.memory == MEMORY_REGION else None
        self.control, self.doorbell = regions[first : first + 2]
        self.part_regions: list[Region] = regions[first + 2 :]
        # Per part: (destination region or None for cross-memory attach, offset or address of
        # block 0, block stride).
        if info.memory == MEMORY_REGION:
            self._dest = [
                (self.data, off, p.block_bytes)
                for off, p in zip(self.geometry.part_offsets, info.layout.parts, strict=True)
            ]
        elif info.memory == MEMORY_PARTS:
            self._dest = [
                (r, 0, stride)
                for r, (_, stride) in zip(self.part_regions, info.addresses, strict=True)
            ]
        else:
            self._dest = [(None, address, stride) for address, stride in info.addresses]

    def alive(self) -> bool:
        return self.pool.transport.peer_alive(self.control)

    def expect(self, dst_blocks: Iterable[int]) -> KvRecv:
        """Reserves `dst_blocks` of our pool for a transfer from this peer; hand
        ``.request`` to the sender."""
        dst = check_blocks(dst_blocks, self.pool.layout.num_blocks, "destination", unique=True)
        if self.pool.memory == MEMORY_PROCESS:
            cma.allow_writer(self.info.pid)
        slot, seq = self.pool._claim(dst)
        g = self.pool.geometry
        t = self.pool.transport
        for word in [g.status(slot)] + [g.layer(slot, i) for i in range(g.num_layers)]:
            t.signal(self.pool.control, word, 0, SignalOp.SET)
        t.signal(self.pool.control, g.armed(slot), seq, SignalOp.SET)
        return KvRecv(self, slot, seq, dst)

    def send(self, request: KvTransferRequest | str, src_blocks: Iterable[int]) -> None:
        """Writes every layer of `src_blocks` into the request's destination blocks."""
        self.start(request, src_blocks).all_layers()

    def start(self, request: KvTransferRequest | str, src_blocks: Iterable[int]) -> KvSend:
        """Checks a request against both pools and returns the send, to write layer by layer.
        A request that fails the checks is reported to the receiver too (its slot FAILED)
        when it names a slot of the receiver's pool."""
        req = KvTransferRequest.from_json(request) if isinstance(request, str) else request
        return KvSend(self, req, src_blocks)

    def close(self) -> None:
        for r in (self.data, self.control, self.doorbell, *self.part_regions):
            if r is not None:
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
        self._check_layer(layer)
        # On shm the armed word is a load of mapped memory: checked before every layer. Over a
        # network it is a READ (a round trip): checked before the first layer only.
        if self.peer.pool.transport.name == "shm" or not self.done_layers:
            self._check_armed()
        self._write(layer)
        self._signal_layer(layer)
        ring(self.peer.pool.transport, self.peer.doorbell)
        self.done_layers.add(layer)

    def all_layers(self) -> None:
        """Every layer, then :meth:`finish`. Over a network transport every layer's WRITEs are
        queued first and leave as ONE transfer with the first layer word (the others and the
        status word follow as notifications), instead of one transfer per layer."""
        n = self.peer.pool.layout.num_layers
        if self.peer.pool.transport.name == "shm":
            for layer in range(n):
                self.layer(layer)
            self.finish()
            return
        for layer in range(n):
            self._check_layer(layer)
        self._check_armed()
        for layer in range(n):
            self._write(layer)
        for layer in range(n):
            self._signal_layer(layer)
            self.done_layers.add(layer)
        self.finish()

    def _check_layer(self, layer: int) -> None:
        pool = self.peer.pool
        if self.finished:
            raise BlockTransferError("kv send: already finished")
        if not 0 <= layer < pool.layout.num_layers or layer in self.done_layers:
            raise BlockTransferError(
                f"kv send: layer {layer} not in [0, {pool.layout.num_layers}) or already sent"
            )

    def _check_armed(self) -> None:
        if not self._armed():
            self._check_alive()
            raise BlockTransferError(
                f"kv send: the receiver no longer expects transfer "
                f"{self.req.seq} in slot {self.req.slot} (released or reused)"
            )

    def _write(self, layer: int) -> None:
        """Writes (or, over a network, queues the WRITEs of) `layer`'s blocks."""
        pool, peer = self.peer.pool, self.peer
        t = pool.transport
        pieces = self._pieces(layer)
        if peer.info.memory != MEMORY_PROCESS:
            # Into a region of the peer: shm copies from our address; nixl queues a WRITE per
            # piece from our registered memory, and the next word's signal sends them as one
            # transfer that carries the word (nixl_transport.h, "Ordering").
            for i, src, dst, size in pieces:
                src_region = pool.source(i)[0]
                dst_region = peer._dest[i][0]
                if src_region is None:
                    t.put(dst_region, dst, src, size)
                else:
                    t.put_region(dst_region, dst, src_region, src, size)
        else:
            try:
                cma.write(peer.info.pid, [(src, dst, size) for _, src, dst, size in pieces])
            except PeerLostError:
                reap_stale_segments()
                raise PeerLostError(
                    f"kv send: the receiving process died ({peer.control.describe()})"
                ) from None
            except cma.CmaError as exc:
                # The receiver learns why at once (its slot FAILED), not at its deadline.
                self.fail(str(exc))
                raise

    def _signal_layer(self, layer: int) -> None:
        self.peer.pool.transport.signal(
            self.peer.control,
            self.peer.geometry.layer(self.req.slot, layer),
            make_word(self.req.seq, WordState.LAYER_DONE),
            SignalOp.SET,
        )

    def _pieces(self, layer: int) -> list[tuple[int, int, int, int]]:
        """(part, source offset or address, destination offset or address, bytes) of every
        copy of `layer`: one per contiguous run and part, or one per block where a side's
        blocks are strided (see KvPool.source and KvPeer._dest for what the numbers are)."""
        pool, peer = self.peer.pool, self.peer
        out = []
        for i in pool.layout.layer_parts(layer):
            bb = pool.layout.parts[i].block_bytes
            _, src_base = pool.source(i)
            src_stride = pool.block_stride(i)
            _, dst_base, dst_stride = peer._dest[i]
            for s, d, n in self.runs:
                if src_stride == bb and dst_stride == bb:
                    out.append((i, src_base + s * bb, dst_base + d * bb, n * bb))
                else:
                    out.extend(
                        (i, src_base + (s + k) * src_stride, dst_base + (d + k) * dst_stride, bb)
                        for k in range(n)
                    )
        return out

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
            make_word(self.req.seq, WordState.DONE),
            SignalOp.SET,
        )
        ring(t, self.peer.doorbell)
        self.finished = True
        self._check_alive()

    def fail(self, reason: str) -> None:
        """Tells the receiver this transfer will not complete, with `reason`."""
        self._mark_failed(reason)
        self.finished = True

    def _check_alive(self) -> None:
        if not self.peer.alive():
            raise peer_lost(f"kv send: the receiving process died ({self.peer.control.describe()})")

    def _mark_failed(self, reason: str) -> None:
        peer, g, req = self.peer, self.peer.geometry, self.req
        t = peer.pool.transport
        raw = reason.encode("utf-8", "replace")[: REASON_BYTES - 1] + b"\0"
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        t.put(peer.control, g.reason(req.slot), buf.data_ptr(), len(raw))
        word = make_word(req.seq & MAX_SEQ, WordState.FAILED)
        for off in [g.layer(req.slot, i) for i in range(g.num_layers)] + [g.status(req.slot)]:
            t.signal(peer.control, off, word, SignalOp.SET)
        ring(t, peer.doorbell)


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

        def sleep(slice_s: float) -> bool:
            try:
                t.wait(
                    self.peer.pool.control,
                    offset,
                    WaitOp.EQUAL,
                    self.seq << SEQ_SHIFT,
                    SEQ_MASK,
                    timeout_ns(slice_s),
                    self.peer.control,
                )
            except DeadlineExceededError:
                # The slice ended: the shared wait checks the word, the deadline and, as a
                # safety net beside this wait's own death watch, the sender's liveness (the
                # /proc read costs tens of µs, so only here, never on a wait that was answered).
                return False
            return True

        def check_peer() -> None:
            if not self.peer.alive():
                raise peer_lost(
                    f"kv transfer {self.seq} (slot {self.slot}): the sending process died "
                    f"before {what} arrived"
                )

        wait_for(
            lambda: self._judge(self._read(offset), what),
            sleep,
            check_peer,
            timeout,
            f"kv transfer {self.seq} (slot {self.slot}): {what} did not arrive within "
            f"{timeout:.3f} s",
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
