"""The front ends' KV hand-off (disagg.transfer.KvEndpoint) between two real processes over
shared-memory KV pools: the bytes arrive bit-exactly, block to block; a sender killed
mid-transfer ends the receiver's wait at once with PeerLostError, a receiver killed before the
write ends the sender's with KvTransferError; a reservation nobody takes expires; a transfer
taken under another hand-off's name is refused — and after each, no block is held and no
shared-memory segment of the dead process is left."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from moecomm import prefork
from moecomm.errors import DeadlineExceededError, PeerLostError
from moecomm.wire.kv import KvTransferRequest
from moecomm.wire.shm import list_segments, reap_stale_segments
from moecomm_serving.disagg.schema import ReserveAnswer, ReserveCall
from moecomm_serving.disagg.transfer import (
    QUARANTINE_S,
    KvEndpoint,
    KvReservationError,
    KvTransferError,
)
from moecomm_serving.kv.blocks import BlockPool, PagedSequence

LAYERS = (0, 1, 2)
HEADS, DIM, BLOCK = 2, 8, 4
POOL_BYTES = 1 << 20
TOKENS = 18  # five blocks, the last one partly full
START_S = 120.0  # a spawned interpreter importing torch on a loaded 2-core host
STEP_S = 30.0
# A dead sender must end the receiver's wait at once (its life word), far below this.
DEATH_SEEN_S = 5.0


def new_pool() -> BlockPool:
    return BlockPool(LAYERS, HEADS, DIM, DIM, torch.float32, "cpu", BLOCK)


def kv(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(HEADS, TOKENS, DIM, generator=g), torch.randn(HEADS, TOKENS, DIM, generator=g))
        for _ in LAYERS
    ]


def filled(pool: BlockPool, seed: int) -> PagedSequence:
    seq = PagedSequence(pool)
    for layer, (k, v) in zip(LAYERS, kv(seed), strict=True):
        seq.layer(layer).append(k, v)
    return seq


def _sender(conn, seed: int, stop_after_layers: int) -> None:
    """A prefill side: holds a filled sequence's blocks, reports its package and pool, writes
    into the reservation it is handed (all layers, or only the first few, then waits)."""
    pool = new_pool()
    ep = KvEndpoint(pool, POOL_BYTES)
    seq = filled(pool, seed)
    held = seq.export_blocks()
    seq.release()
    conn.send((held.package, ep.info))
    answer = conn.recv()
    if stop_after_layers:
        send = ep.peer(answer.pool).start(answer.request, held.blocks)
        for layer in range(stop_after_layers):
            send.layer(layer)
        conn.send("partial")
        conn.recv()  # killed while waiting here
    else:
        conn.send(ep.write(answer, held))
    conn.recv()


def _receiver(conn) -> None:
    """A decode side: reserves for the call it is handed, answers, then waits to be killed."""
    ep = KvEndpoint(new_pool(), POOL_BYTES)
    conn.send(ep.reserve(conn.recv()))
    conn.recv()


@pytest.fixture
def spawn():
    ctx = prefork.process_context()
    procs = []

    def start(target, *args):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        procs.append(p)
        return p, parent

    yield start
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)
    reap_stale_segments()
    for p in procs:
        assert list_segments(p.pid) == []  # a dead process's pools are reaped


@pytest.fixture
def decode():
    ep = KvEndpoint(new_pool(), POOL_BYTES)
    yield ep
    ep.close()


def recv(conn, what: str):
    assert conn.poll(START_S), f"the other process did not {what}"
    return conn.recv()


@pytest.mark.timeout(300)
def test_blocks_arrive_bit_exactly_from_another_process(spawn, decode):
    _, conn = spawn(_sender, 7, 0)
    package, info = recv(conn, "start")
    answer = decode.reserve(ReserveCall("h1", package, info))
    conn.send(answer)
    slot, seq, transport = recv(conn, "write")
    assert transport == "shm"
    req = KvTransferRequest.from_json(answer.request)
    assert (req.slot, req.seq) == (slot, seq)
    held = decode.take("h1", slot, seq, STEP_S)
    got = PagedSequence.import_blocks(decode.block_pool, held)
    for layer, (k, v) in zip(LAYERS, kv(7), strict=True):
        gk, gv = got.gather(layer)
        assert torch.equal(gk, k) and torch.equal(gv, v)
    got.release()
    assert decode.block_pool.num_used == 0 and decode.num_reserved == 0


@pytest.mark.timeout(300)
def test_a_sender_killed_mid_transfer_ends_the_wait_at_once(spawn, decode):
    proc, conn = spawn(_sender, 8, 1)
    package, info = recv(conn, "start")
    answer = decode.reserve(ReserveCall("h2", package, info))
    conn.send(answer)
    assert recv(conn, "write a layer") == "partial"
    req = KvTransferRequest.from_json(answer.request)
    os.kill(proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(PeerLostError, match="died"):
        decode.take("h2", req.slot, req.seq, STEP_S)
    assert time.monotonic() - t0 < DEATH_SEEN_S
    assert decode.block_pool.num_used == 0 and decode.num_reserved == 0


@pytest.mark.timeout(300)
def test_a_receiver_killed_before_the_write_fails_the_send(spawn):
    pool = new_pool()
    ep = KvEndpoint(pool, POOL_BYTES)
    try:
        seq = filled(pool, 9)
        held = seq.export_blocks()
        seq.release()
        proc, conn = spawn(_receiver)
        conn.send(ReserveCall("h3", held.package, ep.info))
        answer = recv(conn, "reserve")
        assert isinstance(answer, ReserveAnswer)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        with pytest.raises(KvTransferError, match="died"):
            ep.write(answer, held)
        held.release()
        assert pool.num_used == 0
    finally:
        ep.close()


def test_an_untaken_reservation_expires_and_a_wrong_name_is_refused(decode):
    src_pool = new_pool()
    src = KvEndpoint(src_pool, POOL_BYTES)
    try:
        seq = filled(src_pool, 10)
        held = seq.export_blocks()
        seq.release()
        answer = decode.reserve(ReserveCall("h4", held.package, src.info))
        assert decode.block_pool.num_used == len(held.blocks)
        later = time.monotonic() + decode.ttl_s + 1
        decode.sweep(later)
        assert decode.num_reserved == 0 and decode.stats["expired"] == 1
        with pytest.raises(KvTransferError, match="no longer expects"):
            src.write(answer, held)  # the sender is refused: nothing written into them
        # its sender lives and had not finished: the blocks wait out the quarantine
        assert decode.stats["quarantined"] == 1
        assert decode.block_pool.num_used == len(held.blocks)
        decode.sweep(later + QUARANTINE_S + 1)
        assert decode.block_pool.num_used == 0
        req = KvTransferRequest.from_json(answer.request)
        with pytest.raises(DeadlineExceededError, match="never reserved, or expired"):
            decode.take("h4", req.slot, req.seq, STEP_S)
        # written, then taken under another hand-off's name: refused, and freed
        answer = decode.reserve(ReserveCall("h5", held.package, src.info))
        slot, seqno, _ = src.write(answer, held)
        with pytest.raises(KvReservationError, match="hand-off 'h5'"):
            decode.take("other", slot, seqno, STEP_S)
        assert decode.block_pool.num_used == 0 and decode.num_reserved == 0
        held.release()
        assert src_pool.num_used == 0
    finally:
        src.close()


def test_a_reservation_that_cannot_fit_is_refused(decode):
    src_pool = new_pool()
    src = KvEndpoint(src_pool, POOL_BYTES)
    try:
        seq = filled(src_pool, 11)
        held = seq.export_blocks()
        seq.release()
        other = BlockPool((0, 1), HEADS, DIM, DIM, torch.float32, "cpu", BLOCK)
        stranger = KvEndpoint(other, POOL_BYTES)
        try:
            with pytest.raises(KvReservationError, match="layouts do not match"):
                decode.reserve(ReserveCall("h6", held.package, stranger.info))
        finally:
            stranger.close()
        with pytest.raises(KvReservationError, match="malformed"):
            decode.reserve(ReserveCall("h7", held.package, '{"version": 1}'))
        assert decode.block_pool.num_used == 0 and decode.num_reserved == 0
        held.release()
    finally:
        src.close()
