"""The monitor's HTTP API against the session's monitor process: bad requests get a 4xx with a
message naming the problem, the token guards every route but /health, long-polls are pushed."""

from __future__ import annotations

import secrets
import threading
import time

import httpx
import pytest
from membership_procs import MONITOR_TOKEN, TTL_S
from moecomm.membership import (
    EmbeddedMembership,
    Member,
    MonitorRemoteError,
    SupersededError,
    connect_membership,
)
from moecomm.membership import member as m
from moecomm.membership.monitor import MAX_BODY_BYTES, MAX_POLL_S

AUTH = {"Authorization": f"Bearer {MONITOR_TOKEN}"}
HTTP_TIMEOUT_S = 10.0
# A long-poll must be answered by the event, well before its own timeout.
PUSH_WITHIN_S = 1.0


@pytest.fixture
def url(monitor_process):
    return monitor_process.url


def body(member_id: str | None = None, **member_fields) -> dict:
    member = {"role": "server", "member_id": member_id or "h-" + secrets.token_hex(4)}
    member.update(member_fields)
    return {"member": member, "ttl": TTL_S, "incarnation": secrets.token_hex(8)}


def post(url: str, path: str, headers=AUTH, **kw) -> httpx.Response:
    return httpx.post(url + path, headers=headers, timeout=HTTP_TIMEOUT_S, **kw)


def deregister(url: str, b: dict) -> None:
    lease = {k: b["member"][k] for k in ("role", "member_id")} | {"incarnation": b["incarnation"]}
    assert post(url, "/deregister", json=lease).status_code == 200


def test_token_guards_every_route_but_health(url):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": MONITOR_TOKEN + "x"}):
        r = post(url, "/register", headers=headers, json=body())
        assert r.status_code == 401 and "token" in r.json()["detail"]
        r = httpx.get(f"{url}/members", headers=headers, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 401
        r = httpx.get(f"{url}/events?since=0", headers=headers, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 401
    # The token is checked before the body is parsed: garbage from a stranger is still a 401.
    r = post(url, "/register", headers={"Content-Type": "application/json"}, content=b"{,")
    assert r.status_code == 401
    health = httpx.get(f"{url}/health", timeout=HTTP_TIMEOUT_S).json()
    assert health["ok"] is True and len(health["epoch"]) > 0
    ms = EmbeddedMembership(url, token="wrong")
    with pytest.raises(MonitorRemoteError, match="401") as info:
        ms.register(Member("server", "h-denied"))
    assert info.value.status == 401
    with pytest.raises(MonitorRemoteError, match="token"):
        ms.watch()
    ms.close()


def test_malformed_json_is_refused(url):
    headers = AUTH | {"Content-Type": "application/json"}
    r = post(url, "/register", headers=headers, content=b'{"member": {"role": ')
    assert r.status_code == 422 and "JSON" in r.json()["detail"]
    r = post(url, "/heartbeat", headers=headers, content=b"[1, 2, 3]")
    assert r.status_code == 422 and "invalid request" in r.json()["detail"]


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"role": "Server"}, "role"),
        ({"role": "x" * 33}, "role"),
        ({"member_id": "a/b"}, "member_id"),
        ({"member_id": "x" * 129}, "member_id"),
        ({"endpoints": {f"e{i}": "http://h" for i in range(m.MAX_ENDPOINTS + 1)}}, "endpoints"),
        ({"endpoints": {"control": "h" * (m.MAX_ENDPOINT_URL + 1)}}, "endpoints"),
        ({"experts": {"zero": [1]}}, "experts"),
        ({"experts": {"0": [-1]}}, "expert ids"),
        ({"experts": {"0": [m.MAX_EXPERT_ID]}}, "expert ids"),
        ({"metadata": {"k": "v" * (m.MAX_METADATA_VALUE + 1)}}, "metadata"),
        ({"metadata": {"k": 3}}, "metadata"),
    ],
)
def test_bad_member_fields_are_refused(url, fields, where):
    b = body()
    b["member"].update(fields)
    r = post(url, "/register", json=b)
    assert r.status_code == 422, r.text
    assert where in r.json()["detail"], r.json()["detail"]


