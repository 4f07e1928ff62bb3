"""Both ends of one (client, server) connection over the slot protocol.

`ClientChannel` owns the response slots and writes requests into the server's memory;
`ServerChannel` owns the request slots and writes responses into the client's memory. Each side
waits only for transitions the other side makes (the client for RESPONSE_READY in its own
memory, the server for REQUEST_READY / the doorbell in its own), so neither can wait on itself.

Every wait has a deadline and releases the GIL.

Read once, own the copy (DESIGN.md): a reader copies out (or consumes) what it uses from a slot
and validates the copy; after it releases the slot — the server by answering, the client by
:meth:`ClientChannel.release` — it never reads that slot again, because the peer may already be
writing its next message there. With ``MOECOMM_POISON_SLOTS=1`` (on in the test suite) a release
overwrites the slot with a poison pattern first, so a read after release fails every time.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from moecomm import _C
from moecomm.errors import (
    PeerLostError,
    PeerOfflineError,
    ProtocolError,
    RemoteError,
    TimeoutError,
)
from moecomm.protocol import (
    ENCODING_DTYPE,
    Encoding,
    ResponseStatus,
    SlotLayout,
    ValidateCode,
    as_encoding,
    scales_per_token,
    validate_reason,
)
from moecomm.transport import (
    Region,
    RegionViews,
    Transport,
    WaitStatus,
    reap_stale_segments,
)

# Generous default for a single expert round trip; callers pass tighter ones.
DEFAULT_TIMEOUT_S = 30.0
_WAIT_OK = WaitStatus.OK
_VALID = ValidateCode.OK
_DTYPE_OF_CODE = {int(e): d for e, d in ENCODING_DTYPE.items()}
_ENC_OF_CODE = {int(e): e for e in ENCODING_DTYPE}
_QUANTIZED_CODES = {int(e) for e in ENCODING_DTYPE if _C.encoding_quantized(e)}

# Slots per connection: one per micro-batch in flight; two give double-batch overlap.
DEFAULT_NUM_SLOTS = 2
# Debug mode: released slots are poisoned (protocol/poison.h). Read once, when this module loads.
POISON_ENV = "MOECOMM_POISON_SLOTS"
POISON_SLOTS = os.environ.get(POISON_ENV, "0") not in ("", "0")


def _ns(timeout_s: float) -> int:
    if timeout_s is None or timeout_s < 0:
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout_s!r}")
    return int(timeout_s * 1e9)


def _host_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU for the shm transport, got {t.device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    return t.contiguous()


def read_reason(region_bytes: torch.Tensor, offset: int, nbytes: int) -> str:
    """The reason string of an error answer, copied out of the region."""
    return bytes(region_bytes[offset : offset + nbytes].tolist()).decode("utf-8", "replace")


@dataclass
class Response:
    slot: int
    seq: int
    layer_id: int
    num_tokens: int
    activations: torch.Tensor  # [num_tokens, hidden], a view into the client's response slot
    stale_dropped: int = 0


class _Channel:
    """What both ends share: the two slot rings of the connection and our own region (response
    slots for a client, request slots for a server)."""

    owns_requests = False

    def __init__(
        self,
        transport: Transport,
        layout: SlotLayout,
        client_id: int,
        num_slots: int,
        name: str,
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.transport = transport
        self.layout = layout
        self.client_id = int(client_id)
        self.num_slots = num_slots
        self.name = name
        self.request_ring = _C.SlotRing(layout.config, num_slots, True, POISON_SLOTS)
        self.response_ring = _C.SlotRing(layout.config, num_slots, False, POISON_SLOTS)
        own = self.request_ring if self.owns_requests else self.response_ring
        self.region: Region = transport.create_region(own.region_bytes)
        self._views = RegionViews(self.region)
        self._bytes = self._views.bytes

    @property
    def handle(self) -> str:
        return self.region.handle

    def _attach_peer(self, handle: str, ring) -> Region:
        peer = self.transport.attach(handle)
        if peer.size < ring.region_bytes:
            raise ProtocolError(
                f"{self.name}: its region holds {peer.size} bytes, the "
                f"agreed slot layout needs {ring.region_bytes}"
            )
        return peer

    def close(self) -> None:
        self.region.close()


class ClientChannel(_Channel):
    """The client's end: response slots in our memory, requests written into the server's."""

    def __init__(
        self,
        transport: Transport,
        layout: SlotLayout,
        client_id: int,
        num_slots: int = DEFAULT_NUM_SLOTS,
        name: str = "server",
    ):
        super().__init__(transport, layout, client_id, num_slots, name)
        self.server: Region | None = None
        self.doorbell: Region | None = None
        self._next_seq = 1  # 0 is the sequence of the zero-filled (IDLE) slot
        # Payload bytes of the last answer read from each slot: what release() poisons.
        self._held = [0] * num_slots

    def connect(self, server_handle: str, doorbell_handle: str | None = None) -> None:
        """Attaches to the server's request region, and to its shared doorbell when it has one
        (a server of many clients sleeps on a single doorbell)."""
        server = self._attach_peer(server_handle, self.request_ring)
        self.doorbell = self.transport.attach(doorbell_handle) if doorbell_handle else None
        self.server = server

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
        x = _host_tensor(x, "x", ENCODING_DTYPE[enc], (n, self.layout.hidden))
        expert_ids = _host_tensor(expert_ids, "expert_ids", torch.int32, (n, k))
        scores = _host_tensor(scores, "scores", torch.float32, (n, k))
        scales_addr = 0
        s = scales_per_token(enc, self.layout.hidden)
        if s:
            if scales is None:
                raise ValueError(f"encoding {enc.name} needs scales of shape [{n}, {s}]")
            scales = _host_tensor(scales, "scales", torch.float32, (n, s))
            scales_addr = scales.data_ptr()
        elif scales is not None:
            raise ValueError(f"scales given for the unquantized encoding {enc.name}")
        seq = self._next_seq  # spent only once the request is checked and written
        _C.send_request(
            self.transport,
            self.server,
            self.request_ring,
            slot,
            self.client_id,
            seq,
            layer_id,
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
        dropped. Raises TimeoutError, PeerLostError, ProtocolError or RemoteError."""
        out = _C.wait_response(
            self.transport,
            self.region,
            self.response_ring,
            slot,
            self.client_id,
            seq,
            _ns(timeout),
            self.server,
        )
        # Happy path first: pybind enum comparisons cost ~0.5 µs each.
        if out.status != _WAIT_OK or out.offline or out.code != _VALID:
            self._raise_for(out, slot, seq, timeout)
        h = out.header
        self._held[slot] = h.payload_bytes
        if h.status != 0:
            where = f"{self.name} slot {slot} seq {seq}: "
            reason = read_reason(self._bytes, out.payload_offset, h.payload_bytes)
            raise RemoteError(h.status, reason, where)
        y = self._views.get(
            out.payload_offset, (h.num_tokens, h.hidden), _DTYPE_OF_CODE[h.encoding]
        )
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


