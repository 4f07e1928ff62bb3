"""The embedded monitor's state: members with deadlines, and a bounded, numbered event log.

Pure and single-threaded (the monitor calls it from its event loop only), so it is tested and
reasoned about without HTTP. Times are `time.monotonic()` seconds passed in by the caller.

Deadlines sit in a heap besides the member table, so the monitor's sweep (twenty times a second)
costs the members that are due, not every member: a heartbeat only moves a deadline later, and
the heap entry, which may be earlier than the deadline, is re-filed when it comes up."""

from __future__ import annotations

import heapq
import secrets
from collections import deque
from dataclasses import dataclass
from itertools import islice

from moecomm.membership.member import MembershipError, Record, SupersededError

# Events kept for watchers that reconnect; one further behind gets a full snapshot instead.
MAX_EVENT_LOG = 10_000
# Members one monitor tracks: a 10,000-GPU deployment with one member per GPU and its clients
# (~1 KB of state each), with room to spare; a cap on memory, not a limit anyone should meet.
MAX_MEMBERS = 65_536
# A monitor's epoch: random per start, so a watcher can tell a restarted (empty) monitor.
EPOCH_BYTES = 8


class UnknownMemberError(MembershipError, KeyError):
    """Heartbeat or deregister for a member this monitor does not hold (expired, restarted)."""


class RegistryFullError(MembershipError):
    """The monitor already holds MAX_MEMBERS members."""


@dataclass
class Entry:
    record: Record
    deadline: float


class Registry:
    def __init__(self) -> None:
        self.epoch = secrets.token_hex(EPOCH_BYTES)
        self.seq = 0  # number of the last event; events are numbered from 1
        self._members: dict[tuple[str, str], Entry] = {}
        # (deadline, key) per member, never later than its entry's deadline; stale ones are
        # dropped or re-filed when they come up (see expire()).
        self._deadlines: list[tuple[float, tuple[str, str]]] = []
        self._log: deque[dict] = deque(maxlen=MAX_EVENT_LOG)

    def _event(self, kind: str, rec: Record, reason: str) -> None:
        self.seq += 1
        self._log.append({"seq": self.seq, "kind": kind, "reason": reason, **rec.to_dict()})

    def register(self, rec: Record, now: float) -> str:
        """Adds or refreshes `rec`; returns the event kind it caused ("" for none)."""
        key = rec.member.key
        old = self._members.get(key)
        if old is None and len(self._members) >= MAX_MEMBERS:
            raise RegistryFullError(f"the monitor holds its maximum of {MAX_MEMBERS} members")
        self._members[key] = Entry(rec, now + rec.ttl)
        if old is None or now + rec.ttl < old.deadline:
            heapq.heappush(self._deadlines, (now + rec.ttl, key))
        if old is None:
            self._event("join", rec, "registered")
            return "join"
        if old.record.incarnation != rec.incarnation:
            self._event("loss", old.record, "replaced")
            self._event("join", rec, "registered")
            return "join"
        if old.record.member != rec.member:
            self._event("update", rec, "updated")
            return "update"
        return ""

    def _held(self, key: tuple[str, str], incarnation: str) -> Entry:
        entry = self._members.get(key)
        if entry is None:
            raise UnknownMemberError(
                f"{key[0]}/{key[1]} is not registered here (expired or restarted)"
            )
        if entry.record.incarnation != incarnation:
            raise SupersededError(f"{key[0]}/{key[1]} is held by another incarnation")
        return entry

    def heartbeat(self, key: tuple[str, str], incarnation: str, now: float) -> float:
        entry = self._held(key, incarnation)
        entry.deadline = now + entry.record.ttl
        return entry.record.ttl

    def heartbeat_many(
        self, leases: list[tuple[tuple[str, str], str]], now: float
    ) -> list[float | MembershipError]:
        """`heartbeat` for each (key, incarnation): its TTL, or the error it raised."""
        out: list[float | MembershipError] = []
        for key, incarnation in leases:
            try:
                out.append(self.heartbeat(key, incarnation, now))
            except MembershipError as exc:
                out.append(exc)
        return out

    def deregister(self, key: tuple[str, str], incarnation: str) -> None:
        entry = self._held(key, incarnation)
        del self._members[key]
        self._event("loss", entry.record, "deregistered")

    def extend(self, seconds: float) -> None:
        """Moves every member's deadline `seconds` later (time the monitor did not run)."""
        if seconds < 0:
            raise ValueError(f"leases are extended by a positive time, got {seconds}")
        for entry in self._members.values():
            entry.deadline += seconds

    def expire(self, now: float) -> int:
        """Drops members whose deadline passed; returns how many. Looks only at heap entries that
        are due: a member that heartbeated since is re-filed under its real deadline."""
        dead: set[tuple[str, str]] = set()
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, key = heapq.heappop(heap)
            entry = self._members.get(key)
            if entry is None or key in dead:
                continue  # deregistered, expired, or a second entry of one member
            if entry.deadline <= now:
                dead.add(key)
            else:
                heapq.heappush(heap, (entry.deadline, key))
        for key in sorted(dead):
            self._event("loss", self._members.pop(key).record, "expired")
        return len(dead)

    def records(self, role: str | None, now: float) -> list[dict]:
        out = []
        for key in sorted(self._members):
            e = self._members[key]
            if role is None or key[0] == role:
                out.append({**e.record.to_dict(), "expires_in": max(0.0, e.deadline - now)})
        return out

    def events_since(self, since: int) -> list[dict] | None:
        """Events numbered after `since`, or None when the log no longer holds them all (or
        `since` is from the future, i.e. another epoch): the caller needs a snapshot."""
        if since > self.seq:
            return None
        if since == self.seq:
            return []
        oldest = self._log[0]["seq"] if self._log else self.seq + 1
        if since + 1 < oldest:
            return None
        return list(islice(self._log, since + 1 - oldest, None))

    def __len__(self) -> int:
        return len(self._members)
