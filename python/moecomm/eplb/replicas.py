"""Replica counts: how many physical slots each logical expert gets, batched over rows.

Every expert gets one replica; the redundant slots go to the largest priorities
`load / (count + offset)`, which is the sequential greedy "give the next replica to the expert
with the largest load per replica" (offset 0) computed in one sort instead of one step per slot.
Ties go to the lower expert id, as in the greedy; zero loads instead rank by fewer replicas first,
so idle experts share spare slots instead of piling them onto expert 0.

A cap keeps an expert's replica count at most the number of packs (GPUs) it can be spread over:
past that, two replicas share a GPU and the extra replica lowers nothing. The cap is raised when
the slots could not all be filled under it.
"""

from __future__ import annotations

import torch


def _first_largest_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """[B, n] bool: the k largest values of each row; ties at the cut go to lower column ids.

    A top-k plus tie masks instead of a sort: on CPU a stable sort of a few hundred thousand
    values costs milliseconds, the top-k a fraction of that.
    """
    cut = values.topk(k, dim=1).values[:, -1:]
    above = values > cut
    tied = values == cut
    need = k - above.sum(dim=1, keepdim=True)
    return above | (tied & (tied.cumsum(dim=1) <= need))


def _first_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k] column ids of the k largest values per row, in ascending id order."""
    mask = _first_largest_mask(values, k)
    return mask.nonzero()[:, 1].view(values.size(0), k)


def replica_counts(
    weights: torch.Tensor, num_slots: int, *, max_count: int | None = None, offset: float = 0.0
) -> torch.Tensor:
    """weights [B, E] (>= 0) -> counts [B, E] int64, every row summing to num_slots.

    max_count: per-expert cap (raised to ceil(num_slots / E) when it could not fill the slots).
    offset: divisor offset; 0 reproduces the published greedy, larger values favour mid-sized
    experts over the largest one.
    """
    rows, num_experts = weights.shape
    redundant = num_slots - num_experts
    if redundant < 0:
        raise ValueError(f"need at least one slot per expert: {num_slots} slots, {num_experts}")
    counts = torch.ones(rows, num_experts, dtype=torch.int64)
    if redundant == 0:
        return counts
    floor_cap = -(-num_slots // num_experts)
    cap = redundant + 1 if max_count is None else max(max_count, floor_cap)
    extra = min(redundant, cap - 1)  # most extra replicas one expert can take
    w = weights.to(torch.float64)
    # Only the `redundant` heaviest experts can win an extra replica: each of them outranks any
    # lighter expert's first extra. Ties at the cut keep the lower expert ids.
    top = _first_largest(w, min(redundant, num_experts))  # [B, T], ascending expert id
    divisors = torch.arange(1, extra + 1, dtype=torch.float64) + offset
    priority = w.gather(1, top)[:, :, None] / divisors[None, None, :]  # [B, T, K]
    # Zero loads: rank by replicas already given (fewer first), then expert id, below every
    # positive load, so idle experts share the spare slots instead of expert 0 taking them all.
    spread = -torch.arange(1, extra + 1, dtype=torch.float64)[None, None, :]
    priority = torch.where(priority > 0, priority, spread)
    # Expert-major flattening: among equal priorities the lower expert id wins, exactly as the
    # one-slot-at-a-time greedy picks them.
    won = _first_largest_mask(priority.reshape(rows, -1), redundant).view(priority.shape)
    counts.scatter_add_(1, top, won.sum(dim=2))
    return counts


def expand_replicas(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [B, E] (equal row sums N) -> (expert [B, N], replica rank [B, N]), expert-major."""
    rows = counts.size(0)
    num_slots = int(counts[0].sum())
    ends = counts.cumsum(dim=1)
    slot = torch.arange(num_slots, dtype=torch.int64).expand(rows, num_slots).contiguous()
    expert = torch.searchsorted(ends, slot, right=True)
    rank = slot - (ends - counts).gather(1, expert)
    return expert, rank
