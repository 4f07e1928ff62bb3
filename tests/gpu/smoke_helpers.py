"""The pure-torch half of the loopback smoke test (test_smoke_loopback.py): its inputs, the host
path's expectations, the launch plumbing of one loopback step, the views of what the device
left behind, and the comparison. Everything here runs on the host too: test_smoke_helpers.py
checks the expectations against independent computations, a perfect device emulated from them
against the comparison, the expert-MLP glue under the Triton interpreter, and, on a machine with
no device, that every launcher accepts the step's arguments (it fails only at the launch).

The loopback: one process, one CUDA-IPC region that holds the request ring (the server's
memory) and the response ring (the client's memory), and a peer table whose one peer is that
region itself. CUDA cannot open a process's own IPC handle, so the table is not an
``IpcPeerTable`` (which maps peers by handle and refuses our own): the kernels' ``IpcPeers`` is
built by hand, ``peer_base[0] = local_base = region.device_ptr`` and ``alive[0] = 1`` — what
the DeepEP adapter does for its own rank (compat/_ll_device.py). Client and server are then
each other's peer 0: client_dispatch puts the request into the region, server_gather reads it
there, the grouped expert MLP of the GPU server (Triton) runs on the gathered rows,
server_respond puts the answer into the same region, client_combine reads it.

What is compared, against the host path (moecomm.ops on the CPU):
- bit for bit where data only moves: the request payload (activations or fp8 bytes and their
  per-128 scales, local ids, scores) in the client's staging and in the request slot; the
  gathered batch; the per-expert layout (counts, offsets, src_*, row scores, slot_of) and its
  rows; the signal words; the response payload, against the per-token sums (f32, k order) of
  the expert outputs the device computed; y, against the client combine of that response;
- within the documented tolerance (tests/ops/test_triton_grouped_fp8.py, bf16 weights) where
  values are reduced by the GEMMs: the expert outputs against the float32 reference on the
  dequantized rows, and y against the float32 reference of the whole layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from moecomm import _C
from moecomm.ops.combine import combine
from moecomm.ops.dispatch import ExpertMap, ServerBatch, pack_dispatch
from moecomm.ops.grouped_gemm import DEFAULT_BLOCK_M, grouped_mlp_contiguous_reference
from moecomm.ops.quant import QUANTIZED_ENCODINGS, dequantize, quantize, scales_per_token
from moecomm.ops.reorg import ExpertLayout, combine_rows_reference, reorganize
from moecomm.wire.protocol import ENCODING_DTYPE, PAYLOAD_OFFSET, SCALE_BLOCK, SlotLayout

Encoding = _C.Encoding

CLIENT_ID = 0x5EED_C0DE
LAYER = 3
NUM_SLOTS = 2
SLOT = 0
# The response ring starts at this alignment after the request ring in the one region.
RING_ALIGN = 4096
# EntryState (dispatch_index.h): 8 int32: action, code, num_tokens, topk, layer_id, reserved,
# then the u64 seq.
ENTRY_WORDS = 8
ACTION_NONE, ACTION_SERVE = 0, 1
OUT_ENCODING = Encoding.BF16
OUT_DTYPE = torch.bfloat16
# Expert outputs (bf16 weights, Triton) against the float32 reference on the dequantized rows:
# rtol, and atol relative to the largest |reference| (tests/ops/test_triton_grouped_fp8.py,
# TOL[torch.bfloat16], documented in docs/ops-expert-compute.md).
MLP_RTOL, MLP_ATOL_REL = 4e-2, 8e-3
# Seconds; every deadline the test passes is multiplied by moecomm.wire.cuda.deadline_scale().
COMBINE_TIMEOUT_S = 10.0
ARRIVAL_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    topk: int
    hidden: int
    num_experts: int
    inter: int
    encoding: Encoding
    # fp8 only: the caller casts (DispatchArgs.x_scales, the kernel copies bytes and scales)
    # instead of the pack kernel quantizing bf16 rows.
    prequantized: bool = False
    seed: int = 0

    @property
    def quantized(self) -> bool:
        return self.encoding in QUANTIZED_ENCODINGS

    @property
    def max_step_tokens(self) -> int:
        return self.tokens * NUM_SLOTS  # DeviceExpertServer's default for one client


# The model every case shares (one set of weights, so Triton compiles its kernels once).
HIDDEN, NUM_EXPERTS, INTER = 7168, 16, 128
CASES = {
    c.name: c
    for c in (
        Case("one_token_top1_bf16", 1, 1, HIDDEN, NUM_EXPERTS, INTER, Encoding.BF16, seed=1),
        Case("deepep_fp8_kernel_cast", 128, 8, HIDDEN, NUM_EXPERTS, INTER,
             Encoding.FP8_E4M3_B128, seed=2),
        Case("deepep_fp8_caller_cast", 128, 8, HIDDEN, NUM_EXPERTS, INTER,
             Encoding.FP8_E4M3_B128, prequantized=True, seed=3),
    )
}  # fmt: skip


# ---------------------------------------------------------------------------- inputs
def make_inputs(case: Case):
    """x [T, H] bf16 whose 128-channel blocks span 1/8..8 (so per-block scales differ), one
    all-zero block (token 1: scale 1, zero bytes); ids [T, K] int64, K distinct experts per
    token, about 10% -1, token 5 routed nowhere (not sent: combine gives 0); w [T, K] f32."""
    g = torch.Generator().manual_seed(case.seed)
    t, h, k, e = case.tokens, case.hidden, case.topk, case.num_experts
    blocks = -(-h // SCALE_BLOCK)
    mag = 2.0 ** ((torch.arange(blocks) % 7) - 3).float()
    x = torch.randn(t, blocks * SCALE_BLOCK, generator=g).view(t, blocks, SCALE_BLOCK)
    x = (x * mag[None, :, None]).reshape(t, -1)[:, :h].contiguous()
    if t > 1 and h > SCALE_BLOCK:
        x[1, SCALE_BLOCK : 2 * SCALE_BLOCK] = 0
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int64)
    if t > 1:
        ids = ids.masked_fill(torch.rand(t, k, generator=g) < 0.1, -1)
    if t > 5:
        ids[5] = -1
    w = torch.rand(t, k, generator=g) + 0.05
    return x.to(torch.bfloat16), ids, w


def make_weights(case: Case, seed: int = 7):
    """w13 [E, 2I, H], w2 [E, H, I] in bf16 (the GPU server's dtype), on the host."""
    g = torch.Generator().manual_seed(seed)
    e, h, i = case.num_experts, case.hidden, case.inter
    w13 = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, generator=g) * i**-0.5
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


