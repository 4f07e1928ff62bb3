"""A watcher's view of who is alive, fed by a backend and turned into join/loss/update events.

The view is the same for both backends. A backend feeds it changes (`put`, `delete`) and, after
any reconnect, a full `snapshot`. A snapshot is diffed against the view, so nothing that
happened while the watcher was disconnected is missed. When the backend itself was replaced (a
restarted monitor, an etcd with a fresh data dir), members missing from the first snapshot are
given two TTLs (REREGISTER_GRACE_TTLS) to re-register before they are reported lost: their
heartbeats find the backend empty and register again, and peers must not drop live members
because the monitor restarted. That loss is reported on evidence only — an answer of the
backend, applied, after the grace — never because the watcher could not hear it. While the
backend cannot be reached the view stays as it was.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from moecomm.errors import DeadlineExceededError
from moecomm.membership.member import (
    WATCH_START_TIMEOUT_S,
    Event,
    MembershipError,
    Record,
    monotonic_deadline,
)

log = logging.getLogger("moecomm.membership")

# A member missing from the first snapshot of a replaced store (a restarted monitor, an etcd on a
# fresh data dir) has not had a chance to register there yet: it gets this many of its own TTLs
# before it is reported lost. Its lease promises one TTL (three heartbeats, any of which finds
# the empty store and registers again), but a restarted monitor re-registers every member of the
# deployment at once: the failure drill of bench/scale/scale.py measured 2,700 survivors back 3.2 s
# after the restart (TTL 2 s, a loaded machine), and one TTL evicted all of them from every
# watcher. Two TTLs keep a member that died during the outage within the "death noticed in two
# leases" bound (docs/scale.md).
REREGISTER_GRACE_TTLS = 2
# ...and while re-registrations keep arriving (10,000 members take the restarted monitor seconds
# to register again on a loaded machine), nobody is reported lost before a grace has passed
# since the latest: a busy store is not a dead member.
# Scheduling and one heartbeat round trip on top of that grace.
GRACE_SLACK_S = 0.25


def grace_s(rec: Record) -> float:
    """How long a member missing from a replaced store has to register there again."""
    return rec.ttl * REREGISTER_GRACE_TTLS + GRACE_SLACK_S


class Watcher:
    """Join/loss/update events of one role (or all). Read with `next(timeout)` or `wait_for`,
    or pass a callback to `Membership.watch`. `members()` is the current view."""

    def __init__(
        self,
        backend,
        role: str | None,
        callback: Callable[[Event], None] | None,
        initial: bool,
    ):
        self._backend = backend
        self.role = role
        self._callback = callback
        self._initial = initial
        self._events: queue.Queue[Event | None] = queue.Queue()
        self._lock = threading.Lock()
        self._known: dict[tuple[str, str], Record] = {}
        self._pending: dict[tuple[str, str], tuple[Record, float]] = {}
        # No member missing from a replaced store is reported lost before this (monotonic):
        # a grace after the latest re-registration seen (see _put_locked).
        self._pending_floor = 0.0
        # When the backend last answered with everything up to then applied: a member missing
        # from a replaced store is reported lost only on such evidence, never because this
        # watcher could not hear the backend (an overloaded monitor, a slow network).
        self._heard = 0.0
        self._synced = False
        self._ready = threading.Event()
        self._stop = threading.Event()
        self.last_error: Exception | None = None
        self._failing = False
        self._thread = threading.Thread(target=self._source, name="moecomm-watch", daemon=True)
        self._dispatcher = None
        if callback is not None:
            self._dispatcher = threading.Thread(
                target=self._dispatch, name="moecomm-watch-dispatch", daemon=True
            )
            self._dispatcher.start()
        self._thread.start()
        if not self._ready.wait(WATCH_START_TIMEOUT_S) or not self._synced:
            self.close()
            if isinstance(self.last_error, MembershipError):
                raise self.last_error
            raise ConnectionError(
                f"watch: no snapshot from the membership backend within "
                f"{WATCH_START_TIMEOUT_S} s (last error: {self.last_error})"
            )

    # ---- consumer side ----------------------------------------------------------------------

    def next(self, timeout: float) -> Event | None:
        """The next event, or None when `timeout` seconds pass without one."""
        if self._callback is not None:
            raise RuntimeError("this watcher delivers its events to a callback")
        monotonic_deadline(timeout)
        try:
            ev = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if ev is None:  # closed
            self._events.put(None)
        return ev

    def wait_for(self, predicate: Callable[[Event], bool], timeout: float) -> Event:
        """The first event for which `predicate` is true; events before it are consumed.
        Raises DeadlineExceededError naming what was seen when none matches within `timeout`."""
        deadline = monotonic_deadline(timeout)
        seen = []
        while True:
            left = deadline - time.monotonic()
            ev = self.next(max(0.0, left)) if left > 0 else None
            if ev is not None and predicate(ev):
                return ev
            if ev is not None:
                seen.append(f"{ev.kind}:{ev.member.role}/{ev.member.member_id}({ev.reason})")
            elif time.monotonic() >= deadline or self._stop.is_set():
                raise DeadlineExceededError(
                    f"no matching membership event within {timeout} s; saw {seen}"
                )

    def members(self) -> list:
        """Members in this watcher's view (including those given a grace period)."""
        with self._lock:
            recs = list(self._known.values()) + [r for r, _ in self._pending.values()]
        return sorted((r.member for r in recs), key=lambda m: m.key)

    def close(self) -> None:
        self._stop.set()
        self._events.put(None)
        join_s = self._backend.poll_s + self._backend.timeout
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(join_s)
        if self._dispatcher is not None and threading.current_thread() is not self._dispatcher:
            self._dispatcher.join(join_s)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _dispatch(self) -> None:
        while True:
            ev = self._events.get()
            if ev is None:
                return
            try:
                self._callback(ev)
            except Exception:
                log.exception("membership watch callback failed on %s", ev)

    def _source(self) -> None:
        try:
            self._backend._watch_source(self, self._stop)
        except Exception as exc:  # a bug, not an outage: outages are retried inside
            self.last_error = exc
            log.exception("membership watch stopped")

    # ---- backend side -----------------------------------------------------------------------

    def _emit(self, kind: str, rec: Record, reason: str) -> None:
        self._events.put(Event(kind, rec.member, reason, rec.incarnation))

    def _wanted(self, rec: Record) -> bool:
        return self.role is None or rec.member.role == self.role

    def _put_locked(self, rec: Record, join_reason: str) -> None:
        key = rec.member.key
        old = self._known.get(key)
        if old is None and key in self._pending:
            old = self._pending.pop(key)[0]
            # Re-registrations are still arriving: the store is busy taking the deployment
            # back, and the members still missing wait at least a grace from this one.
            self._pending_floor = time.monotonic() + grace_s(rec)
        self._known[key] = rec
        if old is None:
            self._emit("join", rec, join_reason)
        elif old.incarnation != rec.incarnation:
            # A new process took the id: peers must drop the old one's state and connect again.
            self._emit("loss", old, "replaced")
            self._emit("join", rec, "registered")
        elif old.member != rec.member:
            self._emit("update", rec, "updated")

    def snapshot(self, records: list[Record], backend_changed: bool) -> None:
        """Everything alive now. `backend_changed`: the store was replaced (restart without
        state), so members missing here get two TTLs to come back before they are lost."""
        now = time.monotonic()
        with self._lock:
            first = not self._synced
            seen = set()
            for rec in filter(self._wanted, records):
                seen.add(rec.member.key)
                if first and not self._initial:
                    self._known[rec.member.key] = rec
                else:
                    self._put_locked(rec, "existing" if first else "registered")
            for key in [k for k in self._known if k not in seen]:
                rec = self._known.pop(key)
                if backend_changed:
                    self._pending[key] = (rec, now + grace_s(rec))
                else:
                    self._emit("loss", rec, "missing")
            self._synced = True
        self.recovered()
        self._ready.set()

    def put(self, rec: Record) -> None:
        if not self._wanted(rec):
            return
        with self._lock:
            self._put_locked(rec, "registered")

    def delete(self, key: tuple[str, str], reason: str) -> None:
        with self._lock:
            rec = self._known.pop(key, None)
            if rec is None and key in self._pending:
                rec = self._pending.pop(key)[0]
            if rec is not None:
                self._emit("loss", rec, "deregistered" if rec.leaving else reason)

    def error(self, exc: Exception) -> None:
        """The backend could not be reached (the source retries); logged once per outage."""
        self.last_error = exc
        if not self._synced and isinstance(exc, MembershipError):
            # Refused before the first snapshot (bad token, bad prefix): retrying cannot help.
            self._stop.set()
            self._ready.set()
            return
        if not self._failing:
            log.warning("membership watch: backend unreachable (%s); retrying", exc)
        self._failing = True

    def recovered(self) -> None:
        if self._failing:
            log.info("membership watch: backend reachable again")
        self._failing = False

    def heard(self, at: float) -> None:
        """The backend answered at `at` (monotonic) and the answer is applied: members missing
        from a replaced store whose grace had ended by then (and not within a grace of the
        latest re-registration) are lost."""
        with self._lock:
            self._heard = max(self._heard, at)
            if not self._pending or self._heard < self._pending_floor:
                return
            for key in [k for k, (_, d) in self._pending.items() if d <= self._heard]:
                self._emit("loss", self._pending.pop(key)[0], "not re-registered")

    def stopped(self) -> bool:
        return self._stop.is_set()
