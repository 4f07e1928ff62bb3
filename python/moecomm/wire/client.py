"""The client's end of a (client, server) request channel over the slot protocol (server.py has
the server's end, channel.py what both share).

`ClientChannel` owns the response slots and writes requests into the server's memory;
`ServerChannel` owns the request slots and writes responses into the client's memory. Each side
waits only for transitions the other side makes (the client for RESPONSE_READY in its own
memory, the server for REQUEST_READY / the doorbell in its own), so neither can wait on itself.

Every wait has a deadline and releases the GIL.

Read once, own the copy (docs/design.md, "The slot protocol"): a reader copies out (or
consumes) what it uses from a slot and validates the copy; after it releases the slot — the
server by answering, the client by :meth:`ClientChannel.release` — it never reads that slot
again, because the peer may already be writing its next message there. With
``MOECOMM_POISON_SLOTS=1`` (on in the test suite) a release overwrites the slot with a poison
pattern first, so a read after release fails every time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecomm import _C
from moecomm.errors import MoecommError, RemoteError
from moecomm.wire.channel import (
    DEFAULT_TIMEOUT_S,
    Channel,
    host_tensor,
    raise_wait_failure,
    read_reason,
    timeout_ns,
)
from moecomm.wire.protocol import (
    DTYPE_OF_CODE,
    ENCODING_DTYPE,
    Encoding,
    ValidateCode,
    as_encoding,
    scales_per_token,
)
from moecomm.wire.transport import Region, WaitStatus
from moecomm.wire.views import RequestViews, check_request_shape, mapped_views, request_views

# Module globals for the hot path: a pybind enum attribute lookup costs ~0.5 µs.
_WAIT_OK = WaitStatus.OK
_VALID = ValidateCode.OK


@dataclass
class Response:
    slot: int
    seq: int
    layer_id: int
    num_tokens: int
    activations: torch.Tensor  # [num_tokens, hidden], a view into the client's response slot
    stale_dropped: int = 0


class ClientChannel(Channel):
    """The client's end: response slots in our memory, requests written into the server's."""

    default_name = "server"

    def _init_end(self) -> None:
        self.server: Region | None = None
        self.doorbell: Region | None = None
        self._server_views = None  # the server's request region, when this process maps it
        self._next_seq = 1  # 0 is the sequence of the zero-filled (IDLE) slot
        # Payload bytes of the last answer read from each slot: what release() poisons.
        self._held = [0] * self.num_slots

    def connect(self, server_handle: str, doorbell_handle: str | None = None) -> None:
        """Attaches to the server's request region, and to its shared doorbell when it has one
        (a server of many clients sleeps on a single doorbell)."""
        server = self._attach_peer(server_handle, self.request_ring)
        self.doorbell = self.transport.attach(doorbell_handle) if doorbell_handle else None
        self.server = server
        self._server_views = mapped_views(server)

    @property
    def zero_copy(self) -> bool:
        """Whether requests can be packed straight into the server's slots (request_views)."""
        return self._server_views is not None

    def request_views(
        self, slot: int, num_tokens: int, topk: int, encoding: Encoding | str | None = None
    ) -> RequestViews | None:
        """Views of the server's request `slot` for a `num_tokens` x `topk` request, to fill in
        place and then :meth:`commit`; None when the server's memory is not mapped here (write
        local tensors and :meth:`send` instead). Only for a slot whose previous answer was read
        (or abandoned): the server no longer reads it."""
        if self.server is None:
            raise RuntimeError(f"{self.name}: request_views before connect")
        if self._server_views is None:
            return None
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in [0, {self.num_slots}), got {slot}")
        enc = self.layout.encoding if encoding is None else as_encoding(encoding)
        check_request_shape(num_tokens, topk, self.layout.max_tokens, self.layout.topk, self.name)
        return request_views(
            self._server_views,
            self.request_ring.slot_offset(slot),
            num_tokens,
            self.layout.hidden,
            topk,
            enc,
        )

    def commit(
        self,
        slot: int,
        num_tokens: int,
        topk: int,
        layer_id: int = 0,
        encoding: Encoding | str | None = None,
        wake: bool = True,
    ) -> int:
        """Publishes the request filled through :meth:`request_views`: header, then the release
        signal, then the doorbell (unless ``wake=False``). Returns its sequence number."""
        if self.server is None:
            raise RuntimeError(f"{self.name}: commit before connect")
        enc = self.layout.encoding if encoding is None else as_encoding(encoding)
        seq = self._next_seq
        _C.commit_request(
            *self._to_server(slot, seq, layer_id),
            num_tokens,
            topk,
            enc,
            self.doorbell,
            wake,
        )
        self._next_seq += 1
        return seq

    def _to_server(self, slot: int, seq: int, layer_id: int) -> tuple:
        """The arguments every request written into `slot` of the server starts with
        (commit_request, send_request)."""
        return (
            self.transport,
            self.server,
            self.request_ring,
            slot,
            self.client_id,
            seq,
            layer_id,
        )

    def peek_seq(self) -> int:
        """The sequence number the next send() will use."""
        return self._next_seq

    def next_seq(self) -> int:
        """Takes a sequence number (also for callers that resend to another server)."""
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def send(
        self,
        slot: int,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        scores: torch.Tensor,
        layer_id: int = 0,
        scales: torch.Tensor | None = None,
        encoding: Encoding | str | None = None,
        wake: bool = True,
    ) -> int:
        """Writes a request into `slot` of the server and signals it. Returns its sequence
        number. Everything is checked before a byte is written. With ``wake=False`` the server
        is not woken until :meth:`ring` (write to several servers first, then wake them all)."""
        if self.server is None:
            raise RuntimeError(f"{self.name}: send before connect")
        enc = self.layout.encoding if encoding is None else as_encoding(encoding)
        for name, t in (("x", x), ("expert_ids", expert_ids), ("scores", scores)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if x.dim() != 2:
            raise ValueError(f"x must be [num_tokens, hidden], got shape {list(x.shape)}")
        n, k = x.shape[0], expert_ids.shape[-1] if expert_ids.dim() == 2 else -1
        x = host_tensor(x, "x", ENCODING_DTYPE[enc], (n, self.layout.hidden))
        expert_ids = host_tensor(expert_ids, "expert_ids", torch.int32, (n, k))
        scores = host_tensor(scores, "scores", torch.float32, (n, k))
        scales_addr = 0
        s = scales_per_token(enc, self.layout.hidden)
        if s:
            if scales is None:
                raise ValueError(f"encoding {enc.name} needs scales of shape [{n}, {s}]")
            scales = host_tensor(scales, "scales", torch.float32, (n, s))
            scales_addr = scales.data_ptr()
        elif scales is not None:
            raise ValueError(f"scales given for the unquantized encoding {enc.name}")
        seq = self._next_seq  # spent only once the request is checked and written
        _C.send_request(
            *self._to_server(slot, seq, layer_id),
            n,
            k,
            enc,
            x.data_ptr(),
            scales_addr,
            expert_ids.data_ptr(),
            scores.data_ptr(),
            self.doorbell,
            wake,
        )
        self._next_seq += 1
        return seq

    def ring(self) -> None:
        """Wakes the server for requests sent with wake=False."""
        _C.ring_doorbell(
            self.transport, self.doorbell if self.doorbell is not None else self.server
        )

    def wait(self, slot: int, seq: int, timeout: float = DEFAULT_TIMEOUT_S) -> Response:
        """Waits for the answer to request `seq` in `slot`. Late answers to older requests are
        dropped. Raises DeadlineExceededError, PeerLostError, ProtocolError or RemoteError."""
        out = _C.wait_response(
            self.transport,
            self.region,
            self.response_ring,
            slot,
            self.client_id,
            seq,
            timeout_ns(timeout),
            self.server,
        )
        return self._answer(out, slot, seq, timeout)

    def _answer(self, out, slot: int, seq: int, timeout: float) -> Response:
        """The Response of a finished wait's outcome `out`, or the error it stands for."""
        # Happy path first: pybind enum comparisons cost ~0.5 µs each.
        if out.status != _WAIT_OK or out.offline or out.code != _VALID:
            self._raise_for(out, slot, seq, timeout)
        h = out.header
        self._held[slot] = h.payload_bytes
        if h.status != 0:
            where = f"{self.name} slot {slot} seq {seq}: "
            reason = read_reason(self._bytes, out.payload_offset, h.payload_bytes)
            raise RemoteError(h.status, reason, where)
        y = self._views.get(out.payload_offset, (h.num_tokens, h.hidden), DTYPE_OF_CODE[h.encoding])
        return Response(slot, seq, h.layer_id, h.num_tokens, y, out.stale_dropped)

    def release(self, slot: int) -> None:
        """Gives response `slot` back once every answer read from it was copied or consumed:
        the `activations` of its Response must not be read after this (poison mode overwrites
        them). A slot is released before the next request is sent into it."""
        if not self.response_ring.poison:  # nothing to write: keep the hot path free of it
            return
        _C.release_response(self.transport, self.region, self.response_ring, slot, self._held[slot])
        self._held[slot] = 0

    def _raise_for(self, out, slot: int, seq: int, timeout: float) -> None:
        raise_wait_failure(
            out,
            f"{self.name} slot {slot} seq {seq}: ",
            self.server,
            "server",
            f"no response within {timeout:.3f} s",
            "response header",
        )


def wait_first(waits: list[tuple[ClientChannel, int, int]], timeout: float) -> tuple[int, object]:
    """Waits for the first of several answers, each `(channel, slot, seq)`: the answer that
    comes first, or the first server found dead, ends the wait — the order of `waits` does not
    decide which is heard first. Returns `(i, Response)` for wait i's answer, `(i, error)` for
    wait i's failure (the exception ClientChannel.wait would raise, not raised), or
    `(-1, None)` when the deadline passed before any. Every channel must share one transport."""
    if not waits:
        raise ValueError("wait_first needs at least one answer to wait for")
    transport = waits[0][0].transport
    if any(ch.transport is not transport for ch, _, _ in waits):
        raise ValueError("wait_first: the channels use different transports")
    index, out = _C.wait_any_response(
        transport,
        [ch.region for ch, _, _ in waits],
        [ch.response_ring for ch, _, _ in waits],
        [slot for _, slot, _ in waits],
        [seq for _, _, seq in waits],
        [ch.server for ch, _, _ in waits],
        waits[0][0].client_id,
        timeout_ns(timeout),
    )
    if index < 0:
        return -1, None
    ch, slot, seq = waits[index]
    try:
        return index, ch._answer(out, slot, seq, timeout)
    except MoecommError as exc:  # handed to the caller, which decides per server
        return index, exc
