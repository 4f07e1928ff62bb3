"""DeepEP's low-latency test shape as both rows of bench/ops/vs_deepep.py use it (the host ranks and
the moecomm GPU row, bench/ops/vs_deepep_gpu.py): its inputs, the bytes DeepEP counts, and its
closeness measure. Owned by neither row, so neither imports the other for them."""

from __future__ import annotations

import torch

MASKED = 10  # DeepEP's test masks this many random (token, k) entries to -1


def deepep_inputs(rank: int, tokens: int, hidden: int, experts: int, topk: int, seed: int = 1):
    torch.manual_seed(seed + rank)
    x = (torch.randn(tokens, hidden) * 0.1).to(torch.bfloat16)
    scores = torch.randn(tokens, experts).abs() + 1
    topk_idx = torch.topk(scores, topk, dim=-1, largest=True, sorted=True)[1]
    weights = torch.randn(tokens, topk).abs()
    g = torch.Generator().manual_seed(seed + rank)
    for _ in range(MASKED):
        t = int(torch.randint(tokens, (1,), generator=g))
        topk_idx[t, int(torch.randint(topk, (1,), generator=g))] = -1
    return x, topk_idx, weights


def deepep_bytes(topk_idx: torch.Tensor, hidden: int) -> tuple[int, int]:
    selections = int((topk_idx != -1).sum())
    return selections * (hidden + hidden // 128 * 4 + 16), selections * hidden * 2


def calc_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """1 - cosine-like similarity, DeepEP's closeness measure."""
    a, b = a.double(), b.double()
    denom = (a * a + b * b).sum()
    return float(1 - 2 * (a * b).sum() / denom) if denom else 0.0
