"""Zero copy over nixl (csrc/transport/nixl/nixl_transport.h, "Zero copy"): a large put from the
transport's own registered memory is sent in place, read when the signal writes the queue, not
copied at put; a write through the transport into our own memory over such a queued source
sends the queue first, so the peer gets the bytes as they were at put; small puts and
borrow=False copy at put, as before. End to end on the slot protocol: a client sending from a
registered buffer and a server answering from the request slot the bytes landed in move every
payload in place, one WRITE per message, bit-exact. Real agents in two processes; seeds are
fixed; deadlines are seconds."""

from __future__ import annotations

import moecomm
import moecomm.wire.nixl
import pytest
import torch
from moecomm.testing import make_pattern
from moecomm.wire.client import ClientChannel
from moecomm.wire.views import region_bytes_view
from nixl_helpers import NIXL_OK, NIXL_WHY, SEED, nixl_identity_server, recv, spawn
from nixl_zero_copy_procs import LINE, payload_reporter

pytestmark = [
    pytest.mark.skipif(not NIXL_OK, reason=f"NIXL is not installed: {NIXL_WHY}"),
    pytest.mark.timeout(120),
]

# A source this large is sent in place (kBorrowMinBytes is 64 KiB); SMALL is copied at put.
LARGE = 256 << 10
SMALL = 4 << 10


