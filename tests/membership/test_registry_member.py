"""Pure pieces without processes: member validation and encoding, the monitor's registry, the
URL factory."""

from __future__ import annotations

import pytest
from moecomm.membership import (
    EmbeddedMembership,
    EtcdMembership,
    Event,
    Member,
    Record,
    connect_membership,
    registry,
)
from moecomm.membership import member as m
from moecomm.membership.member import check_ttl

TTL = 1.0


def rec(mid: str, inc: str = "i0", **kw) -> Record:
    return Record(Member("server", mid, **kw), TTL, inc)


def test_member_round_trip_keeps_int_layers():
    a = Member("server", "s.0:a-b", {"control": "http://h:1"}, {0: [1, 2], 7: []}, {"k": "v"})
    assert Member.from_dict(a.to_dict()) == a
    assert a.to_dict()["experts"] == {"0": [1, 2], "7": []}
    r = Record(a, 2.0, "abc", leaving=True)
    assert Record.from_dict(r.to_dict()) == r


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"role": ""}, "role"),
        ({"role": "Server"}, "role"),
        ({"member_id": "../x"}, "member_id"),
        ({"member_id": 3}, "member_id"),
        ({"endpoints": {"": "http://h"}}, "endpoint names"),
        ({"experts": {-1: [0]}}, "layers"),
        ({"experts": {0: (1, 2)}}, "expert ids"),
        ({"experts": {0: list(range(m.MAX_HOSTED_EXPERTS + 1))}}, "hosted experts"),
        ({"metadata": {"k": 1}}, "metadata"),
    ],
)
def test_member_validation_names_the_field(kwargs, match):
    fields = {"role": "server", "member_id": "s0"} | kwargs
    with pytest.raises(ValueError, match=match):
        Member(**fields)


def test_bad_ttl_and_event_kind():
    for bad in (0, m.MIN_TTL_S / 2, m.MAX_TTL_S + 1):
        with pytest.raises(ValueError, match="ttl"):
            check_ttl(bad)
    with pytest.raises(ValueError, match="kind"):
        Event("gone", Member("server", "s0"))
    with pytest.raises(ValueError, match="JSON object"):
        Record.from_dict(["not", "a", "record"])


def test_registry_events_and_expiry():
    reg = registry.Registry()
    assert reg.register(rec("a"), now=0.0) == "join"
    assert reg.register(rec("a"), now=0.1) == ""  # same incarnation, same fields
    assert reg.register(rec("a", metadata={"x": "1"}), now=0.2) == "update"
    assert reg.register(rec("a", "i1"), now=0.3) == "join"  # replaced: loss, then join
    assert [(e["seq"], e["kind"], e["reason"]) for e in reg.events_since(0)] == [
        (1, "join", "registered"),
        (2, "update", "updated"),
        (3, "loss", "replaced"),
        (4, "join", "registered"),
    ]
    with pytest.raises(registry.SupersededError):
        reg.heartbeat(("server", "a"), "i0", now=0.4)
    assert reg.heartbeat(("server", "a"), "i1", now=0.5) == TTL
    assert reg.expire(now=0.5 + TTL - 0.01) == 0
    assert reg.expire(now=0.5 + TTL) == 1
    assert reg.events_since(4)[0]["reason"] == "expired"
    with pytest.raises(registry.UnknownMemberError):
        reg.heartbeat(("server", "a"), "i1", now=2.0)
    assert reg.events_since(reg.seq) == [] and reg.events_since(reg.seq + 1) is None


def test_registry_extend_credits_time_the_monitor_did_not_run():
    reg = registry.Registry()
    reg.register(rec("a"), now=0.0)
    reg.register(rec("b"), now=0.5)
    reg.extend(2.0)  # the monitor was stopped for 2 s
    assert reg.expire(now=2.0 + TTL - 0.01) == 0  # a's deadline moved from TTL to 2 + TTL
    assert reg.expire(now=2.0 + TTL) == 1
    assert [e["member"]["member_id"] for e in reg.events_since(2)] == ["a"]
    with pytest.raises(ValueError, match="positive"):
        reg.extend(-1.0)


def test_registry_log_overflow_asks_for_a_snapshot(monkeypatch):
    monkeypatch.setattr(registry, "MAX_EVENT_LOG", 4)
    reg = registry.Registry()
    for i in range(6):
        reg.register(rec(f"m{i}"), now=0.0)
    assert reg.events_since(1) is None  # events 2.. are gone from the log
    assert [e["seq"] for e in reg.events_since(2)] == [3, 4, 5, 6]


def test_registry_is_bounded(monkeypatch):
    monkeypatch.setattr(registry, "MAX_MEMBERS", 2)
    reg = registry.Registry()
    reg.register(rec("a"), now=0.0)
    reg.register(rec("b"), now=0.0)
    with pytest.raises(registry.RegistryFullError, match="maximum of 2"):
        reg.register(rec("c"), now=0.0)
    reg.register(rec("b", metadata={"x": "y"}), now=0.0)  # a known member may still refresh


def test_connect_membership_picks_the_backend():
    ms = connect_membership("http://127.0.0.1:1")
    assert isinstance(ms, EmbeddedMembership)
    ms.close()
    ms = connect_membership("etcd://127.0.0.1:1,127.0.0.1:2/cluster-a")
    assert isinstance(ms, EtcdMembership) and ms.prefix == "/cluster-a"
    assert ms.endpoints == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    ms.close()
    with pytest.raises(ValueError, match="etcd://"):
        connect_membership("zk://127.0.0.1:1")
    with pytest.raises(ValueError, match="host:port"):
        connect_membership("etcd:///x")
    with pytest.raises(ValueError, match="token"):
        connect_membership("etcd://127.0.0.1:1", token="t")


def test_unreachable_backend_is_a_connection_error():
    # Port 1 on loopback: nothing listens there, the connection is refused at once.
    for url in ("http://127.0.0.1:1", "etcd://127.0.0.1:1"):
        ms = connect_membership(url, timeout=1.0)
        with pytest.raises(ConnectionError, match="unreachable"):
            ms.register(Member("server", "s0"))
        with pytest.raises(ConnectionError, match="unreachable"):
            ms.list_members()
        ms.close()
