"""Stage-to-stage channels: byte packages (activations, KV blocks) between pipeline stages over
the slot protocol, in their own message kind (``MessageKind.STAGE``).

A :class:`StageSender` writes chunks into the receiver's data ring (in the receiver's memory)
and owns a small ack ring; a :class:`StageReceiver` owns the data ring, copies each chunk out
(read once, own the copy) and answers with a header-only ack, which frees the slot. A package
larger than one slot travels as several chunks (``chunk / num_chunks`` in the header); with
``num_slots`` slots, that many chunks are in flight before the sender waits for an ack.

Every wait has a deadline; a dead peer raises :class:`~moecomm.errors.PeerLostError`, a stuck one
:class:`~moecomm.errors.DeadlineExceededError`. Several receivers of one process may share a
doorbell (:class:`StageInbox`), so the process sleeps on one word whichever peer sends next.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moecomm import _C
from moecomm.errors import PeerLostError, ProtocolError, RemoteError
from moecomm.wire.channel import (
    DEFAULT_TIMEOUT_S,
    Channel,
    raise_wait_failure,
    read_reason,
    timeout_ns,
)
from moecomm.wire.mailbox import (
    MULTI_BELL_POLL_S,  # noqa: F401  (re-exported: the serving hand-off polls at this period)
    WAIT_SLICE_S,
    Doorbells,
    peer_lost,
    wait_for,
)
from moecomm.wire.protocol import (
    DTYPE_OF_CODE,
    ENCODING_OF_CODE,
    ENCODING_OF_DTYPE,
    PAYLOAD_OFFSET,
    Encoding,
    ResponseStatus,
    SlotHeader,
    SlotLayout,
    ValidateCode,
    validate_reason,
)
from moecomm.wire.transport import Region, Transport, WaitStatus

# A stage ack carries no payload; its ring only needs room for a refusal's reason string, so it
# is sized for one row (the layout's minimum error payload covers the reason).
_ACK_ROWS = 1


def stage_layout(max_bytes_rows: int, hidden: int, encoding: Encoding | str) -> SlotLayout:
    """The layout of a stage channel whose chunks hold `max_bytes_rows` rows of `hidden`
    elements (one micro-batch of activations fits one chunk)."""
    return SlotLayout(max_bytes_rows, hidden, 1, encoding, encoding, _ACK_ROWS)


@dataclass
class Chunk:
    """One chunk taken from a data slot; `data` is the receiver's own copy."""

    tag: int
    index: int
    count: int
    encoding: Encoding
    data: torch.Tensor  # uint8 [payload_bytes]


