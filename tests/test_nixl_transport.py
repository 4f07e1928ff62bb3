"""The nixl backend between real processes on this host, each with its own NIXL agent: payload
before signal word under changing sizes and offsets, the slot protocol end to end in poison
mode, dead and stopped peers, region handles, remote reads, bounds, and the doorbell that kAdd
on a peer's word has to be. Seeds are fixed; deadlines are seconds (the machine is shared)."""

from __future__ import annotations

import gc
import itertools
import math
import multiprocessing as mp
import os
import random
import signal
import threading
import time

import moecomm
import moecomm.nixl
import pytest
import torch
from moecomm.errors import PeerLostError
from moecomm.slots import ClientChannel, ServerChannel
from moecomm.testing import check_pattern, make_pattern
from moecomm.transport import SignalOp, WaitOp, region_bytes_view
from proc_helpers import stop_process

NIXL_OK, NIXL_WHY = moecomm.nixl.available()
pytestmark = [
    pytest.mark.skipif(not NIXL_OK, reason=f"NIXL is not installed: {NIXL_WHY}"),
    pytest.mark.timeout(60),  # the in-process tests; those with processes say 120
]

SEED = 20240611
S = 1_000_000_000  # ns per second
START_TIMEOUT_S = 60.0
# Generous: a wait here only ends early on success; other test runs share the two cores.
WAIT_NS = 30 * S


# ---------------------------------------------------------------------------------- helpers
def start(reaper, target, *args):
    """Starts `target(conn, *args)` in a spawned process, killed at teardown whatever happens
    (the reaper fixture); returns (process, our end of the pipe)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = reaper.process(ctx.Process(target=target, args=(child, *args), daemon=True))
    p.start()
    child.close()
    return p, parent


def spawn(reaper, target, *args):
    """start(), then the process's first message: (process, pipe, message)."""
    p, conn = start(reaper, target, *args)
    return p, conn, recv(conn, START_TIMEOUT_S)


def recv(conn, timeout=WAIT_NS / S):
    assert conn.poll(timeout), "the peer process did not answer in time"
    return conn.recv()


def kill(p):
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert not p.is_alive()


# ------------------------------------------------------- 1. put + signal + wait, bit-exact
# The receiver's region: two signal words, then two halves a message goes into alternately.
HALF = 6 << 20
HEADER = 64
STREAM_BYTES = HEADER + 2 * HALF
STREAM_MESSAGES = 120
# Sizes at the edges of the transport's staging (4 MiB, a 64-byte scratch, 64-byte slots).
EDGE_SIZES = [1, 2, 63, 64, 65, 4096, (4 << 20) - 64, (4 << 20) - 63, 4 << 20, HALF]


