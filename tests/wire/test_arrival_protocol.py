"""Message completion as device writers do it, against the host slot_io readers.

A device writer's warps put payload chunks that land in any order, each adding its bytes to the
slot's arrival counter, and the header (with ``arrival_target``: every byte ever sent to that
slot, cumulative) may be visible before the last chunk. The reader never resets the counter.
These tests play that writer over the shm transport, chunk by chunk in an order a GPU may
deliver, so the host server and the host client are checked against what the kernels send:

- a reader never takes a message before its last chunk landed (request and response side);
- chunks of a message the reader already rejected, landing late, neither complete the next
  message early nor keep it from completing (the defect of a counter the reader resets);
- sizes change every message and slots are reused the instant they are released.
"""

import random
import threading
import time

import moecomm
import pytest
import torch
from moecomm import _C
from moecomm.wire.client import ClientChannel
from moecomm.wire.protocol import Encoding, MessageKind, SlotState, ValidateCode, make_signal
from moecomm.wire.server import ServerChannel
from moecomm.wire.views import region_bytes_view

ARRIVAL_OFFSET = 16  # protocol/layout.h kArrivalOffset, in each slot's signal line
LAYOUT = moecomm.SlotLayout(max_tokens=16, hidden=64, topk=2)
CLIENT = 33
CHUNK = 96  # small chunks: many per message, landing in shuffled order


def pair(transport):
    c = ClientChannel(transport, LAYOUT, CLIENT)
    s = ServerChannel(transport, LAYOUT, CLIENT)
    c.connect(s.handle)
    s.connect(c.handle)
    return c, s


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class ChunkedWriter:
    """Writes one peer region's slots the way the device kernels do: chunks that each ADD
    their bytes to the slot's arrival counter, and a header stamped with the cumulative target
    (all bytes ever sent to that slot) put with the signal, in an order the test chooses."""

    def __init__(self, transport, region, ring):
        self.t, self.region, self.slot_bytes = transport, region, ring.slot_bytes
        self.sent = {}  # slot -> bytes ever added to its counter
        # The counter is a plain word inside the signal line: a GPU adds to it with an atomic,
        # this single writer with a read-modify-write of the mapped word.
        self.mem = region_bytes_view(region)

    def _slot(self, slot: int) -> int:
        return _C.slot_offset(self.slot_bytes, slot)

    def chunks(self, slot: int, payload: bytes) -> list:
        return [(slot, o, payload[o : o + CHUNK]) for o in range(0, len(payload), CHUNK)]

    def land(self, chunk) -> None:
        slot, o, data = chunk
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.t.put(self.region, self._slot(slot) + _C.PAYLOAD_OFFSET + o, buf.data_ptr(), len(data))
        at = self._slot(slot) + ARRIVAL_OFFSET
        self.mem[at : at + 8].view(torch.int64).add_(len(data))

    def header(self, slot: int, kind: MessageKind, payload_bytes: int, target=None, **fields):
        """Puts the header and SETs the signal (before or after the chunks: the test decides)."""
        counted = self.sent.get(slot, 0) + payload_bytes
        self.sent[slot] = counted
        h = _C.SlotHeader()
        h.kind = int(kind)
        h.hidden = LAYOUT.hidden
        h.client_id = CLIENT
        for k, v in fields.items():
            setattr(h, k, int(v))
        h.payload_bytes = payload_bytes
        h.arrival_target = (counted if payload_bytes else 0) if target is None else target
        raw = torch.frombuffer(bytearray(h.to_bytes()), dtype=torch.uint8)
        off = self._slot(slot)
        self.t.put(self.region, off + _C.HEADER_OFFSET, raw.data_ptr(), raw.numel())
        request = kind == MessageKind.REQUEST
        state = SlotState.REQUEST_READY if request else SlotState.RESPONSE_READY
        self.t.signal(self.region, off, make_signal(state, h.seq), _C.SignalOp.SET)
        self.t.signal(self.region, 0, 1, _C.SignalOp.ADD)  # doorbell


