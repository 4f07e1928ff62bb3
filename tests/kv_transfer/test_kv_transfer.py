"""KV block transfers between registered pools (moecomm.wire.kv) over shm: two real processes,
bit-exact KV (whole and layer by layer), every refusal on the side that finds it, fuzzed
requests, poisoned completion words, a sender or a receiver killed mid-transfer, and the shared
memory freed afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import random
import time

import pytest
import torch
from kv_helpers import (
    DEATH_NOTICE_S,
    LAYERS,
    PARTS,
    RECEIVER_BLOCKS,
    SEED,
    SENDER_BLOCKS,
    WAIT_S,
    Peer,
    assert_blocks_equal,
    layout,
    reference,
)
from kv_peer_proc import fill
from moecomm.errors import DeadlineExceededError, PeerLostError, ProtocolError, RemoteError
from moecomm.wire.kv import (
    SEQ_SHIFT,
    BlockTransferError,
    KvLayout,
    KvPool,
    KvState,
    KvTransferRequest,
    block_runs,
)
from moecomm.wire.shm import ShmTransport, list_segments


@pytest.fixture
def transport():
    return ShmTransport()


@pytest.fixture
def peer():
    p = Peer(SENDER_BLOCKS, SEED)
    try:
        yield p
    finally:
        p.close()
        assert not list_segments(p.proc.pid), "the peer's shm segments outlived it"


@pytest.fixture
def pool(transport):
    p = KvPool(transport, layout(RECEIVER_BLOCKS))
    names = [r.handle.removeprefix("shm:") for r in (p.data, p.control, p.doorbell)]
    try:
        yield p
    finally:
        p.close()
        left = set(list_segments(os.getpid())) & set(names)
        assert not left, f"the pool's segments outlived close(): {left}"


def random_blocks(rng: random.Random, n: int):
    return rng.sample(range(SENDER_BLOCKS), n), rng.sample(range(RECEIVER_BLOCKS), n)


def test_blocks_arrive_bit_exact_across_processes(peer, pool):
    ref = reference(SEED, SENDER_BLOCKS)
    try:
        link = pool.connect(peer.info)
        peer.call("connect", pool.info().to_json())
        rng = random.Random(7)
        for n in (1, 5, SENDER_BLOCKS):
            src, dst = random_blocks(rng, n)
            with link.expect(dst) as recv:
                assert recv.poll() == KvState.WAITING
                rung = pool.doorbell_value()
                peer.call("send", recv.request.to_json(), src)
                # The doorbell moved: one sleeper can watch every transfer of the pool.
                assert pool.wait_any(rung, WAIT_S) > rung
                recv.wait(WAIT_S)
                assert recv.poll() == KvState.DONE
                assert_blocks_equal(pool, dst, ref, src)
        # Contiguous runs too: one copy per run and part.
        with link.expect(range(10, 18)) as recv:
            peer.call("send", recv.request.to_json(), list(range(3, 11)))
            recv.wait(WAIT_S)
            assert_blocks_equal(pool, list(range(10, 18)), ref, list(range(3, 11)))
        link.close()
    finally:
        ref.close()


def test_layer_by_layer(peer, pool):
    """A layer's blocks may go as soon as the layer is done; the receiver waits per layer and
    sees the other layers still pending."""
    ref = reference(SEED, SENDER_BLOCKS)
    try:
        link = pool.connect(peer.info)
        peer.call("connect", pool.info().to_json())
        src, dst = random_blocks(random.Random(11), 9)
        with link.expect(dst) as recv:
            seq = peer.call("start", recv.request.to_json(), src)
            peer.call("layer", seq, 1)
            recv.wait_layer(1, WAIT_S)
            assert_blocks_equal(pool, dst, ref, src, layers=[1])
            assert recv.poll() == KvState.TRANSFERRING
            with pytest.raises(DeadlineExceededError, match="layer 0 did not arrive"):
                recv.wait_layer(0, 0.05)
            peer.call("layer", seq, 0)
            recv.wait_layer(0, WAIT_S)
            with pytest.raises(DeadlineExceededError, match="transfer did not arrive"):
                recv.wait(0.05)
            peer.call("finish", seq)
            recv.wait(WAIT_S)
            assert_blocks_equal(pool, dst, ref, src)
        link.close()
    finally:
        ref.close()


def test_receiver_refuses_bad_destinations(transport, pool):
    other = KvPool(transport, layout(SENDER_BLOCKS))
    try:
        link = pool.connect(other.info())
        with pytest.raises(BlockTransferError, match="out of range"):
            link.expect([0, RECEIVER_BLOCKS])
        with pytest.raises(BlockTransferError, match="more than once"):
            link.expect([3, 4, 3])
        held = link.expect([5, 6])
        with pytest.raises(BlockTransferError, match="already reserved"):
            link.expect([7, 6])
        held.release()
        link.expect([7, 6]).release()  # released blocks can be reserved again
        link.close()
    finally:
        other.close()


def test_layout_mismatch_is_refused_on_connect(transport, pool):
    wrong = [
        KvLayout.paged(LAYERS + 1, 8, torch.bfloat16, PARTS),
        KvLayout.paged(LAYERS, 8, torch.float16, PARTS),
        KvLayout.paged(LAYERS, 8, torch.bfloat16, {"k": (2, 4, 96), "v": (2, 8, 96)}),
        KvLayout.paged(LAYERS, 8, torch.bfloat16, {"k": (2, 4, 96)}),
    ]
    for lay in wrong:
        other = KvPool(transport, lay)
        try:
            with pytest.raises(BlockTransferError, match="layouts do not match"):
                pool.connect(other.info().to_json())
            with pytest.raises(BlockTransferError, match="layouts do not match"):
                other.connect(pool.info())
        finally:
            other.close()


def test_sender_refusals_reach_the_receiver(transport, pool):
    """A request the sender cannot serve raises there and fails the receiver's wait with the
    sender's reason, at once (no deadline)."""
    other = KvPool(transport, layout(SENDER_BLOCKS))
    try:
        recv_link, send_link = pool.connect(other.info()), other.connect(pool.info())
        cases = [
            ([0, SENDER_BLOCKS], "source block .* out of range"),
            ([0], "1 source blocks for 2 destination"),
        ]
        for src, why in cases:
            recv = recv_link.expect([1, 2])
            with pytest.raises(BlockTransferError, match=why):
                send_link.send(recv.request, src)
            assert recv.poll() == KvState.FAILED
            t0 = time.monotonic()
            with pytest.raises(RemoteError, match=why):
                recv.wait(WAIT_S)
            assert time.monotonic() - t0 < WAIT_S / 2
            recv.release()
        # A request released by the receiver is refused by the sender before it writes.
        recv = recv_link.expect([1, 2])
        req = recv.request
        recv.release()
        with pytest.raises(BlockTransferError, match="no longer expects"):
            send_link.send(req, [0, 1])
        # A request for another pool is refused.
        recv = recv_link.expect([3])
        stray = KvTransferRequest("shm:moecomm-elsewhere", recv.slot, recv.seq, (3,))
        with pytest.raises(BlockTransferError, match="request is for pool"):
            send_link.send(stray, [0])
        recv.release()
        send_link.close()
        recv_link.close()
    finally:
        other.close()


