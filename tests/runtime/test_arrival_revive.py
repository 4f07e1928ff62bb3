"""A device writer whose peer is marked dead for one message and alive again, without a reset,
against the host readers (csrc/transport/slot_read.cc: poll_requests' arrival check and
wait_response's wait_arrival).

The writer is a host stand-in for the kernels' finish_message (message_io.cuh): a message's
payload is dealt to warps in chunks (warp w puts chunks w, w + W, ...), each warp reads the
liveness mask once and puts its chunks only if it found the peer alive, and the last warp's
decision is ``_C.stamp_message`` — the function the kernels call (protocol/layout.h). So what is
checked here is the device writer's own bookkeeping:

- a message that was not sent (the peer was dead) must not advance the writer's arrival total,
  or every later target is out of reach and the reader times out on a healthy peer;
- chunks that did land (warps that found the peer alive before it was marked dead) must count,
  or they complete a later message before its own last chunk.
"""

import random
import time

import moecomm
import pytest
import torch
from moecomm import _C
from moecomm.errors import DeadlineExceededError
from moecomm.wire.client import ClientChannel
from moecomm.wire.protocol import Encoding, MessageKind, SlotState, make_signal
from moecomm.wire.server import ServerChannel
from moecomm.wire.views import region_bytes_view

LAYOUT = moecomm.SlotLayout(max_tokens=16, hidden=64, topk=2)
CLIENT = 41
CHUNK = 128
WARPS = 4
# How long a reader is given for a message whose every byte has landed (generous: it is
# immediate) and for one the test expects never to arrive.
READ_S = 2.0
ABSENT_S = 0.05


def pair(transport):
    c = ClientChannel(transport, LAYOUT, CLIENT)
    s = ServerChannel(transport, LAYOUT, CLIENT)
    c.connect(s.handle)
    s.connect(c.handle)
    return c, s


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class DeviceWriter:
    """finish_message's bookkeeping on the host, writing one peer region's slots."""

    def __init__(self, transport, region, slot_bytes: int):
        self.t, self.region, self.slot_bytes = transport, region, slot_bytes
        self.arrival_sent: dict[int, int] = {}  # slot -> the writer's total (workspace word)
        self.mem = region_bytes_view(region)  # the counter word, added to as a GPU's atomics do

    def _slot(self, slot: int) -> int:
        return _C.slot_offset(self.slot_bytes, slot)

    def put(
        self,
        slot: int,
        kind: MessageKind,
        payload: bytes,
        warps_alive,
        alive_at_end: bool,
        **fields,
    ):
        """One message: the chunks of the warps that found the peer alive are issued (returned,
        to land when the test says), then the last warp decides with stamp_message and, if it
        goes out, puts the header and raises the signal. Returns (sent, issued chunks)."""
        chunks = [(o, payload[o : o + CHUNK]) for o in range(0, len(payload), CHUNK)]
        issued = [(slot, o, data) for i, (o, data) in enumerate(chunks) if warps_alive[i % WARPS]]
        bytes_put = sum(len(data) for _, _, data in issued)
        stamp = _C.stamp_message(
            self.arrival_sent.get(slot, 0), len(payload), bytes_put, alive_at_end
        )
        self.arrival_sent[slot] = stamp["arrival_sent"]
        if stamp["put_header"]:
            h = _C.SlotHeader()
            h.kind = int(kind)
            h.hidden = LAYOUT.hidden
            h.client_id = CLIENT
            for k, v in fields.items():
                setattr(h, k, int(v))
            h.payload_bytes = len(payload)
            h.arrival_target = stamp["arrival_target"]
            raw = torch.frombuffer(bytearray(h.to_bytes()), dtype=torch.uint8)
            off = self._slot(slot)
            self.t.put(self.region, off + _C.HEADER_OFFSET, raw.data_ptr(), raw.numel())
            ready = (
                SlotState.REQUEST_READY if kind == MessageKind.REQUEST else SlotState.RESPONSE_READY
            )
            self.t.signal(self.region, off, make_signal(ready, h.seq), _C.SignalOp.SET)
            self.t.signal(self.region, 0, 1, _C.SignalOp.ADD)  # doorbell
        return stamp["put_header"], issued

    def land(self, chunk) -> None:
        slot, o, data = chunk
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.t.put(self.region, self._slot(slot) + _C.PAYLOAD_OFFSET + o, buf.data_ptr(), len(data))
        at = self._slot(slot) + _C.ARRIVAL_OFFSET
        self.mem[at : at + 8].view(torch.int64).add_(len(data))


