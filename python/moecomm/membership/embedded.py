"""Membership through the embedded monitor (`moecomm.membership.monitor`), over httpx."""

from __future__ import annotations

import threading

import httpx

from moecomm.errors import RemoteError
from moecomm.membership.base import (
    DEFAULT_HTTP_TIMEOUT_S,
    DEFAULT_POLL_S,
    Lease,
    Membership,
)
from moecomm.membership.member import MembershipError, Record, SupersededError

# Pause between attempts while the monitor is unreachable: short, because a restarted monitor
# should be noticed quickly, and a watcher makes one cheap request per attempt.
RETRY_S = 0.2
# Margin on top of a long-poll for the HTTP read: the monitor answers at `timeout` exactly.
POLL_MARGIN_S = 2.0


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
    ):
        super().__init__(poll_s, timeout)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the embedded monitor is reached over http(s), got {url!r}")
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, ok=(200,), timeout: float | None = None, **kw):
        try:
            r = self._http.request(method, path, timeout=timeout or self.timeout, **kw)
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

    def _deregister(self, record: Record, lease: Lease) -> None:
        # 404: already gone (expired, or a restarted monitor never saw it) — the goal holds.
        self._call("POST", "/deregister", ok=(200, 404), json=self._lease_body(record))

    def _list_records(self, role: str | None) -> list[Record]:
        params = {"role": role} if role else {}
        body = self._call("GET", "/members", params=params).json()
        return [Record.from_dict(d) for d in body["members"]]

    def _watch_source(self, view, stop: threading.Event) -> None:
        epoch, seq = None, 0
        while not stop.is_set():
            try:
                if epoch is None:
                    body = self._call("GET", "/members").json()
                    view.snapshot([Record.from_dict(d) for d in body["members"]], False)
                    epoch, seq = body["epoch"], body["seq"]
                    continue
                params = {"since": seq, "epoch": epoch, "timeout": self.poll_s}
                body = self._call(
                    "GET", "/events", params=params, timeout=self.poll_s + POLL_MARGIN_S
                ).json()
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
            epoch, seq = body["epoch"], body["seq"]
