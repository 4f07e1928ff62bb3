"""The nixl backend between real processes on this host when things go wrong: killed and stopped
peers, malformed region handles, our own region as a local alias, the peers() lifecycle, and a
handle of a dead agent. The data path: test_nixl_transport.py. Seeds are fixed; deadlines are
seconds (the machine is shared)."""

from __future__ import annotations

import gc
import os
import random
import signal
import threading
import time

import moecomm
import moecomm.wire.nixl
import pytest
import torch
from moecomm.errors import PeerLostError
from moecomm.wire.transport import SignalOp, WaitOp
from moecomm.wire.views import region_bytes_view
from nixl_helpers import NIXL_OK, NIXL_WHY, SEED, WAIT_NS, S, echo, kill, regions, ringer, spawn
from proc_helpers import stop_process

pytestmark = [
    pytest.mark.skipif(not NIXL_OK, reason=f"NIXL is not installed: {NIXL_WHY}"),
    pytest.mark.timeout(60),  # the in-process tests; those with processes say 120
]


# ---------------------------------------------------------- 1. dead and stopped peers
@pytest.mark.timeout(120)
def test_killed_peer_fails_waits_puts_and_reads_fast(reaper):
    p, conn, (handle, _) = spawn(reaper, ringer, SEED)
    t = moecomm.wire.nixl.open_nixl_transport(xfer_timeout_s=20)
    mine = t.create_region(4096)
    peer = t.attach(handle)
    conn.send(mine.handle)
    assert t.peer_alive(peer)
    # Killed at a random point of its ringing, while we wait on it.
    delay = random.Random(SEED).uniform(0.2, 1.0)
    killed_at = []

    def killer():
        killed_at.append(time.monotonic())
        os.kill(p.pid, signal.SIGKILL)

    timer = threading.Timer(delay, killer)
    timer.start()
    try:
        last, wakes = 0, 0
        with pytest.raises(moecomm.PeerLostError, match="peer died"):
            while True:
                last = t.wait(mine, 0, WaitOp.NOT_EQUAL, last, timeout_ns=WAIT_NS, peer=peer)
                wakes += 1
        assert wakes > 0  # it was ringing when it died
        assert time.monotonic() - killed_at[0] < 5  # by liveness, not the 30 s deadline
    finally:
        timer.cancel()
    p.join(10)
    src = torch.ones(64, dtype=torch.uint8)
    start = time.monotonic()
    with pytest.raises(moecomm.PeerLostError, match="gone"):
        t.put(peer, 0, src.data_ptr(), 64)
        t.signal(peer, 8, 1)
    with pytest.raises(moecomm.PeerLostError):
        t.signal(peer, 8, 1, SignalOp.ADD)
    with pytest.raises(moecomm.PeerLostError):
        t.read(peer, 0, src.data_ptr(), 64)
    with pytest.raises(moecomm.PeerLostError):
        t.load(peer, 8)
    assert not t.peer_alive(peer)
    with pytest.raises(moecomm.PeerLostError):  # a dead peer is noticed at the first check
        t.wait(mine, 8, WaitOp.EQUAL, 1, timeout_ns=WAIT_NS, peer=peer)
    assert time.monotonic() - start < 5  # none of them waited for the transfer deadline
    assert isinstance(PeerLostError("x"), ConnectionError)


