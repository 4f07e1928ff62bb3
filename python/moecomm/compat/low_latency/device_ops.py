"""The pure-torch halves of the DeepEP adapter's CUDA path (``low_latency/device.py``): which path a
call takes, the argument checks (no host read), the expanded dispatch, the conversion of the
server gather's per-expert layout into DeepEP's packed receive tensors, and the weighted combine.

Wire mapping (what makes the device kernels give DeepEP's layout and the host path's bits):

- **One request row per (token, k) copy** (DeepEP's low-latency dispatch sends per expert too):
  row ``t*K + k`` of an expanded batch carries ``x[t]`` and the single id ``topk_idx[t, k]``
  (slot topk 1); its score column carries the token index ``t``. The server's per-expert layout
  then holds each copy once, source rank major, token ascending (the host path's order), and its
  answer row is that copy's expert output alone, so the client can weight and sum the copies
  itself: ``out[t] = Σ_k w[t, k]·y(t, k)`` in f32, k ascending, -0.0 for skipped k — the host
  path's arithmetic, bit for bit (:func:`combine_from_answers`).
- **Every rank gets a request from every rank**, even with nothing routed to it: one "sink" row
  per destination (logical expert ``E + q`` = local expert ``L`` of rank ``q``) is appended, so
  the receiver knows how many requests to wait for. Sink rows are dropped from recv_x and
  answered with zeros.
- **Slots**: dispatch ``i`` of a lane uses slot ``i % 2`` and sends ``layer_id = slot``; the
  server gather of slot ``s`` serves only requests of layer ``s`` (the other slot's wait for
  their own receive), into its own workspace.
- **fp8**: cast in torch with DeepEP's formula (``cast.deepep_cast``, the host path's
  function: every op of it is exact f32 arithmetic, the same on the device) once per token,
  expanded, and sent as they are (``DispatchArgs.x_scales``: the pack kernel copies the bytes
  and scales instead of quantizing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecomm.compat.low_latency.cast import UE8M0_PACK, deepep_cast, logfmt_roundtrip, pack_ue8m0
from moecomm.compat.low_latency.layout import (
    LowLatencyHandle,
    check_dispatch_sizes,
    check_dispatch_tensors,
)
from moecomm.wire.protocol import SCALE_BLOCK

__all__ = [
    "DeviceHandle",
    "Received",
    "check_device_combine",
    "check_device_cost",
    "check_device_inputs",
    "check_mode",
    "check_ue8m0_hidden",
    "combine_from_answers",
    "expand_dispatch",
    "expand_quantized",
    "expert_rows",
    "input_device",
    "part",
    "scatter_receive",
    "ue8m0_scales",
]


def input_device(**tensors) -> torch.device | None:
    """The CUDA device of the call's tensors, None when they are all on the host; a clear
    ValueError when CUDA and non-CUDA tensors (or two CUDA devices) are mixed."""
    cuda = {n: t.device for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_cuda}
    if not cuda:
        return None
    other = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and not t.is_cuda]
    if other:
        raise ValueError(
            f"deep_ep.Buffer: {', '.join(cuda)} on {next(iter(cuda.values()))} but "
            f"{', '.join(other)} on the host: give every tensor of a call on the same device"
        )
    if len(set(cuda.values())) > 1:
        raise ValueError(f"deep_ep.Buffer: tensors on several CUDA devices: {cuda}")
    return next(iter(cuda.values()))


def check_mode(mode: str | None, on_cuda: bool) -> str:
    """A Buffer serves CPU or CUDA tensors, whichever its first dispatch used."""
    want = "cuda" if on_cuda else "cpu"
    if mode is not None and mode != want:
        raise RuntimeError(
            f"this deep_ep.Buffer runs on {mode.upper()} tensors (its first dispatch); got "
            f"{want.upper()} tensors: use one Buffer per kind of tensor"
        )
    return want


# ---------------------------------------------------------------------------- events
class DeviceHandle(LowLatencyHandle):
    """The handle of a CUDA dispatch: DeepEP's tuple plus what the device combine needs, copied
    out of the slot's workspaces (which dispatch ``i + 2`` reuses), so it can be combined at any
    time and any number of times."""

    lane: object  # the _ll_device lane that sent it
    slot: int
    # Client side, copied at the dispatch: the route kernel's per-server results.
    sent_seq: torch.Tensor | None = None  # [R] int64 request seq per server (0: not sent)
    count: torch.Tensor | None = None  # [R] int32 request rows per server
    rows_at: torch.Tensor | None = None  # [max_tokens, R] int32 row of each expanded row there
    # Server side, copied at the receive: the gather's admitted entries of this slot.
    entries: torch.Tensor | None = None  # [R, 8] int32 EntryState of (client, slot)
    first: torch.Tensor | None = None  # [R] int64 first step token of each client's request
    slot_of: torch.Tensor | None = None  # [max_rows] int64 layout row of each step token
    expert: torch.Tensor | None = None  # [max_rows] int64 local expert of each layout row
    pos: torch.Tensor | None = None  # [max_rows] int64 row inside recv_x[expert]
    valid: torch.Tensor | None = None  # [max_rows] bool: a real copy (not a sink, not unused)
    received: bool = False


def part(ws: torch.Tensor, layout: dict, name: str, dtype: torch.dtype, count: int):
    """`count` elements of `dtype` at the workspace part `name` (a byte offset of `layout`)."""
    start = layout[name]
    size = torch.empty((), dtype=dtype).element_size() * count
    return ws[start : start + size].view(dtype)


# ---------------------------------------------------------------------------- pure torch
def _expand_rows(src: torch.Tensor, k: int, dst: torch.Tensor, num_sinks: int) -> None:
    """dst row ``t*K + k`` = src row t, then `num_sinks` zero rows."""
    t = src.shape[0]
    n = t * k
    if t:
        dst[:n].view(t, k, -1).copy_(src.unsqueeze(1).expand(t, k, src.shape[1]))
    dst[n : n + num_sinks].zero_()


def expand_dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    x_exp: torch.Tensor | None,
    ids_exp: torch.Tensor,
    sink_ids: torch.Tensor,
) -> int:
    """Writes the expanded batch the dispatch kernels send: row ``t*K + k`` = ``x[t]`` with the
    id ``topk_idx[t, k]``, then one sink row per rank (id ``sink_ids[q]``, zero activations).
    ``x_exp`` None: the ids only (the fp8 lane expands its cast rows, :func:`expand_quantized`).
    Returns the number of rows."""
    t, k = topk_idx.shape
    n = t * k
    r = sink_ids.shape[0]
    if x_exp is not None:
        _expand_rows(x, k, x_exp, r)
    if t:
        ids_exp[:n].copy_(topk_idx.reshape(n, 1))
    ids_exp[n : n + r].copy_(sink_ids.view(r, 1))
    return n + r


def expand_quantized(
    x: torch.Tensor,
    num_topk: int,
    round_scale: bool,
    q_exp: torch.Tensor,
    s_exp: torch.Tensor,
    num_sinks: int,
) -> None:
    """The fp8 lane's expanded rows: each token cast once with DeepEP's formula
    (:func:`moecomm.compat.low_latency.cast.deepep_cast`, ``round_scale`` included), its e4m3 bytes
    into ``q_exp`` [rows, H] uint8 and its scales into ``s_exp`` [rows, H/128] f32 at rows
    ``t*K .. t*K + K - 1``; the sink rows are zero (the receiver drops them)."""
    q, s = deepep_cast(x, round_scale)
    _expand_rows(q.view(torch.uint8), num_topk, q_exp, num_sinks)
    _expand_rows(s, num_topk, s_exp, num_sinks)


def ue8m0_scales(scale_store: torch.Tensor, out: torch.Tensor) -> None:
    """DeepEP's ``use_ue8m0`` receive scales from the f32 ones: ``scale_store`` [L, H/128, R*M]
    f32 (power-of-two scales: ``round_scale``), ``out`` [L, H/512, R*M] int32, the exponent
    bytes packed four per word (:func:`moecomm.compat.low_latency.cast.pack_ue8m0`)."""
    num_local, blocks, rows = scale_store.shape
    flat = scale_store.transpose(1, 2).reshape(num_local * rows, blocks)
    out.transpose(1, 2).copy_(pack_ue8m0(flat).view(num_local, rows, -1))


@dataclass
class Received:
    """DeepEP's receive tensors of one dispatch, and the map back to the gather's layout."""

    recv_count: torch.Tensor  # [L] int32
    src_info: torch.Tensor  # [L, R*M] int32, -1 past the count
    layout_range: torch.Tensor  # [L, R] int64 (begin << 32) | count
    expert: torch.Tensor  # [max_rows] int64
    pos: torch.Tensor  # [max_rows] int64
    valid: torch.Tensor  # [max_rows] bool


def scatter_receive(
    counts: torch.Tensor,
    offsets: torch.Tensor,
    src_batch: torch.Tensor,
    src_token: torch.Tensor,
    row_scores: torch.Tensor,
    rows: torch.Tensor,
    step_scales: torch.Tensor | None,
    data_store: torch.Tensor,
    scale_store: torch.Tensor | None,
    num_ranks: int,
    num_slots: int,
) -> Received:
    """The server gather's per-expert layout, laid out as DeepEP's packed receive: no host read.

    Gather side (``L + 1`` experts, the last one the sinks; ``max_rows`` layout rows of which
    the first ``offsets[L + 1]`` are filled): ``counts`` [L+1] int32, ``offsets`` [L+2] int64,
    ``src_batch`` [max_rows] int32 (entry = source rank * num_slots + slot), ``src_token``
    [max_rows] int64 (row of the step's concatenated requests), ``row_scores`` [max_rows] f32
    (the source token index), ``rows`` [max_rows, ...] the activations, ``step_scales``
    [step tokens, H/128] f32 (fp8) or None.

    DeepEP side: ``data_store`` [L+1, R*M, ...] (``rows``' dtype and row shape; slice ``[:L]``
    is recv_x, expert ``L`` absorbs every unused or sink row), ``scale_store`` [L+1, H/128, R*M]
    f32 (``[:L].transpose(1, 2)`` is the column-major scales) or None.
    """
    num_local = counts.shape[0] - 1
    rows_per_expert = data_store.shape[1]
    dev = rows.device
    max_rows = rows.shape[0]
    i = torch.arange(max_rows, device=dev)
    # Expert of layout row i: how many expert ends are <= i (rows past the last fill give L+1).
    expert = torch.searchsorted(offsets[1:].contiguous(), i, right=True)
    valid = expert < num_local
    first = offsets.index_select(0, expert.clamp(max=num_local))
    pos = torch.where(valid, i - first, 0)
    e_tgt = torch.where(valid, expert, num_local)
    data_store.index_put_((e_tgt, pos), rows)
    if step_scales is not None:
        assert scale_store is not None
        tok = src_token.clamp(0, step_scales.shape[0] - 1)
        scale_store.transpose(1, 2).index_put_((e_tgt, pos), step_scales.index_select(0, tok))
    src_info = torch.full(
        (num_local + 1, rows_per_expert), -1, dtype=torch.int32, device=dev
    ).index_put_((e_tgt, pos), torch.where(valid, row_scores.to(torch.int32), -1))
    src_rank = (src_batch.to(torch.int64) // num_slots).clamp(0, num_ranks - 1)
    cell = torch.where(valid, expert * num_ranks + src_rank, num_local * num_ranks)
    per_rank = torch.zeros((num_local + 1) * num_ranks, dtype=torch.int64, device=dev)
    per_rank.index_add_(0, cell, torch.ones_like(cell))
    per_rank = per_rank.view(num_local + 1, num_ranks)[:num_local]
    begin = per_rank.cumsum(1) - per_rank
    return Received(
        recv_count=counts[:num_local].clone(),
        src_info=src_info[:num_local],
        layout_range=(begin << 32) | per_rank,
        expert=expert,
        pos=pos,
        valid=valid,
    )


def expert_rows(
    y: torch.Tensor, expert: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The respond kernel's ``expert_out``: layout row i = ``y[expert[i], pos[i]]`` (the user's
    expert output, unweighted), zero for sink and unused rows."""
    rows_per_expert, hidden = y.shape[1], y.shape[2]
    flat = torch.where(valid, expert * rows_per_expert + pos, 0)
    torch.index_select(y.reshape(-1, hidden), 0, flat, out=out)
    return out.masked_fill_(~valid.unsqueeze(1), 0)


def combine_from_answers(
    answers: torch.Tensor,
    pos: torch.Tensor,
    topk_idx: torch.Tensor,
    weights: torch.Tensor,
    num_local: int,
    out: torch.Tensor,
    use_logfmt: bool = False,
) -> torch.Tensor:
    """``out[t] = Σ_k w[t, k] · y(t, k)`` in f32, k ascending, cast to ``out``'s dtype: the host
    path's :func:`moecomm.compat.low_latency.layout.weighted_sum` operation by operation (product
    rounded to f32, then the add; -0.0 for a skipped k), so the bits are the same.

    ``answers`` [R, rows, H] bf16: rank q's answer rows (any strides); ``pos`` [>= T*K, R]
    int32: row of expanded row ``t*K + k`` in rank q's request (the client workspace's ``pos``).
    Ids outside ``[0, R*L)`` count as -1. ``use_logfmt``: each answer row as DeepEP's receiver
    decodes its LogFMT-10 encoding (:func:`moecomm.compat.low_latency.cast.logfmt_roundtrip`, the
    host path's function; the rows themselves travel as bf16)."""
    t, k = topk_idx.shape
    num_ranks, hidden = answers.shape[0], answers.shape[2]
    valid = (topk_idx >= 0) & (topk_idx < num_ranks * num_local)
    dest = torch.where(valid, topk_idx // num_local, 0)
    flat = torch.arange(t * k, device=topk_idx.device).view(t, k) * num_ranks + dest
    row = pos.reshape(-1).index_select(0, flat.reshape(-1)).view(t, k).to(torch.int64)
    row = row.clamp(min=0)
    acc = torch.zeros(t, hidden, dtype=torch.float32, device=answers.device)
    w = weights.float()
    for j in range(k):
        got = answers[dest[:, j], row[:, j]]
        prod = (logfmt_roundtrip(got) if use_logfmt else got.float()).mul_(w[:, j : j + 1])
        acc.add_(prod.masked_fill_(~valid[:, j : j + 1], -0.0))
    return out.copy_(acc)


# ---------------------------------------------------------------------------- device memory
def check_device_inputs(x, topk_idx, num_max, num_experts, use_fp8: bool) -> None:
    """The device twin of check_dispatch_inputs, without reading values (no host sync): ids
    outside ``[0, num_experts)`` are treated as -1 by the kernels; a repeated id is not
    detected."""
    check_dispatch_tensors(x, topk_idx)
    if x.stride(1) != 1:
        raise ValueError(
            f"x must be [num_tokens, hidden] with unit column stride, got {list(x.shape)}"
        )
    # No upper bound on num_max here: the lane refuses a dispatch too large for its rows.
    check_dispatch_sizes(x, num_max, num_experts, use_fp8)


def check_ue8m0_hidden(use_ue8m0: bool, hidden: int) -> None:
    if use_ue8m0 and hidden % (SCALE_BLOCK * UE8M0_PACK):
        raise ValueError(f"use_ue8m0 packs 4 scales per int32: hidden % 512, got {hidden}")


def check_device_cost(name: str, t, num_ranks: int, device: torch.device) -> None:
    """DeepEP's cost statistics: int64 ``[num_ranks]`` contiguous, on the call's device."""
    if t is None:
        return
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != torch.int64
        or tuple(t.shape) != (num_ranks,)
        or not t.is_contiguous()
        or t.device != device
    ):
        got = f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else t
        raise ValueError(f"{name} must be contiguous int64 [{num_ranks}] on {device}, got {got}")


def check_device_combine(x, topk_idx, topk_weights, out, handle, want: tuple) -> None:
    if x.dtype != torch.bfloat16 or tuple(x.shape) != want:
        raise ValueError(f"x must be bf16 {list(want)}, got {x.dtype} {list(x.shape)}")
    if topk_idx.shape != handle.topk_idx.shape or topk_idx.dtype != torch.int64:
        raise ValueError("topk_idx must be the one given to the dispatch of this handle")
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"topk_weights must be float32 {list(topk_idx.shape)}, got "
            f"{topk_weights.dtype} {list(topk_weights.shape)}"
        )
    if out is not None:
        shape = (topk_idx.shape[0], want[2])
        if out.dtype != torch.bfloat16 or tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(
                f"out must be contiguous bf16 {list(shape)}, got {out.dtype} {list(out.shape)}"
            )
    if any(t.device != x.device for t in (topk_idx, topk_weights, out) if t is not None):
        raise ValueError("every tensor of the combine must be on the dispatch's device")
