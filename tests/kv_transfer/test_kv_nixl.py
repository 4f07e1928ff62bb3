"""KV block transfers over the nixl transport (moecomm.wire.kv on NIXL, the cross-host path):
two processes with their own NIXL agents; library pools and engine tensors registered part by
part; bit-exact KV whole and layer by layer; a sender killed mid-transfer is a PeerLostError on
the receiver; a nixl pool and an shm pool refuse each other. (Across network namespaces: the
bench, bench/wire/kv_transfer.py --nixl.)"""

from __future__ import annotations

import json
import random
import time

import pytest
from kv_helpers import (
    RECEIVER_BLOCKS,
    SEED,
    SENDER_BLOCKS,
    WAIT_S,
    Peer,
    assert_blocks_equal,
    layout,
    reference,
)
from kv_peer_proc import engine_tensors
from moecomm.errors import PeerLostError
from moecomm.wire.kv import BlockTransferError, KvPool, KvState
from moecomm.wire.nixl import available, open_nixl_transport
from moecomm.wire.shm import ShmTransport

ok, why = available()
pytestmark = pytest.mark.skipif(not ok, reason=f"NIXL is not installed: {why}")
# A nixl waiter probes its peer every 50 ms (nixl_transport.h kPeerCheckIntervalNs); a dead
# peer's agent is noticed within a few probes, far sooner than this on a loaded host.
NIXL_DEATH_NOTICE_S = 10.0


@pytest.fixture(scope="module")
def transport():
    return open_nixl_transport()


@pytest.mark.parametrize(
    ("ours", "theirs"), [("", ""), ("blocks_inner", "blocks_outer")], ids=["pools", "tensors"]
)
def test_blocks_arrive_bit_exact_over_nixl(transport, ours, theirs):
    lay = layout(RECEIVER_BLOCKS)
    pool = KvPool(transport, lay, tensors=engine_tensors(lay, ours) if ours else None)
    assert pool.info().memory == ("parts" if ours else "region")
    peer = Peer(SENDER_BLOCKS, SEED, theirs, transport="nixl")
    ref = reference(SEED, SENDER_BLOCKS)
    try:
        link = pool.connect(peer.info)
        peer.call("connect", pool.info().to_json(), timeout=60)
        rng = random.Random(9)
        for n in (1, 6, SENDER_BLOCKS):
            src, dst = rng.sample(range(SENDER_BLOCKS), n), rng.sample(range(RECEIVER_BLOCKS), n)
            with link.expect(dst) as recv:
                peer.call("send", recv.request.to_json(), src, timeout=60)
                recv.wait(WAIT_S)
                assert recv.poll() == KvState.DONE
                assert_blocks_equal(pool, dst, ref, src)
        with link.expect(range(20, 28)) as recv:
            seq = peer.call("start", recv.request.to_json(), list(range(8)), timeout=60)
            peer.call("layer", seq, 1, timeout=60)
            recv.wait_layer(1, WAIT_S)
            assert_blocks_equal(pool, list(range(20, 28)), ref, list(range(8)), layers=[1])
            peer.call("layer", seq, 0, timeout=60)
            peer.call("finish", seq, timeout=60)
            recv.wait(WAIT_S)
            assert_blocks_equal(pool, list(range(20, 28)), ref, list(range(8)))
        # And back: our blocks into the peer's pool, then home again into other blocks.
        request = peer.call("expect", [0, 1, 2], timeout=60)
        link.send(request, [20, 21, 22])
        peer.call("wait", json.loads(request)["seq"], WAIT_S, timeout=60)
        with link.expect([30, 31, 32]) as recv:
            peer.call("send", recv.request.to_json(), [0, 1, 2], timeout=60)
            recv.wait(WAIT_S)
            assert_blocks_equal(pool, [30, 31, 32], ref, list(range(3)))
        link.close()
    finally:
        ref.close()
        peer.close()
        pool.close()


def test_killed_sender_over_nixl(transport):
    pool = KvPool(transport, layout(RECEIVER_BLOCKS))
    peer = Peer(SENDER_BLOCKS, SEED, transport="nixl")
    try:
        link = pool.connect(peer.info)
        peer.call("connect", pool.info().to_json(), timeout=60)
        with link.expect([4, 5]) as recv:
            seq = peer.call("start", recv.request.to_json(), [0, 1], timeout=60)
            peer.call("layer", seq, 0, timeout=60)
            recv.wait_layer(0, WAIT_S)
            peer.kill()
            t0 = time.monotonic()
            with pytest.raises(PeerLostError):
                recv.wait(WAIT_S)
            assert time.monotonic() - t0 < NIXL_DEATH_NOTICE_S
        link.close()
    finally:
        peer.close()
        pool.close()


def test_nixl_and_shm_pools_refuse_each_other(transport):
    a = KvPool(transport, layout(8))
    b = KvPool(ShmTransport(), layout(8))
    lay = layout(8)
    c = KvPool(ShmTransport(), lay, tensors=engine_tensors(lay, "blocks_inner"))
    try:
        with pytest.raises(BlockTransferError, match="speaks nixl"):
            b.connect(a.info().to_json())
        with pytest.raises(BlockTransferError, match="speaks shm"):
            a.connect(b.info().to_json())
        with pytest.raises(BlockTransferError, match="speaks shm"):
            a.connect(c.info().to_json())
    finally:
        for p in (a, b, c):
            p.close()
