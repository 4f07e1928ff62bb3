"""Child process of the NVSHMEM GPU test: NVSHMEM is initialised once per process, so each
scenario runs in a fresh spawned process and reports back over a Pipe. Also what decides where
the tests can run: the single-node NVSHMEM settings, and whether two PEs can share the GPUs here."""

from __future__ import annotations

import os
from pathlib import Path

SECOND = 1_000_000_000
SHORT_DEADLINE_NS = 200_000_000

# Every PE of these tests runs on this node, so NVSHMEM gets a single-node configuration, set in
# each child before moecomm._nvshmem is imported (NVSHMEM reads its environment in
# get_unique_id and init; assignments here override whatever the machine exports):
# - MOECOMM_NVSHMEM_IBGDA=0: moecomm's get_unique_id/init set none of their IBGDA defaults
#   (NVSHMEM_IB_ENABLE_IBGDA=1, NVSHMEM_IBGDA_NUM_RC_PER_PE, NVSHMEM_QP_DEPTH; docs/
#   gpu-transports.md), which are for GPUs driving a NIC across nodes.
# - NVSHMEM_IB_ENABLE_IBGDA=0: GPU-initiated IB transport off, also if the environment had it on.
# - NVSHMEM_REMOTE_TRANSPORT=none: no remote (network) transport at all; peers on this node use
#   P2P (NVLink/PCIe) or, on one GPU under MPS, the same device. Without it NVSHMEM starts its
#   default IB RC proxy, which on a machine without an IB/RoCE NIC only warns, and with one opens
#   queue pairs nobody uses. Documented values: ibrc, ucx, libfabric, ibdevx, none.
# - NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo, NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY=AF_INET: the unique-id
#   bootstrap's TCP socket (rank 0 listens, the others connect) on the loopback interface over
#   IPv4. By default NVSHMEM picks the first non-loopback interface, which a sandbox or container
#   may lack or not route; every PE is local, so 127.0.0.1 always works.
# (NVSHMEM's env_defs.h: BOOTSTRAP_UID_SOCK_IFNAME, BOOTSTRAP_UID_SOCK_FAMILY, REMOTE_TRANSPORT,
# IB_ENABLE_IBGDA.)
SINGLE_NODE_ENV = {
    "MOECOMM_NVSHMEM_IBGDA": "0",
    "NVSHMEM_IB_ENABLE_IBGDA": "0",
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY": "AF_INET",
}
# The MPS control daemon's pipe directory when CUDA_MPS_PIPE_DIRECTORY is not set.
DEFAULT_MPS_PIPE_DIR = "/tmp/nvidia-mps"
TWO_PE_ONE_GPU_REASON = (
    "one GPU and no MPS: two NVSHMEM PEs cannot share it (NVSHMEM runs several PEs on one GPU "
    "only under CUDA MPS; this needs two GPUs, or the MPS control daemon running)"
)


def apply_single_node_env() -> dict:
    """Sets SINGLE_NODE_ENV in this process; returns the NVSHMEM-related settings now in force."""
    os.environ.update(SINGLE_NODE_ENV)
    return {k: v for k, v in os.environ.items() if k.startswith(("NVSHMEM_", "MOECOMM_NVSHMEM_"))}


