"""Membership through the embedded monitor (`moecomm.membership.monitor`), over httpx.

A process's members are renewed in one POST /heartbeats and re-registered in one POST
/registers per round (split at the monitor's MAX_BATCH_ITEMS). Against a monitor without those
routes (an older one) it falls back to one request per member."""

from __future__ import annotations

import json
import threading
import time

import httpx

from moecomm.errors import RemoteError
from moecomm.membership.base import (
    DEFAULT_HTTP_TIMEOUT_S,
    DEFAULT_POLL_S,
    BackendBusyError,
    Lease,
    Membership,
)
from moecomm.membership.member import MembershipError, Record, SupersededError

# Pause between attempts while the monitor is unreachable: short, because a restarted monitor
# should be noticed quickly, and a watcher makes one cheap request per attempt.
RETRY_S = 0.2
# Margin on top of a long-poll for the HTTP read: the monitor answers at `timeout` exactly.
POLL_MARGIN_S = 2.0
# Items per batch request: the monitor's MAX_BATCH_ITEMS (a 2,500-member process sends one).
BATCH_ITEMS = 8192
# Deadline added to a batch request per item: a loaded monitor validates ~10,000 items a second
# (a 1,024-record registration may take a second more than one member's).
BATCH_ITEM_S = 1e-3
# Bytes of member records per POST /registers, well under the monitor's 2 MiB body limit (one
# record at every bound is ~1.5 MB: such a record goes alone).
BATCH_BYTES = 1 << 20


class MonitorRemoteError(RemoteError, MembershipError):
    """The monitor refused a request (status and its reason attached)."""