def request_message(rng: torch.Generator, n: int):
    """A bf16 request of n tokens: (x, ids, scores, payload bytes in the wire layout)."""
    x = torch.randn(n, LAYOUT.hidden, generator=rng).to(torch.bfloat16)
    ids = torch.randint(0, 8, (n, LAYOUT.topk), generator=rng, dtype=torch.int32)
    scores = torch.rand(n, LAYOUT.topk, generator=rng)
    lay = _C.request_payload_layout(n, LAYOUT.hidden, LAYOUT.topk, _C.Encoding.BF16)
    buf = bytearray(lay["total"])
    for part, t in (("act", x), ("ids", ids), ("scores", scores)):
        b = as_bytes(t)
        buf[lay[f"{part}_offset"] : lay[f"{part}_offset"] + len(b)] = b
    return x, ids, scores, bytes(buf)


def send_request_in_pieces(w, slot, seq, n, rng, order: random.Random, header_first=True):
    x, ids, scores, payload = request_message(rng, n)
    pieces = w.chunks(slot, payload)
    order.shuffle(pieces)
    fields = dict(seq=seq, num_tokens=n, topk=LAYOUT.topk, encoding=Encoding.BF16, layer_id=1)
    return (
        x,
        ids,
        scores,
        pieces,
        lambda: w.header(slot, MessageKind.REQUEST, len(payload), **fields),
    )


@pytest.mark.timeout(120)
def test_a_server_takes_a_request_only_once_its_last_chunk_landed(transport):
    c, s = pair(transport)
    w = ChunkedWriter(transport, c.server, s.request_ring)
    rng, order = torch.Generator().manual_seed(5), random.Random(5)
    for seq in range(1, 41):
        slot = seq % 2
        n = order.randint(1, LAYOUT.max_tokens)  # a new size every message
        x, ids, scores, pieces, put_header = send_request_in_pieces(w, slot, seq, n, rng, order)
        put_header()  # worst case: header and signal before any chunk
        for piece in pieces[:-1]:
            w.land(piece)
            assert s.poll() == [], "a request was taken before its payload had landed"
        w.land(pieces[-1])
        (req,) = s.poll()
        assert req.valid and req.seq == seq and req.num_tokens == n
        assert torch.equal(req.activations.view(torch.int16), x.view(torch.int16))
        assert torch.equal(req.expert_ids, ids) and torch.equal(req.scores, scores)
        s.respond(req, req.activations)  # released: the writer reuses the slot at once


@pytest.mark.timeout(120)
def test_late_chunks_of_a_rejected_request_neither_complete_nor_stall_the_next(transport):
    c, s = pair(transport)
    w = ChunkedWriter(transport, c.server, s.request_ring)
    rng, order = torch.Generator().manual_seed(6), random.Random(6)
    for seq in range(1, 31, 2):
        n_bad, n_next = order.randint(1, 16), order.randint(1, 16)
        # A request the server rejects from its header alone (layer 1 topk 0), before any of
        # its chunks landed; the chunks land afterwards, as a GPU's do when they were in flight.
        _, _, _, bad, _ = send_request_in_pieces(w, 0, seq, n_bad, rng, order)
        payload_bytes = sum(len(p[2]) for p in bad)
        w.header(
            0, MessageKind.REQUEST, payload_bytes, seq=seq, num_tokens=n_bad, topk=0, encoding=1
        )
        (req,) = s.poll()
        assert req.code == ValidateCode.BAD_TOPK
        s.reject(req)
        for piece in bad:
            w.land(piece)
        x, ids, scores, pieces, put_header = send_request_in_pieces(
            w, 0, seq + 1, n_next, rng, order
        )
        put_header()
        for piece in pieces[:-1]:
            w.land(piece)
            assert s.poll() == [], "late bytes of the rejected request completed the next one"
        w.land(pieces[-1])
        (req,) = s.poll()  # a counter the reader had reset would never reach the target now
        assert req.valid and req.seq == seq + 1
        assert torch.equal(req.activations.view(torch.int16), x.view(torch.int16))
        assert torch.equal(req.expert_ids, ids) and torch.equal(req.scores, scores)
        s.respond(req, req.activations)


