"""One message, one transfer over nixl (issue 30, item 1): the signal word rides on the payload's
NIXL notification, which NIXL sends only once the WRITE is complete at the target
(csrc/transport/nixl/nixl_transport.h, "Ordering"). Counted here on the real agents of two
processes: one WRITE per request, the doorbell a notification with no transfer at all, prepared
transfers reposted instead of rebuilt; the old word-per-WRITE path still bit-exact; a notification
naming memory that is not ours is dropped, not stored. Seeds are fixed; deadlines are seconds."""

from __future__ import annotations

import moecomm
import moecomm.wire.nixl
import pytest
import torch
from moecomm.testing import make_pattern
from moecomm.wire.client import ClientChannel
from moecomm.wire.transport import SignalOp, WaitOp
from nixl_helpers import NIXL_OK, NIXL_WHY, SEED, WAIT_NS, nixl_identity_server, recv, spawn

pytestmark = [
    pytest.mark.skipif(not NIXL_OK, reason=f"NIXL is not installed: {NIXL_WHY}"),
    pytest.mark.timeout(120),
]

# Round trips counted: enough that a second transfer per message could not hide in the noise of
# the odd liveness probe (a READ, counted apart).
ROUND_TRIPS = 40
LAYOUT = moecomm.SlotLayout(max_tokens=8, hidden=256, topk=4)
CLIENT_ID = 3


def _round_trips(reaper, notify: bool, count: int):
    """`count` checked round trips against a nixl identity server in its own process; returns
    the client's engine counters before and after (WRITEs, READs, notifications, reposts)."""
    _p, conn, (handle, _poison) = spawn(
        reaper, nixl_identity_server, LAYOUT.to_dict(), CLIENT_ID, 1
    )
    t = moecomm.wire.nixl.open_nixl_transport(notify=notify)
    assert t.notify is notify
    client = ClientChannel(t, LAYOUT, CLIENT_ID, num_slots=1)
    client.connect(handle)
    conn.send(client.handle)
    gen = torch.Generator().manual_seed(SEED)
    e = t.engine

    def counters():
        return (
            e.transfers_by_op["WRITE"],
            e.transfers_by_op["READ"],
            e.notifications_sent,
            e.prepared_hits,
        )

    def once():
        x, ids, scores, scales = make_pattern(CLIENT_ID, client.peek_seq(), 5, LAYOUT, gen)
        seq = client.send(0, x, ids, scores, scales=scales)
        resp = client.wait(0, seq, timeout=WAIT_NS / 1e9)
        assert resp.seq == seq and torch.equal(resp.activations, x), f"mismatch at seq {seq}"
        client.release(0)

    once()  # the first message builds the prepared transfers
    before = counters()
    for _ in range(count):
        once()
    after = counters()
    conn.send("stop")
    assert recv(conn)["served"] == count + 1
    return before, after


def test_a_request_is_one_write_and_its_words_ride_on_notifications(reaper):
    (w0, _r0, n0, h0), (w1, _r1, n1, h1) = _round_trips(reaper, True, ROUND_TRIPS)
    # Payload + header + signal word: one WRITE; the doorbell: a notification, no transfer.
    assert w1 - w0 == ROUND_TRIPS
    assert n1 - n0 == 2 * ROUND_TRIPS
    # Every request after the first reposts the same prepared transfer.
    assert h1 - h0 >= ROUND_TRIPS


def test_the_word_per_write_path_stays_bit_exact_and_costs_three_writes(reaper):
    (w0, _r0, n0, _h0), (w1, _r1, n1, _h1) = _round_trips(reaper, False, ROUND_TRIPS)
    # Payload, signal word, doorbell: three dependent WRITEs, no notification (the baseline the
    # notification path is measured against in bench/wire/cross_host.py).
    assert w1 - w0 == 3 * ROUND_TRIPS
    assert n1 - n0 == 0


def _echo_words(conn):
    """A peer that waits for each word it is told of, answers with a doorbell, and reports the
    word and its neighbour (which no notification may have touched)."""
    t = moecomm.wire.nixl.open_nixl_transport()
    r = t.create_region(REGION_BYTES)
    conn.send(r.handle)
    back = t.attach(conn.recv())
    while (msg := conn.recv()) != "stop":
        t.wait(r, WORD, WaitOp.EQUAL, msg, timeout_ns=WAIT_NS, peer=back)
        conn.send(("seen", t.load(r, WORD), t.load(r, NEIGHBOUR)))
        t.signal(back, 0, 1, SignalOp.ADD)
    conn.send("bye")


REGION_BYTES, WORD, NEIGHBOUR = 256, 8, 16
ALL_ONES = (1 << 64) - 1


def test_a_notification_naming_memory_not_ours_is_dropped(reaper):
    """A peer may send words only into regions we published: an address past the region's end
    and a misaligned one inside it are dropped, and the word that follows still lands."""
    _p, conn, handle = spawn(reaper, _echo_words)
    t = moecomm.wire.nixl.open_nixl_transport()
    mine = t.create_region(64)
    peer = t.attach(handle)
    conn.send(mine.handle)
    bell = t.load(mine, 0)
    _, agent, base_hex = handle.split("|")[:3]
    base = int(base_hex, 16)
    # Past the end (still inside the region's mapped page, so only the bounds check stops it),
    # and misaligned so that a store would spill all-ones into the neighbour word.
    bad = [(base + REGION_BYTES, ALL_ONES), (base + WORD + 1, ALL_ONES)]
    assert t.engine.write_notify(agent, [], bad, WAIT_NS) == moecomm._C.NIXL_XFER_DONE
    t.signal(peer, WORD, 12345)
    conn.send(12345)
    assert recv(conn) == ("seen", 12345, 0)
    t.wait(mine, 0, WaitOp.NOT_EQUAL, bell, timeout_ns=WAIT_NS, peer=peer)
    conn.send("stop")
    assert recv(conn) == "bye"