def expert_map(num_experts: int) -> ExpertMap:
    """Every expert on server 0 (the loopback), local index = logical id."""
    return ExpertMap([[(0, e)] for e in range(num_experts)], num_servers=1)


# ---------------------------------------------------------------------------- host path
def as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def request_payload(batch: ServerBatch, hidden: int, topk: int, enc: Encoding) -> bytes:
    """The request payload of `batch` as csrc/protocol/layout.h lays it out (padding zero)."""
    lay = _C.request_payload_layout(batch.num_tokens, hidden, topk, enc)
    buf = bytearray(lay["total"])
    parts = [("act", batch.activations), ("scale", batch.scales), ("ids", batch.expert_ids),
             ("scores", batch.scores)]  # fmt: skip
    for name, t in parts:
        if t is None:
            continue
        raw = as_bytes(t)
        assert len(raw) == lay[f"{name}_bytes"], (name, len(raw), lay)
        buf[lay[f"{name}_offset"] : lay[f"{name}_offset"] + len(raw)] = raw
    return bytes(buf)


def rows_in_layout(wire: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """The wire rows of one batch in the per-expert layout (bytes moved, any dtype)."""
    return wire.view(torch.uint8).index_select(0, layout.src_token).view(wire.dtype)


@dataclass
class HostStep:
    batch: ServerBatch  # the request the client packs for server 0
    payload: bytes  # its slot payload
    layout: ExpertLayout  # the server's per-expert layout of it
    rows: torch.Tensor  # [N, H] wire rows in layout order
    mlp_ref: torch.Tensor  # [N, H] f32: score * expert MLP of each row (dequantized)
    y_ref: torch.Tensor  # [T, H] f32: the whole layer, Σ_k w·MLP_k(x), in f32


def host_step(case: Case, x, ids, w, w13, w2) -> HostStep:
    """The host path of the step (moecomm.ops on the CPU): pack_dispatch for the one server,
    reorganize, the float32 reference MLP on the dequantized rows, the per-token sums
    (combine_rows_reference) and the client combine."""
    batches = pack_dispatch(x, ids, w, expert_map(case.num_experts), encoding=case.encoding)
    assert len(batches) == 1 and batches[0].server == 0, "every case sends to server 0"
    b = batches[0]
    payload = request_payload(b, case.hidden, case.topk, case.encoding)
    layout = reorganize([b.expert_ids], [b.scores], case.num_experts)
    rows = rows_in_layout(b.activations, layout)
    if case.quantized:
        x_deq = dequantize(b.activations, b.scales, case.encoding, dtype=torch.float32)
    else:
        x_deq = b.activations.float()
    mlp_ref = grouped_mlp_contiguous_reference(
        x_deq.index_select(0, layout.src_token), layout.offsets, w13.float(), w2.float(),
        layout.scores,
    )  # fmt: skip
    partial = combine_rows_reference(mlp_ref, layout)[0]
    y_ref = combine([partial], [b.token_index], case.tokens, hidden=case.hidden,
                    dtype=torch.float32)  # fmt: skip
    return HostStep(b, payload, layout, rows, mlp_ref, y_ref)


def expected_response(expert_out: torch.Tensor, slot_of: torch.Tensor) -> torch.Tensor:
    """server_respond's rows: per token, Σ_k expert_out[slot_of[t, k]] in f32, k ascending,
    skipping -1, one rounding to the response encoding (bf16)."""
    n, k = slot_of.shape
    acc = torch.zeros(n, expert_out.shape[1], dtype=torch.float32)
    for j in range(k):
        s = slot_of[:, j]
        here = s >= 0
        acc[here] = acc[here] + expert_out.index_select(0, s[here]).float()
    return acc.to(OUT_DTYPE)


def expected_y(response: torch.Tensor, token_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """client_combine with one server: its response rows at their tokens (f32, cast), 0 for a
    token sent nowhere: moecomm.ops.combine."""
    return combine([response], [token_index], num_tokens, hidden=response.shape[1],
                   dtype=OUT_DTYPE)  # fmt: skip


def close_problems(what: str, got: torch.Tensor, want: torch.Tensor) -> list[str]:
    """[] when |got - want| <= atol + rtol·|want| everywhere (MLP_RTOL, MLP_ATOL_REL · max
    |want|), else one line saying how far off and where."""
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        return [f"{what}: shape {list(got.shape)}, expected {list(want.shape)}"]
    if not want.numel():
        return []
    atol = MLP_ATOL_REL * max(1.0, float(want.abs().max()))
    err = (got - want).abs()
    bad = ~(err <= atol + MLP_RTOL * want.abs())  # NaN counts as bad
    if not bool(bad.any()):
        return []
    first = tuple(int(i) for i in bad.nonzero()[0])
    return [
        f"{what}: {int(bad.sum())} of {bad.numel()} values outside rtol {MLP_RTOL}, atol {atol:.3g}"
        f" (max error {float(err.nan_to_num(float('inf')).max()):.4g}; first at {first}: got "
        f"{float(got[first]):.6g}, expected {float(want[first]):.6g})"
    ]


def equal_problems(what: str, got, want) -> list[str]:
    """[] when bit-identical (tensors: same shape and bytes; bytes), else where they differ."""
    if isinstance(want, torch.Tensor):
        if tuple(got.shape) != tuple(want.shape):
            return [f"{what}: shape {list(got.shape)}, expected {list(want.shape)}"]
        got_b, want_b, shape = as_bytes(got), as_bytes(want), tuple(want.shape)
    else:
        got_b, want_b, shape = bytes(got), bytes(want), None
    if got_b == want_b:
        return []
    if len(got_b) != len(want_b):
        return [f"{what}: {len(got_b)} bytes, expected {len(want_b)}"]
    diff = np.flatnonzero(np.frombuffer(got_b, np.uint8) != np.frombuffer(want_b, np.uint8))
    where = f"byte {int(diff[0])}"
    if shape is not None and len(shape) >= 1 and want.numel():
        row_bytes = len(want_b) // shape[0] if shape[0] else 1
        where += f" (row {diff[0] // row_bytes})"
    return [f"{what}: {len(diff)} of {len(want_b)} bytes differ, first at {where}"]


# ---------------------------------------------------------------------------- the region
@dataclass(frozen=True)
class RingPlan:
    layout: SlotLayout
    request_ring: int  # bytes of the request ring (the server's), at offset 0
    response_ring: int  # bytes of the response ring (the client's)
    response_offset: int  # where it starts in the region
    region_bytes: int

    def request_slot(self, slot: int) -> int:
        return _C.slot_offset(self.layout.request_slot_bytes, slot)

    def response_slot(self, slot: int) -> int:
        return self.response_offset + _C.slot_offset(self.layout.response_slot_bytes, slot)


def ring_plan(case: Case) -> RingPlan:
    layout = SlotLayout(case.tokens, case.hidden, case.topk, case.encoding, OUT_ENCODING)
    req = _C.SlotRing(layout.config, NUM_SLOTS, True).region_bytes
    resp = _C.SlotRing(layout.config, NUM_SLOTS, False).region_bytes
    off = -(-req // RING_ALIGN) * RING_ALIGN
    return RingPlan(layout, req, resp, off, off + resp)


def part(ws: torch.Tensor, layout: dict, name: str, dtype: torch.dtype, count: int):
    """`count` elements of `dtype` at the workspace part `name` (a byte offset of `layout`)."""
    start = layout[name]
    size = torch.empty((), dtype=dtype).element_size() * count
    return ws[start : start + size].view(dtype)


def signal_word(region: bytes, offset: int) -> int:
    return int.from_bytes(region[offset : offset + 8], "little")


# ---------------------------------------------------------------------------- the step
class LoopbackStep:
    """The configurations, argument structs and workspaces of one loopback step, on `device`,
    over the region at `region_base` (a device address). On the host (device "cpu", a host
    buffer as the region) the same objects are built and every launcher checks them, then fails
    at its first CUDA call (test_smoke_helpers.py)."""

    def __init__(self, k, case: Case, device, region_base: int):
        self.k, self.case, self.device = k, case, torch.device(device)
        self.plan = plan = ring_plan(case)
        dev, lay = self.device, plan.layout
        i64 = dict(dtype=torch.int64, device=dev)
        # u64 arrays of the configs, held in int64 tensors of the same width.
        self.request_ring_offset = torch.zeros(1, **i64)
        self.response_ring_offset = torch.full((1,), plan.response_offset, **i64)
        self.client_ids = torch.full((1,), CLIENT_ID, **i64)
        # The peer table: peer 0 is our own region (see the module docstring).
        self.peer_base = torch.full((1,), region_base, **i64)
        self.alive = torch.ones(1, dtype=torch.int32, device=dev)
        peers = k.IpcPeers()
        peers.local_base, peers.peer_base = region_base, self.peer_base.data_ptr()
        peers.alive, peers.max_peers = self.alive.data_ptr(), 1
        self.peers = peers

        cc = k.ClientConfig()
        cc.num_servers, cc.num_slots, cc.client_id = 1, NUM_SLOTS, CLIENT_ID
        cc.max_tokens, cc.hidden, cc.topk = lay.max_tokens, lay.hidden, lay.topk
        cc.encoding, cc.out_encoding = int(lay.encoding), int(lay.out_encoding)
        cc.request_ring_offset = self.request_ring_offset.data_ptr()
        cc.response_ring_offset = self.response_ring_offset.data_ptr()
        self.ccfg = cc
        self.c_layout = k.client_workspace_layout(cc)
        self.c_ws = torch.zeros(self.c_layout["total"], dtype=torch.uint8, device=dev)

        sc = k.ServerConfig()
        sc.num_clients, sc.num_slots, sc.num_experts = 1, NUM_SLOTS, case.num_experts
        sc.max_step_tokens = case.max_step_tokens
        sc.max_tokens, sc.hidden, sc.topk = lay.max_tokens, lay.hidden, lay.topk
        sc.encoding, sc.out_encoding = int(lay.encoding), int(lay.out_encoding)
        sc.client_ids = self.client_ids.data_ptr()
        sc.request_ring_offset = self.request_ring_offset.data_ptr()
        sc.response_ring_offset = self.response_ring_offset.data_ptr()
        self.scfg = sc
        self.s_layout = k.server_workspace_layout(sc)
        self.s_ws = torch.zeros(self.s_layout["total"], dtype=torch.uint8, device=dev)

        self.next_seq = torch.zeros(1, **i64)
        self.expert_server = torch.zeros(case.num_experts, dtype=torch.int32, device=dev)
        self.expert_local = torch.arange(case.num_experts, dtype=torch.int32, device=dev)

    # -------------------------------------------------------------- arguments
    def dispatch_args(self, x, ids, w, x_q=None, x_scales=None):
        """x bf16 [T, H] (the pack kernel quantizes), or with x_q / x_scales the caller's fp8
        bytes [T, H] uint8 and f32 scales [T, H/128] (sent as they are)."""
        k, case = self.k, self.case
        a = k.DispatchArgs()
        if x_q is not None:
            a.x, a.x_dtype = x_q.data_ptr(), int(Encoding.FP8_E4M3_B128)
            a.x_scales, a.x_row_stride = x_scales.data_ptr(), x_q.stride(0)
        else:
            a.x, a.x_dtype, a.x_row_stride = x.data_ptr(), int(Encoding.BF16), x.stride(0)
        a.topk_ids, a.ids_int64 = ids.data_ptr(), ids.dtype == torch.int64
        a.topk_weights, a.weights_dtype = w.data_ptr(), int(Encoding.F32)
        a.num_tokens, a.topk = ids.shape[0], ids.shape[1]
        a.expert_server, a.expert_local = (
            self.expert_server.data_ptr(),
            self.expert_local.data_ptr(),
        )
        a.num_experts, a.layer_id, a.slot = case.num_experts, LAYER, SLOT
        a.next_seq, a.workspace = self.next_seq.data_ptr(), self.c_ws.data_ptr()
        return a

    def gather_args(self, arrival_timeout_ns: int):
        g = self.k.ServerGatherArgs()
        g.layer_id, g.num_layers, g.layer_hosted = LAYER, 0, 0  # only this layer is served
        g.arrival_timeout_ns, g.block_m = arrival_timeout_ns, DEFAULT_BLOCK_M
        g.workspace, g.draining = self.s_ws.data_ptr(), False
        return g

    def respond_args(self, expert_out: torch.Tensor):
        r = self.k.ServerRespondArgs()
        r.expert_out, r.workspace = expert_out.data_ptr(), self.s_ws.data_ptr()
        r.expert_out_dtype = int(_dtype_encoding(expert_out.dtype))
        return r

    def combine_args(self, y: torch.Tensor, timeout_ns: int):
        a = self.k.CombineArgs()
        a.num_tokens, a.layer_id, a.slot, a.timeout_ns = y.shape[0], LAYER, SLOT, timeout_ns
        a.workspace, a.out, a.out_dtype = self.c_ws.data_ptr(), y.data_ptr(), int(OUT_ENCODING)
        return a

    # -------------------------------------------------------------- launches
    def dispatch(self, stream: int, *args, **kw) -> None:
        self.k.client_dispatch(self.peers, self.ccfg, self.dispatch_args(*args, **kw), stream)

    def gather(self, stream: int, arrival_timeout_ns: int) -> None:
        self.k.server_gather(self.peers, self.scfg, self.gather_args(arrival_timeout_ns), stream)

    def mlp(self, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return server_mlp(self.s_ws, self.s_layout, self.case, w13, w2)

    def respond(self, stream: int, expert_out: torch.Tensor) -> None:
        self.k.server_respond(self.peers, self.scfg, self.respond_args(expert_out), stream)

    def combine(self, stream: int, y: torch.Tensor, timeout_ns: int) -> None:
        self.k.client_combine(self.peers, self.ccfg, self.combine_args(y, timeout_ns), stream)


def _dtype_encoding(dtype: torch.dtype) -> Encoding:
    return {torch.bfloat16: Encoding.BF16, torch.float16: Encoding.FP16,
            torch.float32: Encoding.F32}[dtype]  # fmt: skip


def server_mlp(s_ws: torch.Tensor, s_layout: dict, case: Case, w13, w2) -> torch.Tensor:
    """The GPU server's expert step between gather and respond, as DeviceExpertServer runs it:
    the Triton grouped MLP over the gathered rows (max_rows of them; the offsets bound the
    filled ones), score-weighted, fp8 rows with their per-128 scales gathered by src_token."""
    from moecomm.ops.triton_moe import triton_grouped_mlp_contiguous

    rows_n, h, e = s_layout["max_rows"], case.hidden, case.num_experts
    raw = s_ws[s_layout["rows"] : s_layout["rows"] + rows_n * s_layout["row_bytes"]]
    rows = raw.view(ENCODING_DTYPE[case.encoding]).view(rows_n, h)
    offsets = part(s_ws, s_layout, "offsets", torch.int64, e + 1)
    scores = part(s_ws, s_layout, "row_scores", torch.float32, rows_n)
    x_scales = None
    if case.quantized:
        spt = scales_per_token(case.encoding, h)
        t = case.max_step_tokens
        token_scales = part(s_ws, s_layout, "scales", torch.float32, t * spt).view(t, spt)
        src = part(s_ws, s_layout, "src_token", torch.int64, rows_n)
        x_scales = token_scales.index_select(0, src)
    return triton_grouped_mlp_contiguous(rows, offsets, w13, w2, scores, x_scales=x_scales)


def caller_cast(x: torch.Tensor):
    """The prequantized case's input: moecomm's fp8 per-128 cast on the host (the same as
    pack_dispatch's), as uint8 bytes and f32 scales."""
    q, s = quantize(x, Encoding.FP8_E4M3_B128)
    return q.view(torch.uint8), s


# ---------------------------------------------------------------------------- the comparison
@dataclass
class DeviceResult:
    """What one loopback step left behind, on the host: the workspaces' bytes, the region's
    bytes, the expert outputs (all max_rows rows) and y."""

    c_ws: torch.Tensor
    s_ws: torch.Tensor
    region: bytes
    expert_out: torch.Tensor
    y: torch.Tensor


def client_view(ws: torch.Tensor, layout: dict, num_tokens: int) -> dict:
    return {
        "count": int(part(ws, layout, "count", torch.int32, 1)[0]),
        "sent_seq": int(part(ws, layout, "sent_seq", torch.int64, 1)[0]),
        "status": int(part(ws, layout, "status", torch.int32, 1)[0]),
        "detail": int(part(ws, layout, "detail", torch.int32, 1)[0]),
        "pos": part(ws, layout, "pos", torch.int32, num_tokens),  # [T] (one server)
        "staging": ws[layout["staging"] : layout["staging"] + layout["staging_stride"]],
    }


def server_view(ws: torch.Tensor, layout: dict, case: Case) -> dict:
    t, k, e = case.max_step_tokens, case.topk, case.num_experts
    b, rows_n, row_bytes = layout["num_entries"], layout["max_rows"], layout["row_bytes"]
    spt = scales_per_token(case.encoding, case.hidden) if case.quantized else 0
    return {
        "entries": part(ws, layout, "entries", torch.int32, b * ENTRY_WORDS).view(b, ENTRY_WORDS),
        "batch_offsets": part(ws, layout, "batch_offsets", torch.int64, b + 1),
        "x": ws[layout["x"] : layout["x"] + t * row_bytes].view(t, row_bytes),
        "scales": part(ws, layout, "scales", torch.float32, t * spt).view(t, spt),
        "ids": part(ws, layout, "ids", torch.int32, t * k).view(t, k),
        "scores": part(ws, layout, "scores", torch.float32, t * k).view(t, k),
        "counts": part(ws, layout, "counts", torch.int32, e),
        "offsets": part(ws, layout, "offsets", torch.int64, e + 1),
        "src_token": part(ws, layout, "src_token", torch.int64, rows_n),
        "src_batch": part(ws, layout, "src_batch", torch.int32, rows_n),
        "src_row": part(ws, layout, "src_row", torch.int32, rows_n),
        "src_k": part(ws, layout, "src_k", torch.int32, rows_n),
        "row_scores": part(ws, layout, "row_scores", torch.float32, rows_n),
        "slot_of": part(ws, layout, "slot_of", torch.int64, t * k).view(t, k),
        "rows": ws[layout["rows"] : layout["rows"] + rows_n * row_bytes].view(rows_n, row_bytes),
    }


def check_step(case: Case, host: HostStep, res: DeviceResult, c_layout: dict, s_layout: dict,
               status_names: dict) -> list[str]:  # fmt: skip
    """Every difference between the device step and the host path, one line each ([] = none)."""
    p: list[str] = []
    b, lay, plan = host.batch, host.layout, ring_plan(case)
    n, nrows, t = b.num_tokens, lay.num_rows, case.tokens
    c = client_view(res.c_ws, c_layout, t)
    # client_dispatch: route, pack, put
    if c["status"] != 0 or c["detail"] != 0:
        name = status_names.get(c["status"], c["status"])
        p.append(f"client_combine status of server 0: {name} (detail {c['detail']}), expected OK")
    if c["count"] != n:
        p.append(f"client count: {c['count']} tokens for server 0, expected {n}")
    if c["sent_seq"] != 1:
        p.append(f"client sent_seq: {c['sent_seq']}, expected 1 (first request)")
    want_pos = torch.full((t,), -1, dtype=torch.int32)
    want_pos[b.token_index] = torch.arange(n, dtype=torch.int32)
    p += equal_problems("client pos (row of each token in the request)", c["pos"], want_pos)
    total = len(host.payload)
    p += equal_problems("client staging payload", as_bytes(c["staging"][:total]), host.payload)
    req = plan.request_slot(SLOT) + PAYLOAD_OFFSET
    p += equal_problems("request payload in the region", res.region[req : req + total],
                        host.payload)  # fmt: skip
    # server_gather: poll, copy, reorganize
    s = server_view(res.s_ws, s_layout, case)
    e0 = s["entries"][0].tolist()
    seq = (e0[6] & 0xFFFFFFFF) | (e0[7] << 32)
    got = (e0[0], e0[2], e0[3], e0[4], seq)
    if got != (ACTION_SERVE, n, case.topk, LAYER, 1):
        p.append(
            f"gather entry (client 0, slot 0): action/tokens/topk/layer/seq {got} (code {e0[1]}), "
            f"expected {(ACTION_SERVE, n, case.topk, LAYER, 1)}"
        )
    if int(s["entries"][1][0]) != ACTION_NONE:
        p.append(f"gather entry (client 0, slot 1): {s['entries'][1].tolist()}, expected idle")
    p += equal_problems("gather batch_offsets", s["batch_offsets"],
                        torch.tensor([0, n, n], dtype=torch.int64))  # fmt: skip
    p += equal_problems("gathered activations", s["x"][:n], b.activations.view(torch.uint8))
    if case.quantized:
        p += equal_problems("gathered scales", s["scales"][:n], b.scales)
    p += equal_problems("gathered ids", s["ids"][:n], b.expert_ids)
    p += equal_problems("gathered scores", s["scores"][:n], b.scores)
    p += equal_problems("layout counts", s["counts"], lay.counts)
    p += equal_problems("layout offsets", s["offsets"], lay.offsets)
    for name in ("src_token", "src_row", "src_k"):
        p += equal_problems(f"layout {name}", s[name][:nrows], getattr(lay, name).to(s[name].dtype))
    p += equal_problems(
        "layout src_batch", s["src_batch"][:nrows], torch.zeros(nrows, dtype=torch.int32)
    )
    p += equal_problems("layout row scores", s["row_scores"][:nrows], lay.scores)
    p += equal_problems("layout slot_of", s["slot_of"][:n], lay.slot_of)
    p += equal_problems("layout rows", s["rows"][:nrows], host.rows.view(torch.uint8))
    # the expert MLP: reduced, within tolerance
    p += close_problems(
        "expert outputs (Triton, bf16 weights)", res.expert_out[:nrows], host.mlp_ref
    )
    # server_respond: exact given the device's own expert outputs and slot_of
    response = expected_response(res.expert_out, s["slot_of"][:n])
    resp = plan.response_slot(SLOT) + PAYLOAD_OFFSET
    resp_bytes = n * case.hidden * OUT_DTYPE.itemsize
    p += equal_problems("response payload in the region", res.region[resp : resp + resp_bytes],
                        as_bytes(response))  # fmt: skip
    got_req = signal_word(res.region, plan.request_slot(SLOT))
    want_req = _C.make_signal(_C.SlotState.IDLE, 1)
    if got_req != want_req:
        p.append(f"request slot signal {got_req:#x}, expected IDLE|1 {want_req:#x} (released)")
    got_resp = signal_word(res.region, plan.response_slot(SLOT))
    want_resp = _C.make_signal(_C.SlotState.RESPONSE_READY, 1)
    if got_resp != want_resp:
        p.append(f"response slot signal {got_resp:#x}, expected RESPONSE_READY|1 {want_resp:#x}")
    # client_combine: exact given the response; and the whole layer within tolerance
    p += equal_problems("y (client combine)", res.y, expected_y(response, b.token_index, t))
    p += close_problems("y against the float32 layer", res.y, host.y_ref)
    return p


def emulate_device(case: Case, host: HostStep, c_layout: dict, s_layout: dict) -> DeviceResult:
    """What a correct device step leaves behind, written from the host path: the comparison's
    own test (a perfect device passes it; any one change is caught)."""
    b, lay, plan = host.batch, host.layout, ring_plan(case)
    n, nrows, t = b.num_tokens, lay.num_rows, case.tokens
    c_ws = torch.zeros(c_layout["total"], dtype=torch.uint8)
    c = client_view(c_ws, c_layout, t)  # views: writing them writes c_ws
    part(c_ws, c_layout, "count", torch.int32, 1)[0] = n
    part(c_ws, c_layout, "sent_seq", torch.int64, 1)[0] = 1
    c["pos"].fill_(-1)
    c["pos"][b.token_index] = torch.arange(n, dtype=torch.int32)
    c["staging"][: len(host.payload)] = torch.frombuffer(bytearray(host.payload), dtype=torch.uint8)
    s_ws = torch.zeros(s_layout["total"], dtype=torch.uint8)
    s = server_view(s_ws, s_layout, case)
    s["entries"][0] = torch.tensor([ACTION_SERVE, 0, n, case.topk, LAYER, 0, 1, 0])
    s["batch_offsets"][:] = torch.tensor([0, n, n])
    s["x"][:n] = b.activations.view(torch.uint8)
    if case.quantized:
        s["scales"][:n] = b.scales
    s["ids"].fill_(-1)
    s["ids"][:n] = b.expert_ids
    s["scores"][:n] = b.scores
    s["counts"][:] = lay.counts
    s["offsets"][:] = lay.offsets
    for name in ("src_token", "src_row", "src_k"):
        s[name][:nrows] = getattr(lay, name)
    s["row_scores"][:nrows] = lay.scores
    s["slot_of"].fill_(-1)
    s["slot_of"][:n] = lay.slot_of
    s["rows"][:nrows] = host.rows.view(torch.uint8)
    expert_out = torch.zeros(s_layout["max_rows"], case.hidden, dtype=OUT_DTYPE)
    expert_out[:nrows] = host.mlp_ref.to(OUT_DTYPE)
    response = expected_response(expert_out, lay.slot_of)
    region = bytearray(plan.region_bytes)
    req = plan.request_slot(SLOT)
    region[req : req + 8] = _C.make_signal(_C.SlotState.IDLE, 1).to_bytes(8, "little")
    at = req + PAYLOAD_OFFSET
    region[at : at + len(host.payload)] = host.payload
    resp = plan.response_slot(SLOT)
    region[resp : resp + 8] = _C.make_signal(_C.SlotState.RESPONSE_READY, 1).to_bytes(8, "little")
    raw = as_bytes(response)
    region[resp + PAYLOAD_OFFSET : resp + PAYLOAD_OFFSET + len(raw)] = raw
    y = expected_y(response, b.token_index, t)
    return DeviceResult(c_ws, s_ws, bytes(region), expert_out, y)


# ---------------------------------------------------------------------------- DeepEP, one rank
def deep_ep_round(buf, twin, x, ids, w, num_experts: int, use_fp8: bool, device) -> list[str]:
    """One dispatch (receive through its hook) and one combine on `buf` with the inputs on
    `device`, and the same on `twin` (the host path's Buffer, host tensors): every difference
    in the received tensors and the combined output, one line each ([] = none)."""
    tag = "fp8" if use_fp8 else "bf16"
    m = x.shape[0]
    dev = torch.device(device)
    x_d, ids_d, w_d = x.to(dev), ids.to(dev), w.to(dev)
    recv, count, handle, _, hook = buf.low_latency_dispatch(
        x_d, ids_d, m, num_experts, use_fp8=use_fp8, return_recv_hook=True
    )
    hook()
    c_recv, c_count, c_handle, _, _ = twin.low_latency_dispatch(
        x, ids, m, num_experts, use_fp8=use_fp8
    )
    p: list[str] = []
    p += equal_problems(f"{tag} recv_count", count.cpu(), c_count)
    if int(c_count.sum()) != int((ids >= 0).sum()):
        p.append(f"{tag} host recv_count sums to {int(c_count.sum())}, not the routed copies")
    p += equal_problems(f"{tag} src_info", handle[0].cpu(), c_handle[0])
    p += equal_problems(f"{tag} layout_range", handle[1].cpu(), c_handle[1])
    data, c_data = (recv[0], c_recv[0]) if use_fp8 else (recv, c_recv)
    data = data.cpu()
    for e in range(c_count.shape[0]):
        n = int(c_count[e])
        p += equal_problems(f"{tag} recv_x[{e}]", data[e, :n], c_data[e, :n])
        if use_fp8:
            p += equal_problems(f"{tag} recv scales[{e}]", recv[1][e, :n].cpu(), c_recv[1][e, :n])
    g = torch.Generator().manual_seed(11)
    y = torch.randn(c_data.shape[0], c_data.shape[1], x.shape[1], generator=g).to(torch.bfloat16)
    out = buf.low_latency_combine(y.to(dev), ids_d, w_d, handle)[0]
    c_out = twin.low_latency_combine(y, ids, w, c_handle)[0]
    p += equal_problems(f"{tag} combine", out.cpu(), c_out)
    return p
