"""Inputs and host-path expectations shared by the device dispatch tests.

Cases are routed batches whose expected request payloads and combine results come from the host
path (moecomm.ops.pack_dispatch / combine); the native replay and the GPU check program read the
same little-endian files written here.
"""

from __future__ import annotations

import struct

import torch
from moecomm._C import Encoding, request_payload_layout
from moecomm.ops.combine import combine
from moecomm.ops.dispatch import ExpertMap, pack_dispatch
from moecomm.ops.quant import QUANTIZED_ENCODINGS, dequantize

ELEM_BYTES = {
    Encoding.BF16: 2,
    Encoding.FP16: 2,
    Encoding.F32: 4,
    Encoding.INT8: 1,
    Encoding.FP8_E4M3: 1,
    Encoding.FP8_E4M3_B128: 1,
}
DTYPE_ENCODING = {
    torch.bfloat16: Encoding.BF16,
    torch.float16: Encoding.FP16,
    torch.float32: Encoding.F32,
}


def make_case(
    tokens: int,
    hidden: int,
    topk: int,
    servers: int,
    experts: int,
    seed: int,
    x_dtype: torch.dtype = torch.bfloat16,
):
    """A routed batch with replicas: every expert lives on 1-2 servers (distinct local slots);
    some (token, k) are -1 and some servers may get no token. Returns (x, ids, weights, emap,
    replica [E]) where x encodes its origin (row t, column c -> t + c / 1024)."""
    g = torch.Generator().manual_seed(seed)
    next_local = [0] * servers
    replicas = []
    for _ in range(experts):
        n = 1 + int(torch.randint(0, 2, (1,), generator=g)) if servers > 1 else 1
        chosen = torch.randperm(servers, generator=g)[:n].tolist()
        reps = []
        for s in chosen:
            reps.append((s, next_local[s]))
            next_local[s] += 1
        replicas.append(reps)
    emap = ExpertMap(replicas, num_servers=servers)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    ids = ids.masked_fill(torch.rand(tokens, topk, generator=g) < 0.15, -1).to(torch.int64)
    weights = torch.rand(tokens, topk, generator=g)
    rows = torch.arange(tokens, dtype=torch.float32).unsqueeze(1)
    cols = torch.arange(hidden, dtype=torch.float32).unsqueeze(0)
    noise = torch.randn(tokens, hidden, generator=g) * 4
    x = (rows + cols / 1024 + noise).to(x_dtype)
    replica = torch.tensor([int(torch.randint(0, len(r), (1,), generator=g)) for r in replicas])
    return x, ids, weights, emap, replica


def device_tables(emap: ExpertMap, replica: torch.Tensor) -> tuple[list[int], list[int]]:
    """(expert_server, expert_local) of the per-expert replica choice: the device's map."""
    server, local = [], []
    for e in range(emap.num_experts):
        s, j = emap.replicas(e)[int(replica[e])]
        server.append(s)
        local.append(j)
    return server, local


def payload_bytes(batch, hidden: int, topk: int, enc: Encoding) -> bytes:
    """The request payload of one ServerBatch, laid out as csrc/protocol/layout.h (padding 0)."""
    n = batch.num_tokens
    lay = request_payload_layout(n, hidden, topk, enc)
    buf = bytearray(lay["total"])

    def put(offset: int, t: torch.Tensor) -> None:
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        buf[offset : offset + len(raw)] = raw

    put(lay["act_offset"], batch.activations)
    if batch.scales is not None:
        put(lay["scale_offset"], batch.scales)
    put(lay["ids_offset"], batch.expert_ids)
    put(lay["scores_offset"], batch.scores)
    return bytes(buf)


def expected_round_trip(x, ids, weights, emap, replica, enc: Encoding, out_dtype: torch.dtype):
    """Host path of a full step with the stand-in expert (x * score * (local expert + 1)):
    (batches, y). Each server sums its copies in k order in f32 and answers in out_dtype; the
    client combines the answers in server order (ops.combine)."""
    batches = pack_dispatch(x, ids, weights, emap, encoding=enc, replica=replica)
    partials = []
    for b in batches:
        if enc in QUANTIZED_ENCODINGS:
            xf = dequantize(b.activations, b.scales, enc, dtype=torch.float32)
        else:
            xf = b.activations.float()
        acc = torch.zeros_like(xf)
        for k in range(b.expert_ids.shape[1]):
            here = b.expert_ids[:, k] >= 0
            factor = b.scores[:, k] * (b.expert_ids[:, k] + 1).float()
            acc[here] += (factor.unsqueeze(1) * xf)[here]
        partials.append(acc.to(out_dtype))
    y = combine(
        partials, [b.token_index for b in batches], x.shape[0], hidden=x.shape[1], dtype=out_dtype
    )
    return batches, y


def pack_u32(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


def pack_i32(values) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()
