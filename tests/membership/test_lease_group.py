"""A process hosting many members costs the backend per process, not per member: its leases are
renewed in one batch per interval from one thread, re-registered in one request after a monitor
restart, share one etcd lease; and the monitor's registry holds a 10,000-GPU deployment and
sweeps only the members that are due. Each test names the old behaviour it catches."""

from __future__ import annotations

import secrets
import threading
import time

import pytest
from membership_procs import MONITOR_TOKEN, TTL_S
from moecomm.membership import HEARTBEATS_PER_TTL, Member, connect_membership, registry
from moecomm.membership.member import Record

# Members one test process hosts: enough that per-member renewal is unmistakable.
MEMBERS = 40
# Renewal intervals the request count is taken over.
ROUNDS = 4
EVENT_WAIT_S = 10.0


def counted(ms, paths: tuple[str, ...]) -> list[int]:
    """A counter of the requests `ms` sends to `paths` (its own HTTP client's hook)."""
    n = [0]
    lock = threading.Lock()

    def hook(request) -> None:
        if request.url.path in paths:
            with lock:
                n[0] += 1

    ms._http.event_hooks["request"].append(hook)
    return n


def members(prefix: str, n: int = MEMBERS) -> list[Member]:
    uid = secrets.token_hex(4)
    return [Member("server", f"{prefix}{i}-{uid}") for i in range(n)]


def test_one_process_renews_its_members_in_one_request_per_interval(monitor_process):
    """Old: one heartbeat thread and one POST /heartbeat per member and interval (40 members:
    ~40 requests and 40 threads per interval)."""
    ms = connect_membership(monitor_process.url, MONITOR_TOKEN)
    threads_before = threading.active_count()
    regs = [ms.register(m, TTL_S) for m in members("g")]
    try:
        sent = counted(ms, ("/heartbeat", "/heartbeats"))
        interval = TTL_S / HEARTBEATS_PER_TTL
        time.sleep(ROUNDS * interval)
        # Registrations made at different moments align after their first renewal: at most one
        # extra batch per interval for that, and one for the window's edges.
        assert sent[0] <= 2 * ROUNDS + 2, sent[0]
        assert all(r.heartbeats >= ROUNDS - 2 for r in regs), [r.heartbeats for r in regs]
        assert threading.active_count() - threads_before <= 1
        assert {m.member_id for m in ms.list_members("server")} >= {
            r.member.member_id for r in regs
        }
    finally:
        for r in regs:
            r.close()
        ms.close()


def test_restarted_monitor_gets_a_process_members_back_in_one_request(monitor_process):
    """Old: each member found the empty monitor on its own and sent its own POST /register
    (40 requests within one interval, per process)."""
    ms = connect_membership(monitor_process.url, MONITOR_TOKEN)
    regs = ms.register_many(members("r"), TTL_S)
    try:
        sent = counted(ms, ("/register", "/registers"))
        monitor_process.restart()
        want = {r.member.member_id for r in regs}
        deadline = time.monotonic() + EVENT_WAIT_S
        while time.monotonic() < deadline:
            try:
                if want <= {m.member_id for m in ms.list_members("server")}:
                    break
            except ConnectionError:
                pass
            time.sleep(0.05)
        assert want <= {m.member_id for m in ms.list_members("server")}
        assert all(r.reregistrations == 1 for r in regs)
        assert sent[0] <= 2, sent[0]  # one batch (two if a renewal round straddled the restart)
    finally:
        for r in regs:
            r.close()
        ms.close()


def test_register_many_is_all_or_nothing(monitor_process):
    ms = connect_membership(monitor_process.url, MONITOR_TOKEN)
    try:
        ok = members("a", 3)
        # A member the monitor refuses (its TTL is fine, its id collides with nothing: the
        # refusal is a bad token on a second client) fails the whole call.
        bad = connect_membership(monitor_process.url, "wrong-token")
        with pytest.raises(Exception, match="401"):
            bad.register_many(ok, TTL_S)
        bad.close()
        assert not {m.member_id for m in ms.list_members("server")} & {m.member_id for m in ok}
        with pytest.raises(TypeError, match="Members"):
            ms.register_many([ok[0], "s1"], TTL_S)
    finally:
        ms.close()


def test_etcd_members_of_one_process_share_one_lease(etcd_process):
    """Old: one etcd lease, and one keep-alive per interval, per member; a member leaving
    revoked its own lease. Now one lease per process: leaving deletes the key alone."""
    prefix = "/t" + secrets.token_hex(4)
    ms = connect_membership(f"etcd://{etcd_process.endpoint}{prefix}", poll_s=0.3)
    regs = [ms.register(m, TTL_S) for m in members("e", 5)]
    watcher = ms.watch(role="server", initial=False)
    try:
        assert len({r._lease.handle for r in regs}) == 1
        keepalives = counted(ms, ("/v3/lease/keepalive",))
        time.sleep(ROUNDS * regs[0].interval)
        assert keepalives[0] <= 2 * ROUNDS + 2, keepalives[0]
        leaving = regs.pop()
        leaving.close()
        ev = watcher.wait_for(lambda e: e.kind == "loss", EVENT_WAIT_S)
        assert (ev.member, ev.reason) == (leaving.member, "deregistered")
        time.sleep(2 * regs[0].ttl)  # the shared lease still holds the others
        listed = {m.member_id for m in ms.list_members("server")}
        assert listed == {r.member.member_id for r in regs}
        assert watcher.next(timeout=0.0) is None
    finally:
        watcher.close()
        for r in regs:
            r.close()
        ms.close()


