"""The CUDA path of the DeepEP-shaped adapter: ``low_latency_dispatch`` / ``low_latency_combine``
with CUDA tensors, on the device launchers of ``moecomm._cuda`` (client_dispatch, server_gather,
server_respond, client_combine) over CUDA IPC. Selected by deep_ep.Buffer when the inputs are
CUDA tensors; everything else about the Buffer (rendezvous, shapes, two results in flight) is
shared with the host path.

Each rank is a client (its tokens go out) and a server (its ``L`` local experts answer). Per
encoding (``use_fp8`` or not) a *lane*: one CUDA-IPC region per rank holding a request ring per
source rank and a response ring per destination rank (2 slots each), the peers' regions mapped
through an ``IpcPeerTable`` (the region handles travel through the Buffer's rendezvous, so every
rank must be on one node: a handle from another node is refused with a clear error).

The wire mapping (one request row per (token, k) copy, a sink row per destination, one slot
per dispatch parity) and the pure-torch halves of the path are in ``low_latency/device_ops.py``.

Receive: the gather kernel polls without waiting, so the receive re-launches it until every
rank's request of this slot is admitted, reading the 32-byte entry states back each pass — the
one host synchronisation of the path (documented in docs/compat-deep-ep.md). The conversion of
the per-expert layout into DeepEP's packed ``recv_x`` / scales / ``src_info`` / ``layout_range``
/ ``recv_count`` is torch on the device, with no host read (:func:`scatter_receive`). Combine
launches no host read either; the per-peer statuses of a combine are checked at the next receive
of the Buffer (where the host synchronises anyway).

DeepEP's contract, as on the host path (``moecomm.compat.deep_ep``), in the kernels' terms:

- **fp8** is cast in torch on the device with DeepEP's formula (``cast.deepep_cast``, the
  host path's function: 1e-4 amax floor, ``448 / amax`` as an f32 division, saturating e4m3,
  ``round_scale``'s powers of two) and sent as it is: ``DispatchArgs.x_scales`` makes the pack
  kernel copy the e4m3 bytes and their f32 scales instead of quantizing with moecomm's formula.
  ``use_ue8m0`` packs the received power-of-two scales into DeepEP's int32 layout.
- **Uncombined dispatches are legal**: dispatch ``i + 2`` reuses slot ``i % 2`` whatever became
  of dispatch ``i``. Nothing releases an unanswered request slot, so a gather may find a stale
  request there (an older sequence, or a header the new request is overwriting): it counts as
  not arrived yet, as the host path's ``wait_request`` skips it.
- **A handle is combined any number of times, at any time**: the handle keeps what its combine
  needs (the route's per-server rows and sequences, the gather's entries and ``slot_of``), and
  combine ``c`` of a lane answers on its own sequence space (``COMBINE_SEQ_BASE + c + 1``, the
  host path's) in response slot ``c % 2``: the server workspace of that slot gets the handle's
  entries re-stamped with that sequence before ``server_respond``, the client workspace the
  same sequence before ``client_combine`` (below). So a second combine of a
  handle is never mistaken for the first, and each response slot is written from one server
  workspace only (its cumulative arrival counter stays exact).
- ``zero_copy`` and ``use_logfmt`` (the host path's numerics, bf16 on the wire) work;
  ``dispatch_wait_recv_cost_stats`` is the host-measured wait, in ns, for each source rank's
  request. Refused on CUDA tensors (deep_ep.Buffer says why): ``combine_wait_recv_cost_stats``
  (the combine waits inside a kernel, not on the host) and shrink mode (the kernels' liveness
  mask and the agreed sequences would need a masked rank to be skipped on the device).

This path has been checked on CPU with stand-in kernels only; it has not run on a GPU.

Everything runs on the caller's current stream; a call on another stream than the previous one
first waits for the previous call's event, so the order of the calls is the order on the device.

**Combine** (a handle combined any number of times, at any time, each combine on its own
sequence number). The device kernels answer a request with the request's own sequence, from
the server workspace of its gather, into the response slot of its request slot. So the combine
does not use them as they were left: combine ``c`` of a lane uses slot ``j = c % 2`` and sequence
``COMBINE_SEQ_BASE + c + 1`` (the host path's combine sequence space, far above any dispatch
sequence):

- **respond** (server side): the handle's admitted entries (copied at its receive) are written
  into the entries of server workspace ``j`` at entry ``(client, j)``, re-stamped with that
  sequence and ``layer_id = j``, with their first step tokens and the handle's ``slot_of``;
  every other entry is idle. ``server_respond`` then answers each client in its response slot
  ``j``. Response slot ``j`` of a client is only ever written from workspace ``j``'s entry
  ``(client, j)``, so the cumulative arrival counter that entry keeps stays exact. (Its
  release of our request slot compares against this sequence and so leaves the request slot
  alone: a request slot is only ever overwritten by the next request, see above.)
- **reduce** (client side): client workspace ``j`` gets the handle's per-server row counts and
  this sequence for every server the dispatch sent to; ``client_combine`` waits (no reduce
  launch) and the weighted sum is torch on the device (``combine_from_answers``), from the
  handle's row map.

Nothing here reads the device from the host: the statuses of a combine are checked at the next
receive of its lane, where the host synchronises anyway.

:class:`DevicePath` is the CUDA half of one Buffer (stream order across calls, the dispatch
with its receive hook, the combine); its :class:`_Lane` per encoding holds the regions.
"""

