"""What every moecomm receiver does while it waits for a peer's one-sided write: its doorbells,
its deadlines and its liveness rule, written once and shared by the stage channels' inbox
(:class:`~moecomm.wire.stage.StageInbox`, the pipeline's activations and KV migration) and the
KV block transfers (:mod:`moecomm.wire.kv`).

- A **doorbell** is one word in the receiver's memory that every sender bumps after it wrote
  (``_C.ring_doorbell``), so one sleeper watches every channel of a process. With doorbells on
  several transports (a stage speaks shm to its own host and nixl to others) there is one per
  transport and the waiter polls them (a remote write cannot wake a futex sleeper).
- A **deadline** bounds every wait; a wait sleeps at most :data:`WAIT_SLICE_S` at a time.
- The **liveness rule**: a slice that ends without the awaited message asks whether the sender
  is still alive (:func:`wait_for`); a dead sender's shared memory is reaped and the wait
  raises :class:`~moecomm.errors.PeerLostError` — unless the message arrived before the death.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from moecomm import _C
from moecomm.errors import DeadlineExceededError, PeerLostError
from moecomm.wire.channel import timeout_ns
from moecomm.wire.shm import reap_stale_segments
from moecomm.wire.transport import Region, Transport, WaitStatus

# Longest single sleep of a wait before it re-checks its deadline and its sender's liveness. A
# futex wait also ends at once when an shm sender dies (its life word); this bounds the
# poll-only death watch and transports without one.
WAIT_SLICE_S = 0.5
# With doorbells on several transports the waiter polls them at this period. Stage steps and KV
# hand-offs take milliseconds, so 100 µs adds little latency while leaving the shared cores to
# the compute.
MULTI_BELL_POLL_S = 100e-6


class Deadline:
    """A point in time `timeout` seconds from now, and the slices a wait sleeps until it."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.at = time.monotonic() + timeout

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def slice(self, longest: float = WAIT_SLICE_S) -> float:
        """The next sleep: what is left, at most `longest`, never negative."""
        return max(0.0, min(self.remaining(), longest))


def peer_lost(message: str) -> PeerLostError:
    """The error for a dead peer, after removing the shared memory dead processes left."""
    reap_stale_segments()
    return PeerLostError(message)


def wait_for(
    arrived: Callable[[], bool],
    sleep: Callable[[float], bool],
    check_peer: Callable[[], None],
    timeout: float,
    late: str,
) -> None:
    """Waits until ``arrived()``. Sleeps through ``sleep(slice)`` (True: something moved,
    False: the slice ended; it may raise PeerLostError when its own death watch fired); after a
    slice that brought nothing, ``check_peer()`` raises PeerLostError (naming who died, see
    :func:`peer_lost`) if the sender is gone. Raises DeadlineExceededError(`late`) once
    `timeout` passed. What arrived just before a death is still taken."""
    deadline = Deadline(timeout)
    while not arrived():
        if deadline.expired():
            raise DeadlineExceededError(late)
        try:
            moved = sleep(deadline.slice())
        except PeerLostError:
            if arrived():
                return
            check_peer()  # names the peer; the transport's own error if liveness lags
            reap_stale_segments()
            raise
        if not moved and not arrived():
            check_peer()


class Doorbells:
    """The doorbell words of one receiving process: one per transport it is reached over."""

    def __init__(self, transports: Transport | Sequence[Transport], what: str = "inbox"):
        transports = [transports] if isinstance(transports, Transport) else list(transports)
        if not transports:
            raise ValueError(f"{what}: needs at least one transport")
        names = [t.name for t in transports]
        if len(set(names)) != len(names):
            raise ValueError(f"{what}: one doorbell per transport, got {names}")
        self.what = what
        self.bells: dict[str, tuple[Transport, Region]] = {}
        try:
            for t in transports:
                self.bells[t.name] = (t, t.create_region(_C.DOORBELL_BYTES))
        except BaseException:
            self.close()
            raise
        self.transport = transports[0]
        self.region: Region = self.bells[self.transport.name][1]

    @property
    def handle(self) -> str:
        """The handle of the first transport's doorbell (the only one, usually)."""
        return self.region.handle

    def handle_of(self, transport_name: str) -> str:
        """The handle of the doorbell a sender over `transport_name` rings."""
        if transport_name not in self.bells:
            raise ValueError(
                f"{self.what}: no doorbell for transport {transport_name!r} "
                f"(has {', '.join(self.bells)})"
            )
        return self.bells[transport_name][1].handle

    def values(self) -> dict[str, int]:
        """Every doorbell's count now (pass it to :meth:`wait` as `seen`)."""
        return {n: t.load(b, 0) for n, (t, b) in self.bells.items()}

    def value(self) -> int:
        """The first doorbell's count."""
        return self.transport.load(self.region, 0)

    def wait(self, seen: dict[str, int], timeout: float) -> bool:
        """Sleeps until a doorbell moves past `seen` or `timeout` passes; False on timeout."""
        if len(self.bells) == 1:
            ((name, (t, bell)),) = self.bells.items()
            status, _ = _C.wait_doorbell(t, bell, seen[name], timeout_ns(timeout), None)
            return status == WaitStatus.OK
        deadline = Deadline(timeout)
        while self.values() == seen:
            if deadline.expired():
                return False
            time.sleep(MULTI_BELL_POLL_S)
        return True

    def wait_value(self, seen: int, timeout: float) -> int:
        """Sleeps until the first doorbell moves past `seen` (or `timeout`); returns its count."""
        _, value = _C.wait_doorbell(self.transport, self.region, seen, timeout_ns(timeout), None)
        return value

    def close(self) -> None:
        for _, bell in self.bells.values():
            bell.close()


def ring(transport: Transport, doorbell: Region | None) -> None:
    """Bumps a peer's doorbell (attached by its handle), after the write it announces."""
    if doorbell is not None:
        _C.ring_doorbell(transport, doorbell)