def _bytes(seed: int, n: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def _open(reaper, nbytes: int, borrow: bool = True):
    """A receiver of `nbytes` in its own process, and our transport attached to it."""
    _p, conn, handle = spawn(reaper, payload_reporter, nbytes)
    t = moecomm.wire.nixl.open_nixl_transport(borrow=borrow)
    return conn, t, t.attach(handle)


def _received(conn, value: int, nbytes: int) -> torch.Tensor:
    """Tells the receiver the word value to wait for; the payload it then holds."""
    conn.send(value)
    got = recv(conn)
    assert len(got) == nbytes
    return torch.frombuffer(bytearray(got), dtype=torch.uint8)


def _stop(conn) -> None:
    conn.send("stop")
    assert recv(conn) == "bye"


@pytest.mark.parametrize(
    ("nbytes", "borrow", "in_place"),
    [(LARGE, True, True), (SMALL, True, False), (LARGE, False, False)],
    ids=["large", "small-copied", "borrow-off"],
)
def test_a_put_from_our_registered_memory_is_read_at_the_signal(reaper, nbytes, borrow, in_place):
    conn, t, peer = _open(reaper, nbytes, borrow)
    assert t.borrow is borrow
    src = t.create_region(nbytes)
    view = region_bytes_view(src)
    at_put, later = _bytes(SEED, nbytes), _bytes(SEED + 1, nbytes)
    view.copy_(at_put)
    t.put(peer, LINE, view.data_ptr(), nbytes)
    view.copy_(later)  # behind the transport's back, before the signal
    t.signal(peer, 0, 1)
    got = _received(conn, 1, nbytes)
    # In place: the WRITE read the region when the signal posted it. Copied: as it was at put.
    assert torch.equal(got, later if in_place else at_put)
    assert t.zero_copy_stats == ((1, nbytes) if in_place else (0, 0))
    _stop(conn)


@pytest.mark.parametrize("local_write", ["put", "signal", "compare_exchange", "put_region"])
def test_a_local_write_over_a_queued_source_sends_the_bytes_as_they_were_at_put(
    reaper, local_write
):
    """The slot protocol's poison mode overwrites the request slot a server just answered
    from before it signals the answer: the answer must still carry the request's bytes."""
    conn, t, peer = _open(reaper, LARGE)
    src = t.create_region(LARGE)
    view = region_bytes_view(src)
    at_put, other = _bytes(SEED + 2, LARGE), _bytes(SEED + 3, LARGE)
    view.copy_(at_put)
    t.put(peer, LINE, view.data_ptr(), LARGE)
    e = t.engine
    writes, notifs = e.transfers_by_op["WRITE"], e.notifications_sent
    if local_write == "put":
        t.put(src, 0, other.data_ptr(), LARGE)
    elif local_write == "signal":
        t.signal(src, 8, 0xABCD)
    elif local_write == "compare_exchange":
        word = int.from_bytes(bytes(at_put[8:16].numpy()), "little")
        assert t.compare_exchange(src, 8, word, 0xABCD)
    else:
        scratch = t.create_region(LARGE)
        region_bytes_view(scratch).copy_(other)
        t.put_region(src, 0, scratch, 0, LARGE)
    # The queue went out first, as one WRITE waited for (no notification: no word yet).
    assert (e.transfers_by_op["WRITE"] - writes, e.notifications_sent - notifs) == (1, 0)
    t.signal(peer, 0, 1)  # nothing queued: the word goes alone
    assert e.transfers_by_op["WRITE"] - writes == 1
    assert torch.equal(_received(conn, 1, LARGE), at_put)
    # And the local write itself happened.
    if local_write in ("put", "put_region"):
        assert torch.equal(view, other)
    else:
        assert int(view[8:16].view(torch.int64)) == 0xABCD
    _stop(conn)


def test_a_write_elsewhere_in_our_memory_leaves_the_queue_alone(reaper):
    """Only an overlap writes the queue early: a local write beside the source costs nothing."""
    conn, t, peer = _open(reaper, LARGE)
    src = t.create_region(LINE + LARGE)
    view = region_bytes_view(src)
    at_put = _bytes(SEED + 4, LARGE)
    view[LINE:].copy_(at_put)
    t.put(peer, LINE, view[LINE:].data_ptr(), LARGE)
    writes = t.engine.transfers_by_op["WRITE"]
    t.signal(src, 0, 7)  # our own word, in the line before the source
    assert t.engine.transfers_by_op["WRITE"] == writes
    view[LINE : LINE + 8] = 9  # a change the peer must see: the source is still read in place
    t.signal(peer, 0, 1)
    want = at_put.clone()
    want[:8] = 9
    assert torch.equal(_received(conn, 1, LARGE), want)
    assert t.engine.transfers_by_op["WRITE"] == writes + 1
    _stop(conn)


# The slot protocol end to end: 8 tokens x 7168 bf16 = 112 KiB of activations, sent in place.
LAYOUT = moecomm.SlotLayout(max_tokens=8, hidden=7168, topk=4)
CLIENT_ID = 5
ROUND_TRIPS = 30


def _registered_request_buffer(t, layout: moecomm.SlotLayout):
    """x [max_tokens, hidden], expert ids and scores as views of one registered host buffer
    (TensorRegion): what a client sends from to go without a staging copy."""
    n, h, k = layout.max_tokens, layout.hidden, layout.topk
    shapes = [((n, h), torch.bfloat16), ((n, k), torch.int32), ((n, k), torch.float32)]
    sizes = [a * b * torch.empty((), dtype=d).element_size() for (a, b), d in shapes]
    buf = torch.zeros(sum(sizes), dtype=torch.uint8)
    region = moecomm.wire.nixl.TensorRegion(t, buf)
    views, at = [], 0
    for (shape, dtype), size in zip(shapes, sizes, strict=True):
        views.append(buf[at : at + size].view(dtype).view(shape))
        at += size
    return region, views


@pytest.mark.parametrize("borrow", [True, False], ids=["in-place", "staged"])
def test_the_slot_protocol_moves_every_payload_in_place_and_bit_exact(reaper, borrow):
    _p, conn, (handle, _poison) = spawn(
        reaper, nixl_identity_server, LAYOUT.to_dict(), CLIENT_ID, 1, borrow
    )
    t = moecomm.wire.nixl.open_nixl_transport(borrow=borrow)
    client = ClientChannel(t, LAYOUT, CLIENT_ID, num_slots=1)
    client.connect(handle)
    conn.send(client.handle)
    _region, (xs, idss, scoress) = _registered_request_buffer(t, LAYOUT)
    gen = torch.Generator().manual_seed(SEED)
    e = t.engine

    def once(n):
        x, ids, scores, _ = make_pattern(CLIENT_ID, client.peek_seq(), n, LAYOUT, gen)
        xs[:n].copy_(x)
        idss[:n].copy_(ids)
        scoress[:n].copy_(scores)
        seq = client.send(0, xs[:n], idss[:n], scoress[:n])
        resp = client.wait(0, seq, timeout=20.0)
        assert resp.seq == seq and torch.equal(resp.activations, x), f"mismatch at seq {seq}"
        client.release(0)

    # The first message also makes this thread's staging (a flush of what is queued before it
    # is registered) and the prepared transfers: counted from the second on.
    once(LAYOUT.max_tokens)
    writes, in_place = e.transfers_by_op["WRITE"], t.zero_copy_stats[0]
    for i in range(ROUND_TRIPS):
        once(LAYOUT.max_tokens if i % 3 else 5)  # 5 tokens: 70 KiB, still over the threshold
    # One WRITE per request either way; in place, its activations were read from our buffer.
    assert e.transfers_by_op["WRITE"] - writes == ROUND_TRIPS
    assert t.zero_copy_stats[0] - in_place == (ROUND_TRIPS if borrow else 0)
    conn.send("stop")
    report = recv(conn)
    assert (report["served"], report["rejected"]) == (ROUND_TRIPS + 1, 0)
    # The server answered from the request slot the bytes landed in: no copy on its side either
    # (its first answer makes its staging too: one more WRITE, as on the client).
    assert report["in_place"][0] == (ROUND_TRIPS + 1 if borrow else 0)
    assert report["writes"] - (ROUND_TRIPS + 1) == (1 if borrow else 0)
