"""Membership: who is alive among expert servers, attention clients and other stages.

One interface (`Membership`), two backends: the embedded monitor (`http://...`, the default,
nothing to install; run it with `python -m moecomm.membership.monitor`) and etcd
(`etcd://host:port[/prefix]`). See docs/membership.md.

    ms = connect_membership("http://127.0.0.1:7000")
    reg = ms.register(Member("server", "s0", {"control": url}, {0: [0, 1]}), ttl=5.0)
    with ms.watch(role="server") as w:
        ev = w.next(timeout=1.0)   # Event(kind="join"|"loss"|"update", member, reason, ...)
    reg.close()
"""

from __future__ import annotations

from urllib.parse import urlsplit

from moecomm.membership.base import (
    DEFAULT_HTTP_TIMEOUT_S,
    DEFAULT_POLL_S,
    DEFAULT_TTL_S,
    HEARTBEATS_PER_TTL,
    LeaseGroup,
    Membership,
    Registration,
    monitor_token,
)
from moecomm.membership.embedded import EmbeddedMembership, MonitorRemoteError
from moecomm.membership.etcd import DEFAULT_PREFIX, EtcdError, EtcdMembership
from moecomm.membership.member import Event, Member, MembershipError, Record, SupersededError
from moecomm.membership.monitor import MonitorServer
from moecomm.membership.watcher import Watcher


def connect_membership(
    url: str,
    token: str = "",
    poll_s: float = DEFAULT_POLL_S,
    timeout: float = DEFAULT_HTTP_TIMEOUT_S,
    group_leases: bool = True,
) -> Membership:
    """The backend named by `url`: "http(s)://host:port" is an embedded monitor (`token` is its
    shared token), "etcd://host:port[,host:port...][/prefix]" an etcd cluster. `group_leases`
    False renews each registration from its own thread with its own requests (the behaviour of
    earlier versions, kept for comparison)."""
    parts = urlsplit(url)
    if parts.scheme in ("http", "https"):
        return EmbeddedMembership(url, token, poll_s, timeout, group_leases)
    if parts.scheme == "etcd":
        if not parts.netloc:
            raise ValueError(f"etcd URL needs host:port, got {url!r}")
        if token:
            raise ValueError("the etcd backend takes no token (etcd auth is not supported)")
        prefix = parts.path.rstrip("/") or DEFAULT_PREFIX
        return EtcdMembership(parts.netloc.split(","), prefix, poll_s, timeout, group_leases)
    raise ValueError(f"membership URL must be http://, https:// or etcd://, got {url!r}")


__all__ = [
    "DEFAULT_TTL_S",
    "HEARTBEATS_PER_TTL",
    "EmbeddedMembership",
    "EtcdError",
    "EtcdMembership",
    "Event",
    "LeaseGroup",
    "Member",
    "Membership",
    "MembershipError",
    "MonitorRemoteError",
    "MonitorServer",
    "Record",
    "Registration",
    "SupersededError",
    "Watcher",
    "connect_membership",
    "monitor_token",
]
