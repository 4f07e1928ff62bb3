"""A plain-torch MoE reference for the engine drives: the inputs every rank can regenerate for
every rank from a seed, DeepEP's fp8 cast (written apart from moecomm's), a deterministic
expert, and what DeepEP's dispatch and combine make of them.

Semantics (DeepEP's, with moecomm's documented deterministic order): local expert ``e`` of
rank ``r`` (global ``r*L + e``) receives every (source rank p, token t) routed to it, source rank
major, token ascending. Low-latency combine: ``out[t] = Σ_k w[t,k] · y(t,k)`` in f32, k ascending,
one rounding per product and per sum, cast to bf16. Normal-mode combine: the bf16 sum over the
ranks that received the token (ascending) of their already-reduced rows, in f32."""

from __future__ import annotations

import torch

FP8_MAX = 448.0
BLOCK = 128


def make_inputs(seed: int, rank: int, num_tokens: int, num_experts: int, topk: int, hidden: int):
    """x [T, H] bf16 (values carry rank and token), topk_idx [T, K] int64 (distinct experts, a
    few -1), topk_weights [T, K] f32."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = (torch.randn(num_tokens, hidden, generator=g) * (1 + rank)).to(torch.bfloat16)
    if num_tokens:
        x[:, 0] = torch.arange(num_tokens, dtype=torch.bfloat16)  # token index, exact in bf16
        x[:, 1] = float(rank)
    rows = [torch.randperm(num_experts, generator=g)[:topk] for _ in range(num_tokens)]
    idx = torch.stack(rows) if rows else torch.empty(0, topk, dtype=torch.int64)
    idx = idx.reshape(num_tokens, topk).to(torch.int64)
    if num_tokens > 1 and topk > 1:
        idx[1, topk - 1] = -1  # a masked slot, as DeepEP allows
    w = torch.rand(num_tokens, topk, generator=g)
    return x, idx, w


def deepep_fp8(x: torch.Tensor):
    """DeepEP's low-latency cast per 128 channels: amax = max(|x|, 1e-4) in f32, scale =
    448 / amax (IEEE f32 division), scale_inv = amax * f32(1/448), q = e4m3(x * scale) saturated.
    Returns (q [n, H] e4m3, scale_inv [n, H/128] f32, dequantized f32 [n, H])."""
    n, h = x.shape
    v = x.float().reshape(n, h // BLOCK, BLOCK)
    amax = v.abs().amax(dim=2).clamp(min=1e-4)
    inv = amax * torch.tensor(1 / FP8_MAX, dtype=torch.float32)
    scale = torch.tensor(FP8_MAX, dtype=torch.float32) / amax
    q = (v * scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    deq = q.float() * inv[:, :, None]
    return q.reshape(n, h), inv, deq.reshape(n, h)


def expert(rows_f32: torch.Tensor, global_expert: int) -> torch.Tensor:
    """The simulated expert: a per-expert scale, rounded to bf16."""
    return (rows_f32 * (1.0 + global_expert / 8.0)).to(torch.bfloat16)


def routed(inputs: list, global_expert: int) -> list[tuple[int, int]]:
    """(source rank, token) pairs routed to `global_expert`, in receive order."""
    out = []
    for p, (_, idx, _) in enumerate(inputs):
        for t in range(idx.shape[0]):
            if global_expert in idx[t].tolist():
                out.append((p, t))
    return out


def wire_rows(inputs: list, use_fp8: bool):
    """Per source rank: (wire values, scales or None, f32 values the expert sees)."""
    out = []
    for x, _, _ in inputs:
        if use_fp8:
            out.append(deepep_fp8(x))
        else:
            out.append((x, None, x.float()))
    return out


def ll_combine(x_f32: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out[t] = Σ_k w[t,k] · expert(x[t], idx[t,k]) in f32, k ascending, -1 skipped; bf16."""
    t_count, hidden = x_f32.shape
    acc = torch.zeros(t_count, hidden)
    for t in range(t_count):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                acc[t] = acc[t] + w[t, k] * expert(x_f32[t], e).float()
    return acc.to(torch.bfloat16)


def reduced_row(x_f32: torch.Tensor, idx_row, w_row, experts: range) -> torch.Tensor:
    """One rank's normal-mode answer for one token: Σ over its top-k slots whose expert it holds
    of w · expert(x), f32, k ascending, bf16."""
    acc = torch.zeros(x_f32.shape[-1])
    for k, e in enumerate(idx_row):
        if int(e) in experts:
            acc = acc + w_row[k] * expert(x_f32, int(e)).float()
    return acc.to(torch.bfloat16)


def normal_combine(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, num_ranks: int, local: int):
    """DeepEP normal-mode combine of reduced rows: bf16(Σ_r f32(row_r)) over ranks r holding one
    of the token's experts, ranks ascending."""
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for r in range(num_ranks):
            experts = range(r * local, (r + 1) * local)
            if any(int(e) in experts for e in idx[t]):
                out[t] = out[t] + reduced_row(x[t].float(), idx[t], w[t], experts).float()
    return out.to(torch.bfloat16)
