"""Death noticed by the kernel, not by a poll: a waiter sleeping on an answer from an shm peer
also sleeps on the peer's life word (csrc/transport/shm/process.h), which the kernel marks and
wakes as the peer dies. Real processes, real shared memory.

What the 20 ms /proc liveness poll alone (MOECOMM_SHM_DEATH_WATCH=poll) cannot do, and these
tests ask: wake once per poll interval no longer while the peer lives, and see the end of a
peer whose pid lives on (it exec'd: its moecomm mappings are gone, /proc shows it running)."""

import os
import threading
import time

import moecomm
import pytest
from moecomm import _C, prefork
from moecomm.wire.transport import WaitStatus

# The answer never comes in these tests: a wait ends by the peer's death or this deadline.
WAIT_DEADLINE_S = 30.0
# How long the waiter sleeps before the peer is killed.
LIVE_WAIT_S = 3.0
# The /proc poll wakes a sleeping waiter every 20 ms: 150 times in LIVE_WAIT_S. With the life
# word the poll stays as a safety net every 100 ms (30 wake-ups); this bound sits between, far
# from both (a loaded machine stretches naps, so it can only lower either count).
MAX_WAKEUPS_WHILE_ALIVE = 75
# Generous: the kernel's wake comes within milliseconds of the death; the deadline is 30 s.
NOTICE_BOUND_S = 5.0


def _region_and_hang(conn):
    t = moecomm.ShmTransport()
    r = t.create_region(4096)
    conn.send(r.handle)
    time.sleep(600)


def _region_then_exec(conn):
    t = moecomm.ShmTransport()
    r = t.create_region(4096)
    conn.send(r.handle)
    conn.recv()  # go
    os.execv("/bin/sleep", ["sleep", "600"])


def _voluntary_switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc status")


class Waiter(threading.Thread):
    """Waits on a word of our own region that nobody signals, watching `peer`."""

    def __init__(self, transport, own, peer, timeout_s=WAIT_DEADLINE_S):
        super().__init__(daemon=True)
        self.args = (transport, own, peer, timeout_s)
        self.tid = None
        self.started_at = None
        self.status = None
        self.ended_at = None
        self.ready = threading.Event()

    def run(self):
        transport, own, peer, timeout_s = self.args
        self.tid = threading.get_native_id()
        self.started_at = time.monotonic()
        self.ready.set()
        status, _ = _C.wait_doorbell(transport, own, 0, int(timeout_s * 1e9), peer)
        self.ended_at = time.monotonic()
        self.status = status


def _peer(reaper, target):
    ctx = prefork.process_context()
    parent, child = ctx.Pipe()
    p = reaper.process(ctx.Process(target=target, args=(child,), daemon=True))
    p.start()
    assert parent.poll(60), "the peer did not start"
    return p, parent, parent.recv()


@pytest.mark.timeout(120)
def test_a_killed_peer_ends_the_wait_at_once_and_no_poll_wakes_it_before(reaper):
    p, _, handle = _peer(reaper, _region_and_hang)
    t = moecomm.ShmTransport()
    own = t.create_region(4096)
    peer = t.attach(handle)
    w = Waiter(t, own, peer)
    w.start()
    assert w.ready.wait(10)
    time.sleep(0.2)  # into the sleep phase
    before = _voluntary_switches(w.tid)
    time.sleep(LIVE_WAIT_S)
    woke = _voluntary_switches(w.tid) - before
    killed_at = time.monotonic()
    os.kill(p.pid, 9)
    w.join(WAIT_DEADLINE_S + 10)
    assert not w.is_alive()
    assert w.status == WaitStatus.PEER_LOST
    assert w.ended_at - killed_at < NOTICE_BOUND_S
    assert woke <= MAX_WAKEUPS_WHILE_ALIVE, (
        f"the waiter woke {woke} times in {LIVE_WAIT_S} s while its peer lived: it polls"
    )
    p.join(10)
    assert not t.peer_alive(peer)


@pytest.mark.timeout(120)
def test_a_peer_that_execs_is_dead_at_once_though_its_pid_lives_on(reaper):
    p, conn, handle = _peer(reaper, _region_then_exec)
    t = moecomm.ShmTransport()
    own = t.create_region(4096)
    peer = t.attach(handle)
    w = Waiter(t, own, peer)
    w.start()
    assert w.ready.wait(10)
    conn.send("go")
    w.join(WAIT_DEADLINE_S + 10)
    assert w.status == WaitStatus.PEER_LOST, "the exec was not seen before the deadline"
    assert w.ended_at - w.started_at < NOTICE_BOUND_S
    os.kill(p.pid, 0)  # still there (now /bin/sleep): /proc alone says "alive"
    assert not t.peer_alive(peer)
    # Its segment is stale: nobody maps it any more, and the reaper agrees.
    assert moecomm.reap_stale_segments(p.pid) == 1


@pytest.mark.timeout(120)
def test_poll_only_detection_still_exists_for_comparison(reaper):
    """MOECOMM_SHM_DEATH_WATCH=poll (watch_death=False): the exec'd peer looks alive until
    the deadline — the detection before life words, which bench/recovery/chaos_reroute.py
    compares."""
    _, conn, handle = _peer(reaper, _region_then_exec)
    t = moecomm.ShmTransport(watch_death=False)
    assert not t.watch_death
    own = t.create_region(4096)
    peer = t.attach(handle)
    w = Waiter(t, own, peer, timeout_s=1.0)
    w.start()
    assert w.ready.wait(10)
    conn.send("go")
    w.join(30)
    assert w.status == WaitStatus.TIMEOUT
    assert t.peer_alive(peer)