def request_message(rng: torch.Generator, n: int):
    x = torch.randn(n, LAYOUT.hidden, generator=rng).to(torch.bfloat16)
    ids = torch.randint(0, 8, (n, LAYOUT.topk), generator=rng, dtype=torch.int32)
    scores = torch.rand(n, LAYOUT.topk, generator=rng)
    lay = _C.request_payload_layout(n, LAYOUT.hidden, LAYOUT.topk, _C.Encoding.BF16)
    buf = bytearray(lay["total"])
    for part, t in (("act", x), ("ids", ids), ("scores", scores)):
        b = as_bytes(t)
        buf[lay[f"{part}_offset"] : lay[f"{part}_offset"] + len(b)] = b
    return x, ids, bytes(buf)


def poll_one(server: ServerChannel, timeout: float):
    """The server's poll until it takes a request or `timeout` passes (None)."""
    deadline = time.monotonic() + timeout
    while True:
        got = server.poll()
        if got:
            (req,) = got
            return req
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.001)


def send_request(w: DeviceWriter, slot, seq, n, rng, warps_alive, alive_at_end, order):
    x, ids, payload = request_message(rng, n)
    sent, issued = w.put(
        slot,
        MessageKind.REQUEST,
        payload,
        warps_alive,
        alive_at_end,
        seq=seq,
        num_tokens=n,
        topk=LAYOUT.topk,
        encoding=Encoding.BF16,
        layer_id=1,
    )
    order.shuffle(issued)
    return x, ids, sent, issued


ALL_ALIVE = [True] * WARPS
NONE_ALIVE = [False] * WARPS


@pytest.mark.timeout(60)
def test_a_request_after_one_to_a_dead_peer_is_taken(transport):
    """The peer index is dead for one whole request (no chunk, no header), alive again for the
    next: its target must be reachable. Before the fix the writer counted the unsent message
    and the server never took any later request from this client."""
    c, s = pair(transport)
    w = DeviceWriter(transport, c.server, s.request_ring.slot_bytes)
    rng, order = torch.Generator().manual_seed(3), random.Random(3)
    plan = [ALL_ALIVE, NONE_ALIVE, ALL_ALIVE, ALL_ALIVE]
    for seq, warps in enumerate(plan, start=1):
        alive = any(warps)
        x, ids, sent, issued = send_request(
            w, 0, seq, order.randint(1, 16), rng, warps, alive, order
        )
        assert sent == alive
        for chunk in issued:
            w.land(chunk)
        req = poll_one(s, READ_S if sent else ABSENT_S)
        if not sent:
            assert req is None, "a request to a dead peer reached the server"
            continue
        assert req is not None, f"request {seq} never completed: its arrival target is unreachable"
        assert req.valid and req.seq == seq
        assert torch.equal(req.activations.view(torch.int16), x.view(torch.int16))
        assert torch.equal(req.expert_ids, ids)
        s.respond(req, req.activations)


