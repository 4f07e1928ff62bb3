"""The one membership interface, and the registration that keeps a member alive on any backend.

A backend implements five hooks: `_register`, `_heartbeat`, `_deregister`, `_list_records` and
`_watch_source`, and may batch two of them (`_register_many`, `_heartbeat_many`). Everything
else — lease renewal, automatic re-registration, the watcher's view of who is alive — is
written once here and in `watcher.py`.

Leases are renewed per process, not per member: every registration of one `Membership` is
renewed by one thread (`LeaseGroup`), in one batched request per interval where the backend
batches (the monitor's POST /heartbeats, one shared etcd lease), so a process hosting many
members costs the backend one request per heartbeat interval, not one per member."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moecomm.errors import MoecommError
from moecomm.membership.member import (
    Event,
    Member,
    Record,
    SupersededError,
    check_ttl,
)
from moecomm.membership.watcher import Watcher

log = logging.getLogger("moecomm.membership")

# Three heartbeats per TTL: one lost or late heartbeat never expires a live member.
HEARTBEATS_PER_TTL = 3
# Default lease: a lost member is noticed within ~5 s, yet a 1-2 s GC or network pause survives.
DEFAULT_TTL_S = 5.0
# Long-poll or stream read that a watcher's thread blocks in at most; close() waits about as long.
DEFAULT_POLL_S = 2.0
# Every HTTP call to a backend has a deadline; this one covers a loaded machine, not a dead peer.
DEFAULT_HTTP_TIMEOUT_S = 5.0
# The embedded monitor's shared token, for every process that starts from the command line (never
# argv: other users of the host could read it there).
TOKEN_ENV = "MOECOMM_MONITOR_TOKEN"
# Incarnations are random: 64 bits make a collision between two processes of one id negligible.
INCARNATION_BYTES = 8
# Batch latencies a lease group keeps for the scale bench (the latest; about 20 min at 3/s).
LATENCY_SAMPLES = 4096
# While the backend cannot be reached, a lease group tries again this often (one request per
# process, not per member): a restarted monitor has every member back well within the one TTL
# watchers wait for them (watcher.REREGISTER_GRACE_TTLS), even at 10,000 members.
UNREACHABLE_RETRY_S = 0.2
# After a renewal round raised (a bug, not an outage), the group pauses this long.
HEARTBEAT_BUG_PAUSE_S = 1.0
# A lease group renews, with the registrations that are due, those due within this fraction of
# their interval: members registered at different moments share one batch from their second
# renewal on, and none is renewed more than twice per interval.
ALIGN_FRACTION = 0.5


class BackendBusyError(MoecommError, ConnectionError):
    """The backend took the request but did not answer in time (a read timeout): it is up and
    overloaded, so retrying at once would only add to its queue."""


@dataclass
class Lease:
    """What a backend needs to keep a registration alive (a monitor's record, an etcd lease)."""

    handle: Any
    ttl: float  # the TTL the backend granted (etcd rounds up to whole seconds)


def monitor_token() -> str:
    """The monitor's shared token from ``$MOECOMM_MONITOR_TOKEN`` ("" when unset: no token)."""
    return os.environ.get(TOKEN_ENV, "")


class Membership(ABC):
    """Register members with a lease, keep them alive, list them and watch joins and losses.

    Use `connect_membership(url)` to get one: "http://..." is the embedded monitor, "etcd://..."
    an etcd cluster. Thread-safe; one instance can serve many registrations and watchers."""

    def __init__(
        self,
        poll_s: float = DEFAULT_POLL_S,
        timeout: float = DEFAULT_HTTP_TIMEOUT_S,
        group_leases: bool = True,
    ):
        if poll_s <= 0 or timeout <= 0:
            raise ValueError(f"poll_s and timeout must be positive, got {poll_s}, {timeout}")
        self.poll_s = poll_s
        self.timeout = timeout
        # False: the per-member renewal of earlier versions (one thread and one request per
        # member and interval); kept as the contender the scale bench measures against.
        self.group_leases = group_leases
        self.leases = LeaseGroup(self)

    # ---- public API -------------------------------------------------------------------------

    def register(self, member: Member, ttl: float = DEFAULT_TTL_S) -> Registration:
        """Registers `member` with a lease of `ttl` seconds and keeps it alive from a background
        thread until `Registration.close()`. Raises ConnectionError when the backend cannot be
        reached, MembershipError when it refuses (bad token, bad fields, full)."""
        if not isinstance(member, Member):
            raise TypeError(f"register() takes a Member, got {type(member).__name__}")
        return Registration(self, member, check_ttl(ttl))

    def register_many(self, members: list[Member], ttl: float = DEFAULT_TTL_S) -> list:
        """Registers every member of `members` (one process hosting several: a host agent, a
        simulation) in as few requests as the backend allows, each with its own incarnation
        and lease, renewed together. All or nothing: on an error the members registered are
        deregistered (best effort) and the error raised."""
        ttl = check_ttl(ttl)
        for member in members:
            if not isinstance(member, Member):
                raise TypeError(f"register_many() takes Members, got {type(member).__name__}")
        records = [Record(mb, ttl, secrets.token_hex(INCARNATION_BYTES)) for mb in members]
        leases = self._register_many([(r, None) for r in records])
        failed = next((x for x in leases if isinstance(x, Exception)), None)
        if failed is not None:
            for rec, lease in zip(records, leases, strict=True):
                if not isinstance(lease, Exception):
                    try:
                        self._deregister(rec, lease)
                    except Exception as exc:
                        log.warning("deregistering %s failed (%s)", rec.member.key, exc)
            raise failed
        pairs = zip(records, leases, strict=True)
        return [Registration(self, r.member, ttl, (r, lease)) for r, lease in pairs]

    def list_members(self, role: str | None = None) -> list[Member]:
        """Members alive now (optionally of one role), ordered by (role, member_id)."""
        return [r.member for r in self._list_records(role)]

    def watch(
        self,
        role: str | None = None,
        callback: Callable[[Event], None] | None = None,
        initial: bool = True,
    ):
        """Starts watching joins, losses and updates (of one role, or all). With `initial`, the
        members alive now arrive first as "join" events (reason "existing"), so discovery and
        elastic joins are one code path. With `callback`, events are delivered to it from a
        dispatcher thread; otherwise read them with `Watcher.next(timeout)`."""
        return Watcher(self, role, callback, initial)

    @abstractmethod
    def close(self) -> None:
        """Releases the backend's connections (registrations and watchers are closed apart)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- backend hooks ----------------------------------------------------------------------

    @abstractmethod
    def _register(self, record: Record, lease: Lease | None) -> Lease:
        """Stores `record` alive for `record.ttl`. `lease` is the current one when the member
        updates its fields (the backend may reuse it), None for a first or lost registration."""

    @abstractmethod
    def _heartbeat(self, record: Record, lease: Lease) -> bool:
        """Extends the lease. False: the backend no longer knows it (expired, backend restarted).
        Raises SupersededError when another incarnation took the id, ConnectionError when the
        backend cannot be reached."""

    def _register_many(self, items: list[tuple[Record, Lease | None]]) -> list[Lease | Exception]:
        """`_register` for each (record, lease): its lease, or the exception it raised. A
        backend that batches overrides this; this one stops at the first ConnectionError (the
        rest would wait out the same deadline) and gives it to the items left."""
        return _each(items, lambda item: self._register(*item))

    def _heartbeat_many(self, items: list[tuple[Record, Lease]]) -> list[bool | Exception]:
        """`_heartbeat` for each (record, lease): its answer, or the exception it raised (see
        `_register_many`)."""
        return _each(items, lambda item: self._heartbeat(*item))

    def _abandon(self, record: Record, lease: Lease) -> None:
        """Heartbeats stopped without a deregistration: the member must expire within its TTL
        (nothing to do where its lease is its own; see EtcdMembership for a shared one)."""
        return

    @abstractmethod
    def _deregister(self, record: Record, lease: Lease) -> None:
        """Removes the member now (a graceful "loss" with reason "deregistered")."""

    @abstractmethod
    def _list_records(self, role: str | None) -> list[Record]:
        """Live records, ordered by (role, member_id)."""

    @abstractmethod
    def _watch_source(self, view, stop: threading.Event) -> None:
        """Runs in a watcher's thread until `stop` is set: feeds `view.snapshot(records,
        backend_changed)`, `view.put(record)`, `view.delete(key, reason)`, `view.error(exc)`.
        No blocking call may last longer than about `poll_s`."""


def _down(exc: Exception) -> bool:
    """Unreachable (retried soon), as opposed to busy (a timeout: retried at the interval, or a
    monitor re-registering 10,000 members is sent every batch again every 0.2 s)."""
    return isinstance(exc, ConnectionError) and not isinstance(exc, BackendBusyError)


def _each(items: list, call: Callable) -> list:
    out: list = []
    for item in items:
        try:
            out.append(call(item))
        except ConnectionError as exc:
            return out + [exc] * (len(items) - len(out))
        except Exception as exc:
            out.append(exc)
    return out


class LeaseGroup:
    """Renews the leases of every registration of one `Membership` from one thread: at each
    round, those due (and those due within ALIGN_FRACTION of their interval) go out in one
    `_heartbeat_many`, and those the backend forgot (or that hold an unpublished update) in one
    `_register_many`. A registration whose lock is held (an update, a caller's heartbeat_now,
    a test pausing it) is left to the next round. The thread exits when the group is empty and
    starts again with the next registration."""

    def __init__(self, backend: Membership):
        self._backend = backend
        self._lock = threading.Lock()
        self._regs: dict[int, Registration] = {}
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._failing = False
        self.rounds = 0  # batches sent, for tests and the scale bench
        # Seconds each round's heartbeat batch took, the latest first-in-first-out (bounded).
        self.latencies: deque[float] = deque(maxlen=LATENCY_SAMPLES)

    def __len__(self) -> int:
        return len(self._regs)

    def add(self, reg: Registration) -> None:
        with self._lock:
            self._regs[id(reg)] = reg
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="moecomm-leases", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def remove(self, reg: Registration) -> None:
        with self._lock:
            self._regs.pop(id(reg), None)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._regs:
                    self._thread = None
                    return
                wait = min(r._due for r in self._regs.values()) - time.monotonic()
            if wait > 0:
                self._wake.wait(wait)
                self._wake.clear()
                continue
            try:
                self.renew_due()
            except Exception:  # a bug: logged, and the next round tries again
                log.exception("lease renewal round failed")
                time.sleep(HEARTBEAT_BUG_PAUSE_S)

    def renew_due(self) -> None:
        """One round, in the caller's thread."""
        now = time.monotonic()
        with self._lock:
            due = [r for r in self._regs.values() if r._due <= now + ALIGN_FRACTION * r.interval]
        held = []
        for reg in due:
            reg._due = now + reg.interval  # sooner after a ConnectionError (_renew)
            if not reg._lock.acquire(blocking=False):
                continue
            if reg._stop.is_set():
                reg._lock.release()
                continue
            held.append(reg)
        if not held:
            return
        try:
            self._renew(held)
        finally:
            for reg in held:
                reg._lock.release()

    def _renew(self, held: list[Registration]) -> None:
        started = time.monotonic()
        answers = self._backend._heartbeat_many([(r._record, r._lease) for r in held])
        self.latencies.append(time.monotonic() - started)
        self.rounds += 1
        todo: list[tuple[Registration, bool]] = []  # (registration, still known)
        unreachable = None
        for reg, answer in zip(held, answers, strict=True):
            if isinstance(answer, SupersededError):
                # Re-registering would steal the id back and make both incarnations flap.
                reg.superseded = True
                reg.last_error = answer
                self.remove(reg)
                log.error("%s: %s; heartbeats stopped", reg.member.member_id, answer)
            elif isinstance(answer, Exception):
                reg.last_error = answer
                unreachable = answer
                if _down(answer):
                    # A restarted backend is found within UNREACHABLE_RETRY_S, not an interval:
                    # watchers give a missing member two TTLs to come back.
                    reg._due = min(reg._due, time.monotonic() + UNREACHABLE_RETRY_S)
            elif answer:
                reg.heartbeats += 1
                if not reg.published:
                    todo.append((reg, True))
            else:
                todo.append((reg, False))
        if todo:
            leases = self._backend._register_many(
                [(r._record, r._lease if known else None) for r, known in todo]
            )
            again = published = 0
            for (reg, known), lease in zip(todo, leases, strict=True):
                if isinstance(lease, Exception):
                    reg.last_error = lease
                    unreachable = lease
                    if _down(lease):
                        reg._due = min(reg._due, time.monotonic() + UNREACHABLE_RETRY_S)
                    continue
                reg._lease = lease
                reg.published = True
                if known:
                    published += 1
                else:
                    reg.reregistrations += 1
                    again += 1
            if again:
                log.info("re-registered %d member(s) (the backend had lost them)", again)
            if published:
                log.info("published %d update(s) missed while unreachable", published)
        if unreachable is not None and not self._failing:
            log.warning("lease renewal failed: %s", unreachable)
        elif unreachable is None and self._failing:
            log.info("membership backend reachable again")
        self._failing = unreachable is not None


class Registration:
    """A live registration, renewed `HEARTBEATS_PER_TTL` times per TTL with the others of its
    `Membership` (`LeaseGroup`); when the backend answers that it forgot the member (lease
    expired, monitor or etcd restarted with an empty store), it registers again with the same
    incarnation. Unreachable backends are retried at the same pace, so a member is back within
    one heartbeat interval of the backend. An `update` made while the backend cannot be
    reached is kept and published by the renewal as soon as it answers again."""

    def __init__(
        self,
        backend: Membership,
        member: Member,
        ttl: float,
        granted: tuple[Record, Lease] | None = None,
    ):
        self._backend = backend
        self._lock = threading.Lock()
        if granted is None:
            self._record = Record(member, ttl, secrets.token_hex(INCARNATION_BYTES))
            self._lease = backend._register(self._record, None)
        else:  # registered already, by register_many
            self._record, self._lease = granted
        self.incarnation = self._record.incarnation
        self.reregistrations = 0
        self.heartbeats = 0
        # False while the backend may hold an older record than `member` (an update it could
        # not be told of); the heartbeat thread publishes it and sets this back.
        self.published = True
        self.superseded = False
        self.last_error: Exception | None = None
        self._stop = threading.Event()
        self._due = time.monotonic() + self.interval
        self._thread = None
        if backend.group_leases:
            backend.leases.add(self)
        else:
            self._thread = threading.Thread(
                target=self._run, name=f"moecomm-heartbeat-{member.member_id}", daemon=True
            )
            self._thread.start()

    @property
    def member(self) -> Member:
        return self._record.member

    @property
    def ttl(self) -> float:
        """The TTL the backend granted (at least the one asked for)."""
        return self._lease.ttl

    @property
    def interval(self) -> float:
        return self._lease.ttl / HEARTBEATS_PER_TTL

    def update(self, member: Member) -> bool:
        """Publishes new endpoints, hosted experts or metadata for this member (an "update"
        event). The role and id cannot change: register a new member for that. Returns True
        once published; False when the backend cannot be reached: the new fields are kept
        (`member` has them) and the heartbeat thread publishes them when it answers again, so
        a placement change or a drain during a monitor or etcd outage is not lost. A refusal
        (MembershipError) raises and keeps the old fields."""
        if member.key != self._record.member.key:
            raise ValueError(f"update() keeps (role, member_id) {self._record.member.key}")
        with self._lock:
            old = self._record
            self._record = Record(member, old.ttl, self.incarnation)
            try:
                self._lease = self._backend._register(self._record, self._lease)
            except ConnectionError as exc:
                self.published = False
                self.last_error = exc
                log.warning(
                    "%s/%s: update kept until the membership backend answers again (%s)",
                    *member.key,
                    exc,
                )
                return False
            except Exception:
                self._record = old
                raise
            self.published = True
            return True

    def heartbeat_now(self) -> None:
        """One heartbeat (re-registering when the backend forgot us, publishing an update it
        missed), in the caller's thread."""
        with self._lock:
            # Heartbeat first even with an update to publish: a newer incarnation holding the
            # id answers SupersededError here, and registering would steal the id back.
            known = self._backend._heartbeat(self._record, self._lease)
            if known:
                self.heartbeats += 1
                if self.published:
                    return
            # Forgotten (expired, backend restarted): a new lease. Known but missing an update
            # (a backend that kept our lease across an outage): the same lease, new fields.
            self._lease = self._backend._register(self._record, self._lease if known else None)
            self.published = True
            if not known:
                self.reregistrations += 1
        if known:
            log.info("published %s/%s's update missed while unreachable", *self._record.member.key)
        else:
            log.info("re-registered %s/%s (the backend had lost it)", *self._record.member.key)

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self.interval):
            try:
                started = time.monotonic()
                self.heartbeat_now()
                self._backend.leases.latencies.append(time.monotonic() - started)
                if failing:
                    log.info("membership backend reachable again for %s", self.member.member_id)
                failing = False
            except SupersededError as exc:
                # Re-registering would steal the id back and make both incarnations flap.
                self.superseded = True
                self.last_error = exc
                log.error("%s: %s; heartbeats stopped", self.member.member_id, exc)
                return
            except Exception as exc:
                self.last_error = exc
                if not failing:
                    log.warning("heartbeat of %s failed: %s", self.member.member_id, exc)
                failing = True

    def close(self, deregister: bool = True) -> None:
        """Stops heartbeats and, by default, deregisters (best effort: an unreachable backend
        lets the lease expire instead)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._backend.leases.remove(self)
        if self._thread is not None:
            self._thread.join(self._backend.timeout + self.interval)
        # A renewal round in flight holds our lock: deregistering after it, nothing brings the
        # member back.
        if self.superseded:
            return
        try:
            with self._lock:
                if deregister:
                    self._backend._deregister(self._record, self._lease)
                else:
                    self._backend._abandon(self._record, self._lease)
        except Exception as exc:
            log.warning("deregistering %s failed (%s); its lease will expire", self.member, exc)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        role, mid = self._record.member.key
        return f"Registration({role}/{mid}, ttl={self.ttl}, incarnation={self.incarnation})"
