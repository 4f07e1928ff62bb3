"""Membership on etcd (v3), through its HTTP/JSON gateway with httpx: no extra dependency.

Key layout under a prefix (default "/moecomm"):
    {prefix}/epoch                        random id, created by the first client of a fresh store
    {prefix}/members/{role}/{member_id}   JSON Record, attached to the member's lease
A member is alive while its lease is: its heartbeat is a lease keep-alive, and when etcd expires
or loses the lease (restart with a fresh data dir) the key is gone and the keep-alive answers
TTL 0, so the Registration grants a new lease and puts the key again. The members of one
`EtcdMembership` (one process) share one lease per TTL, as etcd's own clients do: one
keep-alive per process and interval, however many members it hosts; a member leaving deletes
its key, and the lease lives on for the others. Watchers read one atomic
transaction (epoch + members, at one revision), then stream /v3/watch from the next revision.
The gateway encodes keys and values in base64 and 64-bit integers as strings.
"""

from __future__ import annotations

import base64
import json
import math
import secrets
import threading
import time

import httpx

from moecomm.membership.base import (
    DEFAULT_HTTP_TIMEOUT_S,
    DEFAULT_POLL_S,
    Lease,
    Membership,
)
from moecomm.membership.member import MembershipError, Record

DEFAULT_PREFIX = "/moecomm"
# etcd's gRPC status for "requested lease not found" (codes.NotFound).
GRPC_NOT_FOUND = 5
# Pause between attempts while etcd is unreachable (see embedded.RETRY_S).
RETRY_S = 0.2
EPOCH_BYTES = 8
# How much of a non-JSON or error answer goes into an exception message.
ERROR_EXCERPT_CHARS = 200
# Puts per transaction when many members register at once: under etcd's --max-txn-ops
# (default 128).
TXN_PUTS = 64
# Failures a watcher retries through a fresh snapshot; anything else is a bug and surfaces.
RETRIED = (
    ConnectionError,
    MembershipError,
    httpx.HTTPError,
    httpx.StreamError,
    ValueError,
    KeyError,
)


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _unb64(s: str) -> str:
    return base64.b64decode(s).decode()


def _prefix_end(prefix: str) -> str:
    # range_end for "every key starting with prefix": the prefix with its last byte + 1.
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class EtcdError(MembershipError):
    """etcd answered with an error (its gRPC code and message attached)."""

    def __init__(self, code: int, message: str, where: str = ""):
        self.code = code
        super().__init__(f"{where}etcd error {code}: {message}")