from __future__ import annotations

import time

import torch

from moecomm import _C
from moecomm.compat.api import EventOverlap
from moecomm.compat.low_latency.cast import UE8M0_PACK
from moecomm.compat.low_latency.device_ops import (
    DeviceHandle,
    check_device_combine,
    check_device_cost,
    check_device_inputs,
    check_ue8m0_hidden,
    combine_from_answers,
    expand_dispatch,
    expand_quantized,
    expert_rows,
    input_device,
    part,
    scatter_receive,
    ue8m0_scales,
)
from moecomm.compat.low_latency.layout import (
    COMBINE_SEQ_BASE,
    MAX_TOKENS_PER_RANK,
    NUM_SLOTS,
    LLShape,
    check_same_shape,
    check_shape,
)
from moecomm.compat.rendezvous import exchange
from moecomm.errors import (
    DeadlineExceededError,
    MoecommError,
    PeerLostError,
    ProtocolError,
)
from moecomm.runtime.device_preload import preload_kernels
from moecomm.wire.cuda import arrival_timeout_ns, cuda_module, deadline_scale
from moecomm.wire.protocol import SCALE_BLOCK, SlotLayout

# The gather's payload wait: the one fact in moecomm.wire.cuda (ARRIVAL_TIMEOUT_NS, scaled).
# Host back-off between gather passes while requests are missing.
MAX_POLL_SLEEP_S = 200e-6
# EntryAction (dispatch_index.h) of the EntryState's first word.
_ACTION_SERVE, _ACTION_REJECT = 1, 2
_SEQ_MASK = (1 << 56) - 1
# torch.cuda, through one name: the CPU tests run this module's glue with stand-in kernels.
_cuda = torch.cuda

# EntryState (dispatch_index.h): int32 action, code, num_tokens, topk, layer_id, reserved; u64 seq.
ENTRY_WORDS = 8
ENTRY_LAYER_WORD = 4
ENTRY_SEQ_QWORD = 3  # the u64 seq as the 4th int64 of the 32-byte entry
# client_dispatch.cuh's kBusySeq (all ones: a server skipped because its slot was busy), as the
# int64 the workspace's u64 reads as.
BUSY_SEQ = -1

__all__ = [
    "CudaEvent",
    "DeviceHandle",
    "DevicePath",
    "combine_from_answers",
    "expand_dispatch",
    "expert_rows",
    "input_device",
    "scatter_receive",
]


# ---------------------------------------------------------------------------- selection
class DeviceEventHandle:
    """DeepEP's ``EventHandle`` on the CUDA path: a ``torch.cuda.Event`` recorded on the stream
    the call ran on, after its last launch; ``current_stream_wait()`` as DeepEP's."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.device = stream.device
        self.event = _cuda.Event()
        self.event.record(stream)

    def current_stream_wait(self) -> None:
        _cuda.current_stream(self.device).wait_event(self.event)


class CudaEvent(EventOverlap):
    """DeepEP's ``EventOverlap`` of a call on the CUDA path (``event`` is its
    :class:`DeviceEventHandle`)."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        super().__init__(DeviceEventHandle(stream))


class _DeviceMemory:
    """Raw device memory seen by torch (``__cuda_array_interface__``); keeps `owner` alive."""

    def __init__(self, ptr: int, nbytes: int, owner) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }
        self.owner = owner


