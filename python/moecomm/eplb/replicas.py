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

import numpy as np

from . import native


def _first_largest_mask(values: np.ndarray, k: int) -> np.ndarray:
    """[B, n] bool: the k largest values of each row; ties at the cut go to lower column ids.

    A partition plus tie masks instead of a sort: on CPU a stable sort of a few hundred thousand
    values costs milliseconds, a partition a fraction of that.
    """
    n = values.shape[1]
    cut = np.partition(values, n - k, axis=1)[:, n - k : n - k + 1]
    above = values > cut
    tied = values == cut
    need = k - above.sum(axis=1, keepdims=True)
    return above | (tied & (np.cumsum(tied, axis=1) <= need))


def _first_largest(values: np.ndarray, k: int) -> np.ndarray:
    """[B, k] column ids of the k largest values per row, in ascending id order."""
    return np.nonzero(_first_largest_mask(values, k))[1].reshape(values.shape[0], k)


def replica_counts(
    weights: np.ndarray,
    num_slots: int,
    *,
    max_count: int | None = None,
    offset: float = 0.0,
    min_count: int = 1,
) -> np.ndarray:
    """weights [B, E] (>= 0) -> counts [B, E] int64, every row summing to num_slots.

    max_count: per-expert cap (raised to ceil(num_slots / E) when it could not fill the slots).
    offset: divisor offset; 0 reproduces the published greedy, larger values favour mid-sized
    experts over the largest one. min_count: replicas every expert gets at least (redundancy).
    """
    rows, num_experts = weights.shape
    if min_count > 1:
        if num_slots < min_count * num_experts:
            raise ValueError(
                f"need {min_count} slots per expert: {num_slots} slots, {num_experts} experts"
            )
        # The same greedy over the slots left once every expert holds min_count replicas: its
        # j-th extra replica then divides the load by min_count - 1 + j (+ offset), so the
        # divisors shift by the replicas each expert already holds.
        base = min_count - 1
        return base + replica_counts(
            weights,
            num_slots - base * num_experts,
            max_count=None if max_count is None else max_count - base,
            offset=offset + base,
        )
    redundant = num_slots - num_experts
    if redundant < 0:
        raise ValueError(f"need at least one slot per expert: {num_slots} slots, {num_experts}")
    counts = np.ones((rows, num_experts), dtype=np.int64)
    if redundant == 0:
        return counts
    floor_cap = -(-num_slots // num_experts)
    cap = redundant + 1 if max_count is None else max(max_count, floor_cap)
    extra = min(redundant, cap - 1)  # most extra replicas one expert can take
    if native.on():
        return native.replica_counts(weights, num_slots, max_count, offset)
    w = np.asarray(weights, dtype=np.float64)
    # Only the `redundant` heaviest experts can win an extra replica: each of them outranks any
    # lighter expert's first extra. Ties at the cut keep the lower expert ids.
    top = _first_largest(w, min(redundant, num_experts))  # [B, T], ascending expert id
    divisors = np.arange(1, extra + 1, dtype=np.float64) + offset
    priority = np.take_along_axis(w, top, axis=1)[:, :, None] / divisors[None, None, :]
    # Zero loads: rank by replicas already given (fewer first), then expert id, below every
    # positive load, so idle experts share the spare slots instead of expert 0 taking them all.
    spread = -np.arange(1, extra + 1, dtype=np.float64)[None, None, :]
    priority = np.where(priority > 0, priority, spread)  # [B, T, K]
    # Expert-major flattening: among equal priorities the lower expert id wins, exactly as the
    # one-slot-at-a-time greedy picks them.
    won = _first_largest_mask(priority.reshape(rows, -1), redundant).reshape(priority.shape)
    np.put_along_axis(counts, top, 1 + won.sum(axis=2), axis=1)
    return counts


def expand_replicas(counts: np.ndarray) -> np.ndarray:
    """counts [B, E] (equal row sums N) -> expert [B, N], expert-major within each row."""
    rows, num_experts = counts.shape
    experts = np.tile(np.arange(num_experts), rows)
    return np.repeat(experts, counts.ravel()).reshape(rows, -1)
