"""Failures: deadlines, dead peers, oversized and malformed requests, late answers."""

import os
import signal
import threading
import time

import moecomm
import pytest
import torch
from moecomm import _C, prefork
from moecomm.testing import make_pattern, spawn_identity_server
from moecomm.wire.client import ClientChannel
from moecomm.wire.protocol import SlotState, make_signal
from moecomm.wire.server import ServerChannel
from moecomm.wire.views import region_bytes_view
from proc_helpers import stop_process

LAYOUT = moecomm.SlotLayout(max_tokens=4, hidden=32, topk=2)
CLIENT = 21


def pair(transport, layout=LAYOUT):
    c = ClientChannel(transport, layout, CLIENT)
    s = ServerChannel(transport, layout, CLIENT)
    c.connect(s.handle)
    s.connect(c.handle)
    return c, s


def send_pattern(client, n=2, slot=0):
    x, ids, scores, scales = make_pattern(CLIENT, client.peek_seq(), n, client.layout)
    return client.send(slot, x, ids, scores, scales=scales), x


@pytest.mark.timeout(120)
def test_killed_server_gives_a_clear_error_fast_and_leaks_nothing(transport, reaper):
    server = reaper.server(spawn_identity_server(LAYOUT, CLIENT))
    client = ClientChannel(transport, LAYOUT, CLIENT)
    client.connect(server.handle)
    server.connect(client.handle)
    seq, x = send_pattern(client)
    assert torch.equal(client.wait(0, seq, 20).activations, x)
    # Freeze the server so the next request is never answered, then kill it mid-wait.
    stop_process(server.process.pid)
    seq, _ = send_pattern(client)
    threading.Timer(0.3, os.kill, (server.process.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(moecomm.PeerLostError, match="server process died"):
        client.wait(0, seq, timeout=30)
    assert time.monotonic() - start < 5  # detected by liveness, not by the 30 s deadline
    server.process.join(10)
    assert moecomm.list_segments(server.process.pid) == []


def _client_then_hang(conn, layout_dict):
    t = moecomm.ShmTransport()
    c = ClientChannel(t, moecomm.SlotLayout.from_dict(layout_dict), CLIENT)
    conn.send(c.handle)
    c.connect(conn.recv())
    conn.send("connected")
    time.sleep(600)


@pytest.mark.timeout(120)
def test_killed_client_is_noticed_by_the_server_and_reaped(transport, reaper):
    ctx = prefork.process_context()
    parent, child = ctx.Pipe()
    p = reaper.process(
        ctx.Process(target=_client_then_hang, args=(child, LAYOUT.to_dict()), daemon=True)
    )
    p.start()
    assert parent.poll(60)
    server = ServerChannel(transport, LAYOUT, CLIENT)
    server.connect(parent.recv())
    parent.send(server.handle)
    assert parent.recv() == "connected"
    assert server.wait(timeout=0.05) == []  # alive and idle: the deadline just passes
    os.kill(p.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(moecomm.PeerLostError, match="client process died"):
        server.wait(timeout=30)
    assert time.monotonic() - start < 5
    server.mark_offline()
    word = transport.load(server.region, server.request_ring.slot_offset(0))
    assert word & 0xFF == int(SlotState.OFFLINE)
    p.join(10)
    assert moecomm.list_segments(p.pid) == []


def test_deadline_expiring_is_a_timeout_error(transport):
    client, _server = pair(transport)
    seq, _ = send_pattern(client)
    start = time.monotonic()
    with pytest.raises(moecomm.DeadlineExceededError, match=f"seq {seq}: no response within"):
        client.wait(0, seq, timeout=0.2)
    assert 0.2 <= time.monotonic() - start < 2
    with pytest.raises(ValueError, match="timeout"):
        client.wait(0, seq, timeout=-1)


def test_oversized_request_is_refused_before_anything_is_written(transport):
    client, server = pair(transport)
    before = region_bytes_view(server.region).clone()
    n = LAYOUT.max_tokens + 1
    with pytest.raises(ValueError, match="exceeds the slot's max_tokens"):
        client.send(
            0,
            torch.zeros(n, 32, dtype=torch.bfloat16),
            torch.zeros(n, 2, dtype=torch.int32),
            torch.zeros(n, 2),
        )
    with pytest.raises(ValueError, match="topk"):
        client.send(
            0,
            torch.zeros(1, 32, dtype=torch.bfloat16),
            torch.zeros(1, 3, dtype=torch.int32),
            torch.zeros(1, 3),
        )
    assert torch.equal(region_bytes_view(server.region), before)
    assert client.peek_seq() == 1  # no sequence number was spent either


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"x": torch.zeros(2, 32)}, TypeError, "x must be torch.bfloat16"),
        ({"x": torch.zeros(2, 31, dtype=torch.bfloat16)}, ValueError, r"shape \[2, 32\]"),
        ({"expert_ids": torch.zeros(2, 2, dtype=torch.int64)}, TypeError, "torch.int32"),
        ({"scores": torch.zeros(2, 2, dtype=torch.float64)}, TypeError, "torch.float32"),
        ({"scales": torch.zeros(2, 1)}, ValueError, "unquantized"),
        ({"x": [[0.0] * 32]}, TypeError, "torch.Tensor"),
    ],
)
def test_bad_request_arguments_name_what_was_expected(transport, kwargs, error, message):
    client, _ = pair(transport)
    args = {
        "x": torch.zeros(2, 32, dtype=torch.bfloat16),
        "expert_ids": torch.zeros(2, 2, dtype=torch.int32),
        "scores": torch.zeros(2, 2),
    }
    args.update(kwargs)
    with pytest.raises(error, match=message):
        client.send(0, **args)


