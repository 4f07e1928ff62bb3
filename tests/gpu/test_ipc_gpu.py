"""CUDA-IPC transport across processes (needs a GPU; skipped cleanly without one).

Inputs carry their origin (request i: x = i * 1000 + element index) so a response or payload
read back says where it came from; data movement is compared bit-exactly. Every test has a
wall-clock timeout so a hang fails instead of stalling the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import device_step as ds
import ipc_procs
import numpy as np
import pytest
from moecomm import _C

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

SPAWN = mp.get_context("spawn")  # never fork a process that may hold a CUDA context
LEGACY_STREAM = 0
WAIT_NS = 30_000_000_000
# The join/leave test's device waits: a put that is seen at all is seen in microseconds, so a
# few seconds separate "late" from "never" without spending a GPU run's minutes on one wait.
JOIN_WAIT_S = 3.0
DEADLINE_NS = 200_000_000  # the device wait's deadline in the peer-killed test
# The probe kernel must finish within this much wall time after its deadline (launch, the
# liveness check interval, and host polling of the event).
SLACK_S = 5.0


def recv(conn, timeout=60.0):
    assert conn.poll(timeout), "child process did not answer in time"
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise AssertionError(f"child failed: {msg[1]}")
    return msg


def start(target, *args):
    parent, child = SPAWN.Pipe()
    p = SPAWN.Process(target=target, args=(child, *args), daemon=True)
    p.start()
    return p, parent


def stop(p):
    if p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
    p.join(10)


@pytest.fixture
def ipc(cuda_native):
    t = cuda_native.IpcTransport()
    return cuda_native, t


def wait_done(probe, timeout_s):
    end = time.monotonic() + timeout_s
    while not probe.done():
        assert time.monotonic() < end, "device wait did not finish: the kernel hangs"
        time.sleep(0.002)
    return probe.result()


def test_slot_protocol_two_processes_bit_exact(ipc):
    cuda, t = ipc
    num_requests = 12
    server, conn = start(ipc_procs.slot_server, num_requests)
    try:
        cfg = ipc_procs.slot_config()
        req_ring = _C.SlotRing(cfg, ipc_procs.NUM_SLOTS, True)
        resp_ring = _C.SlotRing(cfg, ipc_procs.NUM_SLOTS, False)
        local = t.create_region(resp_ring.region_bytes)
        remote = t.attach(recv(conn))
        assert isinstance(remote, cuda.IpcRegion) and not remote.owned
        conn.send(local.handle)
        h, k = ipc_procs.HIDDEN, ipc_procs.TOPK
        for i in range(num_requests):
            n = 1 + (i * 5) % ipc_procs.MAX_TOKENS
            x = (np.arange(n * h, dtype=np.float32) + i * 1000).reshape(n, h)
            ids = (np.arange(n * k, dtype=np.int32) % 5 + i).reshape(n, k)
            scores = np.full((n, k), 0.5, dtype=np.float32)
            slot, seq = i % ipc_procs.NUM_SLOTS, i + 1
            _C.send_request(
                t, remote, req_ring, slot, ipc_procs.CLIENT_ID, seq, i, n, k, _C.Encoding.F32,
                x.ctypes.data, 0, ids.ctypes.data, scores.ctypes.data,
            )  # fmt: skip
            out = _C.wait_response(
                t, local, resp_ring, slot, ipc_procs.CLIENT_ID, seq, WAIT_NS, remote
            )
            assert out.status == _C.WaitStatus.OK and not out.offline
            assert out.code == _C.ValidateCode.OK
            assert out.header.layer_id == i and out.header.num_tokens == n
            y = np.frombuffer(t.read(local, out.payload_offset, n * h * 4), np.float32)
            assert np.array_equal(y.reshape(n, h), ipc_procs.expected_response(x, ids))
        assert recv(conn) == ("done", num_requests)
    finally:
        stop(server)


def test_host_wait_times_out_and_sees_a_dead_peer(ipc):
    _, t = ipc
    p, conn = start(ipc_procs.peer)
    try:
        local = t.create_region(4096)
        remote = t.attach(recv(conn))
        assert t.peer_alive(remote)
        pred = dict(op=_C.WaitOp.EQUAL, value=1)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            t.wait(local, 64, timeout_ns=DEADLINE_NS, peer=remote, **pred)
        assert time.monotonic() - t0 < DEADLINE_NS / 1e9 + SLACK_S
        conn.send(("sleep",))
        assert recv(conn) == "sleeping"
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        with pytest.raises(ConnectionError):
            t.wait(local, 64, timeout_ns=WAIT_NS, peer=remote, **pred)
        assert not t.peer_alive(remote)
    finally:
        stop(p)


@pytest.mark.parametrize("watchdog", [False, True], ids=["deadline", "liveness"])
def test_device_wait_returns_when_peer_is_killed(ipc, watchdog):
    """A kernel waits on a word the peer will never write; the peer is SIGKILLed. Without a
    watchdog the kernel ends at its 200 ms deadline (TIMEOUT); with one, the host marks the
    peer dead and the kernel ends with PEER_LOST long before its (30 s) deadline."""
    cuda, t = ipc
    p, conn = start(ipc_procs.peer)
    try:
        local = t.create_region(4096)
        table = cuda.IpcPeerTable(t, local, 4)
        idx = table.add_peer(recv(conn))
        conn.send(("sleep",))
        assert recv(conn) == "sleeping"
        timeout_ns = WAIT_NS if watchdog else DEADLINE_NS
        probe = table.launch_wait(64, _C.WaitOp.EQUAL, 1, timeout_ns=timeout_ns, peer=idx)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        killed = time.monotonic()
        if watchdog:
            while not probe.done():
                if not t.peer_alive(table.peer_region(idx)):
                    table.mark_dead(idx)
                    break
                assert time.monotonic() - killed < SLACK_S, "liveness check never fired"
                time.sleep(0.005)
        r = wait_done(probe, DEADLINE_NS / 1e9 + SLACK_S)
        if watchdog:
            assert r["status"] == _C.WaitStatus.PEER_LOST
            assert r["elapsed_ns"] < WAIT_NS
        else:
            assert r["status"] in (_C.WaitStatus.TIMEOUT, _C.WaitStatus.PEER_LOST)
            if r["status"] == _C.WaitStatus.TIMEOUT:
                assert r["elapsed_ns"] >= DEADLINE_NS
        assert r["observed"] == 0
        retire(cuda, table, idx)
    finally:
        stop(p)


def test_wait_probe_refuses_a_wait_without_deadline(ipc):
    """Its destructor waits for the kernel: a negative (endless) timeout would hang it."""
    cuda, t = ipc
    table = cuda.IpcPeerTable(t, t.create_region(4096), 1)
    with pytest.raises(ValueError, match="needs a deadline"):
        table.launch_wait(64, _C.WaitOp.EQUAL, 1, timeout_ns=-1, peer=0)


def retire(cuda, table, idx, timeout_s=10.0):
    """remove_peer, then collect until the retirement event has completed. The probes of these
    tests run on streams of their own and have finished; the legacy stream is named only
    because remove_peer needs some stream (the GPU reaches its event a moment later)."""
    table.remove_peer(idx, [LEGACY_STREAM])
    end = time.monotonic() + timeout_s
    while table.state(idx) != cuda.PeerState.FREE:
        assert table.state(idx) == cuda.PeerState.RETIRING
        assert time.monotonic() < end, "retirement never completed"
        table.collect()
        time.sleep(0.001)


def pattern(tag: int, n: int) -> bytes:
    return bytes((tag * 31 + i) % 251 for i in range(n))


def wait_seen(t, local, probe, launched, want, offset, data, what):
    """Waits for a join/leave probe; on anything but OK fails with what it saw: status, the
    observed word, the elapsed time, and the word and payload the host reads back."""
    r = wait_done(probe, JOIN_WAIT_S + SLACK_S)
    elapsed = time.monotonic() - launched
    if r["status"] == _C.WaitStatus.OK and r["observed"] == want:
        return r
    word = t.load(local, offset)
    got = t.read(local, data[0], len(data[1]))
    payload = "matches" if got == data[1] else f"differs first at byte {first_diff(got, data[1])}"
    pytest.fail(
        f"{what}: device wait {r['status']} after {elapsed:.3f} s (deadline {JOIN_WAIT_S} s), "
        f"observed 0x{int(r['observed']):x}, want 0x{want:x}; host read-back: word "
        f"0x{word:x}, payload {payload}"
    )


def first_diff(a: bytes, b: bytes) -> int:
    same = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(same, min(len(a), len(b)))


def test_peers_join_and_leave_at_run_time(ipc):
    """Two peers join A's table and write with the device put_signal path; one leaves, a third
    takes its index. Payloads of odd sizes at aligned and unaligned offsets, read back exactly.
    The peers load their kernels before they say ready (ipc_procs.peer); each device wait has a
    deadline of seconds and a failed one says what it saw (tools/probe/join_leave_diag.py
    separates the ways a join can go wrong)."""
    cuda, t = ipc
    local = t.create_region(ipc_procs.REGION_BYTES)
    table = cuda.IpcPeerTable(t, local, 2)
    wait_ns = int(JOIN_WAIT_S * 1e9)
    procs = {}
    try:
        for name in ("b", "c", "d"):
            procs[name] = start(ipc_procs.peer)
        handles = {name: recv(conn) for name, (_, conn) in procs.items()}
        ib, ic = table.add_peer(handles["b"]), table.add_peer(handles["c"])
        assert (ib, ic) == (0, 1) and table.active_peers == 2
        with pytest.raises(ValueError, match="peer table full"):
            table.add_peer(handles["d"])

        def put_from(name, tag, offset, nbytes, sig_offset, op="SET", value=None):
            conn = procs[name][1]
            conn.send(("connect", local.handle))
            assert recv(conn) == 0
            data = pattern(tag, nbytes)
            value = tag if value is None else value
            conn.send(("put_signal", 0, offset, data, sig_offset, value, op))
            return data

        # b: 1000 bytes (not a multiple of 16) at an aligned offset; c: unaligned offset.
        for name, idx, tag, offset, sig in (("b", ib, 11, 4096, 64), ("c", ic, 12, 8195, 128)):
            probe = table.launch_wait(sig, _C.WaitOp.EQUAL, tag, timeout_ns=wait_ns, peer=idx)
            launched = time.monotonic()
            data = put_from(name, tag, offset, 1000, sig)
            assert recv(procs[name][1]) == "ok"
            wait_seen(t, local, probe, launched, tag, sig, (offset, data), f"peer {name}")
            assert t.read(local, offset, len(data)) == data

        # b leaves: alive = 0 at once, the mapping closes once the named stream is idle.
        retire(cuda, table, ib)
        assert table.active_peers == 1
        procs["b"][1].send(("exit",))
        assert recv(procs["b"][1]) == "bye"

        # d joins into the freed index and adds to an arrival counter twice.
        idd = table.add_peer(handles["d"])
        assert idd == ib
        counter = 64 * 3 + 16  # a slot's arrival counter sits 16 bytes into its signal line
        probe = table.launch_wait(counter, _C.WaitOp.EQUAL, 2000, timeout_ns=wait_ns, peer=idd)
        launched = time.monotonic()
        data = put_from("d", 13, 20000, 1000, counter, op="ADD", value=1000)
        assert recv(procs["d"][1]) == "ok"
        procs["d"][1].send(("put_signal", 0, 21000, data, counter, 1000, "ADD"))
        assert recv(procs["d"][1]) == "ok"
        wait_seen(t, local, probe, launched, 2000, counter, (21000, data), "peer d (ADD x2)")
        assert t.read(local, 20000, 1000) == data and t.read(local, 21000, 1000) == data
    finally:
        for p, _ in procs.values():
            stop(p)


# The free path while a wait spins: each step must return well before the spinning probe's
# deadline (it would block until then if it synchronised the device, as cudaFree does).
SPIN_S = 4.0
FREE_PATH_S = 1.0


def test_the_free_path_does_not_wait_for_a_spinning_kernel(ipc):
    """While a probe kernel spins (nobody writes its word), dropping a probe, a peer table and an
    owned region, and a device put through a staging buffer, all return at once: the frees are
    stream-ordered (cudaFreeAsync) or put off (release_deferred_frees)."""
    cuda, t = ipc
    local = t.create_region(ipc_procs.REGION_BYTES)
    table = cuda.IpcPeerTable(t, local, 1)
    p, conn = start(ipc_procs.peer)
    try:
        table.add_peer(recv(conn))
        spin = table.launch_wait(
            256, _C.WaitOp.EQUAL, 99, timeout_ns=int(SPIN_S * 1e9), peer=0
        )  # nobody writes word 256: it spins until its deadline
        t0 = time.monotonic()
        steps = {}

        def timed(name, fn):
            s0 = time.monotonic()
            fn()
            steps[name] = time.monotonic() - s0

        def drop_probe():
            other = table.launch_wait(512, _C.WaitOp.EQUAL, 0, timeout_ns=10**9, peer=0)
            wait_done(other, SLACK_S)  # word 512 is 0: done at once
            del other

        def drop_table_and_region():
            region = t.create_region(4096)
            extra = cuda.IpcPeerTable(t, region, 1)
            del extra, region

        def put_through_staging():
            # The peer writes into our region: its put stages the payload (stream-ordered).
            conn.send(("connect", local.handle))
            assert recv(conn) == 0
            conn.send(("put_signal", 0, 1024, b"x" * 100, 128, 5, "SET"))
            assert recv(conn) == "ok"

        timed("probe dropped", drop_probe)
        timed("peer table and owned region dropped", drop_table_and_region)
        timed("device put through a staging buffer", put_through_staging)
        assert not spin.done(), (
            f"the spinning probe ended within {time.monotonic() - t0:.2f} s: the steps above "
            "did not run under a spinning kernel"
        )
        slow = {k: round(v, 3) for k, v in steps.items() if v > FREE_PATH_S}
        assert not slow, f"blocked behind the spinning wait (s): {slow}; all: {steps}"
        wait_done(spin, SPIN_S + SLACK_S)
        assert cuda.release_deferred_frees() >= 1  # the dropped region, freed now
    finally:
        stop(p)


# --- the device client step over CUDA IPC: liveness and retirement under a running kernel ------

COMBINE_WAIT_NS = 30_000_000_000  # far longer than any check below: only liveness ends it
AUX_BYTES = 1 << 20


class Client:
    """A device client over CUDA IPC in this process: buffers in IPC regions of its own, a peer
    table whose servers are `ipc_procs.peer` children (they never answer)."""

    def __init__(self, cuda, t, handles, streams=()):
        self.k, self.t = cuda, t
        _, resp_bytes = ds.ring_bytes()
        n = len(handles)
        self.local = t.create_region(resp_bytes * n)
        self.table = cuda.IpcPeerTable(t, self.local, n, list(streams))
        assert [self.table.add_peer(h) for h in handles] == list(range(n))
        region = t.create_region(AUX_BYTES)
        self.aux = ds.Arena(
            region.device_ptr,
            AUX_BYTES,
            lambda off, data: t.write(region, off, data),
            lambda off, nbytes: t.read(region, off, nbytes),
        )
        self._region = region
        self.cfg = ds.client_config(cuda, self.aux, n, [0] * n, [resp_bytes * i for i in range(n)])
        self.layout = cuda.client_workspace_layout(self.cfg)
        ws = self.aux.alloc(self.layout["total"])
        self.ws = self.aux.addr(ws)
        self.ws_read = lambda off, nbytes: self.aux.read(ws + off, nbytes)
        self.y = self.aux.alloc(ds.NUM_TOKENS * ds.HIDDEN * 4)
        self.n = n

    def step(self, stream: int, timeout_ns: int) -> None:
        """Dispatch to every server, then a combine that waits for answers that never come."""
        self.aux.write(self.y, b"\xff" * (ds.NUM_TOKENS * ds.HIDDEN * 4))  # NaN: not written
        peers = self.table.kernel_peers()  # straight from C++, no dict round trip
        dargs = ds.dispatch_args(self.k, self.aux, self.n, self.ws)
        self.k.client_dispatch(peers, self.cfg, dargs, stream)  # same stream: ordered
        args = ds.combine_args(self.k, self.ws, self.aux.addr(self.y), timeout_ns)
        self.k.client_combine(peers, self.cfg, args, stream)

    def combined(self) -> bool:
        """Whether the combine's reduce has written y (it runs after every wait ended)."""
        return self.aux.read(self.y, 4) != b"\xff" * 4

    def wait_combined(self, timeout_s: float) -> float:
        end = time.monotonic() + timeout_s
        while not self.combined():
            assert time.monotonic() < end, "the combine kernel did not end"
            time.sleep(0.002)
        time.sleep(0.05)  # the reduce writes every row after the first
        return time.monotonic()

    def statuses(self) -> list[int]:
        return ds.statuses(self.layout, self.ws_read, self.n)