class StageSender(Channel):
    """The sending end: acks in our memory, chunks written into the receiver's data ring (the
    channel's request ring; the ack ring is its response ring)."""

    default_name = "stage"

    def _init_end(self) -> None:
        self.data_ring, self.ack_ring = self.request_ring, self.response_ring
        self.capacity = self.data_ring.slot_bytes - PAYLOAD_OFFSET
        self.receiver: Region | None = None
        self.doorbell: Region | None = None
        self._seq = 1  # 0 is the sequence of the zero-filled (IDLE) slot
        self._next_slot = 0
        self._pending: dict[int, tuple[int, int, int]] = {}  # slot -> (seq, tag, chunk)

    def connect(self, receiver_handle: str, doorbell_handle: str | None = None) -> None:
        receiver = self._attach_peer(receiver_handle, self.data_ring)
        self.doorbell = self.transport.attach(doorbell_handle) if doorbell_handle else None
        self.receiver = receiver

    def send(
        self,
        tag: int,
        data: torch.Tensor,
        timeout: float = DEFAULT_TIMEOUT_S,
        encoding: Encoding | None = None,
    ) -> int:
        """Sends the bytes of `data` (a contiguous CPU tensor) as package `tag`; returns its
        chunk count. Returns once every chunk is written, not acknowledged (see flush())."""
        if self.receiver is None:
            raise RuntimeError(f"{self.name}: send before connect")
        if not isinstance(data, torch.Tensor) or data.device.type != "cpu":
            raise TypeError(f"{self.name}: data must be a CPU torch.Tensor")
        if encoding is None:
            encoding = ENCODING_OF_DTYPE.get(data.dtype, self.layout.encoding)
        raw = data.contiguous().reshape(-1).view(torch.uint8)
        n = raw.numel()
        if n == 0:
            raise ValueError(f"{self.name}: package {tag} is empty")
        count = -(-n // self.capacity)
        deadline = time.monotonic() + timeout
        for i in range(count):
            piece = raw[i * self.capacity : (i + 1) * self.capacity]
            self._take_slot(deadline)
            self.send_chunk(tag, i, count, piece, encoding)
        return count

    def next_slot_free(self, deadline: float) -> bool:
        """Whether the next chunk can be written without waiting: its slot's previous chunk was
        acknowledged (an acknowledgement that is there is consumed; raises if it is bad)."""
        slot = self._next_slot
        if slot not in self._pending:
            return True
        seq = self._pending[slot][0]
        out = _C.wait_stage_ack(
            self.transport, self.region, self.ack_ring, slot, self.client_id, seq, 0, self.receiver
        )
        if out.status == WaitStatus.TIMEOUT and not out.offline:
            return False
        self._wait_ack(slot, deadline)
        return True

    def send_chunk(
        self,
        tag: int,
        index: int,
        count: int,
        piece: torch.Tensor,
        encoding: Encoding | None = None,
    ) -> None:
        """Writes chunk `index` of `count` of package `tag` into the next slot, which must be
        free (send() waits for it; next_slot_free() says so without waiting)."""
        slot = self._next_slot
        if slot in self._pending:
            raise RuntimeError(f"{self.name}: slot {slot} still holds an unacknowledged chunk")
        self._next_slot = (slot + 1) % self.num_slots
        seq = self._seq
        try:
            _C.send_stage(
                self.transport,
                self.receiver,
                self.data_ring,
                slot,
                self.client_id,
                seq,
                tag,
                index,
                count,
                self.layout.encoding if encoding is None else encoding,
                piece.data_ptr(),
                piece.numel(),
                self.doorbell,
                True,
            )
        except PeerLostError as exc:  # name the channel: the transport knows only the peer's agent
            raise type(exc)(f"{self.name}: {exc}") from None
        self._seq += 1
        self._pending[slot] = (seq, tag, index)

    def flush(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Waits until every chunk sent was acknowledged."""
        deadline = time.monotonic() + timeout
        for slot in list(self._pending):
            self._wait_ack(slot, deadline)

    def _take_slot(self, deadline: float) -> int:
        """Waits until the next slot is free (its previous chunk acknowledged)."""
        slot = self._next_slot
        if slot in self._pending:  # its previous chunk must have been taken first
            self._wait_ack(slot, deadline)
        return slot

    def _wait_ack(self, slot: int, deadline: float) -> None:
        seq, tag, chunk = self._pending.pop(slot)
        remaining = max(0.0, deadline - time.monotonic())
        out = _C.wait_stage_ack(
            self.transport,
            self.region,
            self.ack_ring,
            slot,
            self.client_id,
            seq,
            timeout_ns(remaining),
            self.receiver,
        )
        where = f"{self.name} slot {slot} (package {tag} chunk {chunk}): "
        if out.status != WaitStatus.OK or out.offline or out.code != ValidateCode.OK:
            raise_wait_failure(
                out,
                where,
                self.receiver,
                "receiving",
                "no acknowledgement within the deadline",
                "acknowledgement",
            )
        h = out.header
        # Read once: the reason (if any) is copied before the release below.
        reason = read_reason(self._bytes, out.payload_offset, h.payload_bytes)
        _C.release_response(self.transport, self.region, self.ack_ring, slot, h.payload_bytes)
        if h.status != 0:
            raise RemoteError(h.status, reason, where)
        if (h.layer_id, h.num_tokens) != (tag, chunk):
            raise ProtocolError(f"{where}acknowledged package {h.layer_id} chunk {h.num_tokens}")


class StageReceiver(Channel):
    """The receiving end: the data ring in our memory, acks written into the sender's."""

    owns_requests = True
    default_name = "stage"

    def _init_end(self) -> None:
        self.data_ring, self.ack_ring = self.request_ring, self.response_ring
        self.sender: Region | None = None

    def connect(self, sender_handle: str) -> None:
        self.sender = self._attach_peer(sender_handle, self.ack_ring)

    def poll(self, check: Callable[[SlotHeader], str | None] | None = None) -> list[Chunk]:
        """Every chunk waiting in the data ring, copied out and acknowledged. A chunk whose
        header does not validate is refused (the sender gets the reason) and raises
        ProtocolError; so is a valid one for which `check` (the caller's own rules, given the
        header copy before the payload is read) returns a reason (the sender reads at least its
        first 256 bytes: the ack slot's smallest error payload). Chunks taken before a refusal
        were acknowledged but are lost with the exception: a refusal ends the connection."""
        out = []
        for inc in _C.poll_stage(self.transport, self.region, self.data_ring, self.client_id):
            h = inc.header
            if inc.code != ValidateCode.OK:
                reason = validate_reason(inc.code)
                if inc.code == ValidateCode.CLIENT_MISMATCH:
                    reason = f"{reason} (the chunk says {h.client_id}, this channel's is "
                    reason += f"{self.client_id})"
                self._ack(inc, int(inc.code), reason)
                raise ProtocolError(f"{self.name}: refused a stage message: {reason}")
            why = None if check is None else check(h)
            if why is not None:
                # A valid chunk the receiver will not take: a failure on the receiving side as
                # far as the slot protocol knows, with the receiver's reason.
                self._ack(inc, int(ResponseStatus.SERVER_ERROR), why)
                raise ProtocolError(
                    f"{self.name}: refused package {h.layer_id} chunk {h.num_tokens}/{h.topk}: "
                    f"{why}"
                )
            data = self._views.get(inc.payload_offset, (h.payload_bytes,), torch.uint8).clone()
            self._ack(inc, 0, "")
            out.append(Chunk(h.layer_id, h.num_tokens, h.topk, ENCODING_OF_CODE[h.encoding], data))
        return out

    def _ack(self, inc, status: int, reason: str) -> None:
        """Answers the chunk `inc` (0: taken, else the refusal's status and reason), which frees
        its data slot."""
        client_id = self.client_id
        if inc.code == ValidateCode.CLIENT_MISMATCH:
            # Answered under the id the chunk carries: the sender checks its acknowledgements
            # against its own id, and would otherwise read the refusal as an invalid
            # acknowledgement, without the reason. The answer still goes only into the ring of
            # the sender this channel connected to.
            client_id = inc.header.client_id
        _C.send_stage_ack(
            self.transport,
            self.region,
            self.data_ring,
            self.sender,
            self.ack_ring,
            inc.slot,
            client_id,
            inc.seq,
            inc.header,
            status,
            reason,
        )

    def peer_alive(self) -> bool:
        return self.sender is None or self.transport.peer_alive(self.sender)


class StageInbox:
    """The receivers of one process, sleeping on one shared doorbell, with the packages they
    reassemble. Senders connect with ``doorbell_handle=inbox.doorbell_handle``.

    `transport`: one transport, or several (a pipeline stage speaks shm to the stages of its own
    host and nixl to the others): then there is one doorbell per transport, each sender rings the
    one in the memory its transport writes (:meth:`doorbell_handle_of`), and the inbox sleeps on
    the single doorbell when there is one, else polls them all (a remote write cannot wake a
    futex sleeper anyway). Doorbells, deadlines and the liveness rule are the shared mailbox's
    (:mod:`moecomm.wire.mailbox`)."""

    def __init__(self, transport: Transport | Sequence[Transport]):
        self.bells = Doorbells(transport, "stage inbox")
        self.transport = self.bells.transport
        self.doorbell: Region = self.bells.region
        self.receivers: dict[object, StageReceiver] = {}
        self._parts: dict[tuple[object, int], list] = {}  # (source, tag) -> chunks so far
        self.ready: dict[tuple[object, int], tuple[Encoding, torch.Tensor]] = {}

    @property
    def doorbell_handle(self) -> str:
        return self.bells.handle

    def doorbell_handle_of(self, transport_name: str) -> str:
        """The handle of the doorbell a sender over `transport_name` rings."""
        return self.bells.handle_of(transport_name)

    def add(self, source: object, receiver: StageReceiver) -> None:
        self.receivers[source] = receiver

    def _check_senders(self) -> None:
        for source, r in self.receivers.items():
            if not r.peer_alive():
                raise peer_lost(f"stage inbox: the sender {source!r} died")

    def _sleep(self, timeout: float) -> tuple[bool, bool]:
        """Takes what arrived, sleeping up to `timeout` on the doorbells when nothing did:
        (a package completed, a doorbell moved)."""
        seen = self.bells.values()
        if self.take_arrived():
            return True, True
        moved = self.bells.wait(seen, timeout)
        return self.take_arrived(), moved

    def pump(self, timeout: float) -> bool:
        """Takes every chunk that arrived, sleeping up to `timeout` for the first one; returns
        whether a package completed. Raises PeerLostError when a sender process died."""
        completed, moved = self._sleep(timeout)
        if not moved:  # a peer that died never rings again
            self._check_senders()
        return completed

    def take_arrived(self) -> bool:
        """Takes every chunk already there, without waiting; returns whether a package
        completed."""
        completed = False
        for source, r in self.receivers.items():
            for c in r.poll():
                parts = self._parts.setdefault((source, c.tag), [None] * c.count)
                if len(parts) != c.count or parts[c.index] is not None:
                    raise ProtocolError(
                        f"stage inbox: package {c.tag} from {source!r}: chunk {c.index} of "
                        f"{c.count} does not fit the chunks received so far"
                    )
                parts[c.index] = c
                if all(p is not None for p in parts):
                    del self._parts[(source, c.tag)]
                    data = torch.cat([p.data for p in parts]) if len(parts) > 1 else parts[0].data
                    self.ready[(source, c.tag)] = (c.encoding, data)
                    completed = True
        return completed

    def take(self, source: object, tag: int, timeout: float) -> tuple[Encoding, torch.Tensor]:
        """Waits for package `tag` from `source`; returns (encoding, bytes)."""
        wait_for(
            lambda: (source, tag) in self.ready,
            lambda s: self._sleep(min(s, INBOX_SLICE_S))[1],
            self._check_senders,
            timeout,
            f"stage inbox: package {tag} from {source!r} did not arrive within {timeout:.3f} s",
        )
        return self.ready.pop((source, tag))

    def close(self) -> None:
        for r in self.receivers.values():
            r.close()
        self.bells.close()


# Longest sleep on the shared doorbell before a caller re-checks its deadline and the senders'
# liveness (a dead sender never rings): the shared mailbox's slice.
INBOX_SLICE_S = WAIT_SLICE_S


def as_tensor(encoding: Encoding, data: torch.Tensor, hidden: int) -> torch.Tensor:
    """Activation rows ``[T, hidden]`` from a package's bytes."""
    return data.view(DTYPE_OF_CODE[int(encoding)]).view(-1, hidden)