# The size of the deployment the issue is about: one member per GPU.
DEPLOYMENT = 10_000


def test_registry_holds_a_ten_thousand_gpu_deployment():
    """Old: MAX_MEMBERS was 4,096, so the 4,097th member was refused (507)."""
    reg = registry.Registry()
    for i in range(DEPLOYMENT):
        reg.register(Record(Member("server", f"s{i}"), TTL_S, "i0"), now=0.0)
    assert len(reg) == DEPLOYMENT


def test_expiry_sweep_reads_only_the_members_that_are_due(monkeypatch):
    """Old: every 50 ms sweep read every member's deadline (10,000 reads per sweep, 200,000/s
    at 10,000 members); now a sweep reads the heap's due entries only."""
    reads = [0]

    class CountingEntry(registry.Entry):
        def __getattribute__(self, name):
            if name == "deadline":
                reads[0] += 1
            return super().__getattribute__(name)

    monkeypatch.setattr(registry, "Entry", CountingEntry)
    reg = registry.Registry()
    n = 2000
    for i in range(n):
        reg.register(Record(Member("server", f"s{i}"), TTL_S, "i0"), now=0.0)
    for i in range(n // 2):  # half of them renew
        reg.heartbeat(("server", f"s{i}"), "i0", now=0.5)
    reads[0] = 0
    for k in range(20):  # sweeps before anyone is due
        assert reg.expire(now=0.01 * k) == 0
    assert reads[0] == 0, reads[0]
    assert reg.expire(now=TTL_S) == n // 2  # the silent half, at its deadline
    assert reads[0] <= 2 * n, reads[0]  # each due entry once, the renewed ones re-filed
    reads[0] = 0
    assert reg.expire(now=TTL_S + 0.01) == 0
    assert reads[0] == 0, reads[0]
    assert reg.expire(now=0.5 + TTL_S) == n // 2
    assert len(reg) == 0


def test_member_slow_to_reregister_after_a_restart_is_not_evicted(monitor_process):
    """Old: a watcher gave a member missing from a restarted monitor one TTL to come back, and
    reported a live member lost when the restarted monitor took longer than that to take its
    registration (thousands re-registering at once). Now two TTLs: a member back 1.8 TTLs after
    the restart stays, silently."""
    ms = connect_membership(monitor_process.url, MONITOR_TOKEN, poll_s=0.3)
    reg = ms.register(members("slow", 1)[0], TTL_S)
    events = []
    watcher = ms.watch(role="server", callback=events.append, initial=False)
    try:
        with reg._lock:  # the member cannot re-register: the monitor is slow to take it
            monitor_process.restart()
            time.sleep(1.8 * TTL_S)
        deadline = time.monotonic() + EVENT_WAIT_S
        while reg.member.member_id not in {m.member_id for m in ms.list_members("server")}:
            assert time.monotonic() < deadline, "not re-registered"
            time.sleep(0.05)
        time.sleep(TTL_S)  # past the grace either way
        mine = [(e.kind, e.reason) for e in events if e.member.key == reg.member.key]
        assert mine == [], mine
        assert reg.reregistrations == 1
    finally:
        watcher.close()
        reg.close()
        ms.close()


def test_members_still_reregistering_after_a_restart_are_not_evicted(monitor_process):
    """Old: each member missing from a restarted monitor had a fixed grace from the watcher's
    resync (one TTL; two after the first fix), so with thousands re-registering for longer than
    that the last ones were reported lost while alive. Now nobody is reported lost while
    re-registrations keep arriving: B, back 3.3 TTLs after the restart but within two TTLs of
    A's re-registration, stays."""
    ms = connect_membership(monitor_process.url, MONITOR_TOKEN, poll_s=0.3)
    a, b = ms.register_many(members("late", 2), TTL_S)
    events = []
    watcher = ms.watch(role="server", callback=events.append, initial=False)
    try:
        with b._lock:
            with a._lock:
                monitor_process.restart()
                time.sleep(1.5 * TTL_S)
            time.sleep(1.8 * TTL_S)
        deadline = time.monotonic() + EVENT_WAIT_S
        want = {a.member.member_id, b.member.member_id}
        while not want <= {m.member_id for m in ms.list_members("server")}:
            assert time.monotonic() < deadline, "not re-registered"
            time.sleep(0.05)
        time.sleep(TTL_S)
        keys = {a.member.key, b.member.key}
        mine = [(e.kind, e.reason) for e in events if e.member.key in keys]
        assert mine == [], mine
    finally:
        watcher.close()
        a.close()
        b.close()
        ms.close()