@pytest.mark.timeout(120)
def test_stopped_peer_never_hangs_a_waiter_and_answers_after_sigcont(reaper):
    p, conn, handle = spawn(reaper, echo)
    t = moecomm.wire.nixl.open_nixl_transport(xfer_timeout_s=3)
    mine = t.create_region(4096)
    peer = t.attach(handle)
    conn.send(mine.handle)
    t.signal(peer, 0, 1)
    assert t.wait(mine, 0, WaitOp.EQUAL, 1, timeout_ns=WAIT_NS, peer=peer) == 1
    stop_process(p.pid)
    try:
        start_s = time.monotonic()
        try:  # one-sided: it may land in the stopped process or time out, never hang
            t.signal(peer, 0, 2)
            rung = True
        except moecomm.DeadlineExceededError:
            rung = False
        assert time.monotonic() - start_s < 3 + 5
        start_s = time.monotonic()
        # Stopped is not dead: the wait ends at its own deadline (probes are capped by it).
        with pytest.raises(moecomm.DeadlineExceededError):
            t.wait(mine, 0, WaitOp.EQUAL, 2, timeout_ns=S + S // 2, peer=peer)
        elapsed = time.monotonic() - start_s
        assert 1.5 <= elapsed < 1.5 + 2, elapsed
    finally:
        os.kill(p.pid, signal.SIGCONT)
    if not rung:
        t.signal(peer, 0, 2)
    # Resumed, it answers again.
    assert t.wait(mine, 0, WaitOp.EQUAL, 2, timeout_ns=WAIT_NS) == 2
    t.signal(peer, 0, 3)
    assert t.wait(mine, 0, WaitOp.EQUAL, 3, timeout_ns=WAIT_NS) == 3


# nixl_transport.h: kProbeTimeoutNs.
PROBE_S = 2


@pytest.mark.timeout(120)
def test_stopped_peer_is_a_timeout_not_a_lost_peer(reaper):
    p, _conn, (_agent, handles) = spawn(reaper, regions, 1)
    t = moecomm.wire.nixl.open_nixl_transport(xfer_timeout_s=3)
    mine = t.create_region(64)
    peer = t.attach(handles[0])
    assert t.load(peer, 0) == 0x0101010101010101  # connected
    stop_process(p.pid)
    try:
        start_s = time.monotonic()
        with pytest.raises(moecomm.DeadlineExceededError):
            t.wait(mine, 0, WaitOp.EQUAL, 1, timeout_ns=PROBE_S * S + S, peer=peer)
        assert time.monotonic() - start_s < PROBE_S + 1 + 2  # at its deadline
    finally:
        os.kill(p.pid, signal.SIGCONT)
    assert t.peer_alive(peer)  # stopped is not dead


# --------------------------------------------------------------------------- 2. handles
# Region handles: "nixl|<agent>|<address hex>|<bytes>|<memory: host or cuda:N>|<blob>".
MALFORMED = [
    ("", "not a nixl region handle"),
    ("shm:moecomm-1-2-3-deadbeef", "not a nixl region handle"),
    ("nixl|agent|7f00|4096|host", "not a nixl region handle"),  # no blob
    ("nixl|agent|7f00|4096|QUFB", "not a nixl region handle"),  # no memory kind
    ("nixl|agent|7f00|4096|host|QUFB|extra", "not a nixl region handle"),
    ("nixl||7f00|4096|host|QUFB", "not a nixl region handle"),  # no agent
    ("nixl|agent|7f00|4096|host|", "not a nixl region handle"),  # empty blob
    ("NIXL|agent|7f00|4096|host|QUFB", "not a nixl region handle"),
    ("nixl|agent|zz|4096|host|QUFB", "bad address or size"),
    ("nixl|agent|7f00g|4096|host|QUFB", "bad address"),
    ("nixl|agent||4096|host|QUFB", "bad address or size"),
    ("nixl|agent|7f00|0x10|host|QUFB", "bad address or size"),
    ("nixl|agent|7f00|0|host|QUFB", "bad address or size"),
    ("nixl|agent|7f00|99999999999999999999999|host|QUFB", "bad address or size"),
    ("nixl|agent|7f00|4096|gpu|QUFB", "unknown memory"),
    ("nixl|agent|7f00|4096|cuda:x|QUFB", "unknown memory"),
    ("nixl|agent|7f00|4096||QUFB", "unknown memory"),
    # No sign, no blanks (std::stoull would take them: "-1" would be 2^64-1 bytes).
    ("nixl|agent|-7f00|4096|host|QUFB", "bad address or size"),
    ("nixl|agent|7f00|-4096|host|QUFB", "bad address or size"),
    ("nixl|agent| 7f00|4096|host|QUFB", "bad address or size"),
    ("nixl|agent|7f00|4096|host|!!not base64!!", "not base64"),
    ("nixl|agent|7f00|4096|host|QUF", "not base64"),  # truncated base64
]


def _refuse(handle, message):
    t = moecomm.wire.nixl.open_nixl_transport()
    try:
        with pytest.raises(ValueError, match=message):
            t.attach(handle)
    finally:
        assert t.peers() == []
        r = t.create_region(64)  # nothing broke
        assert t.attach(r.handle).size == 64


@pytest.mark.parametrize(("handle", "message"), MALFORMED)
def test_malformed_handles_are_value_errors(handle, message):
    _refuse(handle, message)


def test_a_blob_that_is_no_nixl_metadata_is_refused_cleanly():
    # Well-formed base64 of something that is not an agent's metadata: NIXL refuses it. The
    # transport must survive it (and attach nothing).
    t = moecomm.wire.nixl.open_nixl_transport()
    with pytest.raises(ValueError, match="no loadable metadata"):
        t.attach("nixl|agent|7f00|4096|host|Z2FyYmFnZQ==")
    assert t.peers() == []
    r = t.create_region(64)
    assert t.attach(r.handle).size == 64


def test_own_region_attaches_as_a_local_alias():
    t = moecomm.wire.nixl.open_nixl_transport()
    r = t.create_region(4096)
    alias = t.attach(r.handle)
    assert not alias.owned and alias.size == 4096 and alias.handle == r.handle
    assert t.peers() == []  # ourselves: no peer loaded into the agent
    transfers = t.engine.transfers
    src = torch.arange(1, 101, dtype=torch.uint8)
    t.put(alias, 1000, src.data_ptr(), 100)
    t.signal(alias, 8, 40)
    t.signal(alias, 8, 2, SignalOp.ADD)  # our own word: a true add
    view = region_bytes_view(r)
    assert torch.equal(view[1000:1100], src)
    assert t.load(r, 8) == 42 and t.load(alias, 8) == 42
    out = torch.zeros(100, dtype=torch.uint8)
    t.read(alias, 1000, out.data_ptr(), 100)
    assert torch.equal(out, src)
    assert t.peer_alive(alias)
    assert t.wait(r, 8, WaitOp.EQUAL, 42, timeout_ns=0) == 42
    assert t.engine.transfers == transfers  # all of it in our own memory
    fields = r.handle.split("|")  # nixl|agent|address|bytes|memory|blob
    assert fields[:2] == ["nixl", t.agent_name] and fields[3] == "4096"
    wrong_size = [*fields[:3], "4095", *fields[4:]]
    with pytest.raises(moecomm.SegmentNotFoundError, match="no region of ours"):
        t.attach("|".join(wrong_size))  # right address, wrong size
    wrong_addr = [*fields[:2], f"{int(fields[2], 16) + 4096:x}", *fields[3:]]
    with pytest.raises(moecomm.SegmentNotFoundError, match="no region of ours"):
        t.attach("|".join(wrong_addr))


@pytest.mark.timeout(120)
def test_peers_lists_a_peer_until_its_last_region_is_released(reaper):
    _p, _conn, (agent, handles) = spawn(reaper, regions, 2)
    t = moecomm.wire.nixl.open_nixl_transport()
    assert agent != t.agent_name and t.peers() == []
    a = t.attach(handles[0])
    assert t.peers() == [agent]
    b, c = t.attach(handles[0]), t.attach(handles[1])
    assert t.peers() == [agent] and c.size == 8192
    assert t.load(b, 0) == 0x0101010101010101 and t.load(c, 0) == 0x0202020202020202
    del a, b
    gc.collect()
    assert t.peers() == [agent]  # c still holds it
    assert t.load(c, 0) == 0x0202020202020202
    del c
    gc.collect()
    assert t.peers() == []
    # Forgotten, and loaded again from a handle as if new.
    d = t.attach(handles[1])
    assert t.peers() == [agent] and t.load(d, 0) == 0x0202020202020202
    del d
    gc.collect()
    assert t.peers() == []


@pytest.mark.timeout(120)
def test_handle_of_a_dead_agent_fails_at_attach_or_first_use(reaper):
    p, _conn, (_agent, handles) = spawn(reaper, regions, 1)
    kill(p)
    t = moecomm.wire.nixl.open_nixl_transport(xfer_timeout_s=5)
    start = time.monotonic()
    try:
        peer = t.attach(handles[0])
    except moecomm.PeerLostError as exc:  # NIXL could not reach it to load it
        assert "unreachable" in str(exc)
    else:
        with pytest.raises(moecomm.PeerLostError):
            t.signal(peer, 0, 1)
        assert not t.peer_alive(peer)
    assert time.monotonic() - start < 5 + 5
    r = t.create_region(64)  # and the transport still works
    assert t.attach(r.handle).size == 64