class EtcdMembership(Membership):
    """Membership on the etcd cluster at `endpoints` ("127.0.0.1:2379" or a list; tried in
    order when one cannot be reached), keys under `prefix`. etcd leases are whole seconds and
    at least etcd's minimum (about 1.5 election timeouts): a TTL is rounded up to those."""

    def __init__(
        self,
        endpoints: str | list[str],
        prefix: str = DEFAULT_PREFIX,
        poll_s: float = DEFAULT_POLL_S,
        timeout: float = DEFAULT_HTTP_TIMEOUT_S,
        group_leases: bool = True,
    ):
        super().__init__(poll_s, timeout, group_leases)
        if isinstance(endpoints, str):
            endpoints = endpoints.split(",")
        self.endpoints = [e if "://" in e else f"http://{e}" for e in endpoints if e]
        if not self.endpoints:
            raise ValueError("EtcdMembership needs at least one endpoint")
        if not prefix.startswith("/") or prefix.endswith("/") or len(prefix) < 2:
            raise ValueError(f"prefix must look like '/name', got {prefix!r}")
        self.prefix = prefix
        self._members_prefix = f"{prefix}/members/"
        self._epoch_key = f"{prefix}/epoch"
        self._http = httpx.Client(timeout=timeout)
        self._current = 0  # index of the endpoint that answered last
        # The shared lease per granted TTL (group_leases), and the lock its grant is under.
        self._shared: dict[int, Lease] = {}
        self._shared_lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    # ---- plumbing -----------------------------------------------------------------------------

    def _post(self, path: str, body: dict) -> dict:
        """One gateway call, failing over across endpoints. Raises ConnectionError when none
        answers, EtcdError when etcd refuses."""
        errors = []
        for i in range(len(self.endpoints)):
            idx = (self._current + i) % len(self.endpoints)
            url = self.endpoints[idx] + path
            try:
                r = self._http.post(url, json=body)
            except httpx.HTTPError as exc:
                errors.append(f"{url}: {exc}")
                continue
            self._current = idx
            try:
                data = r.json()
            except ValueError:
                raise EtcdError(
                    -1, f"non-JSON answer ({r.status_code}): {r.text[:ERROR_EXCERPT_CHARS]}"
                ) from None
            if r.status_code != 200 or "error" in data:
                raise EtcdError(
                    data.get("code", -1),
                    data.get("message", r.text[:ERROR_EXCERPT_CHARS]),
                    url + ": ",
                )
            return data
        raise ConnectionError("etcd unreachable: " + "; ".join(errors))

    def _key(self, record: Record) -> str:
        role, member_id = record.member.key
        return f"{self._members_prefix}{role}/{member_id}"

    def _put(self, record: Record, lease_id: str) -> None:
        body = {"key": _b64(self._key(record)), "lease": lease_id}
        body["value"] = _b64(json.dumps(record.to_dict(), separators=(",", ":")))
        self._post("/v3/kv/put", body)

    def _parse_kv(self, kv: dict) -> Record | None:
        try:
            return Record.from_dict(json.loads(_unb64(kv["value"])))
        except (KeyError, ValueError, TypeError):
            # Not ours or corrupt: ignore it rather than fail every watcher on one bad key.
            return None

    # ---- backend hooks ------------------------------------------------------------------------

    def _grant(self, ttl: float) -> Lease:
        granted = self._post("/v3/lease/grant", {"TTL": math.ceil(ttl)})
        return Lease(granted["ID"], float(granted["TTL"]))

    def _shared_lease(self, ttl: float, lost: Lease | None = None) -> Lease:
        """This process's lease for `ttl`; a new one when there is none or it is `lost`."""
        with self._shared_lock:
            lease = self._shared.get(math.ceil(ttl))
            if lease is None or (lost is not None and lease.handle == lost.handle):
                lease = self._shared[math.ceil(ttl)] = self._grant(ttl)
            return lease

    def _forget_shared(self, handle: str) -> None:
        with self._shared_lock:
            for ttl, lease in list(self._shared.items()):
                if lease.handle == handle:
                    del self._shared[ttl]

    def _register(self, record: Record, lease: Lease | None) -> Lease:
        if lease is not None:
            try:
                self._put(Record(record.member, lease.ttl, record.incarnation), lease.handle)
                return lease
            except EtcdError as exc:
                if exc.code != GRPC_NOT_FOUND:
                    raise
        if not self.group_leases:
            lease = self._grant(record.ttl)
            self._put(Record(record.member, lease.ttl, record.incarnation), lease.handle)
            return lease
        return self._put_shared([record])

    def _put_shared(self, records: list[Record]) -> Lease:
        """Puts `records` (one TTL) on the shared lease, in transactions of TXN_PUTS; grants a
        new lease once if the shared one was lost meanwhile."""
        lease = self._shared_lease(records[0].ttl)
        for attempt in range(2):
            try:
                for i in range(0, len(records), TXN_PUTS):
                    puts = [
                        {
                            "request_put": {
                                "key": _b64(self._key(r)),
                                "value": _b64(
                                    json.dumps(
                                        Record(r.member, lease.ttl, r.incarnation).to_dict(),
                                        separators=(",", ":"),
                                    )
                                ),
                                "lease": lease.handle,
                            }
                        }
                        for r in records[i : i + TXN_PUTS]
                    ]
                    self._post("/v3/kv/txn", {"success": puts})
                return lease
            except EtcdError as exc:
                if exc.code != GRPC_NOT_FOUND or attempt:
                    raise
                lease = self._shared_lease(records[0].ttl, lost=lease)
        raise AssertionError("unreachable")

    def _register_many(self, items: list[tuple[Record, Lease | None]]) -> list:
        if not self.group_leases or len(items) <= 1:
            return super()._register_many(items)
        by_ttl: dict[int, list[int]] = {}
        for i, (rec, _) in enumerate(items):
            by_ttl.setdefault(math.ceil(rec.ttl), []).append(i)
        out: list = [None] * len(items)
        for idx in by_ttl.values():
            try:
                lease = self._put_shared([items[i][0] for i in idx])
            except (ConnectionError, MembershipError) as exc:
                lease = exc
            for i in idx:
                out[i] = lease
        return out

    def _heartbeat_many(self, items: list[tuple[Record, Lease]]) -> list:
        if not self.group_leases:
            return super()._heartbeat_many(items)
        answers: dict[str, bool | Exception] = {}
        for _, lease in items:
            if lease.handle in answers:
                continue
            try:
                answers[lease.handle] = self._heartbeat(None, lease)
            except ConnectionError as exc:
                return [exc] * len(items)
            except MembershipError as exc:
                answers[lease.handle] = exc
            if answers[lease.handle] is False:
                self._forget_shared(lease.handle)
        return [answers[lease.handle] for _, lease in items]

    def _heartbeat(self, record: Record, lease: Lease) -> bool:
        try:
            result = self._post("/v3/lease/keepalive", {"ID": lease.handle}).get("result", {})
        except EtcdError as exc:
            if exc.code == GRPC_NOT_FOUND:
                return False
            raise
        # An expired or unknown lease comes back with TTL 0, which JSON leaves out.
        return int(result.get("TTL", 0)) > 0

    def _abandon(self, record: Record, lease: Lease) -> None:
        """On a shared lease the other members would keep this one alive forever: its key moves
        to a lease of its own that nobody renews, and expires a TTL later."""
        if not self.group_leases:
            return
        own = self._grant(record.ttl)
        key = _b64(self._key(record))
        mine = Record(record.member, lease.ttl, record.incarnation).to_dict()
        value = _b64(json.dumps(mine, separators=(",", ":")))
        moved = Record(record.member, own.ttl, record.incarnation).to_dict()
        put = {"key": key, "value": _b64(json.dumps(moved, separators=(",", ":")))}
        txn = {
            "compare": [{"target": "VALUE", "key": key, "value": value}],
            "success": [{"request_put": {**put, "lease": own.handle}}],
        }
        self._post("/v3/kv/txn", txn)

    def _deregister(self, record: Record, lease: Lease) -> None:
        # Mark the record leaving first, so watchers report "deregistered", not "expired" —
        # only while the key is still on our lease: a newer incarnation may have taken it.
        key = _b64(self._key(record))
        leaving = Record(record.member, lease.ttl, record.incarnation, leaving=True)
        value = _b64(json.dumps(leaving.to_dict(), separators=(",", ":")))
        ours = [{"target": "LEASE", "key": key, "lease": lease.handle}]
        if self.group_leases:
            # A shared lease may hold a newer incarnation of this id from the same process:
            # the key is ours only while it holds exactly what we put.
            mine = Record(record.member, lease.ttl, record.incarnation).to_dict()
            put = _b64(json.dumps(mine, separators=(",", ":")))
            ours.append({"target": "VALUE", "key": key, "value": put})
        txn = {
            "compare": ours,
            "success": [{"request_put": {"key": key, "value": value, "lease": lease.handle}}],
        }
        try:
            done = self._post("/v3/kv/txn", txn).get("succeeded", False)
            if self.group_leases:
                # The lease is the other members' too: delete the key alone (if still ours).
                if done:
                    still = [{"target": "VALUE", "key": key, "value": value}]
                    delete = {"request_delete_range": {"key": key}}
                    self._post("/v3/kv/txn", {"compare": still, "success": [delete]})
            else:
                self._post("/v3/lease/revoke", {"ID": lease.handle})
        except EtcdError as exc:
            if exc.code != GRPC_NOT_FOUND:  # lease already gone: so is the key
                raise

    def _list_records(self, role: str | None) -> list[Record]:
        prefix = self._members_prefix + (f"{role}/" if role else "")
        data = self._post(
            "/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}
        )
        records = [self._parse_kv(kv) for kv in data.get("kvs", [])]
        return sorted((r for r in records if r is not None), key=lambda r: r.member.key)

    def _snapshot(self) -> tuple[str, int, list[Record]]:
        """(epoch, revision, records) in one transaction; creates the epoch on a fresh store."""
        members = {
            "request_range": {
                "key": _b64(self._members_prefix),
                "range_end": _b64(_prefix_end(self._members_prefix)),
            }
        }
        epoch_key = _b64(self._epoch_key)
        new_epoch = secrets.token_hex(EPOCH_BYTES)
        txn = {
            "compare": [{"target": "CREATE", "key": epoch_key, "create_revision": "0"}],
            "success": [{"request_put": {"key": epoch_key, "value": _b64(new_epoch)}}, members],
            "failure": [{"request_range": {"key": epoch_key}}, members],
        }
        data = self._post("/v3/kv/txn", txn)
        responses = data["responses"]
        if data.get("succeeded"):
            epoch = new_epoch
        else:
            epoch = _unb64(responses[0]["response_range"]["kvs"][0]["value"])
        kvs = responses[1]["response_range"].get("kvs", [])
        records = [r for r in map(self._parse_kv, kvs) if r is not None]
        return epoch, int(data["header"]["revision"]), records

    def _member_key(self, etcd_key: str) -> tuple[str, str] | None:
        rest = etcd_key[len(self._members_prefix) :].split("/")
        return (rest[0], rest[1]) if len(rest) == 2 else None

    def _current_epoch(self) -> tuple[str | None, int]:
        """(epoch, revision) of the store now: one small read, to resume a watch safely."""
        data = self._post("/v3/kv/range", {"key": _b64(self._epoch_key)})
        kvs = data.get("kvs", [])
        return (_unb64(kvs[0]["value"]) if kvs else None), int(data["header"]["revision"])

    def _puts_since(self, revision: int) -> int:
        """How many member keys were put after `revision` (one keys-only read: etcd's `count`
        ignores the revision filter, the keys it returns do not)."""
        body = {
            "key": _b64(self._members_prefix),
            "range_end": _b64(_prefix_end(self._members_prefix)),
            "keys_only": True,
            "min_mod_revision": str(revision + 1),
        }
        return len(self._post("/v3/kv/range", body).get("kvs", []))

    def _watch_source(self, view, stop: threading.Event) -> None:
        identity, revision, need_snapshot = None, 0, True
        while not stop.is_set():
            try:
                if need_snapshot:
                    epoch, rev, records = self._snapshot()
                    answered = time.monotonic()
                    # A new epoch, or a revision that went back: a store without our history.
                    changed = identity is not None and (epoch != identity or rev < revision)
                    view.snapshot(records, changed)
                    view.heard(answered)
                    identity, revision = epoch, rev
                else:
                    # An idle stream ended: resume from `revision` if the store is still ours.
                    asked = time.monotonic()
                    epoch, rev = self._current_epoch()
                    if epoch != identity or rev < revision:
                        need_snapshot = True
                        continue
                    if not self._puts_since(revision):  # the view has every record put
                        view.heard(asked)
                revision, complete = self._stream(view, stop, revision)
                need_snapshot = not complete
            except Exception as exc:
                if stop.is_set():
                    return
                if not isinstance(exc, RETRIED):
                    raise
                view.error(exc)
                need_snapshot = True
                stop.wait(RETRY_S)

    def _stream(self, view, stop: threading.Event, revision: int) -> tuple[int, bool]:
        """Streams changes after `revision` until the stream idles for `poll_s`, ends or stop is
        set. Returns the last revision seen, and False when history may be incomplete (etcd
        cancelled the watch, e.g. compaction): the caller then takes a snapshot. Raises on
        broken connections."""
        create = {
            "create_request": {
                "key": _b64(self._members_prefix),
                "range_end": _b64(_prefix_end(self._members_prefix)),
                "start_revision": str(revision + 1),
                "prev_kv": True,
            }
        }
        url = self.endpoints[self._current] + "/v3/watch"
        timeout = httpx.Timeout(self.timeout, read=self.poll_s)
        with self._http.stream("POST", url, json=create, timeout=timeout) as response:
            try:
                for line in response.iter_lines():
                    if stop.is_set():
                        return revision, True
                    if not line.strip():
                        continue
                    result = json.loads(line).get("result")
                    if result is None or result.get("canceled"):
                        return revision, False
                    read = time.monotonic()
                    revision = max(revision, int(result["header"]["revision"]))
                    for ev in result.get("events", []):
                        self._apply(view, ev)
                    view.recovered()
                    if not result.get("created"):
                        # The created answer comes before the history it will replay.
                        view.heard(read)
            except httpx.ReadTimeout:
                return revision, True
        return revision, False

    def _apply(self, view, ev: dict) -> None:
        kv = ev["kv"]
        if ev.get("type") == "DELETE":
            key = self._member_key(_unb64(kv["key"]))
            if key is not None:
                view.delete(key, "expired")
            return
        rec = self._parse_kv(kv)
        if rec is not None:
            view.put(rec)