def _bytes_view(ptr: int, nbytes: int, owner, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(_DeviceMemory(ptr, nbytes, owner), device=device)


def combine_seq(c: int) -> tuple[int, int]:
    """(response slot, sequence) of combine `c` of a lane."""
    return c % NUM_SLOTS, COMBINE_SEQ_BASE + c + 1


# ---------------------------------------------------------------------------- lanes
class _Lane:
    """One encoding's regions, peer table, configs and workspaces (see the module docstring)."""

    def __init__(self, path, shape: LLShape, use_fp8: bool, device: torch.device):
        # path: the DevicePath this lane belongs to
        k = path.k
        buf = path.buf
        r, nr = buf.rank, buf.num_ranks
        self.path, self.shape, self.use_fp8, self.device = path, shape, use_fp8, device
        self.num_local = shape.num_experts // nr
        m, kk, h = shape.num_max_dispatch_tokens_per_rank, shape.num_topk, shape.hidden
        self.max_tokens = m * kk + nr  # expanded rows of one dispatch, sinks included
        if self.max_tokens > MAX_TOKENS_PER_RANK:
            raise ValueError(f"num_max_dispatch_tokens_per_rank * num_topk too large: {m * kk}")
        enc = "fp8_e4m3_b128" if use_fp8 else "bf16"
        self.layout = SlotLayout(self.max_tokens, h, 1, enc, "bf16")
        cfg = self.layout.config
        self.req_ring = _C.SlotRing(cfg, NUM_SLOTS, True).region_bytes
        self.resp_ring = _C.SlotRing(cfg, NUM_SLOTS, False).region_bytes
        self.resp_slot_bytes = self.layout.response_slot_bytes
        self.resp_base = nr * self.req_ring
        total = self.resp_base + nr * self.resp_ring
        # Every kernel loaded before this rank exchanges its handle (its "ready"): a rank that
        # joins cold beside another's spinning wait (runtime/device_preload.py).
        preload_kernels(k, device.index)
        self.transport = k.IpcTransport(device.index)
        self.region = self.transport.create_region(total)  # zero-filled: idle slots
        stream = _cuda.current_stream(device)
        self.table = k.IpcPeerTable(self.transport, self.region, nr, [stream.cuda_stream])
        mine = {"shape": shape.describe(), "use_fp8": use_fp8, "handle": self.region.handle}
        prefix = f"{buf.store_prefix}/cuda/{enc}"
        infos = exchange(mine, r, nr, buf.group, buf.store, prefix, buf.timeout)
        self.peer_index: dict[int, int] = {}
        for p, info in enumerate(infos):
            if info["shape"] != mine["shape"] or info["use_fp8"] != use_fp8:
                raise ValueError(
                    f"rank {p} set up its CUDA lane with {info['shape']} (use_fp8="
                    f"{info['use_fp8']}), rank {r} with {mine['shape']} (use_fp8={use_fp8})"
                )
            if p == r:
                continue
            try:
                self.peer_index[p] = self.table.add_peer(info["handle"])
            except Exception as exc:
                raise MoecommError(
                    f"deep_ep.Buffer rank {r}: cannot map the region of rank {p} over CUDA IPC "
                    f"({exc}); the CUDA path needs every rank on this node, one process per rank"
                ) from exc
        i64 = dict(dtype=torch.int64, device=device)
        # The kernels' peer p is rank p; we are our own peer (CUDA cannot open its own handle,
        # so the table holds only the others and the base array is ours).
        table_base = _bytes_view(
            self.table.backend()["peer_base"], 8 * nr, self.table, device
        ).view(torch.int64)
        self.peer_base = torch.full((nr,), self.region.device_ptr, **i64)
        for p, idx in self.peer_index.items():
            self.peer_base[p] = table_base[idx]
        self.alive = torch.ones(nr, dtype=torch.int32, device=device)
        peers = k.IpcPeers()
        peers.local_base, peers.peer_base = self.region.device_ptr, self.peer_base.data_ptr()
        peers.alive, peers.max_peers = self.alive.data_ptr(), nr
        self.peers = peers
        self.region_bytes = _bytes_view(self.region.device_ptr, total, self.region, device)
        # Client: our request ring is ring r of every server's region; server q's answers land
        # in our response ring q.
        self.c_req_off = torch.full((nr,), r * self.req_ring, **i64)
        self.c_resp_off = torch.arange(nr, **i64) * self.resp_ring + self.resp_base
        cc = k.ClientConfig()
        cc.num_servers, cc.num_slots, cc.client_id = nr, NUM_SLOTS, r + 1
        self.ccfg = cc
        self.c_layout, self.c_ws = self._workspaces(
            cc, self.c_req_off, self.c_resp_off, k.client_workspace_layout
        )
        self.next_seq = torch.zeros(nr, **i64)
        e, lc = shape.num_experts, self.num_local
        self.expert_server = torch.cat([torch.arange(e) // lc, torch.arange(nr)]).to(
            device, torch.int32
        )
        self.expert_local = torch.cat([torch.arange(e) % lc, torch.full((nr,), lc)]).to(
            device, torch.int32
        )
        self.sink_ids = torch.arange(e, e + nr, **i64)
        if use_fp8:  # the cast rows, sent as they are (DispatchArgs.x_scales)
            self.x_exp = torch.zeros(self.max_tokens, h, dtype=torch.uint8, device=device)
            self.s_exp = torch.zeros(self.max_tokens, h // SCALE_BLOCK, device=device)
        else:
            self.x_exp = torch.zeros(self.max_tokens, h, dtype=torch.bfloat16, device=device)
        self.ids_exp = torch.full((self.max_tokens, 1), -1, **i64)
        # The score column carries the source token index (exact in f32 below 2^24): row
        # t*K + k of a dispatch with top-k K. One column per top-k used (the slots hold up to
        # the lane's top-k; a dispatch may use fewer), kept for the kernels reading them.
        self._w_exp: dict[int, torch.Tensor] = {}
        self.w_exp = self.token_column(kk)
        # Server: client c's requests in our request ring c; our answers go to ring r of c's.
        self.s_clients = torch.arange(nr, **i64) + 1
        self.s_req_off = torch.arange(nr, **i64) * self.req_ring
        self.s_resp_off = torch.full((nr,), self.resp_base + r * self.resp_ring, **i64)
        sc = k.ServerConfig()
        sc.num_clients, sc.num_slots, sc.num_experts = nr, NUM_SLOTS, lc + 1
        sc.max_step_tokens = nr * self.max_tokens
        sc.client_ids = self.s_clients.data_ptr()
        self.scfg = sc
        self.s_layout, self.s_ws = self._workspaces(
            sc, self.s_req_off, self.s_resp_off, k.server_workspace_layout
        )
        self.layer_hosted = torch.ones(NUM_SLOTS, dtype=torch.uint8, device=device)
        rows = nr * m
        self.max_rows = int(self.s_layout["max_rows"])
        self.expert_out = torch.empty(self.max_rows, h, dtype=torch.bfloat16, device=device)
        if use_fp8:
            self.data_store = [
                torch.empty(lc + 1, rows, h, dtype=torch.uint8, device=device)
                for _ in range(NUM_SLOTS)
            ]
            self.scale_store = [
                torch.empty(lc + 1, h // SCALE_BLOCK, rows, device=device) for _ in range(NUM_SLOTS)
            ]
        else:
            self.data_store = [
                torch.empty(lc + 1, rows, h, dtype=torch.bfloat16, device=device)
                for _ in range(NUM_SLOTS)
            ]
            self.scale_store = [None] * NUM_SLOTS
        self.ue8m0_store: list[torch.Tensor | None] = [None] * NUM_SLOTS  # made at first use
        self.count = 0  # dispatches of this lane
        self.num_combines = 0  # combines of this lane: their own sequence space
        self.pending_status: list[tuple[int, torch.Tensor]] = []

    def token_column(self, num_topk: int) -> torch.Tensor:
        """[max_tokens, 1] f32: the source token index of each expanded row at this top-k."""
        col = self._w_exp.get(num_topk)
        if col is None:
            rows = torch.arange(self.max_tokens, dtype=torch.int64, device=self.device)
            col = self._w_exp[num_topk] = (rows // num_topk).float().view(-1, 1)
        return col

    def _workspaces(self, c, req_off: torch.Tensor, resp_off: torch.Tensor, workspace_layout):
        """Completes a client or server config `c` (the slot fields of this lane's layout and
        its ring offsets, tensors the caller keeps) and returns ``(workspace_layout(c), one
        zeroed workspace of that layout per slot)``."""
        lay = self.layout
        c.max_tokens, c.hidden, c.topk = lay.max_tokens, lay.hidden, lay.topk
        c.encoding, c.out_encoding = int(lay.encoding), int(lay.out_encoding)
        c.request_ring_offset = req_off.data_ptr()
        c.response_ring_offset = resp_off.data_ptr()
        layout = workspace_layout(c)
        zeroed = [
            torch.zeros(layout["total"], dtype=torch.uint8, device=self.device)
            for _ in range(NUM_SLOTS)
        ]
        return layout, zeroed

    def recv_tensors(self, slot: int, use_ue8m0: bool = False):
        lc = self.num_local
        if not self.use_fp8:
            return self.data_store[slot][:lc]
        data = self.data_store[slot][:lc].view(torch.float8_e4m3fn)
        if not use_ue8m0:
            return data, self.scale_store[slot][:lc].transpose(1, 2)
        if self.ue8m0_store[slot] is None:
            s, rows = self.shape, self.data_store[slot].shape[1]
            n = s.hidden // (SCALE_BLOCK * UE8M0_PACK)
            self.ue8m0_store[slot] = torch.zeros(lc, n, rows, dtype=torch.int32, device=self.device)
        return data, self.ue8m0_store[slot].transpose(1, 2)

    # -------------------------------------------------------------- dispatch: sends
    def send(self, x, topk_idx, round_scale: bool, handle: DeviceHandle, stream) -> None:
        """Launches the dispatch into slot ``count % 2`` and copies the route's per-server
        results into `handle` (the slot's client workspace is rewritten two dispatches later)."""
        slot = self.count % NUM_SLOTS
        nr, kk = self.path.buf.num_ranks, topk_idx.shape[1]
        k = self.path.k
        a = k.DispatchArgs()
        if self.use_fp8:
            n = expand_dispatch(x, topk_idx, None, self.ids_exp, self.sink_ids)
            expand_quantized(x, kk, round_scale, self.x_exp, self.s_exp, nr)
            a.x, a.x_dtype = self.x_exp.data_ptr(), int(_C.Encoding.FP8_E4M3_B128)
            a.x_scales = self.s_exp.data_ptr()
        else:
            n = expand_dispatch(x, topk_idx, self.x_exp, self.ids_exp, self.sink_ids)
            a.x, a.x_dtype = self.x_exp.data_ptr(), int(_C.Encoding.BF16)
        a.x_row_stride = x.shape[1]
        a.topk_ids, a.ids_int64 = self.ids_exp.data_ptr(), True
        a.topk_weights, a.weights_dtype = self.token_column(kk).data_ptr(), int(_C.Encoding.F32)
        a.num_tokens, a.topk = n, 1
        a.expert_server = self.expert_server.data_ptr()
        a.expert_local = self.expert_local.data_ptr()
        a.num_experts, a.layer_id, a.slot = self.expert_server.shape[0], slot, slot
        a.next_seq, a.workspace = self.next_seq.data_ptr(), self.c_ws[slot].data_ptr()
        k.client_dispatch(self.peers, self.ccfg, a, stream.cuda_stream)
        ws, lay = self.c_ws[slot], self.c_layout
        handle.sent_seq = part(ws, lay, "sent_seq", torch.int64, nr).clone()
        handle.count = part(ws, lay, "count", torch.int32, nr).clone()
        handle.rows_at = part(ws, lay, "pos", torch.int32, self.max_tokens * nr).view(-1, nr)
        handle.rows_at = handle.rows_at.clone()
        handle.slot, handle.index_in_lane = slot, self.count
        self.count += 1

    # -------------------------------------------------------------- dispatch: receive
    def gather_all(self, slot: int, seq: int, cost, stream) -> None:
        """Re-launches the gather of `slot` until every rank's request `seq` is admitted. A
        request of an older sequence (a dispatch two earlier, never answered), even one the
        gather rejected (its header already being overwritten by ours), is not arrived yet.
        `cost` (int64 [R] or None): ns from the start until each rank's request was seen."""
        k, buf = self.path.k, self.path.buf
        nr = buf.num_ranks
        ga = k.ServerGatherArgs()
        ga.layer_id, ga.layer_hosted, ga.num_layers = slot, self.layer_hosted.data_ptr(), NUM_SLOTS
        ga.arrival_timeout_ns, ga.block_m = arrival_timeout_ns(), 1
        ga.workspace = self.s_ws[slot].data_ptr()
        entries = part(
            self.s_ws[slot], self.s_layout, "entries", torch.int32, nr * NUM_SLOTS * ENTRY_WORDS
        ).view(nr, NUM_SLOTS, ENTRY_WORDS)[:, slot]
        t0 = time.monotonic_ns()
        seen: list[int | None] = [None] * nr
        deadline = time.monotonic() + buf.timeout
        sleep = 0.0
        while True:
            k.server_gather(self.peers, self.scfg, ga, stream.cuda_stream)
            got = entries.cpu()  # the receive's host synchronisation
            self.check_statuses()
            now = time.monotonic_ns()
            missing = []
            for p in range(nr):
                action, code, layer = (int(v) for v in got[p, [0, 1, 4]])
                got_seq = (int(got[p, 6]) & 0xFFFFFFFF) | (int(got[p, 7]) << 32)
                ours = got_seq & _SEQ_MASK == seq
                if action == _ACTION_REJECT and ours:
                    raise ProtocolError(
                        f"deep_ep.Buffer rank {buf.rank}: the request of rank {p} in slot {slot}"
                        f" was rejected by the gather (code {code})"
                    )
                if action != _ACTION_SERVE or layer != slot or not ours:
                    missing.append(p)
                elif seen[p] is None:
                    seen[p] = now - t0
            if not missing:
                if cost is not None:
                    cost.add_(torch.tensor(seen, dtype=torch.int64).to(cost.device))
                return
            for p in missing:
                idx = self.peer_index.get(p)
                if idx is not None and not self.transport.peer_alive(self.table.peer_region(idx)):
                    raise PeerLostError(
                        f"deep_ep.Buffer rank {buf.rank}: waiting for the dispatch request of "
                        f"rank {p}: the process of rank {p} is gone"
                    )
            if time.monotonic() > deadline:
                raise DeadlineExceededError(
                    f"deep_ep.Buffer rank {buf.rank}: waiting for the dispatch request of rank "
                    f"{missing[0]} (missing: ranks {missing}) timed out after {buf.timeout:.1f} s"
                )
            time.sleep(sleep)
            sleep = min(MAX_POLL_SLEEP_S, sleep * 2 or 10e-6)

    def receive(self, handle: DeviceHandle, recv_x, recv_count, stats, cost, use_ue8m0, stream):
        slot = handle.slot
        self.gather_all(slot, handle.index_in_lane + 1, cost, stream)
        ws, lay = self.s_ws[slot], self.s_layout
        nr, lc, mr = self.path.buf.num_ranks, self.num_local, self.max_rows
        h = self.shape.hidden
        step = int(self.scfg.max_step_tokens)
        rows = ws[lay["rows"] : lay["rows"] + mr * lay["row_bytes"]].view(mr, lay["row_bytes"])
        if not self.use_fp8:
            rows = rows.view(torch.bfloat16)
        scales = None
        if self.use_fp8:
            spt = h // SCALE_BLOCK
            scales = part(ws, lay, "scales", torch.float32, step * spt).view(step, spt)
        got = scatter_receive(
            part(ws, lay, "counts", torch.int32, lc + 1),
            part(ws, lay, "offsets", torch.int64, lc + 2),
            part(ws, lay, "src_batch", torch.int32, mr),
            part(ws, lay, "src_token", torch.int64, mr),
            part(ws, lay, "row_scores", torch.float32, mr),
            rows,
            scales,
            self.data_store[slot],
            self.scale_store[slot],
            nr,
            NUM_SLOTS,
        )
        if use_ue8m0:
            ue8m0_scales(self.scale_store[slot][:lc], self.ue8m0_store[slot])
        handle[0].copy_(got.src_info)
        handle[1].copy_(got.layout_range)
        recv_count.copy_(got.recv_count)
        if stats is not None:
            stats.add_(got.recv_count)
        handle.expert, handle.pos, handle.valid = got.expert, got.pos, got.valid
        # What the combine's respond needs of this gather, kept: the next gather of the slot
        # (dispatch i + 2) rewrites the workspace.
        ent = part(ws, lay, "entries", torch.int32, nr * NUM_SLOTS * ENTRY_WORDS)
        handle.entries = ent.view(nr, NUM_SLOTS, ENTRY_WORDS)[:, slot].clone()
        first = part(ws, lay, "batch_offsets", torch.int64, nr * NUM_SLOTS + 1)
        handle.first = first[: nr * NUM_SLOTS].view(nr, NUM_SLOTS)[:, slot].clone()
        handle.slot_of = part(ws, lay, "slot_of", torch.int64, mr).clone()
        handle.received = True

    def close(self) -> None:
        _cuda.synchronize(self.device)
        self.table = None
        self.region_bytes = None

    # -------------------------------------------------------------- combine

    def respond(self, y: torch.Tensor, handle: DeviceHandle, stream) -> tuple[int, int]:
        """Answers every client with `y`'s rows of `handle`; returns the (slot, seq) used."""
        k, nr = self.path.k, self.path.buf.num_ranks
        slot, seq = combine_seq(self.num_combines)
        self.num_combines += 1
        ws, lay = self.s_ws[slot], self.s_layout
        entries = part(ws, lay, "entries", torch.int32, nr * NUM_SLOTS * ENTRY_WORDS)
        entries = entries.view(nr, NUM_SLOTS, ENTRY_WORDS)
        entries.zero_()  # idle: respond skips them
        mine = entries[:, slot]
        mine.copy_(handle.entries)
        mine[:, ENTRY_LAYER_WORD] = slot
        mine.view(torch.int64)[:, ENTRY_SEQ_QWORD] = seq
        first = part(ws, lay, "batch_offsets", torch.int64, nr * NUM_SLOTS + 1)
        first[: nr * NUM_SLOTS].view(nr, NUM_SLOTS)[:, slot].copy_(handle.first)
        part(ws, lay, "slot_of", torch.int64, self.max_rows).copy_(handle.slot_of)
        expert_rows(y, handle.expert, handle.pos, handle.valid, self.expert_out)
        ra = k.ServerRespondArgs()
        ra.expert_out, ra.expert_out_dtype = self.expert_out.data_ptr(), int(_C.Encoding.BF16)
        ra.workspace = ws.data_ptr()
        k.server_respond(self.peers, self.scfg, ra, stream.cuda_stream)
        return slot, seq

    def reduce(
        self, handle: DeviceHandle, slot: int, seq: int, topk_idx, weights, out, use_logfmt, stream
    ) -> None:
        """Waits for the answers of combine (slot, seq) and sums them into `out`."""
        k, buf = self.path.k, self.path.buf
        nr = buf.num_ranks
        ws, lay = self.c_ws[slot], self.c_layout
        # Servers the dispatch sent nothing to (0, or the kernels' busy mark) stay so; every
        # other one is waited for with this combine's sequence.
        sent = handle.sent_seq
        was_sent = (sent != 0) & (sent != BUSY_SEQ)
        part(ws, lay, "sent_seq", torch.int64, nr).copy_(torch.where(was_sent, seq, sent))
        part(ws, lay, "count", torch.int32, nr).copy_(handle.count)
        ca = k.CombineArgs()
        ca.num_tokens, ca.layer_id, ca.slot = 0, slot, slot  # wait only: we reduce below
        ca.workspace, ca.out, ca.out_dtype = ws.data_ptr(), 0, int(_C.Encoding.BF16)
        # Scaled like every device deadline (a sanitizer or debugger slows the server down).
        ca.timeout_ns = int(buf.timeout * 1e9 * deadline_scale())
        k.client_combine(self.peers, self.ccfg, ca, stream.cuda_stream)
        h = self.shape.hidden
        start = self.resp_base + _C.slot_offset(self.resp_slot_bytes, slot) + _C.PAYLOAD_OFFSET
        answers = torch.as_strided(
            self.region_bytes.view(torch.bfloat16),
            (nr, self.max_tokens, h),
            (self.resp_ring // 2, h, 1),
            start // 2,
        )
        combine_from_answers(
            answers, handle.rows_at, topk_idx, weights, self.num_local, out, use_logfmt
        )
        status = part(ws, lay, "status", torch.int32, nr)
        self.pending_status.append((handle.index, status.clone()))

    def check_statuses(self) -> None:
        """Raises for a combine whose wait failed (read where the host synchronised anyway)."""
        pending, self.pending_status = self.pending_status, []
        names = {v: n for n, v in self.path.k.SERVER_STATUS.items()}
        errors = {"PEER_LOST": PeerLostError, "TIMEOUT": DeadlineExceededError}
        errors["PAYLOAD_TIMEOUT"] = DeadlineExceededError
        for index, status in pending:
            for q, code in enumerate(status.tolist()):
                name = names.get(code, str(code))
                if name not in ("OK", "NOT_SENT"):
                    raise errors.get(name, ProtocolError)(
                        f"deep_ep.Buffer rank {self.path.buf.rank}: a combine of dispatch "
                        f"{index} got no valid answer from rank {q} ({name}); its output was "
                        "wrong"
                    )


# ---------------------------------------------------------------------------- the path
class DevicePath:
    """The CUDA half of one deep_ep.Buffer."""

    def __init__(self, buf, kernels=None) -> None:
        try:
            self.k = kernels or cuda_module()
        except MoecommError as exc:
            raise type(exc)(
                f"deep_ep.Buffer got CUDA tensors, but its CUDA path cannot run: {exc}"
            ) from exc
        self.buf = buf
        self.lanes: dict[bool, _Lane] = {}
        self.device: torch.device | None = None
        self.last_event = None
        self.last_stream = None
        self.num_dispatches = 0
        self.combine_buffers: dict[tuple[bool, int], torch.Tensor] = {}

    def _stream(self, device: torch.device):
        if self.device is None:
            self.device = device
        elif device != self.device:
            raise ValueError(f"this deep_ep.Buffer runs on {self.device}, got {device}")
        stream = _cuda.current_stream(device)
        if self.last_event is not None and stream != self.last_stream:
            stream.wait_event(self.last_event)  # keep the calls in order across streams
        return stream

    def _done(self, stream) -> CudaEvent:
        ev = CudaEvent(stream)
        self.last_event, self.last_stream = ev.event.event, stream
        return ev

    def dispatch(
        self, x, topk_idx, num_max, num_experts, stats, cost, flags, return_recv_hook, device
    ):
        """`flags`: (use_fp8, round_scale, use_ue8m0) as given to low_latency_dispatch."""
        buf = self.buf
        use_fp8, round_scale, use_ue8m0 = flags
        check_device_inputs(x, topk_idx, num_max, num_experts, use_fp8)
        check_ue8m0_hidden(use_ue8m0, x.shape[1])  # as the host path checks it
        use_ue8m0 = use_ue8m0 and use_fp8  # bf16 rows have no scales (DeepEP ignores it)
        shape = LLShape(num_max, x.shape[1], num_experts, topk_idx.shape[1])
        if buf.shape is None:
            buf.shape = check_shape(shape, buf.num_ranks)
        else:
            check_same_shape(buf.shape, shape)
            if shape.num_topk > buf.shape.num_topk:
                raise NotImplementedError(
                    f"low_latency_dispatch on CUDA tensors with num_topk={shape.num_topk}: this "
                    f"Buffer's CUDA slots were sized at its first dispatch for top-k up to "
                    f"{buf.shape.num_topk}, and the CUDA path does not re-size them (the host "
                    f"path does). Give the largest top-k at construction (Buffer(..., "
                    f"num_topk=...) with the other shape keywords)"
                )
            shape = buf.shape  # the lane is sized for the buffer's top-k; this call uses fewer
        num_local = num_experts // buf.num_ranks
        if stats is not None and (
            stats.dtype != torch.int32
            or tuple(stats.shape) != (num_local,)
            or stats.device != device
        ):
            raise ValueError(
                f"cumulative_local_expert_recv_stats must be int32 [{num_local}] on the device, "
                f"got {stats.dtype} {list(stats.shape)} on {stats.device}"
            )
        check_device_cost("dispatch_wait_recv_cost_stats", cost, buf.num_ranks, device)
        stream = self._stream(device)
        with _cuda.device(device), _cuda.stream(stream):
            lane = self.lanes.get(use_fp8)
            if lane is None:
                lane = self.lanes[use_fp8] = _Lane(self, shape, use_fp8, device)
            rows = buf.num_ranks * num_max
            handle = DeviceHandle(
                torch.full((num_local, rows), -1, dtype=torch.int32, device=device),
                torch.zeros(num_local, buf.num_ranks, dtype=torch.int64, device=device),
                num_max,
                x.shape[1],
                num_experts,
            )
            handle.owner, handle.index = id(buf), self.num_dispatches
            # The reduce reads the ids the kernels routed, whatever the caller does with theirs.
            handle.topk_idx, handle.lane = topk_idx.clone(), lane
            # Whatever became of the dispatch two earlier (combined or not), its slot is reused,
            # as DeepEP's buffers are: its handle keeps what its combine needs.
            lane.send(x, topk_idx, round_scale, handle, stream)
            self.num_dispatches += 1
            recv_x = lane.recv_tensors(handle.slot, use_ue8m0)
            recv_count = torch.zeros(num_local, dtype=torch.int32, device=device)
            event = self._done(stream)

        def hook() -> None:
            if handle.received:
                return
            buf._check_open()
            s = self._stream(device)
            with _cuda.device(device), _cuda.stream(s):
                lane.receive(handle, recv_x, recv_count, stats, cost, use_ue8m0, s)
                self._done(s)

        if return_recv_hook:
            return recv_x, recv_count, handle, event, hook
        hook()
        return recv_x, recv_count, handle, self._done(stream), None

    def combine_buffer(self, handle: DeviceHandle) -> torch.Tensor:
        """The bf16 [L, R*M, H] device tensor the next zero_copy combine of `handle`'s lane
        reads (one per response slot: reused two combines of the lane later)."""
        lane, s = handle.lane, self.buf.shape
        key = (lane.use_fp8, lane.num_combines % NUM_SLOTS)
        got = self.combine_buffers.get(key)
        if got is None:
            want = (lane.num_local, self.buf.num_ranks * s.num_max_dispatch_tokens_per_rank)
            with _cuda.device(lane.device):
                got = torch.zeros(*want, s.hidden, dtype=torch.bfloat16, device=lane.device)
            self.combine_buffers[key] = got
        return got

    def combine(self, x, topk_idx, topk_weights, handle, flags, return_recv_hook, out):
        """`flags`: (use_logfmt, zero_copy) as given to low_latency_combine."""
        buf = self.buf
        use_logfmt, zero_copy = flags
        if not handle.received:
            raise RuntimeError("call the dispatch's receive hook before combining it")
        lane = handle.lane
        s = buf.shape
        want = (s.num_experts // buf.num_ranks, buf.num_ranks * s.num_max_dispatch_tokens_per_rank)
        check_device_combine(x, topk_idx, topk_weights, out, handle, (*want, s.hidden))
        if zero_copy:
            x = self.combine_buffer(handle)
        device = x.device
        stream = self._stream(device)
        t = topk_idx.shape[0]
        with _cuda.device(device), _cuda.stream(stream):
            combined = (
                out
                if out is not None
                else torch.empty(t, s.hidden, dtype=torch.bfloat16, device=device)
            )
            slot, seq = lane.respond(x, handle, stream)
            # The host path's rule: a copy the combine's topk_idx no longer selects (-1 now)
            # is left out; the others are read where the dispatch routed them.
            idx = torch.where(topk_idx >= 0, handle.topk_idx, -1)
            weights = topk_weights.clone() if return_recv_hook else topk_weights
            event = self._done(stream)
        done = []

        def hook() -> None:
            if done:
                return
            buf._check_open()
            st = self._stream(device)
            with _cuda.device(device), _cuda.stream(st):
                lane.reduce(handle, slot, seq, idx, weights, combined, use_logfmt, st)
                self._done(st)
            done.append(True)

        if return_recv_hook:
            return combined, event, hook
        hook()
        return combined, self._done(stream), None

    def destroy(self) -> None:
        for lane in self.lanes.values():
            lane.close()
        self.lanes.clear()