def test_bad_lease_fields_are_refused(url):
    for ttl in (0, m.MIN_TTL_S / 2, m.MAX_TTL_S * 2, "soon"):
        r = post(url, "/register", json=body() | {"ttl": ttl})
        assert r.status_code == 422 and "ttl" in r.json()["detail"]
    r = post(url, "/register", json=body() | {"incarnation": "i" * (m.MAX_INCARNATION + 1)})
    assert r.status_code == 422 and "incarnation" in r.json()["detail"]
    for query in ("since=-1", "since=0&timeout=-1", f"since=0&timeout={MAX_POLL_S + 1}", ""):
        r = httpx.get(f"{url}/events?{query}", headers=AUTH, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 422, (query, r.text)


def test_oversized_body_is_refused_before_it_is_read(url):
    filler = "x" * (MAX_BODY_BYTES + 1)
    r = post(url, "/register", json=body(metadata={"pad": filler}))
    assert r.status_code == 413 and str(MAX_BODY_BYTES) in r.json()["detail"]


def test_heartbeat_and_deregister_of_unknown_member(url):
    lease = {"role": "client", "member_id": "h-nobody", "incarnation": "0" * 16}
    for path in ("/heartbeat", "/deregister"):
        r = post(url, path, json=lease)
        assert r.status_code == 404 and "not registered" in r.json()["detail"]


def test_superseded_registration_stops_heartbeating(url):
    ms = connect_membership(url, MONITOR_TOKEN)
    member = Member("server", "h-" + secrets.token_hex(4))
    old = ms.register(member, TTL_S)
    new = ms.register(member, TTL_S)
    with pytest.raises(SupersededError, match="another incarnation"):
        old.heartbeat_now()
    deadline = time.monotonic() + 3 * old.interval + HTTP_TIMEOUT_S
    while not old.superseded and time.monotonic() < deadline:
        time.sleep(old.interval / 4)
    assert old.superseded and isinstance(old.last_error, SupersededError)
    old.close()  # superseded: does not deregister the new incarnation
    assert [x.member_id for x in ms.list_members("server")].count(member.member_id) == 1
    new.close()
    ms.close()


def test_events_long_poll_is_answered_by_the_event(url):
    state = httpx.get(f"{url}/members", headers=AUTH, timeout=HTTP_TIMEOUT_S).json()
    answer = {}

    def poll():
        q = f"since={state['seq']}&epoch={state['epoch']}&timeout={MAX_POLL_S}"
        r = httpx.get(f"{url}/events?{q}", headers=AUTH, timeout=MAX_POLL_S + HTTP_TIMEOUT_S)
        answer["body"], answer["at"] = r.json(), time.monotonic()

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(0.2)  # let the poll park in the monitor
    b = body()
    sent = time.monotonic()
    assert post(url, "/register", json=b).status_code == 200
    t.join(PUSH_WITHIN_S + HTTP_TIMEOUT_S)
    assert answer["at"] - sent < PUSH_WITHIN_S
    evs = [
        e for e in answer["body"]["events"] if e["member"]["member_id"] == b["member"]["member_id"]
    ]
    assert [(e["kind"], e["reason"], e["incarnation"]) for e in evs] == [
        ("join", "registered", b["incarnation"])
    ]
    deregister(url, b)


def test_other_epoch_gets_a_resync_snapshot(url):
    b = body()
    assert post(url, "/register", json=b).status_code == 200
    r = httpx.get(f"{url}/events?since=0&epoch=stale", headers=AUTH, timeout=HTTP_TIMEOUT_S)
    snap = r.json()
    assert snap["resync"] is True and snap["epoch"] != "stale"
    ids = [rec["member"]["member_id"] for rec in snap["members"]]
    assert b["member"]["member_id"] in ids
    deregister(url, b)
