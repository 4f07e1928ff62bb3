"""Child processes of the CUDA-IPC GPU tests (started with the spawn method: a process must
not fork once CUDA is initialised). Each talks to the test over a Pipe."""

from __future__ import annotations

import time

import numpy as np

# Request/response shapes of the slot-protocol test.
HIDDEN = 37  # not a multiple of any vector width: tails are exercised
TOPK = 3
MAX_TOKENS = 16
NUM_SLOTS = 2
CLIENT_ID = 7
REGION_BYTES = 1 << 16


def slot_config():
    from moecomm import _C

    return _C.SlotConfig(MAX_TOKENS, HIDDEN, TOPK, _C.Encoding.F32, _C.Encoding.F32)


def expected_response(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """What the test server answers: exact in f32 (small integers times 2 plus an id)."""
    return (x * np.float32(2) + ids[:, :1].astype(np.float32)).astype(np.float32)


def slot_server(conn, num_requests: int) -> None:
    """Serves `num_requests` requests over the slot protocol on a cuda_ipc request region."""
    try:
        from moecomm import _C
        from moecomm._cuda import IpcTransport

        t = IpcTransport()
        cfg = slot_config()
        req_ring = _C.SlotRing(cfg, NUM_SLOTS, True)
        resp_ring = _C.SlotRing(cfg, NUM_SLOTS, False)
        local = t.create_region(req_ring.region_bytes)
        conn.send(local.handle)
        client = t.attach(conn.recv())
        served = 0
        seen = t.load(local, 0)
        while served < num_requests:
            for inc in _C.poll_requests(t, local, req_ring, CLIENT_ID):
                assert inc.code == _C.ValidateCode.OK, inc.code
                n = inc.header.num_tokens
                base = inc.payload_offset
                x = np.frombuffer(t.read(local, base + inc.act_offset, n * HIDDEN * 4), np.float32)
                ids = np.frombuffer(t.read(local, base + inc.ids_offset, n * TOPK * 4), np.int32)
                y = expected_response(x.reshape(n, HIDDEN), ids.reshape(n, TOPK))
                y = np.ascontiguousarray(y)
                _C.send_response(
                    t, local, req_ring, client, resp_ring, inc.slot, CLIENT_ID, inc.seq,
                    inc.header.layer_id, n, _C.Encoding.F32, y.ctypes.data,
                )  # fmt: skip
                served += 1
            if served < num_requests:
                status, seen = _C.wait_doorbell(t, local, seen, 30_000_000_000, client)
                assert status == _C.WaitStatus.OK, status
        conn.send(("done", served))
    except Exception as e:  # reported to the test, which fails with it
        conn.send(("error", repr(e)))


def peer(conn) -> None:
    """A peer that owns one region and obeys commands: connect to the test's region, put with
    the device put_signal_warp path, sleep (to be killed), exit. Like every process that puts on
    a shared GPU it loads its kernels before it says ready (sends its handle): it joins while
    the test's wait kernel spins (moecomm.runtime.device_preload)."""
    try:
        import moecomm._cuda as kernels
        from moecomm import _C
        from moecomm._cuda import IpcPeerTable, IpcTransport
        from moecomm.runtime.device_preload import preload_kernels

        preload_kernels(kernels, 0)
        t = IpcTransport()
        own = t.create_region(REGION_BYTES)
        conn.send(own.handle)
        table = None
        while True:
            cmd, *args = conn.recv()
            if cmd == "connect":
                table = IpcPeerTable(t, own, 1)
                conn.send(table.add_peer(args[0]))
            elif cmd == "put_signal":
                index, offset, data, sig_offset, value, op = args
                table.put_signal(index, offset, data, sig_offset, value, getattr(_C.SignalOp, op))
                conn.send("ok")
            elif cmd == "sleep":
                conn.send("sleeping")
                time.sleep(600)
            elif cmd == "exit":
                conn.send("bye")
                return
            else:
                raise ValueError(f"unknown command {cmd!r}")
    except Exception as e:
        conn.send(("error", repr(e)))