def test_non_contiguous_inputs_are_accepted(transport):
    client, server = pair(transport)
    x = torch.randn(32, 4).to(torch.bfloat16).t()  # [4, 32], not contiguous
    ids = torch.zeros(2, 4, dtype=torch.int32).t()
    seq = client.send(1, x, ids, torch.ones(4, 2))
    (req,) = server.wait(1.0)
    assert req.seq == seq and torch.equal(req.activations, x)


@pytest.mark.timeout(120)
def test_malformed_header_gets_an_error_and_the_server_keeps_serving(transport, reaper):
    server = reaper.server(spawn_identity_server(LAYOUT, CLIENT))
    client = ClientChannel(transport, LAYOUT, CLIENT)
    client.connect(server.handle)
    server.connect(client.handle)
    # A buggy client writes a header claiming 1000 tokens, then signals it.
    ring = client.request_ring
    h = moecomm.wire.protocol.SlotHeader()
    h.kind, h.encoding, h.num_tokens, h.hidden, h.topk = 1, 1, 1000, 32, 2
    h.client_id, h.seq = CLIENT, client.next_seq()
    raw = torch.frombuffer(bytearray(h.to_bytes()), dtype=torch.uint8)
    transport.put(client.server, ring.slot_offset(0) + 64, raw.data_ptr(), 64)
    transport.signal(
        client.server, ring.slot_offset(0), make_signal(SlotState.REQUEST_READY, h.seq)
    )
    transport.signal(client.server, 0, 1, moecomm.wire.transport.SignalOp.ADD)
    with pytest.raises(moecomm.RemoteError, match="exceeds the slot's max_tokens") as info:
        client.wait(0, h.seq, timeout=20)
    assert info.value.status == int(moecomm.ValidateCode.TOO_MANY_TOKENS)
    for slot in (0, 1):  # and it goes on serving the same client on every slot
        seq, x = send_pattern(client, n=3, slot=slot)
        assert torch.equal(client.wait(slot, seq, 20).activations, x)
    assert server.stop() == {"served": 2, "rejected": 1}


def test_late_answer_to_an_abandoned_request_is_dropped(transport):
    client, server = pair(transport)
    seq1, _ = send_pattern(client)
    (req1,) = server.wait(1.0)
    with pytest.raises(moecomm.DeadlineExceededError):
        client.wait(0, seq1, timeout=0.05)
    # The client gives up on seq1 and reuses the slot for seq2 before the server answers seq1.
    seq2, x2 = send_pattern(client)
    result = {}
    waiter = threading.Thread(target=lambda: result.update(r=client.wait(0, seq2, timeout=10)))
    waiter.start()
    time.sleep(0.2)  # let the waiter take its first look before the late answer lands
    server.respond(req1, torch.zeros(2, 32, dtype=torch.bfloat16))  # late, stale
    time.sleep(0.2)  # the waiter wakes on it, drops it and goes back to waiting
    # The late answer did not wipe the newer request: the server still finds seq2 ready.
    (req2,) = server.wait(5.0)
    assert req2.seq == seq2
    server.respond(req2, req2.activations)
    waiter.join(10)
    assert result["r"].seq == seq2 and torch.equal(result["r"].activations, x2)
    assert result["r"].stale_dropped == 1


def test_channels_refuse_regions_too_small_for_the_layout(transport):
    small = transport.create_region(64)
    c = ClientChannel(transport, LAYOUT, CLIENT)
    with pytest.raises(moecomm.ProtocolError, match="needs"):
        c.connect(small.handle)
    with pytest.raises(ValueError, match="num_slots"):
        ServerChannel(transport, LAYOUT, CLIENT, num_slots=0)
    assert _C.SlotRing(LAYOUT.config, 2, True).region_bytes > small.size
