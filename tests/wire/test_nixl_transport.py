"""The nixl backend between real processes on this host, each with its own NIXL agent, on its
data path: payload before signal word under changing sizes and offsets, the slot protocol end to
end in poison mode, remote reads, loads and bounds, and the doorbell that kAdd on a peer's word
has to be. Dead and stopped peers and region handles: test_nixl_faults.py. Seeds are fixed;
deadlines are seconds (the machine is shared)."""

from __future__ import annotations

import random
import threading
import time

import moecomm
import moecomm.wire.nixl
import pytest
import torch
from moecomm.testing import make_pattern
from moecomm.wire.client import ClientChannel
from moecomm.wire.transport import SignalOp, WaitOp
from nixl_helpers import (
    HALF,
    HEADER,
    NIXL_OK,
    NIXL_WHY,
    READ_BYTES,
    SEED,
    START_TIMEOUT_S,
    STREAM_MESSAGES,
    WAIT_NS,
    S,
    doorbell_writer,
    filled,
    nixl_identity_server,
    recv,
    spawn,
    start,
    stream_message,
    stream_receiver,
)

pytestmark = [
    pytest.mark.skipif(not NIXL_OK, reason=f"NIXL is not installed: {NIXL_WHY}"),
    pytest.mark.timeout(60),  # the in-process tests; those with processes say 120
]


# ------------------------------------------------------- 1. put + signal + wait, bit-exact
@pytest.mark.timeout(120)
@pytest.mark.parametrize("senders", [1, 2])
def test_put_signal_wait_is_bit_exact_for_every_size_and_offset(reaper, senders):
    """With two sender threads each owns one half: puts are staged per thread, and a thread's
    signal must carry its own puts (and never wait on, or drop, the other's)."""
    _p, conn, handle = spawn(reaper, stream_receiver, SEED + senders, STREAM_MESSAGES)
    t = moecomm.wire.nixl.open_nixl_transport()
    ack = t.create_region(64)
    peer = t.attach(handle)
    conn.send(ack.handle)
    errors = []

    def send(slots):
        rng = random.Random(SEED + slots[0])
        acked = 0
        try:
            for i in range(STREAM_MESSAGES):
                slot = i % 2
                if slot not in slots:
                    continue
                # Message i-2 used this half: it must have been checked (ack i-1). Message
                # i-1 may still be in flight in the other half: checked while we write.
                while acked < i - 1:
                    acked = t.wait(ack, 0, WaitOp.NOT_EQUAL, acked, timeout_ns=WAIT_NS, peer=peer)
                offset, payload, pieces = stream_message(SEED + senders, i)
                base = HEADER + slot * HALF + offset
                rng.shuffle(pieces)  # the order of puts within a message must not matter
                for a, b in pieces:
                    t.put(peer, base + a, payload.data_ptr() + a, b - a)
                payload.zero_()  # put copied the bytes: our memory is ours again at once
                if rng.random() < 0.1:
                    t.fence()
                t.signal(peer, 8 * slot, i + 1)
        except Exception as exc:  # re-raised below
            errors.append(exc)

    if senders == 1:
        send((0, 1))
    else:
        threads = [threading.Thread(target=send, args=((s,),)) for s in (0, 1)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(WAIT_NS / S * 3)
    if errors:
        raise errors[0]
    assert recv(conn) == ("ok", STREAM_MESSAGES)


# ----------------------------------------------- 2. the slot protocol over nixl, poisoned
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("encoding", "hidden", "count"), [("bf16", 7168, 200), ("int8", 300, 200)])
def test_slot_protocol_round_trips_bit_exact_with_poisoned_slots(reaper, encoding, hidden, count):
    layout = moecomm.SlotLayout(max_tokens=16, hidden=hidden, topk=4, encoding=encoding)
    client_id, num_slots = 7, 2
    _p, conn, (handle, server_poison) = spawn(
        reaper, nixl_identity_server, layout.to_dict(), client_id, num_slots
    )
    t = moecomm.wire.nixl.open_nixl_transport()
    client = ClientChannel(t, layout, client_id, num_slots)
    # Poison mode on both ends: a read of a released slot sees 0xFF bytes, every time.
    assert client.response_ring.poison and client.request_ring.poison and server_poison
    client.connect(handle)
    conn.send(client.handle)
    gen = torch.Generator().manual_seed(SEED)
    sizes = torch.randint(1, layout.max_tokens + 1, (count,), generator=gen).tolist()
    inflight, sent, done = {}, 0, 0

    def send(slot):
        nonlocal sent
        n = sizes[sent]
        x, ids, scores, scales = make_pattern(client_id, client.peek_seq(), n, layout, gen)
        layer = sent % 61
        seq = client.send(slot, x, ids, scores, layer_id=layer, scales=scales)
        inflight[slot] = (seq, x, n, layer)
        sent += 1

    for slot in range(num_slots):
        send(slot)
    while inflight:
        for slot in sorted(inflight):
            seq, x, n, layer = inflight.pop(slot)
            resp = client.wait(slot, seq, timeout=20.0)
            assert (resp.seq, resp.num_tokens, resp.layer_id) == (seq, n, layer)
            want = x if x.dtype == resp.activations.dtype else x.to(resp.activations.dtype)
            assert torch.equal(resp.activations, want), f"payload mismatch at seq {seq}"
            client.release(slot)
            assert not torch.equal(resp.activations, want)  # poisoned: a late read fails
            done += 1
            if sent < count:
                send(slot)  # the slot goes back to the server the instant it is released
    assert done == count
    conn.send("stop")
    report = recv(conn)
    assert (report["served"], report["rejected"]) == (count, 0)