def test_mark_dead_ends_a_waiting_combine_with_peer_lost(ipc):
    """The combine runs on the legacy stream with a 30 s deadline; mark_dead must not queue
    behind it (the table writes on its own stream) and the kernel must end PEER_LOST at once."""
    cuda, t = ipc
    p, conn = start(ipc_procs.peer)
    try:
        c = Client(cuda, t, [recv(conn)], streams=[LEGACY_STREAM])
        conn.send(("sleep",))
        assert recv(conn) == "sleeping"
        c.step(LEGACY_STREAM, COMBINE_WAIT_NS)
        time.sleep(0.3)
        assert not c.combined(), "the combine ended before its server was marked dead"
        t0 = time.monotonic()
        c.table.mark_dead(0)
        assert time.monotonic() - t0 < 1.0, "mark_dead waited for the kernel it should stop"
        assert c.wait_combined(SLACK_S) - t0 < SLACK_S
        assert c.statuses() == [cuda.SERVER_STATUS["PEER_LOST"]]
        assert np.all(np.frombuffer(c.aux.read(c.y, 4 * ds.HIDDEN), np.float32) == 0)
        retire(cuda, c.table, 0)
    finally:
        stop(p)


def user_stream():
    """(handle, synchronize, close) of a non-blocking stream of this process's CUDA context:
    torch's when it has CUDA (the GPU run builds against it), else cuda-python's."""
    import torch

    if torch.cuda.is_available():
        s = torch.cuda.Stream()
        return s.cuda_stream, s.synchronize, lambda: None
    rt = pytest.importorskip("cuda.bindings.runtime", reason="needs CUDA torch or cuda-python")
    err, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    assert err == rt.cudaError_t.cudaSuccess, err

    def sync():
        assert rt.cudaStreamSynchronize(s)[0] == rt.cudaError_t.cudaSuccess

    return int(s), sync, lambda: rt.cudaStreamDestroy(s)


