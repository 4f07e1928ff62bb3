"""The server's end of a (client, server) request channel over the slot protocol (client.py has
the client's end, channel.py what both share): request slots in the server's memory, responses
written into the client's, in place when the client's memory is mapped here (zero copy)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecomm import _C
from moecomm.errors import PeerLostError
from moecomm.wire.channel import DEFAULT_TIMEOUT_S, Channel, host_tensor, timeout_ns
from moecomm.wire.protocol import (
    DTYPE_OF_CODE,
    ENCODING_DTYPE,
    ENCODING_OF_CODE,
    PAYLOAD_OFFSET,
    QUANTIZED_CODES,
    Encoding,
    ResponseStatus,
    ValidateCode,
    scales_per_token,
    validate_reason,
)
from moecomm.wire.shm import reap_stale_segments
from moecomm.wire.transport import Region, WaitStatus
from moecomm.wire.views import mapped_views

# A module global for the hot path: a pybind enum attribute lookup costs ~0.5 µs.
_VALID = ValidateCode.OK


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


class ServerChannel(Channel):
    """The server's end: request slots in our memory, responses written into the client's."""

    owns_requests = True

    default_name = "client"

    def _init_end(self) -> None:
        self.client: Region | None = None
        self._client_views = None  # the client's response region, when this process maps it
        self._doorbell = 0
        self._out_dtype = ENCODING_DTYPE[self.layout.out_encoding]

    def connect(self, client_handle: str) -> None:
        self.client = self._attach_peer(client_handle, self.response_ring)
        self._client_views = mapped_views(self.client)

    def response_view(self, req: Request) -> torch.Tensor | None:
        """The client's response slot for `req` as ``[num_tokens, hidden]`` of the layout's
        output dtype, to compute the answer into and then :meth:`commit_response`; None when
        the client's memory is not mapped here (answer with :meth:`respond`)."""
        if self._client_views is None or not req.valid:
            return None
        off = self.response_ring.slot_offset(req.slot) + PAYLOAD_OFFSET
        return self._client_views.get(off, (req.num_tokens, self.layout.hidden), self._out_dtype)

    def commit_response(self, req: Request) -> None:
        """Answers `req` with what was computed into :meth:`response_view`: header, release of
        the request slot, signal."""
        _C.commit_response(*self._answer(req), req.num_tokens, self.layout.out_encoding)
        req.activations = None  # released, as in respond()

    def _answer(self, req: Request) -> tuple:
        """The arguments every answer to `req` starts with (send_response, commit_response,
        send_error): where it goes and which request it answers."""
        return (
            self.transport,
            self.region,
            self.request_ring,
            self.client,
            self.response_ring,
            req.slot,
            self.client_id,
            req.seq,
            req.layer_id,
        )

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
                req.encoding = ENCODING_OF_CODE[code]
                views = self._views
                req.activations = views.get(base + inc.act_offset, (n, hid), DTYPE_OF_CODE[code])
                if code in QUANTIZED_CODES:
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
            self.transport, self.region, self._doorbell, timeout_ns(timeout), self.client
        )
        if status == WaitStatus.PEER_LOST:
            reap_stale_segments()
            raise PeerLostError(f"{self.name}: the client process died ({self.client.describe()})")
        return self.poll()

    def respond(self, req: Request, y: torch.Tensor) -> None:
        """Answers `req` with y [num_tokens, hidden]. y may be a view of the request itself."""
        y = host_tensor(
            y, "y", ENCODING_DTYPE[self.layout.out_encoding], (req.num_tokens, self.layout.hidden)
        )
        enc = self.layout.out_encoding
        _C.send_response(*self._answer(req), req.num_tokens, enc, y.data_ptr())
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
        _C.send_error(*self._answer(req), code, reason)
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
