"""Stage channels between real processes: chunked packages arrive whole and bit-exact under slot
poisoning, a dead peer is an error on both ends (never a hang), a refused chunk reaches the
sender with its reason."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
from moecomm.errors import PeerLostError
from moecomm.wire.protocol import PAYLOAD_OFFSET
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
    ctx = mp.get_context("spawn")
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
            os.kill(p.pid, signal.SIGKILL)
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
    ctx = mp.get_context("spawn")
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
    the sender's ack wait raises too (the refusal names the receiver's id, which the sender
    does not take for its own) instead of waiting out its deadline."""
    _, parent = sender_proc(client_id=CLIENT)
    inbox = _connect(parent, client_id=CLIENT + 1)
    try:
        with pytest.raises(Exception, match="client id"):
            inbox.take("up", 1, DEADLINE_S)
        assert parent.poll(DEADLINE_S)
        status, what = parent.recv()
        assert status == "error" and "client id" in what, what
    finally:
        inbox.close()
