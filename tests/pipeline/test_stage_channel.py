"""Stage channels between real processes: chunked packages arrive whole and bit-exact under slot
poisoning, a dead peer is an error on both ends (never a hang), a refused chunk reaches the
sender with its reason, and so does one the receiver's own check refuses."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from moecomm import prefork
from moecomm.errors import PeerLostError, ProtocolError, RemoteError
from moecomm.wire.protocol import PAYLOAD_OFFSET, ResponseStatus
from moecomm.wire.shm import ShmTransport, reap_stale_segments
from moecomm.wire.stage import StageInbox, StageReceiver, StageSender, as_tensor, stage_layout

ROWS, HIDDEN, SLOTS, CLIENT = 4, 16, 2, 21
LAYOUT = stage_layout(ROWS, HIDDEN, "f32")
DEADLINE_S = 20.0
# Chunks per big package: more than the slots, so the sender must wait for acks mid-package.
BIG_CHUNKS = 7


def package(tag: int, numel: int) -> torch.Tensor:
    """Values that name their package and position: a chunk reordered or lost shows."""
    return torch.arange(numel, dtype=torch.int64) * 1000 + tag


def _sender(conn, client_id: int, tags: list[int], numel: int, then_hold: bool) -> None:
    t = ShmTransport()
    s = StageSender(t, LAYOUT, client_id, SLOTS, "test")
    conn.send(s.handle)
    recv_handle, doorbell = conn.recv()
    s.connect(recv_handle, doorbell)
    try:
        for tag in tags:
            s.send(tag, package(tag, numel), timeout=DEADLINE_S)
        s.flush(DEADLINE_S)
        conn.send(("ok", None))
    except Exception as e:  # the test reads what the sender saw
        conn.send(("error", f"{type(e).__name__}: {e}"))
    if then_hold:
        time.sleep(DEADLINE_S)
    s.close()


@pytest.fixture
def sender_proc():
    ctx = prefork.process_context()
    procs = []

    def start(client_id=CLIENT, tags=(1,), numel=HIDDEN, then_hold=False):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_sender, args=(child, client_id, list(tags), numel, then_hold))
        p.start()
        procs.append(p)
        return p, parent

    yield start
    for p in procs:
        if p.is_alive():
            p.kill()  # a forked one may be reaped already
        p.join(DEADLINE_S)
        reap_stale_segments(p.pid)


def _connect(parent, client_id=CLIENT):
    t = ShmTransport()
    inbox = StageInbox(t)
    r = StageReceiver(t, LAYOUT, client_id, SLOTS, "test")
    assert parent.poll(DEADLINE_S)
    r.connect(parent.recv())
    inbox.add("up", r)
    parent.send((r.handle, inbox.doorbell_handle))
    return inbox


def test_chunked_packages_arrive_whole_from_another_process(sender_proc):
    capacity = LAYOUT.request_slot_bytes - PAYLOAD_OFFSET
    numel = BIG_CHUNKS * capacity // 8 - 3  # the last chunk is a partial one
    _, parent = sender_proc(tags=(5, 6, 7), numel=numel)
    inbox = _connect(parent)
    try:
        for tag in (7, 5, 6):  # asked for out of order: the others wait in the inbox
            _, data = inbox.take("up", tag, DEADLINE_S)
            assert torch.equal(data.view(torch.int64), package(tag, numel))
        assert parent.poll(DEADLINE_S) and parent.recv() == ("ok", None)
    finally:
        inbox.close()


def test_activations_round_trip_as_rows(sender_proc):
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(0))
    t = ShmTransport()
    inbox = StageInbox(t)
    r = StageReceiver(t, LAYOUT, CLIENT, SLOTS)
    s = StageSender(t, LAYOUT, CLIENT, SLOTS)
    s.connect(r.handle, inbox.doorbell_handle)
    r.connect(s.handle)
    inbox.add(0, r)
    try:
        assert s.send(3, x) == 1  # one micro-batch is one chunk
        enc, data = inbox.take(0, 3, DEADLINE_S)
        assert torch.equal(as_tensor(enc, data, HIDDEN), x)
        s.flush(DEADLINE_S)
    finally:
        s.close()
        inbox.close()


def test_a_dead_receiver_is_an_error_for_the_sender(sender_proc):
    """The sender fills its slots, then waits for an ack that never comes: the receiver's
    process is gone, so it fails fast with PeerLostError instead of waiting out its deadline."""
    ctx = prefork.process_context()
    _, parent = sender_proc(tags=(1,), numel=BIG_CHUNKS * LAYOUT.request_slot_bytes // 8)
    # The receiver lives in a child that attaches and then is killed without reading.
    child_conn, mine = ctx.Pipe()
    holder = ctx.Process(target=_receiver_that_never_reads, args=(mine,))
    holder.start()
    try:
        assert parent.poll(DEADLINE_S)
        child_conn.send(parent.recv())
        assert child_conn.poll(DEADLINE_S)
        parent.send(child_conn.recv())
        time.sleep(0.5)  # the sender is blocked on an ack by now
        t0 = time.monotonic()
        os.kill(holder.pid, signal.SIGKILL)
        assert parent.poll(DEADLINE_S)
        status, what = parent.recv()
        assert status == "error" and "PeerLostError" in what, what
        assert time.monotonic() - t0 < DEADLINE_S / 2
    finally:
        holder.join(DEADLINE_S)
        reap_stale_segments(holder.pid)


def _receiver_that_never_reads(conn) -> None:
    t = ShmTransport()
    inbox = StageInbox(t)
    r = StageReceiver(t, LAYOUT, CLIENT, SLOTS)
    r.connect(conn.recv())
    conn.send((r.handle, inbox.doorbell_handle))
    time.sleep(DEADLINE_S * 3)


def test_a_dead_sender_is_an_error_for_the_receiver(sender_proc):
    p, parent = sender_proc(tags=(), then_hold=True)
    inbox = _connect(parent)
    try:
        assert parent.poll(DEADLINE_S) and parent.recv() == ("ok", None)
        os.kill(p.pid, signal.SIGKILL)
        p.join(DEADLINE_S)
        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match="died"):
            inbox.take("up", 1, DEADLINE_S)
        assert time.monotonic() - t0 < DEADLINE_S / 2
    finally:
        inbox.close()


def test_a_refused_chunk_reaches_the_sender_with_its_reason(sender_proc):
    """A receiver that expects another client id refuses the chunk: the receiver raises, and
    the sender's ack wait raises the receiver's reason (the refusal is answered under the id the
    chunk carries, so the sender reads it) instead of waiting out its deadline."""
    _, parent = sender_proc(client_id=CLIENT)
    inbox = _connect(parent, client_id=CLIENT + 1)
    try:
        with pytest.raises(ProtocolError, match="client id"):
            inbox.take("up", 1, DEADLINE_S)
        assert parent.poll(DEADLINE_S)
        status, what = parent.recv()
        assert status == "error" and what.startswith("RemoteError"), what
        assert f"the chunk says {CLIENT}, this channel's is {CLIENT + 1}" in what, what
    finally:
        inbox.close()


def test_a_chunk_the_callers_check_refuses_reaches_the_sender_with_its_reason():
    """poll(check): the check sees each valid chunk's header before the chunk is taken; a reason
    refuses it (a server-error status with that reason for the sender, ProtocolError for the
    receiver), None takes it as poll() without a check does."""
    t = ShmTransport()
    r = StageReceiver(t, LAYOUT, CLIENT, SLOTS, "rx")
    s = StageSender(t, LAYOUT, CLIENT, SLOTS, "tx")
    s.connect(r.handle)
    r.connect(s.handle)
    seen = []

    def check(h):
        seen.append((h.layer_id, h.num_tokens, h.topk, h.payload_bytes))
        return "tag 4 is not welcome here" if h.layer_id == 4 else None

    try:
        s.send(3, package(3, HIDDEN))
        (chunk,) = r.poll(check)
        assert (chunk.tag, chunk.index, chunk.count) == (3, 0, 1)
        assert torch.equal(chunk.data.view(torch.int64), package(3, HIDDEN))
        s.flush(DEADLINE_S)
        s.send(4, package(4, HIDDEN))
        with pytest.raises(ProtocolError, match="refused package 4 chunk 0/1: tag 4 is not"):
            r.poll(check)
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as err:
            s.flush(DEADLINE_S)
        assert time.monotonic() - t0 < DEADLINE_S / 2  # the answer was there: no deadline
        assert err.value.status == int(ResponseStatus.SERVER_ERROR)
        assert err.value.reason == "tag 4 is not welcome here"
        assert seen == [(3, 0, 1, HIDDEN * 8), (4, 0, 1, HIDDEN * 8)]
    finally:
        s.close()
        r.close()
