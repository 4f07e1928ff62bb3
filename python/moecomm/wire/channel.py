"""What every slot channel shares (client.py: the client's end of a request channel, server.py: the
server's, stage.py: the two ends of a stage channel): the two slot rings of the connection, our
own region, deadlines, host-tensor checks, error answers."""

from __future__ import annotations

import os

import torch

from moecomm import _C
from moecomm.errors import (
    DeadlineExceededError,
    PeerLostError,
    PeerOfflineError,
    ProtocolError,
)
from moecomm.wire.protocol import SlotLayout, validate_reason
from moecomm.wire.shm import reap_stale_segments
from moecomm.wire.transport import Region, Transport, WaitStatus
from moecomm.wire.views import RegionViews

# Generous default for a single expert round trip; callers pass tighter ones.
DEFAULT_TIMEOUT_S = 30.0

# Slots per connection: one per micro-batch in flight; two give double-batch overlap.
DEFAULT_NUM_SLOTS = 2
# Debug mode: released slots are poisoned (protocol/poison.h). Read once, when this module loads.
POISON_ENV = "MOECOMM_POISON_SLOTS"
POISON_SLOTS = os.environ.get(POISON_ENV, "0") not in ("", "0")


def timeout_ns(timeout_s: float) -> int:
    """A wait's deadline in the nanoseconds the native waits take; refuses a negative one."""
    if timeout_s is None or timeout_s < 0:
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout_s!r}")
    return int(timeout_s * 1e9)


def host_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """`t` checked to be a CPU tensor of `dtype` and `shape` (named `name` in the error), made
    contiguous: what a channel copies from into a peer's slot."""
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


class Channel:
    """One end of a slot connection: the two slot rings (requests or data one way, responses or
    acks the other) and our own region, holding the ring this end reads (the request ring for a
    server or a stage receiver, the response ring for a client or a stage sender)."""

    owns_requests = False
    # The channel's name (in every error message) when the caller gives none: what the peer is.
    default_name = "peer"

    def __init__(
        self,
        transport: Transport,
        layout: SlotLayout,
        client_id: int,
        num_slots: int = DEFAULT_NUM_SLOTS,
        name: str | None = None,
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.transport = transport
        self.layout = layout
        self.client_id = int(client_id)
        self.num_slots = num_slots
        self.name = self.default_name if name is None else name
        self.request_ring = _C.SlotRing(layout.config, num_slots, True, POISON_SLOTS)
        self.response_ring = _C.SlotRing(layout.config, num_slots, False, POISON_SLOTS)
        own = self.request_ring if self.owns_requests else self.response_ring
        self.region: Region = transport.create_region(own.region_bytes)
        self._views = RegionViews(self.region)
        self._bytes = self._views.bytes
        self._init_end()

    def _init_end(self) -> None:
        """This end's own state (its peer, sequence numbers), set up once the rings and our
        region exist."""

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


def raise_wait_failure(out, where: str, peer: Region, role: str, late: str, what: str) -> None:
    """Raises what a failed wait for an answer stands for: the deadline (`late` says which),
    a dead `role` process, a slot it marked OFFLINE, or an invalid `what`. Shared by every
    channel that waits for its peer's answer in its own memory."""
    if out.status == WaitStatus.TIMEOUT:
        if getattr(out, "payload_late", False):
            late = f"the {what} came, its payload did not complete in time"
        raise DeadlineExceededError(f"{where}{late}")
    if out.status == WaitStatus.PEER_LOST:
        reap_stale_segments()
        raise PeerLostError(f"{where}the {role} process died ({peer.describe()})")
    if out.offline:
        raise PeerOfflineError(f"{where}the {role} marked the slot OFFLINE")
    raise ProtocolError(f"{where}invalid {what}: {validate_reason(out.code)}")