class EmbeddedMembership(Membership):
    """Client of an embedded monitor at `url` (e.g. "http://127.0.0.1:7000")."""

    def __init__(
        self,
        url: str,
        token: str = "",
        poll_s: float = DEFAULT_POLL_S,
        timeout: float = DEFAULT_HTTP_TIMEOUT_S,
        group_leases: bool = True,
    ):
        super().__init__(poll_s, timeout, group_leases)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the embedded monitor is reached over http(s), got {url!r}")
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        # Batches until the monitor says it has no batch routes (404 on the route itself).
        self.batches = True

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, ok=(200,), timeout: float | None = None, **kw):
        try:
            r = self._http.request(method, path, timeout=timeout or self.timeout, **kw)
        except httpx.ReadTimeout as exc:
            raise BackendBusyError(f"monitor {self.url}{path} did not answer: {exc}") from exc
        except httpx.HTTPError as exc:
            raise ConnectionError(f"monitor {self.url}{path} unreachable: {exc}") from exc
        if r.status_code not in ok:
            try:
                reason = r.json().get("detail", r.text)
            except ValueError:
                reason = r.text
            raise MonitorRemoteError(r.status_code, str(reason), f"monitor {self.url}{path}: ")
        return r

    def _register(self, record: Record, lease: Lease | None) -> Lease:
        self._call("POST", "/register", json=record.to_dict())
        return Lease(record.incarnation, record.ttl)

    def _lease_body(self, record: Record) -> dict:
        role, member_id = record.member.key
        return {"role": role, "member_id": member_id, "incarnation": record.incarnation}

    def _heartbeat(self, record: Record, lease: Lease) -> bool:
        r = self._call("POST", "/heartbeat", ok=(200, 404, 409), json=self._lease_body(record))
        if r.status_code == 409:
            raise SupersededError(r.json().get("detail", "superseded"))
        return r.status_code == 200

    def _batched(self, path: str, key: str, bodies: list[dict]) -> list[dict] | None:
        """The monitor's per-item answers to `bodies` sent to `path` in batches, or None when it
        has no such route. Raises ConnectionError or MonitorRemoteError for a whole batch."""
        chunks, size = [[]], 0
        for body in bodies:
            n = len(json.dumps(body)) if key == "records" else 0
            if chunks[-1] and (len(chunks[-1]) >= BATCH_ITEMS or size + n > BATCH_BYTES):
                chunks.append([])
                size = 0
            chunks[-1].append(body)
            size += n
        results = []
        for chunk in chunks:
            timeout = self.timeout + len(chunk) * BATCH_ITEM_S
            r = self._call("POST", path, ok=(200, 404), timeout=timeout, json={key: chunk})
            if r.status_code == 404:
                self.batches = False  # an older monitor: one request per member from now on
                return None
            results += r.json()["results"]
        if len(results) != len(bodies):
            raise MembershipError(f"{path}: {len(results)} answers to {len(bodies)} items")
        return results

    def _register_many(self, items: list[tuple[Record, Lease | None]]) -> list:
        if not self.batches or len(items) <= 1:
            return super()._register_many(items)
        try:
            results = self._batched("/registers", "records", [r.to_dict() for r, _ in items])
        except ConnectionError as exc:
            return [exc] * len(items)
        if results is None:
            return super()._register_many(items)
        return [
            Lease(rec.incarnation, rec.ttl)
            if res["status"] == 200
            else MonitorRemoteError(res["status"], res["detail"], f"monitor {self.url}: ")
            for (rec, _), res in zip(items, results, strict=True)
        ]

    def _heartbeat_many(self, items: list[tuple[Record, Lease]]) -> list:
        if not self.batches or len(items) <= 1:
            return super()._heartbeat_many(items)
        try:
            results = self._batched(
                "/heartbeats", "leases", [self._lease_body(rec) for rec, _ in items]
            )
        except ConnectionError as exc:
            return [exc] * len(items)
        if results is None:
            return super()._heartbeat_many(items)
        out: list = []
        for res in results:
            if res["status"] == 409:
                out.append(SupersededError(res["detail"]))
            elif res["status"] in (200, 404):
                out.append(res["status"] == 200)
            else:
                where = f"monitor {self.url}: "
                out.append(MonitorRemoteError(res["status"], res["detail"], where))
        return out

    def _deregister(self, record: Record, lease: Lease) -> None:
        # 404: already gone (expired, or a restarted monitor never saw it) — the goal holds.
        self._call("POST", "/deregister", ok=(200, 404), json=self._lease_body(record))

    def _list_records(self, role: str | None) -> list[Record]:
        params = {"role": role} if role else {}
        body = self._call("GET", "/members", params=params).json()
        return [Record.from_dict(d) for d in body["members"]]

    def _watch_source(self, view, stop: threading.Event) -> None:
        epoch, seq = None, 0
        # The monitor sends only this role's members and events (the view filters as well).
        role = {"role": view.role} if view.role else {}
        while not stop.is_set():
            try:
                if epoch is None:
                    body = self._call("GET", "/members", params=role).json()
                    answered = time.monotonic()
                    view.snapshot([Record.from_dict(d) for d in body["members"]], False)
                    view.heard(answered)
                    epoch, seq = body["epoch"], body["seq"]
                    continue
                params = {"since": seq, "epoch": epoch, "timeout": self.poll_s, **role}
                body = self._call(
                    "GET", "/events", params=params, timeout=self.poll_s + POLL_MARGIN_S
                ).json()
                answered = time.monotonic()
            except (ConnectionError, MembershipError, ValueError, KeyError) as exc:
                view.error(exc)
                stop.wait(RETRY_S)
                continue
            if stop.is_set():
                return
            if body.get("resync"):
                records = [Record.from_dict(d) for d in body["members"]]
                view.snapshot(records, backend_changed=body["epoch"] != epoch)
            else:
                view.recovered()
                for ev in body["events"]:
                    rec = Record.from_dict(ev)
                    if ev["kind"] == "loss":
                        view.delete(rec.member.key, ev["reason"])
                    else:
                        view.put(rec)
            view.heard(answered)
            epoch, seq = body["epoch"], body["seq"]