def raise_wait_failure(out, where: str, peer: Region, role: str, late: str, what: str) -> None:
    """Raises what a failed wait for an answer stands for: the deadline (`late` says which),
    a dead `role` process, a slot it marked OFFLINE, or an invalid `what`. Shared by every
    channel that waits for its peer's answer in its own memory."""
    if out.status == WaitStatus.TIMEOUT:
        if getattr(out, "payload_late", False):
            late = f"the {what} came, its payload did not complete in time"
        raise TimeoutError(f"{where}{late}")
    if out.status == WaitStatus.PEER_LOST:
        reap_stale_segments()
        raise PeerLostError(f"{where}the {role} process died ({peer.describe()})")
    if out.offline:
        raise PeerOfflineError(f"{where}the {role} marked the slot OFFLINE")
    raise ProtocolError(f"{where}invalid {what}: {validate_reason(out.code)}")


@dataclass
class Request:
    """A request taken from a slot. Header fields, expert ids, scores and scales are the
    server's own copies, read once; `activations` is a zero-copy view of the slot, to be
    consumed (gathered, dequantized) before the answer, and dropped when the slot is released
    by respond() or reject()."""

    slot: int
    seq: int
    client_id: int
    code: ValidateCode
    layer_id: int = 0
    num_tokens: int = 0
    topk: int = 0
    encoding: Encoding | None = None
    activations: torch.Tensor | None = None  # view into the request slot, until the release
    scales: torch.Tensor | None = None  # owned copies from here on
    expert_ids: torch.Tensor | None = None
    scores: torch.Tensor | None = None

    @property
    def valid(self) -> bool:
        return self.code == ValidateCode.OK


