"""The shm backend in one process (and a few helper processes): regions, puts, signals, waits."""

import os
import signal
import stat
import threading
import time

import moecomm
import pytest
import torch
from moecomm import _C, prefork
from moecomm.wire.transport import SignalOp, WaitOp
from moecomm.wire.views import region_bytes_view


def test_region_is_private_zeroed_and_unique(transport):
    a, b = transport.create_region(1000), transport.create_region(1000)
    assert a.handle != b.handle and a.handle.startswith("shm:moecomm-")
    assert a.size >= 1000 and a.size % 64 == 0
    mode = os.stat("/dev/shm/" + a.handle[4:]).st_mode
    assert stat.S_IMODE(mode) == 0o600
    assert int(region_bytes_view(a).sum()) == 0


def test_put_is_visible_through_an_attached_mapping(transport):
    owner = transport.create_region(4096)
    peer = transport.attach(owner.handle)
    src = torch.arange(256, dtype=torch.uint8)
    transport.put(peer, 128, src.data_ptr(), src.numel())
    assert torch.equal(region_bytes_view(owner)[128:384], src)
    assert not peer.owned and owner.owned


def test_out_of_bounds_and_misaligned_accesses_are_refused(transport):
    r = transport.create_region(256)
    src = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside"):
        transport.put(r, r.size - 4, src.data_ptr(), 8)
    with pytest.raises(ValueError, match="outside"):
        transport.put(r, 2**63, src.data_ptr(), 8)
    with pytest.raises(ValueError, match="not aligned"):
        transport.signal(r, 8, 1)
    with pytest.raises(ValueError, match="outside"):
        transport.signal(r, r.size, 1)


def test_attach_errors_are_clear(transport):
    with pytest.raises(moecomm.SegmentNotFoundError, match="does not exist"):
        transport.attach("shm:moecomm-1-2-3-deadbeef")
    with pytest.raises(ValueError, match="not a shm handle"):
        transport.attach("tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="malformed"):
        transport.attach("shm:../etc/passwd")
    with pytest.raises(ValueError, match="malformed"):
        transport.attach("shm:other-segment")


def test_close_unlinks_but_keeps_views_valid(transport):
    r = transport.create_region(128)
    v = region_bytes_view(r)
    handle = r.handle
    r.close()
    assert r.closed
    assert not os.path.exists("/dev/shm/" + handle[4:])
    v[0] = 7  # the mapping lives as long as a view of it
    assert int(v[0]) == 7
    with pytest.raises(moecomm.SegmentNotFoundError):
        transport.attach(handle)
    with pytest.raises(ValueError, match="closed"):
        transport.signal(r, 0, 1)


def test_signal_set_add_and_wait_predicates(transport):
    r = transport.create_region(256)
    transport.signal(r, 64, 5, SignalOp.SET)
    transport.signal(r, 64, 3, SignalOp.ADD)
    assert transport.load(r, 64) == 8
    assert transport.wait(r, 64, WaitOp.EQUAL, 8, timeout_ns=0) == 8
    assert transport.wait(r, 64, WaitOp.NOT_EQUAL, 0, timeout_ns=0) == 8
    # Masked compare: only the state byte.
    assert transport.wait(r, 64, WaitOp.EQUAL, 8, mask=0xFF, timeout_ns=0) == 8


@pytest.mark.parametrize("spin_ns", [0, 50_000])
def test_wait_times_out_at_its_deadline(spin_ns):
    t = moecomm.ShmTransport(spin_ns=spin_ns)
    r = t.create_region(64)
    start = time.monotonic()
    with pytest.raises(moecomm.DeadlineExceededError, match="timed out") as info:
        t.wait(r, 0, WaitOp.EQUAL, 1, timeout_ns=200_000_000)
    elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 1.5
    assert isinstance(info.value, TimeoutError)  # also the builtin


def test_sleeping_waiter_is_woken_and_releases_the_gil():
    # spin_ns=0: the waiter goes straight to the futex; the signal must wake it.
    t = moecomm.ShmTransport(spin_ns=0)
    r = t.create_region(64)
    ticks = []
    woke = []

    def waiter():
        woke.append(t.wait(r, 0, WaitOp.EQUAL, 42, timeout_ns=5_000_000_000))

    th = threading.Thread(target=waiter)
    th.start()
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # Python keeps running while the waiter sleeps
        ticks.append(1)
        time.sleep(0.001)
    t.signal(r, 0, 42)
    th.join(5)
    assert woke == [42]
    assert len(ticks) > 50


def _make_segment_and_hang(conn):
    t = moecomm.ShmTransport()
    r = t.create_region(4096)
    conn.send(r.handle)
    time.sleep(600)


def test_segments_of_a_killed_process_are_reaped(reaper):
    ctx = prefork.process_context()
    parent, child = ctx.Pipe()
    p = reaper.process(ctx.Process(target=_make_segment_and_hang, args=(child,), daemon=True))
    p.start()
    assert parent.poll(60)
    handle = parent.recv()
    name = handle[4:]
    live = moecomm.ShmTransport()
    peer = live.attach(handle)
    assert live.peer_alive(peer)
    assert moecomm.reap_stale_segments(p.pid) == 0  # alive: not touched
    assert moecomm.list_segments(p.pid) == [name]
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert not live.peer_alive(peer)
    assert moecomm.list_segments(p.pid) == [name]  # SIGKILL leaves it behind...
    assert moecomm.reap_stale_segments(p.pid) == 1  # ...until someone reaps it
    assert moecomm.list_segments(p.pid) == []


def test_own_segments_are_never_reaped(transport):
    r = transport.create_region(64)
    assert _C.shm_reap_stale_segments(os.getpid()) == 0
    assert r.handle[4:] in moecomm.list_segments(os.getpid())


def test_the_shm_spin_comes_from_the_environment(monkeypatch):
    from moecomm.wire.choose import make_transport
    from moecomm.wire.shm import SHM_SPIN_ENV

    monkeypatch.delenv(SHM_SPIN_ENV, raising=False)
    assert make_transport("shm").spin_ns == moecomm._C.SHM_DEFAULT_SPIN_NS
    monkeypatch.setenv(SHM_SPIN_ENV, "0")
    assert make_transport("shm").spin_ns == 0
    monkeypatch.setenv(SHM_SPIN_ENV, "12.5")
    assert make_transport("shm").spin_ns == 12_500
    for bad in ("fast", "-1", "2e6"):
        monkeypatch.setenv(SHM_SPIN_ENV, bad)
        with pytest.raises(ValueError, match=SHM_SPIN_ENV):
            make_transport("shm")
