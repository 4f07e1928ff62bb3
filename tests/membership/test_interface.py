"""The membership interface, run against both backends (embedded monitor and etcd), each a real
process on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import pytest
from membership_procs import TTL_S, open_backend
from moecomm.membership import HEARTBEATS_PER_TTL, Member

# How long a test waits for an event that must come promptly (a join, an update).
EVENT_WAIT_S = 5.0
# How long a test listens to prove that an event does NOT come.
QUIET_S = 0.6


def is_event(kind: str, member_id: str):
    return lambda ev: ev.kind == kind and ev.member.member_id == member_id


def test_register_list_deregister(backend):
    server = backend.member(
        "server", 0, endpoints={"control": "http://127.0.0.1:9"}, experts={0: [1, 3], 2: [5]}
    )
    client = backend.member("client", 0, metadata={"device": "cpu"})
    rs = backend.register(server)
    rc = backend.register(client)
    assert rs.ttl >= TTL_S and rs.interval == pytest.approx(rs.ttl / HEARTBEATS_PER_TTL)
    assert backend.mine(backend.ms.list_members()) == [client, server]
    # Fields come back exactly, expert layers as ints.
    assert backend.mine(backend.ms.list_members("server")) == [server]
    assert backend.mine(backend.ms.list_members("client")) == [client]
    rs.close()
    assert backend.mine(backend.ms.list_members()) == [client]
    rc.close()
    assert backend.mine(backend.ms.list_members()) == []


def test_heartbeat_keeps_member_alive(backend):
    watcher = backend.watch(role="server")
    reg = backend.register(backend.member("server", 1))
    watcher.wait_for(is_event("join", reg.member.member_id), EVENT_WAIT_S)
    time.sleep(2 * reg.ttl)  # without heartbeats the lease would have run out twice
    assert backend.mine(backend.ms.list_members()) == [reg.member]
    assert reg.heartbeats >= HEARTBEATS_PER_TTL, reg.heartbeats
    assert reg.reregistrations == 0 and reg.last_error is None
    assert watcher.next(timeout=0.0) is None, "a heartbeating member produced an event"


def test_missed_heartbeats_are_a_loss_within_one_ttl(backend):
    watcher = backend.watch()
    reg = backend.register(backend.member("client", 2))
    watcher.wait_for(is_event("join", reg.member.member_id), EVENT_WAIT_S)
    reg.close(deregister=False)  # the member dies: heartbeats stop, nothing is said
    stopped = time.monotonic()
    ev = watcher.wait_for(is_event("loss", reg.member.member_id), reg.ttl + EVENT_WAIT_S)
    elapsed = time.monotonic() - stopped
    assert ev.reason == "expired" and ev.incarnation == reg.incarnation
    # Not before the lease could have run out (the last heartbeat was <= one interval ago)...
    assert elapsed >= reg.ttl - reg.interval - 0.05, elapsed
    # ...and within one TTL plus the backend's detection slack.
    assert elapsed <= reg.ttl + backend.loss_slack, elapsed
    assert backend.mine(backend.ms.list_members()) == []


def test_join_events_existing_and_elastic(backend):
    first = backend.register(backend.member("server", 3, experts={0: [0]}))
    watcher = backend.watch(role="server")
    ev = watcher.wait_for(is_event("join", first.member.member_id), EVENT_WAIT_S)
    assert ev.reason == "existing" and ev.member == first.member
    late = backend.watch(role="server", initial=False)
    # An elastic join: a server registers after the watch started.
    second = backend.register(backend.member("server", 4, experts={0: [1]}))
    for w in (watcher, late):
        ev = w.wait_for(lambda e: e.member.member_id.endswith(backend.uid), EVENT_WAIT_S)
        assert (ev.kind, ev.reason, ev.member) == ("join", "registered", second.member)
    assert backend.mine(watcher.members()) == [first.member, second.member]
    # A client joining is not seen by a watcher of servers.
    backend.register(backend.member("client", 4))
    assert watcher.next(timeout=QUIET_S) is None


def test_update_and_graceful_deregister(backend):
    watcher = backend.watch()
    reg = backend.register(backend.member("server", 5, experts={0: [0, 1]}))
    watcher.wait_for(is_event("join", reg.member.member_id), EVENT_WAIT_S)
    moved = Member(reg.member.role, reg.member.member_id, experts={0: [1], 1: [7]})
    reg.update(moved)
    ev = watcher.wait_for(is_event("update", reg.member.member_id), EVENT_WAIT_S)
    assert ev.member == moved and ev.reason == "updated"
    reg.update(moved)  # nothing changed: no event
    assert watcher.next(timeout=QUIET_S) is None
    with pytest.raises(ValueError, match="keeps"):
        reg.update(backend.member("server", 99))
    reg.close()
    ev = watcher.wait_for(is_event("loss", reg.member.member_id), EVENT_WAIT_S)
    assert ev.reason == "deregistered" and ev.member == moved


def test_new_incarnation_replaces_old(backend):
    watcher = backend.watch()
    member = backend.member("server", 6)
    old = backend.register(member)
    watcher.wait_for(is_event("join", member.member_id), EVENT_WAIT_S)
    new = backend.register(member)  # a restarted process under the same id
    loss = watcher.wait_for(is_event("loss", member.member_id), EVENT_WAIT_S)
    join = watcher.wait_for(is_event("join", member.member_id), EVENT_WAIT_S)
    assert (loss.reason, loss.incarnation) == ("replaced", old.incarnation)
    assert join.incarnation == new.incarnation
    old.close()  # must not take the new incarnation's registration with it
    time.sleep(new.interval * 2)
    assert backend.mine(backend.ms.list_members()) == [member]
    assert watcher.next(timeout=0.0) is None


def test_watch_deadlines(backend):
    watcher = backend.watch(role="server")
    start = time.monotonic()
    assert watcher.next(timeout=0.3) is None
    assert 0.3 - 0.01 <= time.monotonic() - start < 0.3 + QUIET_S  # 10 ms: clock granularity
    with pytest.raises(TimeoutError, match="no matching membership event"):
        watcher.wait_for(lambda ev: False, timeout=0.2)
    with pytest.raises(ValueError, match="deadline"):
        watcher.next(timeout=-1)
    watcher.close()
    # A closed watcher answers at once instead of blocking until the deadline.
    start = time.monotonic()
    assert watcher.next(timeout=EVENT_WAIT_S) is None
    assert time.monotonic() - start < QUIET_S


def test_callback_delivery(backend):
    got, seen = [], threading.Event()

    def on_event(ev):
        if ev.member.member_id.endswith(backend.uid):
            got.append(ev)
            seen.set()
        raise RuntimeError("a failing callback must not stop the watcher")

    watcher = backend.watch(callback=on_event)
    with pytest.raises(RuntimeError, match="callback"):
        watcher.next(timeout=0.1)
    reg = backend.register(backend.member("client", 7))
    assert seen.wait(EVENT_WAIT_S)
    seen.clear()
    reg.close()
    assert seen.wait(EVENT_WAIT_S)
    assert [(e.kind, e.member) for e in got] == [("join", reg.member), ("loss", reg.member)]


# The monitor keeps nothing, so its restart is always "fresh"; etcd restarts on its data dir
# (leases and keys survive) or on a new one (everything is forgotten).
RESTARTS = [("embedded", True), ("etcd", False), ("etcd", True)]


@pytest.mark.parametrize(("name", "fresh"), RESTARTS, ids=["monitor", "etcd-same", "etcd-fresh"])
def test_backend_restart_members_reregister(request, name, fresh):
    backend = open_backend(request, name)
    watcher = backend.watch()
    alive = backend.register(backend.member("server", 8, experts={0: [2]}))
    dead = backend.register(backend.member("client", 8))
    for reg in (alive, dead):
        watcher.wait_for(is_event("join", reg.member.member_id), EVENT_WAIT_S)
    dead.close(deregister=False)  # dies while the backend is down
    backend.restart(fresh)
    restarted = time.monotonic()
    seen = []
    ev = watcher.wait_for(
        lambda e: seen.append(e) or is_event("loss", dead.member.member_id)(e),
        dead.ttl * 2 + EVENT_WAIT_S,
    )
    # Gone with the restarted store (not re-registered within its TTL), or, when etcd kept its
    # lease, expired in place ("missing" if it expired before the watcher reconnected).
    assert ev.reason in (("not re-registered",) if fresh else ("expired", "missing")), ev
    assert time.monotonic() - restarted <= 2 * dead.ttl + backend.loss_slack + 1.0
    # The live member came back by itself, and nobody was told it was lost.
    time.sleep(alive.ttl)
    while (e := watcher.next(timeout=0.0)) is not None:
        seen.append(e)
    assert not [e for e in seen if e.member == alive.member and e.kind == "loss"], seen
    assert backend.mine(backend.ms.list_members()) == [alive.member]
    assert backend.mine(watcher.members()) == [alive.member]
    if fresh:
        assert alive.reregistrations >= 1
    else:
        assert alive.reregistrations == 0  # etcd kept the lease across the restart


def test_member_paused_past_its_ttl_comes_back_as_a_join(backend):
    watcher = backend.watch()
    reg = backend.register(backend.member("server", 9))
    watcher.wait_for(is_event("join", reg.member.member_id), EVENT_WAIT_S)
    # Hold the registration's lock: its heartbeat thread blocks, as in a long GC or SIGSTOP.
    with reg._lock:
        loss = watcher.wait_for(is_event("loss", reg.member.member_id), reg.ttl + EVENT_WAIT_S)
    assert loss.reason == "expired"
    # The next heartbeat finds the member forgotten and registers it again.
    join = watcher.wait_for(is_event("join", reg.member.member_id), reg.interval + EVENT_WAIT_S)
    assert (join.reason, join.incarnation) == ("registered", reg.incarnation)
    with (
        reg._lock
    ):  # the heartbeat thread counts the re-registration after its put, under this lock
        assert reg.reregistrations == 1
    assert backend.mine(backend.ms.list_members()) == [reg.member]


# Members registered at once from as many threads: every join and every loss is reported once.
CONCURRENT_MEMBERS = 16


def test_concurrent_registrations_are_each_reported_once(backend):
    watcher = backend.watch(role="client")
    members = [backend.member("client", 100 + i) for i in range(CONCURRENT_MEMBERS)]
    regs = [None] * len(members)

    def register(i):
        regs[i] = backend.register(members[i], TTL_S)  # tracked: closed even if the test fails

    threads = [threading.Thread(target=register, args=(i,)) for i in range(len(members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(EVENT_WAIT_S)
    assert all(r is not None for r in regs)

    def collect(kind):
        got = []
        deadline = time.monotonic() + EVENT_WAIT_S
        while len(got) < len(members) and time.monotonic() < deadline:
            ev = watcher.next(timeout=max(0.0, deadline - time.monotonic()))
            if ev is not None and ev.member.member_id.endswith(backend.uid):
                assert ev.kind == kind, ev
                got.append(ev.member)
        return by_key(got)

    assert collect("join") == by_key(members)
    assert backend.mine(backend.ms.list_members("client")) == by_key(members)
    closers = [threading.Thread(target=r.close) for r in regs]
    for t in closers:
        t.start()
    for t in closers:
        t.join(EVENT_WAIT_S)
    assert collect("loss") == by_key(members)
    assert watcher.next(timeout=QUIET_S) is None
    assert backend.mine(backend.ms.list_members()) == []


def by_key(members):
    return sorted(members, key=lambda mem: mem.key)