@pytest.mark.timeout(120)
def test_a_client_waits_for_every_chunk_of_a_device_servers_answer(transport):
    c, s = pair(transport)
    w = ChunkedWriter(transport, s.client, c.response_ring)
    rng, order = torch.Generator().manual_seed(7), random.Random(7)
    for i in range(12):
        slot, n = i % 2, order.randint(1, LAYOUT.max_tokens)
        x = torch.randn(n, LAYOUT.hidden, generator=rng).to(torch.bfloat16)
        seq = c.send(slot, x, torch.zeros(n, 2, dtype=torch.int32), torch.ones(n, 2))
        (req,) = s.poll()  # the host server takes it; the "device server" below answers
        y = torch.randn(n, LAYOUT.hidden, generator=rng).to(torch.bfloat16)
        pieces = w.chunks(slot, as_bytes(y))
        order.shuffle(pieces)
        w.header(
            slot,
            MessageKind.RESPONSE,
            len(as_bytes(y)),
            seq=seq,
            num_tokens=n,
            topk=0,
            encoding=Encoding.BF16,
        )
        # The request slot is released by the server before it answers (slot_io's rule).
        transport.compare_exchange(
            s.region,
            _C.slot_offset(s.request_ring.slot_bytes, slot),
            make_signal(SlotState.REQUEST_READY, req.seq),
            make_signal(SlotState.IDLE, req.seq),
        )
        last_started = []

        def trickle(pieces=pieces, last_started=last_started):
            for k, piece in enumerate(pieces):
                time.sleep(0.002)
                if k == len(pieces) - 1:
                    # Stamped before the last write: a reader woken by that write may note
                    # its own time before this thread runs again.
                    last_started.append(time.monotonic())
                w.land(piece)

        th = threading.Thread(target=trickle)
        th.start()
        r = c.wait(slot, seq, timeout=10)
        done = time.monotonic()
        th.join(10)
        assert last_started and done >= last_started[0], (
            "the answer was read before its last chunk was written"
        )
        assert torch.equal(r.activations.view(torch.int16), y.view(torch.int16))
        c.release(slot)


@pytest.mark.timeout(60)
def test_an_answer_whose_payload_never_completes_times_out_naming_the_payload(transport):
    c, s = pair(transport)
    w = ChunkedWriter(transport, s.client, c.response_ring)
    n = 3
    seq = c.send(
        0,
        torch.zeros(n, LAYOUT.hidden, dtype=torch.bfloat16),
        torch.zeros(n, 2, dtype=torch.int32),
        torch.ones(n, 2),
    )
    y = torch.ones(n, LAYOUT.hidden, dtype=torch.bfloat16)
    pieces = w.chunks(0, as_bytes(y))
    w.header(
        0,
        MessageKind.RESPONSE,
        len(as_bytes(y)),
        seq=seq,
        num_tokens=n,
        topk=0,
        encoding=Encoding.BF16,
    )
    for piece in pieces[1:]:  # the first chunk is lost
        w.land(piece)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="payload did not complete"):
        c.wait(0, seq, timeout=0.3)
    assert time.monotonic() - start < 5


def test_a_target_that_does_not_count_the_messages_own_bytes_is_refused(transport):
    c, s = pair(transport)
    w = ChunkedWriter(transport, c.server, s.request_ring)
    _, _, _, payload = request_message(torch.Generator().manual_seed(1), 2)
    w.header(
        0,
        MessageKind.REQUEST,
        len(payload),
        target=len(payload) - 1,
        seq=1,
        num_tokens=2,
        topk=2,
        encoding=Encoding.BF16,
    )
    (req,) = s.poll()
    assert req.code == ValidateCode.BAD_ARRIVAL_TARGET
