"""A membership backend that is down for several leases and comes back (the monitor, which
always returns empty; etcd on its data dir, or on a fresh one): watchers keep their last view and
report no loss, members are back within one TTL of the backend, and an update made during the
outage is published when it returns. Both backends are real processes on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest
from membership_procs import TTL_S, MonitorProcess, open_backend
from moecomm.membership import Member, MonitorRemoteError, connect_membership
from proc_helpers import stop_process

# The backend stays down this long: every lease would have expired twice over.
OUTAGE_S = 2 * TTL_S
# A member heartbeats three times per TTL, so it is back about TTL/3 after the backend; one TTL
# plus scheduling slack on a loaded 2-core machine is the deadline.
BACK_WITHIN_S = TTL_S + 2.0
# After the return, the test listens past every watcher's re-registration grace (two TTLs).
LISTEN_S = 3 * TTL_S
EVENT_WAIT_S = 5.0
POLL_S = 0.05

# The monitor keeps nothing, so its return is always "fresh"; etcd comes back on its data dir
# (leases and keys survive) or on a new one (everything is forgotten).
OUTAGES = [("embedded", True), ("etcd", False), ("etcd", True)]


def _wait_for_join(events: list, key: tuple[str, str]) -> None:
    deadline = time.monotonic() + EVENT_WAIT_S
    while not [e for e in events if e.member.key == key]:
        assert time.monotonic() < deadline, f"no join within {EVENT_WAIT_S} s"
        time.sleep(POLL_S)


def _listed(backend, member) -> bool:
    try:
        return backend.mine(backend.ms.list_members()) == [member]
    except ConnectionError:
        return False  # still coming up


@pytest.mark.parametrize(("name", "fresh"), OUTAGES, ids=["monitor", "etcd-same", "etcd-fresh"])
def test_outage_keeps_views_and_publishes_updates_made_meanwhile(request, name, fresh):
    backend = open_backend(request, name)
    reg = backend.register(backend.member("server", 5, experts={0: [1]}))
    before = reg.member
    events = []
    watcher = backend.watch(callback=events.append)
    _wait_for_join(events, before.key)

    backend.process.stop()
    moved = replace(before, experts={0: [1, 2]})
    assert reg.update(moved) is False  # the backend is down: kept, not lost
    assert (reg.member, reg.published) == (moved, False)
    time.sleep(OUTAGE_S)
    # The last known membership stands while the backend is gone.
    assert backend.mine(watcher.members()) == [before]

    backend.restart(fresh)
    back = time.monotonic()
    while not _listed(backend, moved):
        assert time.monotonic() - back < BACK_WITHIN_S, "not listed again with its update"
        time.sleep(POLL_S)
    assert reg.published
    time.sleep(LISTEN_S)
    mine = [e for e in events if e.member.key == reg.member.key]
    assert [(e.kind, e.reason) for e in mine] == [("join", "existing"), ("update", "updated")]
    assert mine[-1].member == moved
    assert backend.mine(watcher.members()) == [moved]
    assert reg.reregistrations == (1 if fresh else 0)


def test_stopped_monitor_evicts_nobody_when_it_resumes(request):
    """SIGSTOP, not a kill: the monitor keeps its members, and when it resumes its expiry sweep
    runs before it reads the heartbeats queued in its sockets. The time it did not run is
    credited to every lease (monitor.STALL_S), so nobody is expired for its absence."""
    backend = open_backend(request, "embedded")
    reg = backend.register(backend.member("server", 6))
    events = []
    watcher = backend.watch(callback=events.append)
    _wait_for_join(events, reg.member.key)
    pid = backend.process.proc.pid
    stop_process(pid)
    try:
        time.sleep(OUTAGE_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(LISTEN_S)
    mine = [(e.kind, e.reason) for e in events if e.member.key == reg.member.key]
    assert mine == [("join", "existing")]
    assert backend.mine(backend.ms.list_members()) == [reg.member]
    assert backend.mine(watcher.members()) == [reg.member]
    assert reg.reregistrations == 0


def test_refused_update_raises_and_keeps_the_published_fields():
    """Unlike an outage, a refusal cannot be waited out: the monitor came back with another
    token (401), so update() raises and the registration keeps what was last published."""
    mon = MonitorProcess(token="tok-before")
    url = mon.start()
    ms = connect_membership(url, "tok-before", poll_s=POLL_S)
    reg = None
    try:
        reg = ms.register(Member("server", "s-refused", experts={0: [1]}), TTL_S)
        before = reg.member
        mon.stop()
        mon.token = "tok-after"
        mon.start()
        with pytest.raises(MonitorRemoteError) as refused:
            reg.update(replace(before, experts={0: [1, 2]}))
        assert refused.value.status == 401
        assert (reg.member, reg.published) == (before, True)
    finally:
        if reg is not None:
            reg.close(deregister=False)
        ms.close()
        mon.stop()
