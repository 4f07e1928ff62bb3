"""KV hand-offs between a prefill and a decode front end, block to block between their pools.

Each front end of the split keeps its paged KV cache (:class:`~moecomm_serving.kv.blocks.BlockPool`)
in a :class:`moecomm.wire.kv.KvPool`: a :class:`KvEndpoint` allocates the pool in transport
memory and places the block pool's tensors on its views, before the engine serves. A hand-off
then goes the way the engines' own KV connectors go (SGLang's shape):

1. the prefill front end holds its request's blocks (the engine's
   :class:`~moecomm_serving.types.HandoffEvent`) and asks the decode front end to reserve room
   for them (``POST /pd/reserve``, :class:`~moecomm_serving.disagg.schema.ReserveCall`: the
   cache's metadata and the prefill's pool info);
2. the decode front end checks the metadata once against its pool, reserves destination blocks
   (:meth:`KvEndpoint.reserve`: :meth:`HeldBlocks.reserve
   <moecomm_serving.kv.blocks.HeldBlocks.reserve>` and :meth:`KvPeer.expect
   <moecomm.wire.kv.KvPeer.expect>`) and answers its pool info and the transfer request;
3. the prefill front end writes its blocks straight into them (:meth:`KvEndpoint.send`,
   :meth:`KvPeer.send <moecomm.wire.kv.KvPeer.send>`: one copy per contiguous run of blocks and
   part, then the completion word) and answers the router;
4. the router's ``/pd/decode`` finds the reservation (:meth:`KvEndpoint.take`), waits on its
   completion word and hands the blocks to the engine, whose sequence adopts them.

Each KV byte is copied once, from the prefill's pool into the decode's. Faults end as clear
errors with nothing held: a prefill that dies mid-transfer ends the decode's wait at once
(:class:`~moecomm.errors.PeerLostError`), a decode that dies ends the prefill's send with the
same error, a reservation nobody takes is dropped after ``ttl_s``, and a malformed or
mismatched transfer is refused by :mod:`moecomm.wire.kv` on the side that finds it. Blocks a
sender may still be writing (a reservation abandoned while its transfer is under way) are kept
out of the pool for :data:`QUARANTINE_S` before they are reused.

The pools are shared memory (:mod:`moecomm.wire.shm`): the two front ends must share this host's
/dev/shm. Across hosts the same memory is also registered with NIXL (``nixl=True``: a second
:class:`~moecomm.wire.kv.KvPool` over the shm pool's views): the prefill's reservation call
carries both pools' info, a decode front end that cannot map the shm pool connects to the nixl
one, and the prefill WRITEs its blocks over nixl into the same reserved blocks. Without nixl on
either side the reservation is refused (:class:`KvUnreachableError`, HTTP 409).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import httpx
from moecomm.errors import DeadlineExceededError, MoecommError, PeerLostError
from moecomm.wire.kv import (
    BlockTransferError,
    KvLayout,
    KvPeer,
    KvPool,
    KvPoolInfo,
    KvRecv,
    KvState,
    KvTransferRequest,
)
from moecomm.wire.shm import ShmTransport

from moecomm_serving.disagg.schema import PdRequestError, ReserveAnswer, ReserveCall
from moecomm_serving.kv.blocks import BlockPool, HeldBlocks, dtype_name
from moecomm_serving.types import KvPackage

# A KV pool's size in bytes: the pool is allocated once (a peer's writes must land where the
# receiver said), as /dev/shm address space whose pages are committed only as blocks are first
# written, and the block allocator reuses the lowest free ids, so memory follows the high-water
# mark, not this. 4 GiB holds ~30k tokens of DeepSeek-V3's cache; far more of the tiny models'.
DEFAULT_KV_POOL_BYTES = 4 << 30
# Blocks per pool at most, whatever the bytes allow: the allocator keeps a Python int per block,
# and a million tokens (at the default 16-token block) is beyond any CPU reference serving.
MAX_POOL_BLOCKS = 1 << 16
# A reservation is taken within milliseconds (the router calls /pd/decode as soon as the prefill
# answers); one still there after a minute belongs to a request that failed or went elsewhere.
UNCLAIMED_KV_TTL_S = 60.0
# How often the endpoint drops expired reservations and the connections of dead peers.
SWEEP_S = 1.0
# Blocks of a transfer abandoned while the sender may still be copying a layer into them stay
# out of the pool this long: far above one layer's copy, which is all a sender writes after it
# last checked that the receiver still expects it.
QUARANTINE_S = 10.0
# A reservation is bookkeeping on the decode front end: one that takes longer is stopped or
# overloaded, and the router should try another.
RESERVE_TIMEOUT_S = 10.0
# The transfer itself: memcpy of the request's KV (MBs to GBs) on a possibly loaded host.
SEND_TIMEOUT_S = 60.0
# The endpoint's sweeper stops within this on close().
CLOSE_TIMEOUT_S = 5.0


class KvTransferError(MoecommError, RuntimeError):
    """A KV hand-off that failed in transit: the peer is lost or refused the transfer, a deadline
    passed, the decode front end is unreachable; the caller answers 502/503/504."""


class KvUnreachableError(KvTransferError):
    """The decode front end cannot map the prefill's pool: not on this host's shared memory."""


class KvReservationError(MoecommError, ValueError):
    """A reservation that cannot be made or found as asked (metadata that does not fit the
    pool, a transfer for another hand-off); HTTP 400."""


class KvBusyError(KvTransferError):
    """The decode front end has no room for the transfer now (its pool's blocks or transfer
    slots are all in use); HTTP 503."""


def pool_layout(pool: BlockPool, num_blocks: int) -> KvLayout:
    """The KvLayout of `pool`'s layers with `num_blocks` blocks: per layer a key part and a
    value part, each block ``[heads, block_tokens, width]``."""
    heads, kd, vd = pool.kv_shape
    b = pool.block_tokens
    return KvLayout.paged(
        len(pool.layers),
        num_blocks,
        dtype_name(pool.dtype),
        {"k": (heads, b, kd), "v": (heads, b, vd)},
    )


@dataclass
class _Reservation:
    handoff_id: str
    held: HeldBlocks
    recv: KvRecv
    expires: float


class KvEndpoint:
    """A front end's side of KV hand-offs: its KV pool (the engine's `block_pool`, placed in
    shared memory), the peers it talks to, and the reservations it made as a receiver.

    `pool_bytes`: the pool's size (see :data:`DEFAULT_KV_POOL_BYTES`); `ttl_s`: how long a
    reservation waits to be taken."""

    def __init__(
        self,
        block_pool: BlockPool,
        pool_bytes: int = DEFAULT_KV_POOL_BYTES,
        ttl_s: float = UNCLAIMED_KV_TTL_S,
        nixl: bool = False,
        nixl_host: str | None = None,
    ):
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        blocks = min(MAX_POOL_BLOCKS, int(pool_bytes) // block_pool.block_bytes)
        if blocks < 1:
            raise ValueError(
                f"a KV pool of {pool_bytes} bytes holds no block of {block_pool.block_bytes}"
            )
        self.block_pool = block_pool
        self.ttl_s = float(ttl_s)
        self.transport = ShmTransport()
        self.kv = KvPool(self.transport, pool_layout(block_pool, blocks))
        try:
            block_pool.place(
                {layer: self.kv.view(i, "k") for i, layer in enumerate(block_pool.layers)},
                {layer: self.kv.view(i, "v") for i, layer in enumerate(block_pool.layers)},
            )
        except BaseException:
            self.kv.close()
            raise
        self.info = self.kv.info().to_json()
        # Across hosts: the same memory registered with NIXL (the shm pool's views as the
        # pool's tensors, part by part), so a peer on another host WRITEs into the same blocks.
        self.kv_nixl: KvPool | None = None
        self.info_nixl: str | None = None
        if nixl:
            try:
                from moecomm.wire.nixl import open_nixl_transport

                self.nixl_transport = open_nixl_transport(host=nixl_host)
                parts = self.kv.layout.parts
                self.kv_nixl = KvPool(
                    self.nixl_transport,
                    self.kv.layout,
                    tensors=[self.kv.view(p.layer, p.name) for p in parts],
                )
                self.info_nixl = self.kv_nixl.info().to_json()
            except BaseException:
                self.kv.close()
                raise
        self._lock = threading.Lock()
        self._peers: dict[str, KvPeer] = {}  # by the peer pool's control handle
        self._reserved: dict[int, _Reservation] = {}  # by the transfer's sequence number
        self._quarantined: list[tuple[float, HeldBlocks]] = []
        self.stats = dict.fromkeys(("reserved", "expired", "quarantined", "peers_lost"), 0)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="kv-sweeper", daemon=True)
        self._sweeper.start()

    # ------------------------------------------------------------------ peers
    def peer(self, info_json: str) -> KvPeer:
        """The connection to the pool `info_json` describes (made on first use; a peer whose
        process died is replaced)."""
        try:
            info = KvPoolInfo.from_json(info_json)
        except BlockTransferError as exc:
            raise KvReservationError(str(exc)) from None
        with self._lock:
            peer = self._peers.get(info.control_handle)
            if peer is not None:
                return peer
        pool = self.kv if info.transport == self.kv.transport.name else self.kv_nixl
        if pool is None or info.transport != pool.transport.name:
            raise KvUnreachableError(
                f"the peer's KV pool speaks {info.transport}; this front end's pools speak "
                f"{self.kv.transport.name}" + ("" if self.kv_nixl is None else " and nixl")
            )
        try:
            peer = pool.connect(info)
        except BlockTransferError as exc:  # layouts differ: another model or block size
            raise KvReservationError(str(exc)) from None
        except Exception as exc:  # no such segment here: another host's /dev/shm, or gone
            raise KvUnreachableError(
                f"cannot map the peer's KV pool ({exc}); the two front ends must share this "
                "host's shared memory (across hosts both front ends need NIXL: --transport "
                "auto or nixl)"
            ) from None
        with self._lock:
            old = self._peers.setdefault(info.control_handle, peer)
        if old is not peer:  # another thread connected meanwhile
            peer.close()
        return old

    def _forget(self, peer: KvPeer) -> None:
        """Drops a dead peer's connection. Its regions are not closed here: a transfer may still
        be waiting on them (its wait ends with PeerLostError); they are unmapped when the last
        transfer lets go of the peer."""
        with self._lock:
            if self._peers.get(peer.info.control_handle) is peer:
                del self._peers[peer.info.control_handle]
                self.stats["peers_lost"] += 1

    # ------------------------------------------------------------------ receiving (decode)
    def reserve(self, call: ReserveCall) -> ReserveAnswer:
        """Reserves blocks for the cache `call` describes, written from `call.pool`. Raises
        KvReservationError (400: does not fit), KvBusyError (503: no room now),
        KvUnreachableError (the sender's pool cannot be reached from here)."""
        try:
            peer = self.peer(call.pool)
        except KvUnreachableError:
            if call.pool_nixl is None or self.kv_nixl is None:
                raise
            peer = self.peer(call.pool_nixl)  # another host: its pool over nixl
        try:
            held = HeldBlocks.reserve(self.block_pool, call.kv)
        except MoecommError as exc:  # KvPoolFullError
            raise KvBusyError(str(exc)) from None
        except ValueError as exc:
            raise KvReservationError(f"KV package refused: {exc}") from None
        try:
            recv = peer.expect(held.blocks)
        except BlockTransferError as exc:  # every transfer slot in use
            held.release()
            raise KvBusyError(str(exc)) from None
        except BaseException:
            held.release()
            raise
        name = peer.pool.transport.name
        with self._lock:
            self._reserved[(name, recv.seq)] = _Reservation(
                call.handoff_id, held, recv, time.monotonic() + self.ttl_s
            )
            self.stats["reserved"] += 1
        info = self.info if peer.pool is self.kv else self.info_nixl
        return ReserveAnswer(info, recv.request.to_json())

    def take(
        self, handoff_id: str, slot: int, seq: int, timeout: float, transport: str = "shm"
    ) -> HeldBlocks:
        """The blocks of transfer `seq`, once written (its completion word); the caller hands
        them to the engine. Raises DeadlineExceededError (never reserved, expired, or not
        written in `timeout`), PeerLostError (the sender died first), KvReservationError (the
        transfer is another hand-off's), KvTransferError (the sender reported a failure).
        Whatever it raises, the reservation is gone and its blocks are freed."""
        with self._lock:
            r = self._reserved.pop((transport, seq), None)
        if r is None:
            raise DeadlineExceededError(
                f"no KV transfer {seq} is reserved here (never reserved, or expired after "
                f"{self.ttl_s:.0f} s)"
            )
        try:
            if r.handoff_id != handoff_id or r.recv.slot != slot:
                raise KvReservationError(
                    f"KV transfer {seq} is hand-off {r.handoff_id!r} in slot {r.recv.slot}, "
                    f"not {handoff_id!r} in slot {slot}"
                )
            try:
                r.recv.wait(timeout)
            except (PeerLostError, DeadlineExceededError):
                raise
            except MoecommError as exc:  # RemoteError (the sender failed it), ProtocolError
                raise KvTransferError(f"KV transfer {seq} failed: {exc}") from exc
        except BaseException:
            self._abandon(r)
            raise
        r.recv.release()
        return r.held

    def ready(self, seq: int, transport: str = "shm") -> bool:
        """Whether transfer `seq` is reserved here and complete (its completion word set): then
        :meth:`take` returns without waiting."""
        with self._lock:
            r = self._reserved.get((transport, seq))
        if r is None:
            return False
        with contextlib.suppress(Exception):
            return r.recv.poll() == KvState.DONE
        return False

    def _abandon(self, r: _Reservation, now: float | None = None) -> None:
        """Frees a reservation that will not be used; its blocks wait out QUARANTINE_S first
        when a live sender may still write into them (the transfer is not complete: a sender
        that checked the armed word just before the release below copies one more layer)."""
        busy = False
        with contextlib.suppress(Exception):  # poll() says FAILED once the sender is dead
            busy = r.recv.poll() in (KvState.WAITING, KvState.TRANSFERRING)
        r.recv.release()  # disarmed: a sender checking before its next layer stops
        if busy:
            now = time.monotonic() if now is None else now
            with self._lock:
                self._quarantined.append((now + QUARANTINE_S, r.held))
                self.stats["quarantined"] += 1
        else:
            r.held.release()

    @property
    def num_reserved(self) -> int:
        with self._lock:
            return len(self._reserved)

    # ------------------------------------------------------------------ sending (prefill)
    def send(
        self,
        http: httpx.Client,
        decode_url: str,
        handoff_id: str,
        held: HeldBlocks,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, int, str]:
        """Writes `held`'s blocks into the decode front end at `decode_url` (reserve, then
        write); returns the transfer's slot and sequence number (what ``/pd/decode`` names it
        by). `headers` go with the reservation call (the deployment's secret). Raises
        KvTransferError (the decode front end is unreachable, refused, or died meanwhile)."""
        url = decode_url.rstrip("/")
        call = ReserveCall(handoff_id, held.package, self.info, self.info_nixl)
        try:
            r = http.post(
                f"{url}/pd/reserve",
                json=call.to_json(),
                headers=headers or {},
                timeout=RESERVE_TIMEOUT_S,
            )
        except httpx.HTTPError as exc:
            raise KvTransferError(f"reserving KV blocks on {url}: {exc!r}") from None
        if r.status_code == 409:  # it cannot map our pool: another host
            raise KvUnreachableError(f"{url} cannot reach this pool: {_message(r)}")
        if r.status_code != 200:
            raise KvTransferError(
                f"{url} refused the KV reservation ({r.status_code}): {_message(r)}"
            )
        try:
            answer = ReserveAnswer.from_json(r.content)
        except PdRequestError as exc:
            raise KvTransferError(f"{url} answered a malformed reservation: {exc}") from None
        return self.write(answer, held, url)

    def write(
        self, answer: ReserveAnswer, held: HeldBlocks, where: str = ""
    ) -> tuple[int, int, str]:
        """Writes `held`'s blocks into the reservation `answer` describes (every layer, then
        the completion word); returns the transfer's slot, sequence number and transport. Raises
        KvTransferError (the reservation is malformed or refused, the receiver died)."""
        where = where or "the decode front end"
        try:
            peer = self.peer(answer.pool)
        except KvReservationError as exc:
            raise KvTransferError(f"{where} answered a malformed reservation: {exc}") from None
        try:
            peer.send(answer.request, held.blocks)
        except PeerLostError as exc:
            self._forget(peer)
            raise KvTransferError(f"{where} died mid-transfer: {exc}") from None
        except MoecommError as exc:  # BlockTransferError: refused as asked
            raise KvTransferError(f"KV transfer to {where} refused: {exc}") from None
        req = KvTransferRequest.from_json(answer.request)
        return req.slot, req.seq, peer.pool.transport.name

    # ------------------------------------------------------------------ housekeeping
    def _sweep_loop(self) -> None:
        while not self._stop.wait(SWEEP_S):
            with contextlib.suppress(Exception):  # housekeeping must not end the thread
                self.sweep()

    def sweep(self, now: float | None = None) -> None:
        """Drops expired reservations, frees quarantined blocks whose time is up, and closes
        connections to peers that died."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [s for s, r in self._reserved.items() if r.expires <= now]
            gone = [self._reserved.pop(s) for s in expired]
            self.stats["expired"] += len(gone)
        for r in gone:
            self._abandon(r, now)
        with self._lock:
            free = [h for t, h in self._quarantined if t <= now]
            self._quarantined = [(t, h) for t, h in self._quarantined if t > now]
            peers = list(self._peers.values())
        for h in free:
            h.release()
        for p in peers:
            if not p.alive():
                self._forget(p)

    def close(self) -> None:
        """Stops the sweeper, frees every reservation and connection, and the pool's regions
        (the engine must have stopped: its cache tensors are views of them)."""
        self._stop.set()
        self._sweeper.join(CLOSE_TIMEOUT_S)
        with self._lock:
            gone, self._reserved = list(self._reserved.values()), {}
            held = [h for _, h in self._quarantined]
            self._quarantined = []
            peers, self._peers = list(self._peers.values()), {}
        for r in gone:
            with contextlib.suppress(Exception):
                r.recv.release()
            r.held.release()
        for h in held:
            h.release()
        for p in peers:
            with contextlib.suppress(Exception):
                p.close()
        if self.kv_nixl is not None:
            self.kv_nixl.close()
        self.kv.close()


def package_bytes(p: KvPackage, block_bytes: int) -> int:
    """The bytes a transfer of `p` moves (whole blocks, every layer)."""
    return p.num_blocks * block_bytes


def _message(r: httpx.Response) -> str:
    try:
        msg = r.json()["error"]["message"]
        if isinstance(msg, str):
            return msg
    except (ValueError, KeyError, TypeError):
        pass
    return r.text[:300]
