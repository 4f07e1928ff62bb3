"""Argument checks shared by the expert-compute ops: each failure names what was expected."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# The activation and weight dtypes every expert-compute op takes (fp8 payloads are dequantized
# before they reach the experts).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Counts and offsets: int32 from the native kernels and the wire, int64 from torch's cumsum.
INT_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    dim: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dimensions, got shape {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    return t


def check_num_experts(num_experts: object) -> int:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int):
        raise TypeError(f"num_experts: expected an int, got {type(num_experts).__name__}")
    if num_experts <= 0:
        raise ValueError(f"num_experts: expected a positive count, got {num_experts}")
    return num_experts


def check_batches(
    ids: Sequence[torch.Tensor], scores: Sequence[torch.Tensor], num_experts: int
) -> tuple[int, torch.device]:
    """Checks the routing of a list of batches; returns (topk, device)."""
    check_num_experts(num_experts)
    if isinstance(ids, torch.Tensor) or isinstance(scores, torch.Tensor):
        raise TypeError("ids, scores: expected a list of per-batch tensors, got a tensor")
    if len(ids) != len(scores):
        raise ValueError(
            f"expected as many score tensors as id tensors ({len(ids)}), got {len(scores)}"
        )
    if not ids:
        raise ValueError("expected at least one batch, got none")
    topk, device = None, None
    for b, (i, s) in enumerate(zip(ids, scores, strict=True)):
        check_tensor(f"ids[{b}]", i, dtypes=[torch.int32], dim=2, device=device)
        device = i.device
        check_tensor(f"scores[{b}]", s, dtypes=[torch.float32], dim=2, device=device)
        topk = i.shape[1] if topk is None else topk
        if i.shape[1] != topk:
            raise ValueError(f"ids[{b}]: expected topk {topk} like ids[0], got {i.shape[1]}")
        if s.shape != i.shape:
            raise ValueError(f"scores[{b}]: expected shape {list(i.shape)}, got {list(s.shape)}")
        if i.numel():
            lo, hi = int(i.min()), int(i.max())
            if lo < -1 or hi >= num_experts:
                raise ValueError(
                    f"ids[{b}]: expected local expert ids in [-1, {num_experts}), "
                    f"got values in [{lo}, {hi}]"
                )
    assert topk is not None and device is not None
    return int(topk), device


def check_weights(
    w13: torch.Tensor, w2: torch.Tensor, hidden: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, int]:
    """Checks expert weights ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``; returns (E, I)."""
    check_tensor("w13", w13, dtypes=[dtype], dim=3, device=device)
    check_tensor("w2", w2, dtypes=[dtype], dim=3, device=device)
    num_experts, two_i, h = w13.shape
    if h != hidden or two_i % 2 or two_i == 0:
        raise ValueError(
            f"w13: expected shape [E, 2*I, {hidden}] with I > 0, got {list(w13.shape)}"
        )
    inter = two_i // 2
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(
            f"w2: expected shape [{num_experts}, {hidden}, {inter}], got {list(w2.shape)}"
        )
    return int(num_experts), int(inter)