def _message(seed: int, i: int):
    """Message i: (offset in its half, payload bytes in 1..255, piece boundaries). A payload
    byte is never 0, the value the receiver wipes a checked message with."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    if i < len(EDGE_SIZES):
        size = EDGE_SIZES[i]
    else:  # log-uniform over 1 B .. HALF: mostly small, now and then several MiB
        size = int(2 ** (torch.rand(1, generator=g).item() * math.log2(HALF)))
        size = min(max(size, 1), HALF)
    offset = int(torch.randint(0, HALF - size + 1, (1,), generator=g))
    payload = torch.randint(1, 256, (size,), dtype=torch.uint8, generator=g)
    pieces = int(torch.randint(1, 4, (1,), generator=g))
    cuts = sorted({0, size, *torch.randint(0, size + 1, (pieces - 1,), generator=g).tolist()})
    return offset, payload, list(itertools.pairwise(cuts))


def _stream_receiver(conn, seed, count):
    t = moecomm.nixl.NixlTransport()
    r = t.create_region(STREAM_BYTES)
    conn.send(r.handle)
    sender = t.attach(conn.recv())
    view = region_bytes_view(r)
    for i in range(count):
        slot = i % 2
        offset, want, _ = _message(seed, i)  # ready before the word lands: checked at once
        base = HEADER + slot * HALF + offset
        t.wait(r, 8 * slot, WaitOp.EQUAL, i + 1, timeout_ns=WAIT_NS, peer=sender)
        got = view[base : base + want.numel()]
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            conn.send(("mismatch", i, want.numel(), int(bad[0]), bad.numel()))
            return
        got.zero_()  # a stale byte of the next message here reads 0, never a payload byte
        t.signal(sender, 0, i + 1)  # ack: the sender may reuse this half
    conn.send(("ok", count))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("senders", [1, 2])
def test_put_signal_wait_is_bit_exact_for_every_size_and_offset(reaper, senders):
    """With two sender threads each owns one half: puts are staged per thread, and a thread's
    signal must carry its own puts (and never wait on, or drop, the other's)."""
    _p, conn, handle = spawn(reaper, _stream_receiver, SEED + senders, STREAM_MESSAGES)
    t = moecomm.nixl.NixlTransport()
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
                offset, payload, pieces = _message(SEED + senders, i)
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
def _nixl_identity_server(conn, layout_dict, client_id, num_slots):
    """moecomm.testing.serve_identity over nixl (that one builds its own ShmTransport)."""
    layout = moecomm.SlotLayout.from_dict(layout_dict)
    t = moecomm.nixl.NixlTransport()
    channel = ServerChannel(t, layout, client_id, num_slots)
    conn.send((channel.handle, channel.request_ring.poison))
    channel.connect(conn.recv())
    served = rejected = 0
    out_dtype = moecomm.protocol.ENCODING_DTYPE[layout.out_encoding]
    while True:
        try:
            reqs = channel.wait(timeout=0.05)
        except PeerLostError:
            break
        for req in reqs:
            problem = "invalid" if not req.valid else check_pattern(req, client_id)
            if problem is not None:
                channel.reject(req, moecomm.protocol.ResponseStatus.SERVER_ERROR, problem)
                rejected += 1
                continue
            y = req.activations
            channel.respond(req, y if y.dtype == out_dtype else y.to(out_dtype))
            served += 1
        if not reqs and conn.poll() and conn.recv() == "stop":
            break
    conn.send({"served": served, "rejected": rejected})


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("encoding", "hidden", "count"), [("bf16", 7168, 200), ("int8", 300, 200)])
def test_slot_protocol_round_trips_bit_exact_with_poisoned_slots(reaper, encoding, hidden, count):
    layout = moecomm.SlotLayout(max_tokens=16, hidden=hidden, topk=4, encoding=encoding)
    client_id, num_slots = 7, 2
    _p, conn, (handle, server_poison) = spawn(
        reaper, _nixl_identity_server, layout.to_dict(), client_id, num_slots
    )
    t = moecomm.nixl.NixlTransport()
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
    assert recv(conn) == {"served": count, "rejected": 0}


# ---------------------------------------------------------- 3. dead and stopped peers
def _ringer(conn, seed):
    """Rings the parent's word (a put, then kAdd on the word) until killed."""
    t = moecomm.nixl.NixlTransport()
    r = t.create_region(4096)
    conn.send((r.handle, t.agent_name))
    parent = t.attach(conn.recv())
    rng = random.Random(seed)
    buf = torch.arange(256, dtype=torch.uint8)
    while True:
        t.put(parent, 64 + rng.randrange(0, 3000), buf.data_ptr(), rng.randrange(1, 256))
        t.signal(parent, 0, 1, SignalOp.ADD)
        time.sleep(rng.random() * 0.002)


@pytest.mark.timeout(120)
def test_killed_peer_fails_waits_puts_and_reads_fast(reaper):
    p, conn, (handle, _) = spawn(reaper, _ringer, SEED)
    t = moecomm.nixl.NixlTransport(xfer_timeout_s=20)
    mine = t.create_region(4096)
    peer = t.attach(handle)
    conn.send(mine.handle)
    assert t.peer_alive(peer)
    # Killed at a random point of its ringing, while we wait on it.
    delay = random.Random(SEED).uniform(0.2, 1.0)
    killed_at = []

    def killer():
        killed_at.append(time.monotonic())
        os.kill(p.pid, signal.SIGKILL)

    timer = threading.Timer(delay, killer)
    timer.start()
    try:
        last, wakes = 0, 0
        with pytest.raises(moecomm.PeerLostError, match="peer died"):
            while True:
                last = t.wait(mine, 0, WaitOp.NOT_EQUAL, last, timeout_ns=WAIT_NS, peer=peer)
                wakes += 1
        assert wakes > 0  # it was ringing when it died
        assert time.monotonic() - killed_at[0] < 5  # by liveness, not the 30 s deadline
    finally:
        timer.cancel()
    p.join(10)
    src = torch.ones(64, dtype=torch.uint8)
    start = time.monotonic()
    with pytest.raises(moecomm.PeerLostError, match="gone"):
        t.put(peer, 0, src.data_ptr(), 64)
        t.signal(peer, 8, 1)
    with pytest.raises(moecomm.PeerLostError):
        t.signal(peer, 8, 1, SignalOp.ADD)
    with pytest.raises(moecomm.PeerLostError):
        t.read(peer, 0, src.data_ptr(), 64)
    with pytest.raises(moecomm.PeerLostError):
        t.load(peer, 8)
    assert not t.peer_alive(peer)
    with pytest.raises(moecomm.PeerLostError):  # a dead peer is noticed at the first check
        t.wait(mine, 8, WaitOp.EQUAL, 1, timeout_ns=WAIT_NS, peer=peer)
    assert time.monotonic() - start < 5  # none of them waited for the transfer deadline
    assert isinstance(PeerLostError("x"), ConnectionError)