def mps_active(pipe_dir: str | None = None, proc: str = "/proc") -> str | None:
    """How CUDA MPS was found running here, or None. The control daemon
    (nvidia-cuda-mps-control -d) creates a `control` pipe in its pipe directory
    (CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps), which CUDA clients use to reach it; it and
    its server also show as processes named nvidia-cuda-mps-* (15 characters of it in comm)."""
    pipe = Path(pipe_dir or os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_MPS_PIPE_DIR)
    if (pipe / "control").exists():
        return f"MPS control pipe {pipe / 'control'}"
    for comm in Path(proc).glob("[0-9]*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:
            continue
        if name.startswith("nvidia-cuda-mps"):
            return f"MPS daemon running ({name}, pid {comm.parent.name})"
    return None


def two_pe_skip_reason(device_count: int, mps: str | None) -> str | None:
    """Why the two-PE test cannot run here (None: it can). Two PEs take one GPU each when there
    are two; on one GPU they need MPS (NVSHMEM supports several PEs per GPU only under MPS)."""
    if device_count >= 2 or mps is not None:
        return None
    return TWO_PE_ONE_GPU_REASON


def single_pe(conn) -> None:
    """A one-PE job: bootstrap by unique id, a symmetric region, put_signal to itself through
    the device path, and the device wait's three outcomes (OK, TIMEOUT, PEER_LOST). Statuses
    travel as ints (pybind11 enums do not pickle)."""
    try:
        env = apply_single_node_env()
        from moecomm import _C
        from moecomm import _nvshmem as nv

        defaults = nv.transport_env_defaults()  # what moecomm would still add: nothing
        nv.init(nv.get_unique_id(), 0, 1)
        out = {"pe": (nv.my_pe(), nv.n_pes()), "env": env, "defaults": defaults}
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
        try:  # a synchronous wait without a deadline would never return: refused
            table.device_wait(128, _C.WaitOp.EQUAL, 1, timeout_ns=-1, peer=0)
            out["endless"] = "accepted"
        except ValueError as e:
            out["endless"] = str(e)
        table.mark_dead(0)
        lost = table.device_wait(128, _C.WaitOp.EQUAL, 1, timeout_ns=30 * SECOND, peer=0)
        out["lost"] = (int(lost["status"]), lost["elapsed_ns"])
        region.free()
        nv.finalize()
        conn.send(out)
    except Exception as e:
        conn.send(("error", repr(e)))


# The 2-PE step: PE 0 is the client, PE 1 the server. Each PE's transport region holds the
# request ring (at 0, written by the client into the server's copy) and the response ring
# (after it, written by the server into the client's copy); symmetric, so the offsets agree.
AUX_BYTES = 1 << 20
# The step's deadlines, before MOECOMM_DEVICE_DEADLINE_SCALE (scaled in the child).
COMBINE_TIMEOUT_NS = 10 * SECOND
ARRIVAL_TIMEOUT_NS = 2 * SECOND


def scaled_ns(ns: int) -> int:
    import moecomm.wire.cuda

    return int(ns * moecomm.wire.cuda.deadline_scale())


def two_pe(conn, rank: int) -> None:
    """One rank of a two-PE job that runs the real device kernels through moecomm._nvshmem:
    client dispatch -> server gather -> identity expert (host) -> server respond -> client
    combine. Steps are sequenced by the test over `conn` (each waits for "go"), so the two
    processes never spin against each other on a shared GPU. Results travel back as numpy."""
    try:
        env = apply_single_node_env()
        import device_step as ds
        import numpy as np
        from moecomm import _cuda as k
        from moecomm import _nvshmem as nv

        if rank == 0:
            conn.send(("uid", nv.get_unique_id()))
            uid = conn.recv()
        else:
            uid = conn.recv()
        # One GPU per PE when there are two; otherwise both share GPU 0, which the test runs
        # only under MPS (two_pe_skip_reason).
        nv.init(uid, rank, 2, rank % max(1, nv.device_count()))
        req_bytes, resp_bytes = ds.ring_bytes()
        # Collective allocations: the same sizes in the same order on both PEs.
        aux_region = nv.NvshmemRegion(AUX_BYTES)
        region = nv.NvshmemRegion(req_bytes + resp_bytes)
        aux = ds.Arena(aux_region.device_ptr, AUX_BYTES, aux_region.write, aux_region.read)
        ccfg = ds.client_config(k, aux, 1, [0], [req_bytes])
        scfg = ds.server_config(k, aux, 0, req_bytes)
        clay, slay = k.client_workspace_layout(ccfg), k.server_workspace_layout(scfg)
        # The workspaces are put sources: symmetric, allocated as regions (docs/gpu-transports.md).
        cws = nv.NvshmemRegion(clay["total"])
        sws = nv.NvshmemRegion(slay["total"])
        table = nv.NvshmemPeerTable(region, 1)
        table.set_peer(0, 1 - rank)
        peers = table.kernel_peers()
        out = {"pe": (nv.my_pe(), nv.n_pes()), "env": env}
        if rank == 0:
            args = ds.dispatch_args(k, aux, 1, cws.device_ptr)
            y_off = aux.alloc(ds.NUM_TOKENS * ds.HIDDEN * 4)
            aux.write(y_off, np.full(ds.NUM_TOKENS * ds.HIDDEN, np.nan, np.float32).tobytes())
            k.client_dispatch(peers, ccfg, args, 0)
            out["count"] = np.frombuffer(cws.read(clay["count"], 4), np.int32).tolist()
            conn.send(("dispatched", None))  # the region read above waited for stream 0
            assert conn.recv() == "go"
            cargs = ds.combine_args(
                k, cws.device_ptr, aux.addr(y_off), scaled_ns(COMBINE_TIMEOUT_NS)
            )
            k.client_combine(peers, ccfg, cargs, 0)
            raw = aux.read(y_off, ds.NUM_TOKENS * ds.HIDDEN * 4)
            out["y"] = np.frombuffer(raw, np.float32).reshape(ds.NUM_TOKENS, ds.HIDDEN).copy()
            out["status"] = ds.statuses(clay, cws.read, 1)
        else:
            assert conn.recv() == "go"
            g = k.ServerGatherArgs()
            g.layer_id, g.arrival_timeout_ns = ds.LAYER, scaled_ns(ARRIVAL_TIMEOUT_NS)
            g.block_m, g.workspace = ds.BLOCK_M, sws.device_ptr
            k.server_gather(peers, scfg, g, 0)
            out["action"] = ds.entry_action(slay, sws.read)
            out["x"] = ds.gathered_x(slay, sws.read).copy()
            expert_out = ds.identity_expert(slay, sws.read)
            r = k.ServerRespondArgs()
            r.expert_out = aux.addr(aux.put(expert_out))
            r.expert_out_dtype, r.workspace = int(ds.slot_config().out_encoding), sws.device_ptr
            k.server_respond(peers, scfg, r, 0)
            sws.read(0, 8)  # waits for stream 0: the response puts have been issued
            conn.send(("responded", None))
        assert conn.recv() == "finish"
        nv.finalize()  # collective: both PEs get here
        conn.send(("done", out))
    except Exception as e:
        conn.send(("error", repr(e)))
