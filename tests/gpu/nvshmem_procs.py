"""Child process of the NVSHMEM GPU test: NVSHMEM is initialised once per process, so each
scenario runs in a fresh spawned process and reports back over a Pipe."""

from __future__ import annotations

SECOND = 1_000_000_000
SHORT_DEADLINE_NS = 200_000_000


def single_pe(conn) -> None:
    """A one-PE job: bootstrap by unique id, a symmetric region, put_signal to itself through
    the device path, and the device wait's three outcomes (OK, TIMEOUT, PEER_LOST). Statuses
    travel as ints (pybind11 enums do not pickle)."""
    try:
        from moecomm import _C
        from moecomm import _nvshmem as nv

        nv.init(nv.get_unique_id(), 0, 1)
        out = {"pe": (nv.my_pe(), nv.n_pes())}
        region = nv.NvshmemRegion(1 << 16)
        table = nv.NvshmemPeerTable(region, 1)
        table.set_peer(0, 0)
        data = bytes((7 * i + 3) % 251 for i in range(1000))
        region.write(8192, data)
        table.put_signal(0, 4096, 8192, len(data), 64, 5, _C.SignalOp.SET)
        ok = table.device_wait(64, _C.WaitOp.EQUAL, 5, timeout_ns=SECOND, peer=0)
        out["ok"] = (int(ok["status"]), ok["observed"], region.read(4096, len(data)) == data)
        late = table.device_wait(128, _C.WaitOp.EQUAL, 1, timeout_ns=SHORT_DEADLINE_NS, peer=0)
        out["timeout"] = (int(late["status"]), late["elapsed_ns"])
        table.mark_dead(0)
        lost = table.device_wait(128, _C.WaitOp.EQUAL, 1, timeout_ns=30 * SECOND, peer=0)
        out["lost"] = (int(lost["status"]), lost["elapsed_ns"])
        region.free()
        nv.finalize()
        conn.send(out)
    except Exception as e:
        conn.send(("error", repr(e)))