def _echo(conn):
    """Answers every value written into its word 0 by writing it into the parent's word 0."""
    t = moecomm.nixl.NixlTransport()
    r = t.create_region(4096)
    conn.send(r.handle)
    parent = t.attach(conn.recv())
    last = 0
    while True:
        last = t.wait(r, 0, WaitOp.NOT_EQUAL, last, timeout_ns=600 * S, peer=parent)
        t.signal(parent, 0, last)


@pytest.mark.timeout(120)
def test_stopped_peer_never_hangs_a_waiter_and_answers_after_sigcont(reaper):
    p, conn, handle = spawn(reaper, _echo)
    t = moecomm.nixl.NixlTransport(xfer_timeout_s=3)
    mine = t.create_region(4096)
    peer = t.attach(handle)
    conn.send(mine.handle)
    t.signal(peer, 0, 1)
    assert t.wait(mine, 0, WaitOp.EQUAL, 1, timeout_ns=WAIT_NS, peer=peer) == 1
    stop_process(p.pid)
    try:
        start_s = time.monotonic()
        try:  # one-sided: it may land in the stopped process or time out, never hang
            t.signal(peer, 0, 2)
            rung = True
        except moecomm.TimeoutError:
            rung = False
        assert time.monotonic() - start_s < 3 + 5
        start_s = time.monotonic()
        # Stopped is not dead: the wait ends at its own deadline (probes are capped by it).
        with pytest.raises(moecomm.TimeoutError):
            t.wait(mine, 0, WaitOp.EQUAL, 2, timeout_ns=S + S // 2, peer=peer)
        elapsed = time.monotonic() - start_s
        assert 1.5 <= elapsed < 1.5 + 2, elapsed
    finally:
        os.kill(p.pid, signal.SIGCONT)
    if not rung:
        t.signal(peer, 0, 2)
    # Resumed, it answers again.
    assert t.wait(mine, 0, WaitOp.EQUAL, 2, timeout_ns=WAIT_NS) == 2
    t.signal(peer, 0, 3)
    assert t.wait(mine, 0, WaitOp.EQUAL, 3, timeout_ns=WAIT_NS) == 3


# nixl_transport.h: kProbeTimeoutNs.
PROBE_S = 2


@pytest.mark.timeout(120)
def test_stopped_peer_is_a_timeout_not_a_lost_peer(reaper):
    p, _conn, (_agent, handles) = spawn(reaper, _regions, 1)
    t = moecomm.nixl.NixlTransport(xfer_timeout_s=3)
    mine = t.create_region(64)
    peer = t.attach(handles[0])
    assert t.load(peer, 0) == 0x0101010101010101  # connected
    stop_process(p.pid)
    try:
        start_s = time.monotonic()
        with pytest.raises(moecomm.TimeoutError):
            t.wait(mine, 0, WaitOp.EQUAL, 1, timeout_ns=PROBE_S * S + S, peer=peer)
        assert time.monotonic() - start_s < PROBE_S + 1 + 2  # at its deadline
    finally:
        os.kill(p.pid, signal.SIGCONT)
    assert t.peer_alive(peer)  # stopped is not dead


# --------------------------------------------------------------------------- 4. handles
# Region handles: "nixl|<agent>|<address hex>|<bytes>|<memory: host or cuda:N>|<blob>".
MALFORMED = [
    ("", "not a nixl region handle"),
    ("shm:moecomm-1-2-3-deadbeef", "not a nixl region handle"),
    ("nixl|agent|7f00|4096|host", "not a nixl region handle"),  # no blob
    ("nixl|agent|7f00|4096|QUFB", "not a nixl region handle"),  # no memory kind
    ("nixl|agent|7f00|4096|host|QUFB|extra", "not a nixl region handle"),
    ("nixl||7f00|4096|host|QUFB", "not a nixl region handle"),  # no agent
    ("nixl|agent|7f00|4096|host|", "not a nixl region handle"),  # empty blob
    ("NIXL|agent|7f00|4096|host|QUFB", "not a nixl region handle"),
    ("nixl|agent|zz|4096|host|QUFB", "bad address or size"),
    ("nixl|agent|7f00g|4096|host|QUFB", "bad address"),
    ("nixl|agent||4096|host|QUFB", "bad address or size"),
    ("nixl|agent|7f00|0x10|host|QUFB", "bad address or size"),
    ("nixl|agent|7f00|0|host|QUFB", "bad address or size"),
    ("nixl|agent|7f00|99999999999999999999999|host|QUFB", "bad address or size"),
    ("nixl|agent|7f00|4096|gpu|QUFB", "unknown memory"),
    ("nixl|agent|7f00|4096|cuda:x|QUFB", "unknown memory"),
    ("nixl|agent|7f00|4096||QUFB", "unknown memory"),
    # No sign, no blanks (std::stoull would take them: "-1" would be 2^64-1 bytes).
    ("nixl|agent|-7f00|4096|host|QUFB", "bad address or size"),
    ("nixl|agent|7f00|-4096|host|QUFB", "bad address or size"),
    ("nixl|agent| 7f00|4096|host|QUFB", "bad address or size"),
    ("nixl|agent|7f00|4096|host|!!not base64!!", "not base64"),
    ("nixl|agent|7f00|4096|host|QUF", "not base64"),  # truncated base64
]


def _refuse(handle, message):
    t = moecomm.nixl.NixlTransport()
    try:
        with pytest.raises(ValueError, match=message):
            t.attach(handle)
    finally:
        assert t.peers() == []
        r = t.create_region(64)  # nothing broke
        assert t.attach(r.handle).size == 64


@pytest.mark.parametrize(("handle", "message"), MALFORMED)
def test_malformed_handles_are_value_errors(handle, message):
    _refuse(handle, message)


def test_a_blob_that_is_no_nixl_metadata_is_refused_cleanly():
    # Well-formed base64 of something that is not an agent's metadata: NIXL refuses it. The
    # transport must survive it (and attach nothing).
    t = moecomm.nixl.NixlTransport()
    with pytest.raises(ValueError, match="no loadable metadata"):
        t.attach("nixl|agent|7f00|4096|host|Z2FyYmFnZQ==")
    assert t.peers() == []
    r = t.create_region(64)
    assert t.attach(r.handle).size == 64


def test_own_region_attaches_as_a_local_alias():
    t = moecomm.nixl.NixlTransport()
    r = t.create_region(4096)
    alias = t.attach(r.handle)
    assert not alias.owned and alias.size == 4096 and alias.handle == r.handle
    assert t.peers() == []  # ourselves: no peer loaded into the agent
    transfers = t.engine.transfers
    src = torch.arange(1, 101, dtype=torch.uint8)
    t.put(alias, 1000, src.data_ptr(), 100)
    t.signal(alias, 8, 40)
    t.signal(alias, 8, 2, SignalOp.ADD)  # our own word: a true add
    view = region_bytes_view(r)
    assert torch.equal(view[1000:1100], src)
    assert t.load(r, 8) == 42 and t.load(alias, 8) == 42
    out = torch.zeros(100, dtype=torch.uint8)
    t.read(alias, 1000, out.data_ptr(), 100)
    assert torch.equal(out, src)
    assert t.peer_alive(alias)
    assert t.wait(r, 8, WaitOp.EQUAL, 42, timeout_ns=0) == 42
    assert t.engine.transfers == transfers  # all of it in our own memory
    fields = r.handle.split("|")  # nixl|agent|address|bytes|memory|blob
    assert fields[:2] == ["nixl", t.agent_name] and fields[3] == "4096"
    wrong_size = [*fields[:3], "4095", *fields[4:]]
    with pytest.raises(moecomm.SegmentNotFoundError, match="no region of ours"):
        t.attach("|".join(wrong_size))  # right address, wrong size
    wrong_addr = [*fields[:2], f"{int(fields[2], 16) + 4096:x}", *fields[3:]]
    with pytest.raises(moecomm.SegmentNotFoundError, match="no region of ours"):
        t.attach("|".join(wrong_addr))


def _regions(conn, count):
    t = moecomm.nixl.NixlTransport()
    regions = [t.create_region(4096 * (i + 1)) for i in range(count)]
    for i, r in enumerate(regions):
        region_bytes_view(r)[:8] = i + 1
    conn.send((t.agent_name, [r.handle for r in regions]))
    conn.recv()  # until told (or killed)


@pytest.mark.timeout(120)
def test_peers_lists_a_peer_until_its_last_region_is_released(reaper):
    _p, _conn, (agent, handles) = spawn(reaper, _regions, 2)
    t = moecomm.nixl.NixlTransport()
    assert agent != t.agent_name and t.peers() == []
    a = t.attach(handles[0])
    assert t.peers() == [agent]
    b, c = t.attach(handles[0]), t.attach(handles[1])
    assert t.peers() == [agent] and c.size == 8192
    assert t.load(b, 0) == 0x0101010101010101 and t.load(c, 0) == 0x0202020202020202
    del a, b
    gc.collect()
    assert t.peers() == [agent]  # c still holds it
    assert t.load(c, 0) == 0x0202020202020202
    del c
    gc.collect()
    assert t.peers() == []
    # Forgotten, and loaded again from a handle as if new.
    d = t.attach(handles[1])
    assert t.peers() == [agent] and t.load(d, 0) == 0x0202020202020202
    del d
    gc.collect()
    assert t.peers() == []


@pytest.mark.timeout(120)
def test_handle_of_a_dead_agent_fails_at_attach_or_first_use(reaper):
    p, _conn, (_agent, handles) = spawn(reaper, _regions, 1)
    kill(p)
    t = moecomm.nixl.NixlTransport(xfer_timeout_s=5)
    start = time.monotonic()
    try:
        peer = t.attach(handles[0])
    except moecomm.PeerLostError as exc:  # NIXL could not reach it to load it
        assert "unreachable" in str(exc)
    else:
        with pytest.raises(moecomm.PeerLostError):
            t.signal(peer, 0, 1)
        assert not t.peer_alive(peer)
    assert time.monotonic() - start < 5 + 5
    r = t.create_region(64)  # and the transport still works
    assert t.attach(r.handle).size == 64


# -------------------------------------------------------- 5. remote read, load, bounds
READ_BYTES = (10 << 20) + 13  # more than the staging buffer: read in chunks; an odd size


def _filled(conn, seed):
    t = moecomm.nixl.NixlTransport()
    r = t.create_region(READ_BYTES)
    g = torch.Generator().manual_seed(seed)
    region_bytes_view(r).copy_(torch.randint(0, 256, (READ_BYTES,), dtype=torch.uint8, generator=g))
    conn.send(r.handle)
    conn.recv()


@pytest.mark.timeout(120)
def test_remote_read_and_load_are_bit_exact_and_bounds_are_checked_first(reaper):
    _p, _conn, handle = spawn(reaper, _filled, SEED)
    g = torch.Generator().manual_seed(SEED)
    want = torch.randint(0, 256, (READ_BYTES,), dtype=torch.uint8, generator=g)
    t = moecomm.nixl.NixlTransport()
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


# ------------------------------------------------ 6. kAdd on a peer's word: a doorbell
def _bell(conn, seed):
    """Rings the parent's word 0 with kAdd on command: ("ring", n, max_sleep_s)."""
    t = moecomm.nixl.NixlTransport()
    conn.send(t.agent_name)
    peer = t.attach(conn.recv())
    rng = random.Random(seed)
    while (cmd := conn.recv())[0] == "ring":
        _, n, max_sleep = cmd
        for _ in range(n):
            t.signal(peer, 0, 1, SignalOp.ADD)
            if max_sleep:
                time.sleep(rng.random() * max_sleep)
        conn.send("rung")


@pytest.mark.timeout(120)
def test_add_to_a_peer_word_from_two_writers_always_changes_it(reaper):
    t = moecomm.nixl.NixlTransport()
    bell = t.create_region(64)
    started = [start(reaper, _bell, SEED + i) for i in range(2)]  # both boot at once
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
    for _ in range(30):
        w = order.randrange(2)
        conn = writers[w][1]
        conn.send(("ring", 1, 0))
        assert recv(conn) == "rung"
        rings[w] += 1
        last = observe(t.load(bell, 0))  # the ring returned: it has landed
    # Free running: both ring at once while we wait on the word like a server on its doorbell.
    per_writer = 100
    for _, conn, _ in writers:
        conn.send(("ring", per_writer, 0.001))
    wakes, finished = 0, 0
    while finished < 2:
        try:
            last = observe(t.wait(bell, 0, WaitOp.NOT_EQUAL, last, timeout_ns=S // 5))
            wakes += 1
        except moecomm.TimeoutError:
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