def test_remove_peer_waits_for_the_kernels_stream(ipc):
    """A combine on a stream of ours waits for two servers (1.5 s deadline). remove_peer(1) on
    that stream: server 1's wait ends PEER_LOST at once, but its mapping stays (RETIRING) until
    the kernel, still waiting for server 0, is done; then collect() closes it."""
    cuda, t = ipc
    stream, sync, close = user_stream()
    procs = [start(ipc_procs.peer) for _ in range(2)]
    try:
        c = Client(cuda, t, [recv(conn) for _, conn in procs])
        with pytest.raises(ValueError, match="name the streams"):
            c.table.remove_peer(1)  # no streams given, none at construction
        assert c.table.state(1) == cuda.PeerState.ACTIVE
        deadline_ns = 1_500_000_000
        c.step(stream, deadline_ns)
        c.table.remove_peer(1, [stream])
        assert c.table.state(1) == cuda.PeerState.RETIRING
        assert c.table.collect() == 0, "the mapping was closed under a running kernel"
        c.wait_combined(deadline_ns / 1e9 + SLACK_S)
        sync()
        assert c.table.collect() == 1 and c.table.state(1) == cuda.PeerState.FREE
        ok = c.statuses()
        assert ok == [cuda.SERVER_STATUS["TIMEOUT"], cuda.SERVER_STATUS["PEER_LOST"]], ok
        assert c.combined() and t.read(c.local, 0, 8) is not None  # no sticky error
    finally:
        for p, _ in procs:
            stop(p)
        close()