@pytest.mark.timeout(60)
def test_chunks_that_landed_before_the_peer_was_marked_dead_count(transport):
    """Some warps put their chunks before the peer was marked dead, the rest and the header did
    not go out; alive again for the next request. Those landed bytes are in the reader's
    counter: the writer must count them, or they complete the next request before its own last
    chunk (a writer that advanced only for sent messages did exactly that)."""
    c, s = pair(transport)
    w = DeviceWriter(transport, c.server, s.request_ring.slot_bytes)
    rng, order = torch.Generator().manual_seed(4), random.Random(4)
    for round_ in range(6):
        seq = 2 * round_ + 1
        # Dies mid-message: the first warps had put theirs, the others and the last warp saw it
        # dead. 16 tokens: every warp has chunks.
        _, _, sent, issued = send_request(
            w, 0, seq, 16, rng, [True, True, False, False], False, order
        )
        assert not sent and issued
        for chunk in issued:
            w.land(chunk)
        assert poll_one(s, ABSENT_S) is None
        x, ids, sent, issued = send_request(
            w, 0, seq + 1, order.randint(1, 16), rng, ALL_ALIVE, True, order
        )
        assert sent
        for chunk in issued[:-1]:
            w.land(chunk)
            assert s.poll() == [], "bytes of the unsent request completed the next one early"
        w.land(issued[-1])
        req = poll_one(s, READ_S)
        assert req is not None, "the request never completed"
        assert req.valid and req.seq == seq + 1
        assert torch.equal(req.activations.view(torch.int16), x.view(torch.int16))
        assert torch.equal(req.expert_ids, ids)
        s.respond(req, req.activations)


@pytest.mark.timeout(60)
def test_a_client_reads_the_answer_after_one_its_server_could_not_send(transport):
    """The answering side (a GPU server's respond): one answer not sent because the client's
    index was marked dead, then alive again; the client's wait_arrival accepts the next answer
    instead of timing out on its payload."""
    c, s = pair(transport)
    w = DeviceWriter(transport, s.client, c.response_ring.slot_bytes)
    rng = torch.Generator().manual_seed(5)
    for i, warps in enumerate([ALL_ALIVE, NONE_ALIVE, ALL_ALIVE, ALL_ALIVE]):
        n = 1 + i * 3
        x = torch.randn(n, LAYOUT.hidden, generator=rng).to(torch.bfloat16)
        seq = c.send(0, x, torch.zeros(n, 2, dtype=torch.int32), torch.ones(n, 2))
        (req,) = s.poll()
        y = torch.randn(n, LAYOUT.hidden, generator=rng).to(torch.bfloat16)
        alive = any(warps)
        # The server releases the request slot before it answers, alive client or not.
        transport.compare_exchange(
            s.region,
            _C.slot_offset(s.request_ring.slot_bytes, 0),
            make_signal(SlotState.REQUEST_READY, req.seq),
            make_signal(SlotState.IDLE, req.seq),
        )
        sent, issued = w.put(
            0,
            MessageKind.RESPONSE,
            as_bytes(y),
            warps,
            alive,
            seq=seq,
            num_tokens=n,
            topk=0,
            encoding=Encoding.BF16,
            layer_id=0,
        )
        for chunk in issued:
            w.land(chunk)
        if not sent:
            with pytest.raises(DeadlineExceededError, match="no response"):
                c.wait(0, seq, timeout=ABSENT_S)
            continue
        r = c.wait(0, seq, timeout=READ_S)
        assert torch.equal(r.activations.view(torch.int16), y.view(torch.int16))
        c.release(0)


def test_stamp_message_is_the_rule_of_layout_h():
    stamp = _C.stamp_message
    assert stamp(100, 64, 64, True) == {
        "put_header": True,
        "arrival_sent": 164,
        "arrival_target": 164,
    }
    # Peer dead when the last warp decides: not sent; what was put still counts.
    assert stamp(100, 64, 64, False) == {
        "put_header": False,
        "arrival_sent": 164,
        "arrival_target": 0,
    }
    assert stamp(100, 64, 0, False) == {
        "put_header": False,
        "arrival_sent": 100,
        "arrival_target": 0,
    }
    # A warp skipped its chunks (the peer looked dead to it): incomplete, never sent.
    assert stamp(100, 64, 32, True)["put_header"] is False
    # An error answer has no payload: sent with target 0 (nothing to wait for).
    assert stamp(100, 0, 0, True) == {"put_header": True, "arrival_sent": 100, "arrival_target": 0}