# -------------------------------------------------------- 3. remote read, load, bounds
@pytest.mark.timeout(120)
def test_remote_read_and_load_are_bit_exact_and_bounds_are_checked_first(reaper):
    _p, _conn, handle = spawn(reaper, filled, SEED)
    g = torch.Generator().manual_seed(SEED)
    want = torch.randint(0, 256, (READ_BYTES,), dtype=torch.uint8, generator=g)
    t = moecomm.wire.nixl.open_nixl_transport()
    peer = t.attach(handle)
    assert peer.size == READ_BYTES and not peer.owned
    out = torch.zeros(READ_BYTES, dtype=torch.uint8)
    t.read(peer, 0, out.data_ptr(), READ_BYTES)
    assert torch.equal(out, want)
    rng = random.Random(SEED)
    spans = [(READ_BYTES - 1, 1), (0, 0), (1, 4 << 20), (3, (4 << 20) - 64)]
    for _ in range(20):
        n = rng.choice([1, 7, 64, 4095, 65537, 1 << 20])
        spans.append((rng.randrange(0, READ_BYTES - n + 1), n))
    for off, n in spans:
        buf = torch.full((n + 2,), 0xA5, dtype=torch.uint8)
        t.read(peer, off, buf.data_ptr() + 1, n)
        assert torch.equal(buf[1 : n + 1], want[off : off + n]), (off, n)
        assert int(buf[0]) == 0xA5 and int(buf[n + 1]) == 0xA5  # nothing past the end
    for off in [0, 8, 4096, (READ_BYTES - 8) // 8 * 8]:
        word = int.from_bytes(bytes(want[off : off + 8].tolist()), "little")
        assert t.load(peer, off) == word

    # Refused before anything is queued or sent: no transfer, the peer's memory untouched.
    transfers = t.engine.transfers
    src = torch.zeros(64, dtype=torch.uint8)
    size = peer.size
    for call, message in [
        (lambda: t.put(peer, size - 4, src.data_ptr(), 8), "outside"),
        (lambda: t.put(peer, size + 1, src.data_ptr(), 0), "outside"),
        (lambda: t.put(peer, 2**63, src.data_ptr(), 8), "outside"),
        (lambda: t.put(peer, 8, src.data_ptr(), 2**64 - 8), "outside"),
        (lambda: t.signal(peer, 4, 1), "not 8-aligned"),
        (lambda: t.signal(peer, (size + 7) // 8 * 8, 1), "outside"),
        (lambda: t.signal(peer, 2**63, 1, SignalOp.ADD), "outside"),
        (lambda: t.read(peer, size - 63, src.data_ptr(), 64), "outside"),
        (lambda: t.read(peer, 2**64 - 1, src.data_ptr(), 2), "outside"),
        (lambda: t.load(peer, (size + 7) // 8 * 8), "outside"),
        (lambda: t.load(peer, 12), "not 8-aligned"),
        (lambda: t.wait(peer, 0, WaitOp.EQUAL, 1, timeout_ns=S), "own memory"),
        (lambda: t.compare_exchange(peer, 0, 0, 1), "atomically"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
    t.fence()  # nothing was queued by the refused puts
    assert t.engine.transfers == transfers
    t.read(peer, 0, out.data_ptr(), READ_BYTES)
    assert torch.equal(out, want)


# ------------------------------------------------ 4. kAdd on a peer's word: a doorbell
@pytest.mark.timeout(120)
def test_add_to_a_peer_word_from_two_writers_always_changes_it(reaper):
    t = moecomm.wire.nixl.open_nixl_transport()
    bell = t.create_region(64)
    started = [start(reaper, doorbell_writer, SEED + i) for i in range(2)]  # both boot at once
    writers = [(p, conn, recv(conn, START_TIMEOUT_S)) for p, conn in started]
    for _, conn, _ in writers:
        conn.send(bell.handle)
    seen = {0}
    counters: dict[int, int] = {}  # tag -> the last counter seen with it
    rings = [0, 0]

    def observe(v):
        assert v not in seen, f"the word went back to {v:#x}, a value already seen"
        seen.add(v)
        tag, counter = v >> 32, v & 0xFFFFFFFF
        assert tag & 1, f"{v:#x} is no kAdd value (its tag is odd)"
        assert counter > counters.get(tag, 0), "one writer's rings landed out of order"
        counters[tag] = counter
        return v

    # Lock step: every completed ring, from either writer, leaves a value never seen before.
    order = random.Random(SEED)
    last = 0
    for _ in range(30):
        w = order.randrange(2)
        conn = writers[w][1]
        conn.send(("ring", 1, 0))
        assert recv(conn) == "rung"
        rings[w] += 1
        # The ring went (a notification: it lands after the ring returns, never before a ring
        # sent earlier): the word changes to a new value, then stays until the next ring.
        last = observe(t.wait(bell, 0, WaitOp.NOT_EQUAL, last, timeout_ns=WAIT_NS))
    # Free running: both ring at once while we wait on the word like a server on its doorbell.
    per_writer = 100
    for _, conn, _ in writers:
        conn.send(("ring", per_writer, 0.001))
    wakes, finished = 0, 0
    while finished < 2:
        try:
            last = observe(t.wait(bell, 0, WaitOp.NOT_EQUAL, last, timeout_ns=S // 5))
            wakes += 1
        except moecomm.DeadlineExceededError:
            finished = sum(conn.poll() for _, conn, _ in writers)
    for _, conn, _ in writers:
        assert recv(conn) == "rung"
    rings = [r + per_writer for r in rings]
    v = t.load(bell, 0)
    if v != last:
        observe(v)
    assert wakes > per_writer // 2
    assert len(counters) == 2  # both writers were seen, each with its own tag
    # The final word is some writer's last ring: its counter is that writer's ring count.
    assert (v & 0xFFFFFFFF) in rings, (v, rings)
    assert max(counters.values()) <= max(rings)


@pytest.mark.timeout(60)
def test_an_idle_agent_leaves_the_cores_alone():
    """NIXL's wrapper runs the progress thread with no delay (a whole core per process, idle or
    not); moecomm sets one. An idle transport costs well under a tenth of a core."""
    t = moecomm.wire.nixl.open_nixl_transport()
    t.create_region(64)
    start = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - start < 0.25