def test_fuzzed_metadata_is_refused_cleanly(transport, pool):
    """Seeded mutations of a pool description and of a request: each is either refused with
    BlockTransferError (or a receiver-side RemoteError) or served correctly, never anything
    else, and the pools stay usable."""
    other = KvPool(transport, layout(SENDER_BLOCKS))
    fill(other, SEED)
    rng = random.Random(2024)
    junk = [-1, 0, 1, 2**63, 2**64, 3.5, "7", None, [], {}, True, RECEIVER_BLOCKS, 10**9]
    try:
        info = json.loads(pool.info().to_json())
        for _ in range(200):
            d = json.loads(json.dumps(info))
            key = rng.choice(["version", "transport", "max_transfers", "layout"])
            if key == "layout":
                lay = d["layout"]
                sub = rng.choice(["num_layers", "num_blocks", "parts"])
                lay[sub] = rng.choice(
                    [*junk, [[0, "k", [2, 4, 96], "bf16"]], [[9, "k", [2], "bfloat16"]]]
                )
            else:
                d[key] = rng.choice(junk)
            try:
                link = other.connect(json.dumps(d))
            except BlockTransferError:
                continue
            link.close()
        recv_link, send_link = pool.connect(other.info()), other.connect(pool.info())
        served = 0
        for _ in range(300):
            recv = recv_link.expect(rng.sample(range(RECEIVER_BLOCKS), 3))
            d = json.loads(recv.request.to_json())
            key = rng.choice(["slot", "seq", "dst", "pool", "version", None])
            if key == "dst":
                d["dst"] = rng.choice([[rng.choice(junk)] * 3, d["dst"][:2], d["dst"] * 2])
            elif key is not None:
                d[key] = rng.choice(junk)
            src = rng.sample(range(SENDER_BLOCKS), 3)
            try:
                send_link.send(json.dumps(d), src)
            except BlockTransferError:
                # Refused at the sender; the receiver's transfer is failed or still waiting.
                with contextlib.suppress(RemoteError, DeadlineExceededError):
                    recv.wait(0.0)
            else:
                recv.wait(WAIT_S)
                assert_blocks_equal(pool, list(recv.dst), other, src)
                served += 1
            recv.release()
        assert served > 0, "no fuzzed request was left intact"
        send_link.close()
        recv_link.close()
    finally:
        other.close()


