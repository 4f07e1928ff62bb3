"""What only the etcd backend does: TTL rounding, endpoint failover, foreign keys."""

from __future__ import annotations

import base64
import secrets

import httpx
from membership_procs import POLL_S
from moecomm.membership import Member, connect_membership

EVENT_WAIT_S = 5.0
HTTP_TIMEOUT_S = 10.0


def url_of(etcd_process, endpoints: str | None = None) -> str:
    return f"etcd://{endpoints or etcd_process.endpoint}/t{secrets.token_hex(4)}"


def test_ttl_is_rounded_up_to_whole_seconds(etcd_process):
    with connect_membership(url_of(etcd_process), poll_s=POLL_S) as ms:
        reg = ms.register(Member("client", "c-round"), ttl=0.5)
        try:
            assert reg.ttl == 1.0 and reg.interval == 1.0 / 3
        finally:
            reg.close()


def test_unreachable_endpoint_fails_over(etcd_process):
    # Port 1 on loopback refuses connections: the next endpoint answers.
    url = url_of(etcd_process, f"127.0.0.1:1,{etcd_process.endpoint}")
    with connect_membership(url, poll_s=POLL_S) as ms:
        reg = ms.register(Member("server", "s-failover"), ttl=1.0)
        try:
            assert ms.list_members() == [reg.member]
            assert ms.endpoints[ms._current].endswith(etcd_process.endpoint)
        finally:
            reg.close()


def test_foreign_keys_under_the_prefix_are_ignored(etcd_process):
    url = url_of(etcd_process)
    prefix = url.rsplit("/", 1)[1]
    with connect_membership(url, poll_s=POLL_S) as ms:
        reg = ms.register(Member("server", "s-real"), ttl=1.0)
        watcher = ms.watch()
        try:
            # Someone else's junk among our member keys must not break listing or watching.
            key = base64.b64encode(f"/{prefix}/members/server/junk".encode()).decode()
            value = base64.b64encode(b"not json").decode()
            r = httpx.post(
                f"http://{etcd_process.endpoint}/v3/kv/put",
                json={"key": key, "value": value},
                timeout=HTTP_TIMEOUT_S,
            )
            assert r.status_code == 200, r.text
            assert ms.list_members() == [reg.member]
            ev = watcher.next(timeout=EVENT_WAIT_S)
            assert (ev.kind, ev.reason, ev.member) == ("join", "existing", reg.member)
            assert watcher.next(timeout=POLL_S * 2) is None
            assert watcher.members() == [reg.member]
        finally:
            watcher.close()
            reg.close()
