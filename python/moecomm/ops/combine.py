"""Combine: sum the partial results that several expert servers returned for one batch.

Server ``s`` answers with ``partial_s`` [n_s, H] = Σ over its experts of score × expert(x), one row
per token it received; ``token_index_s`` [n_s] (from :class:`~moecomm.ops.dispatch.ServerBatch`)
says which batch row each answer belongs to. The combined output is

    y[t] = Σ_s partial_s[row of t in s]          (0 for a token that no server received)

accumulated in f32, adding the servers in the order given (callers pass them in server order,
as :func:`~moecomm.ops.dispatch.pack_dispatch` returns them). Floating-point addition is not
associative, so a fixed order is what makes the result identical bit for bit from run to run,
whatever order the responses arrived in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moecomm.ops._checks import check_tensor

__all__ = ["combine", "combine_reference"]

_PARTIAL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_combine_args(
    partials: object,
    token_index: object,
    num_tokens: object,
    hidden: object,
    dtype: object,
) -> tuple[int, torch.dtype, torch.device]:
    if not isinstance(partials, Sequence) or not isinstance(token_index, Sequence):
        raise TypeError("partials and token_index must be sequences of tensors")
    if len(partials) != len(token_index):
        raise ValueError(
            f"partials and token_index must pair up: got {len(partials)} partials and "
            f"{len(token_index)} token_index tensors"
        )
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if not partials and hidden is None:
        raise ValueError("hidden must be given when there are no partial results")
    if hidden is not None and (not isinstance(hidden, int) or hidden < 1):
        raise ValueError(f"hidden must be an int >= 1, got {hidden!r}")
    h = hidden
    device = partials[0].device if partials and isinstance(partials[0], torch.Tensor) else None
    for i, (p, idx) in enumerate(zip(partials, token_index, strict=True)):
        if not isinstance(p, torch.Tensor) or not isinstance(idx, torch.Tensor):
            raise TypeError(f"partials[{i}] and token_index[{i}] must be torch.Tensors")
        if p.dtype not in _PARTIAL_DTYPES:
            raise TypeError(f"partials[{i}] must be bfloat16, float16 or float32, got {p.dtype}")
        if p.dim() != 2 or (h is not None and p.shape[1] != h):
            want = f"[n, {h}]" if h is not None else "[n, H]"
            raise ValueError(f"partials[{i}] must have shape {want}, got {tuple(p.shape)}")
        h = p.shape[1]
        if idx.dtype != torch.int64 or idx.dim() != 1 or idx.shape[0] != p.shape[0]:
            raise ValueError(
                f"token_index[{i}] must be int64 of shape [{p.shape[0]}], got {idx.dtype} "
                f"{tuple(idx.shape)}"
            )
        if p.device != device or idx.device != device:
            raise ValueError(
                f"all tensors must be on {device}, got {p.device} / {idx.device} at index {i}"
            )
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_tokens):
            raise ValueError(f"token_index[{i}] must be in [0, {num_tokens})")
    if dtype is None:
        dtype = torch.float32
        if partials:
            dtype = partials[0].dtype
            for p in partials[1:]:
                dtype = torch.promote_types(dtype, p.dtype)
    if dtype not in _PARTIAL_DTYPES:
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    assert h is not None
    return h, dtype, device or torch.device("cpu")


def combine(
    partials: Sequence[torch.Tensor],
    token_index: Sequence[torch.Tensor],
    num_tokens: int,
    *,
    hidden: int | None = None,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    acc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sums per-server partial results into ``y`` [num_tokens, H].

    partials[i] [n_i, H] bf16/fp16/f32 (any strides); token_index[i] [n_i] int64, distinct
    values in [0, num_tokens). Accumulates in f32 in list order, then casts to ``dtype``
    (default: the promoted dtype of the partials, f32 when there are none; ``hidden`` is then
    required). Deterministic: same inputs, same bits. Inputs are not modified.

    Caller-owned memory: ``out`` [num_tokens, H] of ``dtype`` receives the result (and is
    returned); ``acc``, an f32 tensor of at least [num_tokens, H], is the accumulator to use
    (an f32 ``out`` is its own accumulator). With both, an f32 combine allocates nothing.
    """
    h, out_dtype, device = _check_combine_args(partials, token_index, num_tokens, hidden, dtype)
    if out is not None:
        check_tensor("out", out, dtypes=(out_dtype,), dim=2, device=device)
        if tuple(out.shape) != (num_tokens, h):
            raise ValueError(f"out must be [{num_tokens}, {h}], got {list(out.shape)}")
    if out is not None and out_dtype == torch.float32:
        acc = out.zero_()
    elif acc is not None:
        check_tensor("acc", acc, dtypes=(torch.float32,), dim=2, device=device)
        if acc.shape[0] < num_tokens or acc.shape[1] != h:
            raise ValueError(f"acc must hold [{num_tokens}, {h}], got {list(acc.shape)}")
        acc = acc[:num_tokens].zero_()
    else:
        acc = torch.zeros(num_tokens, h, dtype=torch.float32, device=device)
    for p, idx in zip(partials, token_index, strict=True):
        # Rows of one server are distinct tokens, so each index_add_ adds at most once per
        # output row: no order inside a call to worry about, only the order between calls.
        acc.index_add_(0, idx, p if p.dtype == torch.float32 else p.float())
    if out is not None:
        return out if out.data_ptr() == acc.data_ptr() else out.copy_(acc)
    return acc if out_dtype == torch.float32 else acc.to(out_dtype)


def combine_reference(
    partials: Sequence[torch.Tensor],
    token_index: Sequence[torch.Tensor],
    num_tokens: int,
    *,
    hidden: int | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Token-by-token reference of :func:`combine` (same result, bit for bit)."""
    h, out_dtype, device = _check_combine_args(partials, token_index, num_tokens, hidden, dtype)
    acc = torch.zeros(num_tokens, h, dtype=torch.float32, device=device)
    for p, idx in zip(partials, token_index, strict=True):
        for row, t in enumerate(idx.tolist()):
            acc[t] = acc[t] + p[row].float()
    return acc.to(out_dtype)