class ServerChannel(_Channel):
    """The server's end: request slots in our memory, responses written into the client's."""

    owns_requests = True

    def __init__(
        self,
        transport: Transport,
        layout: SlotLayout,
        client_id: int,
        num_slots: int = DEFAULT_NUM_SLOTS,
        name: str = "client",
    ):
        super().__init__(transport, layout, client_id, num_slots, name)
        self.client: Region | None = None
        self._doorbell = 0

    def connect(self, client_handle: str) -> None:
        self.client = self._attach_peer(client_handle, self.response_ring)

    def poll(self) -> list[Request]:
        """Every request slot in REQUEST_READY with its header validated; valid ones carry
        copies of their ids, scores and scales and a view of their activations."""
        self._doorbell = self.transport.load(self.region, 0)
        out = []
        for inc in _C.poll_requests(self.transport, self.region, self.request_ring, self.client_id):
            req = Request(inc.slot, inc.seq, self.client_id, inc.code)
            if inc.code == _VALID:
                h = inc.header
                code = h.encoding
                base = inc.payload_offset
                n, hid, k = h.num_tokens, h.hidden, h.topk
                req.layer_id, req.num_tokens, req.topk = h.layer_id, n, k
                req.encoding = _ENC_OF_CODE[code]
                views = self._views
                req.activations = views.get(base + inc.act_offset, (n, hid), _DTYPE_OF_CODE[code])
                if code in _QUANTIZED_CODES:
                    s = scales_per_token(req.encoding, hid)
                    req.scales = views.get(base + inc.scale_offset, (n, s), torch.float32).clone()
                # Copied once: the server validates and indexes with these, and a client that
                # rewrites its slot meanwhile must not change what was validated.
                req.expert_ids = views.get(base + inc.ids_offset, (n, k), torch.int32).clone()
                req.scores = views.get(base + inc.scores_offset, (n, k), torch.float32).clone()
            out.append(req)
        return out

    def wait(self, timeout: float = DEFAULT_TIMEOUT_S) -> list[Request]:
        """Ready requests; [] when the deadline passes first. Raises PeerLostError when the
        client process dies."""
        reqs = self.poll()
        if reqs:
            return reqs
        status, _ = _C.wait_doorbell(
            self.transport, self.region, self._doorbell, _ns(timeout), self.client
        )
        if status == WaitStatus.PEER_LOST:
            reap_stale_segments()
            raise PeerLostError(f"{self.name}: the client process died ({self.client.describe()})")
        return self.poll()

    def wait_slot(self, slot: int, timeout: float = DEFAULT_TIMEOUT_S) -> Request:
        """Waits for the request in one `slot`, ignoring ready requests in the other slots (which
        may stay unanswered meanwhile). Returns it valid or not: the caller checks `valid` and
        its `seq`. Raises TimeoutError when the deadline passes, PeerLostError when the client
        process dies."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in [0, {self.num_slots}), got {slot}")
        deadline = time.monotonic() + _ns(timeout) / 1e9
        while True:
            for req in self.poll():  # poll() also samples the doorbell we sleep on below
                if req.slot == slot:
                    return req
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.name}: no request in slot {slot} within {timeout:.3f} s")
            status, _ = _C.wait_doorbell(
                self.transport, self.region, self._doorbell, _ns(remaining), self.client
            )
            if status == WaitStatus.PEER_LOST:
                reap_stale_segments()
                raise PeerLostError(
                    f"{self.name}: the client process died ({self.client.describe()})"
                )

    def respond(self, req: Request, y: torch.Tensor) -> None:
        """Answers `req` with y [num_tokens, hidden]. y may be a view of the request itself."""
        y = _host_tensor(
            y, "y", ENCODING_DTYPE[self.layout.out_encoding], (req.num_tokens, self.layout.hidden)
        )
        _C.send_response(
            self.transport,
            self.region,
            self.request_ring,
            self.client,
            self.response_ring,
            req.slot,
            self.client_id,
            req.seq,
            req.layer_id,
            req.num_tokens,
            self.layout.out_encoding,
            y.data_ptr(),
        )
        # Released: the client may be writing its next request into the slot already.
        req.activations = None

    def reject(
        self,
        req: Request,
        status: int | ValidateCode | ResponseStatus | None = None,
        reason: str | None = None,
    ) -> None:
        """Answers `req` with an error; by default the validation failure that it carries."""
        code = int(req.code if status is None else status)
        if reason is None:
            reason = validate_reason(req.code)
        _C.send_error(
            self.transport,
            self.region,
            self.request_ring,
            self.client,
            self.response_ring,
            req.slot,
            self.client_id,
            req.seq,
            req.layer_id,
            code,
            reason,
        )
        req.activations = None  # released, as in respond()

    def announce_offline(self) -> None:
        """Tells the client that this server no longer answers: every response slot of the
        connection goes OFFLINE, so a client waiting there fails over at once instead of at its
        deadline."""
        if self.client is None:
            return
        for s in range(self.num_slots):
            _C.mark_offline(self.transport, self.client, self.response_ring, s, 0)

    def mark_offline(self) -> None:
        """Marks every slot OFFLINE (the client is gone)."""
        for s in range(self.num_slots):
            _C.mark_offline(self.transport, self.region, self.request_ring, s, 0)
