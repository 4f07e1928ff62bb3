"""Redundancy: every expert on at least k distinct GPUs (servers), so that losing k - 1 of them
still leaves a replica of every expert serving (`--min-replicas k`, docs/eplb.md).

How the planners hold it:

- counts: every expert gets at least k replicas (replicas.replica_counts(min_count=k));
- packing: the rounds, de-duplication and refinement of packing.py never lower the number of
  packs a label is in (their swaps never move a label into a pack that holds it), so spread()
  runs once, at the end, and swaps the remaining short experts apart;
- capacity: k copies on k distinct GPUs need, summed over the GPUs, k * E slots that can hold
  distinct experts. limit() says how many copies fit; the planners place that many and say so
  (a log line and Placement.note) when it is fewer than asked.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from .checks import positive_int
from .packing import MAX_REFINE_STEPS, Packing, refine

log = logging.getLogger("moecomm.eplb")


class Placement(tuple):
    """A planner's result: unpacks as the published (phy2log, log2phy, logcnt) triple, and says
    how the minimum-copies constraint went.

    min_replicas: copies asked for; held: every expert is on at least this many distinct GPUs;
    note: why held is below min_replicas ("" when the constraint holds).
    """

    min_replicas: int
    held: int
    note: str

    def __new__(cls, parts: tuple, min_replicas: int = 1, held: int = 1, note: str = ""):
        self = super().__new__(cls, parts)
        self.min_replicas, self.held, self.note = min_replicas, held, note
        return self


def check_min_replicas(value: int) -> int:
    return positive_int(value, "min_replicas")


def limit(slots: Sequence[int], num_experts: int) -> int:
    """The most copies on distinct packs that every one of `num_experts` experts can have, packs
    holding slots[p] slots: the largest k with sum_p min(slots[p], E) >= k * E (a pack holds at
    most one counted copy of each expert; the condition is also sufficient, by Gale-Ryser)."""
    return sum(min(int(s), num_experts) for s in slots) // num_experts


def effective(requested: int, most: int, where: str) -> tuple[int, str]:
    """(copies to place, note): `requested`, or `most` with a note and a log line when fewer
    fit."""
    if requested <= most:
        return requested, ""
    note = (
        f"min_replicas={requested} cannot hold: {where} fit at most {most} "
        f"cop{'y' if most == 1 else 'ies'} of every expert on distinct GPUs; placed {most}"
    )
    log.warning("eplb: %s", note)
    return most, note


def gpus_per_expert(phy2log: np.ndarray, num_experts: int, slots: Sequence[int]) -> np.ndarray:
    """phy2log [L, N] -> [L, E]: how many distinct GPUs hold each expert (GPU g holding the next
    slots[g] slots)."""
    phy2log = np.asarray(phy2log, dtype=np.int64)
    layers = phy2log.shape[0]
    gpu = np.repeat(np.arange(len(slots)), list(slots))
    present = np.zeros((layers, len(slots), num_experts), dtype=bool)
    present[np.arange(layers)[:, None], gpu[None, :], phy2log] = True
    return present.sum(axis=1)


def result(
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slots: Sequence[int],
    min_replicas: int,
    note: str,
) -> Placement:
    """Wraps finalize()'s triple; `held` is read back from phy2log (1 without a constraint:
    every expert has a replica)."""
    held = 1
    if min_replicas > 1:
        phy2log, _, logcnt = parts
        held = int(gpus_per_expert(phy2log.numpy(), logcnt.size(1), slots).min())
    return Placement(parts, min_replicas, held, note)


def _label_counts(packing: Packing, num_labels: int) -> np.ndarray:
    """[B, P, L]: copies of each label in each pack."""
    rows, num_packs, _ = packing.slot_l.shape
    cnt = np.zeros((rows, num_packs, num_labels + 1), dtype=np.int64)
    labels = np.where(packing.slot_l >= 0, packing.slot_l, num_labels)  # padding: last column
    np.add.at(cnt, (np.arange(rows)[:, None, None], np.arange(num_packs)[None, :, None], labels), 1)
    return cnt[:, :, :num_labels]


def spread(packing: Packing, capacity: np.ndarray, min_packs: int) -> None:
    """Puts every label with at least `min_packs` items into at least `min_packs` distinct packs,
    in place: for each short label, a copy sharing a pack with its twin is swapped with an item
    of a pack that lacks the label, the swap that keeps the heavier of the two packs lightest,
    never taking another label below `min_packs`. A row where no such swap exists (possible only
    with unequal packs) is rebuilt by _rebuild_row."""
    if min_packs <= 1 or packing.table.shape[0] == 0:
        return
    assert packing.slot_l is not None
    num_labels = int(packing.slot_l.max()) + 1
    cnt = _label_counts(packing, num_labels)
    short = ((cnt > 0).sum(axis=1) < min_packs) & (cnt.sum(axis=1) >= min_packs)
    for r in np.flatnonzero(short.any(axis=1)):
        if not _swap_apart(packing, capacity, int(r), cnt[r], min_packs):
            _rebuild_row(packing, capacity, int(r), min_packs)


def _swap_apart(
    packing: Packing, capacity: np.ndarray, r: int, cnt: np.ndarray, min_packs: int
) -> bool:
    """spread() on row r; cnt [P, L] (updated in place). False when stuck.

    Each swap raises the short label's pack count by one and lowers no other label below
    `min_packs`, so the summed shortfall bounds the number of swaps. With equal packs a swap
    always exists: if every item of a pack q lacking label a were a single copy of a label of
    a's pack p, q's S distinct labels would fit among the at most S - 2 others of p."""
    _, num_slots = packing.table.shape[1:]
    total = cnt.sum(axis=0)
    row = np.array([r])
    shortfall = int(np.maximum(min_packs - (cnt > 0).sum(axis=0), 0)[total >= min_packs].sum())
    for _ in range(shortfall + 1):
        distinct = (cnt > 0).sum(axis=0)
        short = np.flatnonzero((distinct < min_packs) & (total >= min_packs))
        if short.size == 0:
            return True
        a = int(short[0])
        p = int(cnt[:, a].argmax())  # holds a at least twice: a has more copies than packs
        sa = int(np.flatnonzero(packing.slot_l[r, p] == a)[0])
        labels = packing.slot_l[r]  # [P, S]
        lb = np.where(labels >= 0, labels, 0)
        ok = (labels >= 0) & (cnt[:, a] == 0)[:, None]
        ok &= (
            (cnt[p][lb] == 0)
            | (np.take_along_axis(cnt, lb, axis=1) >= 2)
            | (distinct[lb] > min_packs)
        )
        wa, wb = packing.slot_w[r, p, sa], packing.slot_w[r]
        new_p = (packing.loads[r, p] - wa + wb) / capacity[p]
        new_q = (packing.loads[r][:, None] + wa - wb) / capacity[:, None]
        cost = np.where(ok, np.maximum(new_p, new_q), np.inf)
        best = int(cost.argmin())  # first on ties
        if not np.isfinite(cost.flat[best]):
            return False
        q, sb = divmod(best, num_slots)
        b = int(labels[q, sb])
        packing.swap(row, (np.array([p]), np.array([sa])), (np.array([q]), np.array([sb])))
        cnt[p, a] -= 1
        cnt[q, a] += 1
        cnt[q, b] -= 1
        cnt[p, b] += 1
    return False


def _rebuild_row(packing: Packing, capacity: np.ndarray, r: int, min_packs: int) -> None:
    """Places row r again from its items: first `min_packs` copies of every label, heaviest
    label first, each into the packs with the most free slots left (the Gale-Ryser greedy, which
    finds distinct packs for every label whenever limit() allows), then the other copies
    heaviest first into the lightest pack with room; then refine() (which keeps the spread)."""
    table, slot_w, slot_l = packing.table[r], packing.slot_w[r], packing.slot_l[r]
    num_packs = table.shape[0]
    valid = table >= 0
    items, weights, labels = table[valid], slot_w[valid], slot_l[valid]
    free = valid.sum(axis=1)
    order = np.lexsort((labels, -weights))  # heaviest first, then label id
    new_table = np.full_like(table, -1)
    new_w = np.zeros_like(slot_w)
    new_l = np.full_like(slot_l, -1)
    loads = np.zeros(num_packs)
    fill = np.zeros(num_packs, dtype=np.int64)
    pack_ids = np.arange(num_packs)

    def put(i: int, pack: int) -> None:
        k = fill[pack]
        new_table[pack, k], new_w[pack, k], new_l[pack, k] = items[i], weights[i], labels[i]
        loads[pack] += weights[i]
        fill[pack] += 1

    placed = np.zeros(items.size, dtype=bool)
    for label in dict.fromkeys(labels[order].tolist()):
        mine = order[labels[order] == label][:min_packs]
        # Most free slots first, then the lighter pack, then the lower id.
        packs = np.lexsort((pack_ids, loads / capacity, -(free - fill)))[: mine.size]
        packs = packs[fill[packs] < free[packs]]  # full packs take none (only when k cannot fit)
        for i, pack in zip(mine, packs, strict=False):
            put(int(i), int(pack))
            placed[i] = True
    for i in order[~placed[order]]:
        pack = int(np.where(fill < free, loads / capacity, np.inf).argmin())
        put(int(i), pack)
    packing.table[r], packing.slot_w[r], packing.slot_l[r] = new_table, new_w, new_l
    packing.loads[r] = loads
    one = packing.rows(np.array([r]))
    refine(one, capacity, MAX_REFINE_STEPS)
    packing.table[r], packing.slot_w[r], packing.slot_l[r] = (
        one.table[0],
        one.slot_w[0],
        one.slot_l[0],
    )
    packing.loads[r] = one.loads[0]
