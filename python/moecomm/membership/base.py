"""The one membership interface, and the registration that keeps a member alive on any backend.

A backend implements five hooks: `_register`, `_heartbeat`, `_deregister`, `_list_records` and
`_watch_source`. Everything else — heartbeat threads, automatic re-registration, the watcher's
view of who is alive — is written once here and in `watcher.py`."""

from __future__ import annotations

import logging
import os
import secrets
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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

    def __init__(self, poll_s: float = DEFAULT_POLL_S, timeout: float = DEFAULT_HTTP_TIMEOUT_S):
        if poll_s <= 0 or timeout <= 0:
            raise ValueError(f"poll_s and timeout must be positive, got {poll_s}, {timeout}")
        self.poll_s = poll_s
        self.timeout = timeout

    # ---- public API -------------------------------------------------------------------------

    def register(self, member: Member, ttl: float = DEFAULT_TTL_S) -> Registration:
        """Registers `member` with a lease of `ttl` seconds and keeps it alive from a background
        thread until `Registration.close()`. Raises ConnectionError when the backend cannot be
        reached, MembershipError when it refuses (bad token, bad fields, full)."""
        if not isinstance(member, Member):
            raise TypeError(f"register() takes a Member, got {type(member).__name__}")
        return Registration(self, member, check_ttl(ttl))

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


class Registration:
    """A live registration. Its thread heartbeats `HEARTBEATS_PER_TTL` times per TTL; when the
    backend answers that it forgot the member (lease expired, monitor or etcd restarted with an
    empty store), it registers again with the same incarnation. Unreachable backends are retried
    at the same pace, so a member is back within one heartbeat interval of the backend. An
    `update` made while the backend cannot be reached is kept and published by the same thread
    as soon as it answers again."""

    def __init__(self, backend: Membership, member: Member, ttl: float):
        self._backend = backend
        self.incarnation = secrets.token_hex(INCARNATION_BYTES)
        self._record = Record(member, ttl, self.incarnation)
        self._lock = threading.Lock()
        self._lease = backend._register(self._record, None)
        self.reregistrations = 0
        self.heartbeats = 0
        # False while the backend may hold an older record than `member` (an update it could
        # not be told of); the heartbeat thread publishes it and sets this back.
        self.published = True
        self.superseded = False
        self.last_error: Exception | None = None
        self._stop = threading.Event()
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
                self.heartbeat_now()
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
        self._thread.join(self._backend.timeout + self.interval)
        if deregister and not self.superseded:
            try:
                with self._lock:
                    self._backend._deregister(self._record, self._lease)
            except Exception as exc:
                log.warning("deregistering %s failed (%s); its lease will expire", self.member, exc)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        role, mid = self._record.member.key
        return f"Registration({role}/{mid}, ttl={self.ttl}, incarnation={self.incarnation})"