def test_poisoned_completion_words(transport, pool):
    """Garbage in a completion word is never taken for completion: a word of another sequence
    number is ignored until the deadline, one of ours with an impossible state is a
    ProtocolError."""
    other = KvPool(transport, layout(SENDER_BLOCKS))
    rng = random.Random(99)
    try:
        link = pool.connect(other.info())
        g = pool.geometry
        for _ in range(50):
            recv = link.expect([1])
            offset = rng.choice([g.status(recv.slot), g.layer(recv.slot, 0)])
            garbage = rng.getrandbits(64)
            if rng.random() < 0.5:  # our sequence number with a random state
                garbage = (recv.seq << SEQ_SHIFT) | rng.choice([0, 4, 7, 200, 255])
            transport.signal(pool.control, offset, garbage)
            on_status = offset == g.status(recv.slot)
            if garbage >> SEQ_SHIFT == recv.seq:
                with pytest.raises(ProtocolError, match="expected"):
                    recv.wait(0.05) if on_status else recv.wait_layer(0, 0.05)
            else:
                with pytest.raises(DeadlineExceededError):
                    recv.wait(0.02) if on_status else recv.wait_layer(0, 0.02)
            recv.release()
        link.close()
    finally:
        other.close()


def test_killed_sender_mid_transfer_is_a_clear_error(pool):
    peer = Peer(SENDER_BLOCKS, SEED)
    pid = peer.proc.pid
    try:
        link = pool.connect(peer.info)
        peer.call("connect", pool.info().to_json())
        with link.expect([4, 5, 6]) as recv:
            seq = peer.call("start", recv.request.to_json(), [0, 1, 2])
            peer.call("layer", seq, 0)
            recv.wait_layer(0, WAIT_S)
            peer.kill()
            t0 = time.monotonic()
            with pytest.raises(PeerLostError, match="sending process died"):
                recv.wait(WAIT_S)
            assert time.monotonic() - t0 < DEATH_NOTICE_S
            assert recv.poll() == KvState.FAILED
        link.close()
    finally:
        peer.close()
    assert not list_segments(pid), "the dead sender's segments were not reaped"
    # The pool takes new transfers after the loss.
    self_link = pool.connect(pool.info())
    with self_link.expect([4, 5, 6]) as again:
        assert again.poll() == KvState.WAITING
    self_link.close()


def test_killed_receiver_is_reported_to_the_sender(transport):
    sender = KvPool(transport, layout(SENDER_BLOCKS))
    peer = Peer(RECEIVER_BLOCKS, SEED)  # the receiving end this time
    pid = peer.proc.pid
    try:
        peer.call("connect", sender.info().to_json())
        link = sender.connect(peer.info)
        request = peer.call("expect", [0, 1])
        send = link.start(request, [2, 3])
        send.layer(0)
        peer.kill()
        with pytest.raises(PeerLostError, match="receiving process died"):
            send.layer(1)
            send.finish()
        link.close()
    finally:
        peer.close()
        sender.close()
    assert not list_segments(pid), "the dead receiver's segments were not reaped"


def test_block_runs():
    assert block_runs([3, 4, 5, 9], [0, 1, 2, 3]) == [(3, 0, 3), (9, 3, 1)]
    assert block_runs([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]
    assert block_runs([], []) == []
