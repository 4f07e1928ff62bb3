"""Assignment problems for relabelling: which new GPU (or node) takes over which old one.

A Hungarian solver (shortest augmenting paths with potentials, O(n^3)) whose inner scan over
columns is one numpy expression; the outer loops run over rows and path steps only.
"""

from __future__ import annotations

import numpy as np


def max_weight_matching(score: np.ndarray) -> np.ndarray:
    """score [n, n] -> perm with perm[i] = column matched to row i, maximizing the summed score."""
    score = np.asarray(score, dtype=np.float64)
    if score.ndim != 2 or score.shape[0] != score.shape[1]:
        raise ValueError(f"score must be a square matrix, got shape {score.shape}")
    cost = score.max(initial=0.0) - score  # minimize cost == maximize score; keeps cost >= 0
    n = cost.shape[0]
    # 1-based potentials and matching as in the textbook formulation; index 0 is the virtual
    # column that each augmentation starts from.
    u = np.zeros(n + 1)
    v = np.zeros(n + 1)
    row_of = np.zeros(n + 1, dtype=np.int64)  # row_of[j]: row matched to column j (0 = none)
    way = np.zeros(n + 1, dtype=np.int64)
    for i in range(1, n + 1):
        row_of[0] = i
        j0 = 0
        minv = np.full(n + 1, np.inf)
        used = np.zeros(n + 1, dtype=bool)
        while True:
            used[j0] = True
            i0 = row_of[j0]
            cur = cost[i0 - 1] - u[i0] - v[1:]
            free = ~used[1:]
            better = free & (cur < minv[1:])
            minv[1:][better] = cur[better]
            way[1:][better] = j0
            masked = np.where(free, minv[1:], np.inf)
            j1 = int(masked.argmin()) + 1
            delta = masked[j1 - 1]
            u[row_of[used]] += delta
            v[used] -= delta
            minv[~used] -= delta
            j0 = j1
            if row_of[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            row_of[j0] = row_of[j1]
            j0 = j1
    perm = np.empty(n, dtype=np.int64)
    perm[row_of[1:] - 1] = np.arange(n)
    return perm
