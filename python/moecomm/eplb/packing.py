"""Balanced packing of weighted items into packs with fixed slot counts, batched over rows.

One row is one independent problem (a layer, or a layer's node). Every step is a handful of
array operations over all rows at once; Python loops run over rounds (slots per pack) and
improvement steps, never over items or rows. The arrays are numpy: these steps are many small
operations, where numpy's per-call cost (about 1 us) beats torch's (about 5 us on CPU) and no
intra-op thread pool waits on busy cores.

1. Rounds: items sorted heaviest first; round r hands the next `active` items to the packs that
   still have a free slot r, heaviest item to the pack with the lowest normalized load.
2. De-duplication: an item whose label (logical expert) already sits in its pack is swapped with
   an item of another pack that holds neither label, choosing the swap that raises the pair's
   load least. Skipped where no such swap exists or where every such swap would raise the
   heaviest pack of the row (or of its group): balance comes first. Run again after refinement,
   when a layer's other nodes have slack below its bottleneck.
3. Refinement: swap one item of the most loaded pack with one item of any other pack, the swap
   that lowers the larger of the two loads most, never creating a duplicate; repeat while the
   row (or the group of rows it belongs to, e.g. the nodes of one layer) improves.

Loads are normalized by pack capacity (load / capacity), so servers of unequal speed work too.
"""

from __future__ import annotations

import numpy as np
import torch

from . import native

# Swaps must lower the heaviest pack by more than this fraction: float noise is not a gain and
# would let the loop run to its cap on ties.
_MIN_RELATIVE_GAIN = 1e-9
# Swap steps per group (refine). On the bench's 58 x 256 lognormal and Zipf loads, 16 and 64
# steps end within 0.01% imbalance of each other; a parallel pair exchange tried before it
# gained nothing measurable and was removed.
MAX_REFINE_STEPS = 16
# De-duplication swaps per row; each fixes one duplicate, and rows rarely hold more than a few.
MAX_DEDUP_STEPS = 64

_INF = np.inf


class Packing:
    """A batch of packings (numpy arrays). `table[row, pack, k]` is the item in slot k of that
    pack (-1 = none); `slot_w` / `slot_l` hold that item's weight (0 for none) and label (-1 for
    none), kept beside the table so improvement steps need no gathers; `loads[row, pack]` sums
    `slot_w`.
    """

    def __init__(
        self,
        table: np.ndarray,
        slot_w: np.ndarray,
        slot_l: np.ndarray | None,
        loads: np.ndarray,
    ):
        self.table = table
        self.slot_w = slot_w
        self.slot_l = slot_l
        self.loads = loads
        # Every slot holds an item (equal slot counts): the padding checks can be skipped.
        self.full = bool((table >= 0).all())

    def rows(self, idx: np.ndarray) -> Packing:
        """A copy of the given rows (the active set of an improvement loop)."""
        labels = None if self.slot_l is None else self.slot_l[idx]
        return Packing(self.table[idx], self.slot_w[idx], labels, self.loads[idx])

    def swap(
        self,
        rows: np.ndarray,
        src: tuple[np.ndarray, np.ndarray],
        dst: tuple[np.ndarray, np.ndarray],
    ) -> None:
        """Swap slot src=(pack, k) with slot dst=(pack, k) in each of `rows`, in place."""
        (sp, sk), (dp, dk) = src, dst
        delta = self.slot_w[rows, sp, sk] - self.slot_w[rows, dp, dk]
        arrays = [self.table, self.slot_w] + ([] if self.slot_l is None else [self.slot_l])
        for t in arrays:
            a, b = t[rows, sp, sk], t[rows, dp, dk]
            t[rows, sp, sk] = b
            t[rows, dp, dk] = a
        self.loads[rows, sp] -= delta
        self.loads[rows, dp] += delta


def _rounds(
    weights: np.ndarray, labels: np.ndarray | None, slots: list[int], capacity: np.ndarray
) -> Packing:
    rows = weights.shape[0]
    num_packs = len(slots)
    max_slots = max(slots)
    if (
        native.on()
        and labels is not None
        and min(slots) == max_slots
        and not bool((capacity != 1.0).any())
    ):
        return Packing(*native.rounds(weights, labels, num_packs, max_slots))
    order = np.argsort(-weights, axis=1, kind="stable")
    sorted_w = np.take_along_axis(weights, order, axis=1)
    slots_a = np.asarray(slots)
    loads = np.zeros((rows, num_packs))
    table = np.full((rows, num_packs, max_slots), -1, dtype=np.int64)
    slot_w = np.zeros((rows, num_packs, max_slots))
    row_idx = np.arange(rows)[:, None]
    start = 0
    for r in range(max_slots):
        active = slots_a > r
        count = int(active.sum())
        if r == 0:
            packs = np.broadcast_to(np.flatnonzero(active), (rows, count))  # all packs empty
        else:
            key = np.where(active, loads / capacity, _INF)
            # Lightest (normalized) packs first; stable: equal loads keep pack order.
            packs = np.argsort(key, axis=1, kind="stable")[:, :count]
        chunk = slice(start, start + count)
        table[row_idx, packs, r] = order[:, chunk]
        slot_w[row_idx, packs, r] = sorted_w[:, chunk]
        loads[row_idx, packs] += sorted_w[:, chunk]  # packs are distinct within a row
        start += count
    slot_l = None
    if labels is not None:
        flat = np.clip(table, 0, None).reshape(rows, -1)
        slot_l = np.take_along_axis(labels, flat, axis=1).reshape(table.shape)
        slot_l[table < 0] = -1
    return Packing(table, slot_w, slot_l, loads)


def _presence(sub: Packing) -> np.ndarray:
    """[B, P, L + 1] bool: pack p holds an item labelled l. Padding (-1) lands in the extra last
    column, which is also where a lookup of label -1 reads: those slots are masked anyway."""
    assert sub.slot_l is not None
    rows, num_packs, _ = sub.slot_l.shape
    num_labels = int(sub.slot_l.max()) + 1
    present = np.zeros((rows, num_packs, num_labels + 1), dtype=bool)
    labels = np.where(sub.slot_l >= 0, sub.slot_l, num_labels)
    present[np.arange(rows)[:, None, None], np.arange(num_packs)[None, :, None], labels] = True
    return present


def _blocked(sub: Packing, src_pack: np.ndarray, a_labels: np.ndarray) -> np.ndarray:
    """[B, Sa, P, Sb] bool: the swap would put two items of one label in a pack (a's label is
    already in pack p, or b's label already in the source pack)."""
    rows, num_packs, _ = sub.table.shape
    r = np.arange(rows)
    present = _presence(sub)
    a_in_dst = present[r[:, None], :, a_labels]  # [B, Sa, P]
    b_in_src = np.take_along_axis(present[r, src_pack], sub.slot_l.reshape(rows, -1), axis=1)
    return a_in_dst[:, :, :, None] | b_in_src.reshape(rows, 1, num_packs, -1)


def _swap_costs(
    sub: Packing,
    capacity: np.ndarray | None,
    src_pack: np.ndarray,
    src_slot: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (item a of src_pack, item b of another pack) swap of each row of `sub`.

    src_slot (optional): only that item of the source pack may move (Sa = 1).
    capacity None means all packs equal (skips the divisions).
    Returns (cost, delta, allowed), each [B, Sa, P, Sb]: cost is the larger normalized load of the
    two packs after the swap, delta = w_a - w_b; allowed excludes empty slots, the source pack
    itself and swaps that would put two items of one label in a pack.
    """
    rows, num_packs, _ = sub.table.shape
    row_idx = np.arange(rows)
    src_w = sub.slot_w[row_idx, src_pack]  # [B, S]
    src_valid = sub.table[row_idx, src_pack] >= 0
    if src_slot is not None:
        src_w = src_w[row_idx, src_slot][:, None]  # [B, 1]
        src_valid = src_valid[row_idx, src_slot][:, None]
    delta = src_w[:, :, None, None] - sub.slot_w[:, None, :, :]
    src_load = sub.loads[row_idx, src_pack][:, None, None, None]
    if capacity is None:
        cost = np.maximum(src_load - delta, sub.loads[:, None, :, None] + delta)
    else:
        new_src = (src_load - delta) / capacity[src_pack][:, None, None, None]
        new_dst = (sub.loads[:, None, :, None] + delta) / capacity[None, None, :, None]
        cost = np.maximum(new_src, new_dst)
    not_src = np.arange(num_packs)[None, :] != src_pack[:, None]  # [B, P]
    allowed = np.broadcast_to(not_src[:, None, :, None], cost.shape)
    if not sub.full:
        allowed = allowed & src_valid[:, :, None, None] & (sub.table >= 0)[:, None, :, :]
    if sub.slot_l is not None:
        src_l = sub.slot_l[row_idx, src_pack]  # [B, S]
        a_l = src_l if src_slot is None else src_l[row_idx, src_slot][:, None]
        allowed = allowed & ~_blocked(sub, src_pack, a_l)
    return cost, delta, allowed


def _duplicate_slots(slot_l: np.ndarray) -> np.ndarray:
    """[B, P, S] bool: the item repeats a label held by an earlier slot of the same pack."""
    # Stable sort of each pack's labels: equal labels become neighbours in slot order, and every
    # one after the first is a duplicate. O(S log S) per pack instead of all S^2 pairs.
    order = np.argsort(slot_l, axis=2, kind="stable")
    sorted_l = np.take_along_axis(slot_l, order, axis=2)
    repeat = np.zeros(slot_l.shape, dtype=bool)
    repeat[:, :, 1:] = (sorted_l[:, :, 1:] == sorted_l[:, :, :-1]) & (sorted_l[:, :, 1:] >= 0)
    dup = np.empty_like(repeat)
    np.put_along_axis(dup, order, repeat, axis=2)
    return dup


def _group_peak(packing: Packing, capacity: np.ndarray, group: np.ndarray | None) -> np.ndarray:
    """[B] the heaviest normalized pack of each row's group (of the row itself without groups)."""
    peak = (packing.loads / capacity).max(axis=1)
    if group is None:
        return peak
    group_peak = np.full(int(group.max()) + 1, -_INF)
    np.maximum.at(group_peak, group, peak)
    return group_peak[group]


def dedup(packing: Packing, capacity: np.ndarray, row_group: np.ndarray | None = None) -> None:
    """Swap duplicates (a label twice in one pack) away where a swap can without raising the
    heaviest pack of the row's group (row_group as in refine); see the module doc."""
    assert packing.slot_l is not None
    rows, _, max_slots = packing.table.shape
    if rows == 0:
        return
    if native.usable(packing, capacity):
        native.dedup(packing, row_group, MAX_DEDUP_STEPS)
        return
    cap = capacity if bool((capacity != 1.0).any()) else None  # None: equal packs
    dup = _duplicate_slots(packing.slot_l).reshape(rows, -1)
    active = np.flatnonzero(dup.any(axis=1))
    for _ in range(MAX_DEDUP_STEPS):
        if active.size == 0:
            return
        bound = _group_peak(packing, capacity, row_group)[active]
        sub = packing.rows(active)
        n = active.size
        dup = _duplicate_slots(sub.slot_l).reshape(n, -1)
        has = dup.any(axis=1)
        first = dup.argmax(axis=1)  # first duplicate slot of each row
        src_pack, src_slot = first // max_slots, first % max_slots
        cost, _, allowed = _swap_costs(sub, cap, src_pack, src_slot)
        sub_idx = np.arange(n)
        # Only the duplicate item itself may leave its pack (Sa = 1).
        cost = np.where(allowed, cost, _INF)
        flat_cost = cost.reshape(n, -1)
        dst = flat_cost.argmin(axis=1)
        # Balance comes first: a duplicate that can only go by raising the group's heaviest pack
        # stays (so does one that no swap can remove).
        go = has & (flat_cost[sub_idx, dst] <= bound)
        sel = np.flatnonzero(go)
        packing.swap(
            active[sel],
            (src_pack[sel], src_slot[sel]),
            (dst[sel] // max_slots, dst[sel] % max_slots),
        )
        active = active[sel]


def rounds_are_optimal(packing: Packing, capacity: np.ndarray) -> bool:
    """True for a packing straight from the rounds (then dedup) with at most two items in every
    one of equal packs: the rounds pair the k-th heaviest item with the k-th lightest, which
    minimizes the heaviest pair, and dedup() never raises it, so refine() cannot help.
    """
    return packing.table.shape[2] <= 2 and packing.full and not bool((capacity != 1.0).any())


def _best_swaps_equal(sub: Packing, top: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """refine()'s search for equal, full packs: per row, the swap between the top pack and any
    other that lowers the pair's larger load most.

    With equal capacities the pair's larger load after moving d = w_a - w_b from the top pack
    (gap g above pack p) drops by min(d, g - d), positive exactly when the swap helps, so one
    array replaces the cost, delta and bounds of _swap_costs; labels are looked up in a
    per-pack presence table instead of comparing every pair of slots.
    Returns (flat index over [Sa, P, Sb], found).
    """
    n = sub.table.shape[0]
    r = np.arange(n)
    top_load = sub.loads[r, top]
    delta = sub.slot_w[r, top][:, :, None, None] - sub.slot_w[:, None, :, :]  # [n, Sa, P, Sb]
    gap = (top_load[:, None] - sub.loads)[:, None, :, None]  # 0 for the top pack itself
    gain = np.minimum(delta, gap - delta)
    if sub.slot_l is not None:
        gain = np.where(_blocked(sub, top, sub.slot_l[r, top]), -_INF, gain)
    flat_gain = gain.reshape(n, -1)
    flat = flat_gain.argmax(axis=1)
    return flat, flat_gain[r, flat] > top_load * _MIN_RELATIVE_GAIN


def refine(
    packing: Packing,
    capacity: np.ndarray,
    max_steps: int = MAX_REFINE_STEPS,
    row_group: np.ndarray | None = None,
) -> None:
    """Swap one item of the heaviest pack with one item of any other pack, the swap that lowers
    the larger of the two loads most; repeat while it helps.

    row_group [B] (optional): rows of one group are judged together by their heaviest pack (the
    nodes of one layer: only the layer's slowest GPU sets its latency). Only rows at their
    group's peak are refined, and a group stops once its peak row cannot improve.
    """
    rows, num_packs, max_slots = packing.table.shape
    if rows == 0:
        return
    if native.usable(packing, capacity):
        native.refine(packing, row_group, max_steps, _MIN_RELATIVE_GAIN)
        return
    per_src = num_packs * max_slots
    cap = capacity if bool((capacity != 1.0).any()) else None  # None: equal packs
    group = np.arange(rows) if row_group is None else row_group
    done = np.zeros(int(group.max()) + 1, dtype=bool)
    for _ in range(max_steps):
        peak = (packing.loads / capacity).max(axis=1)
        at_peak = peak >= _group_peak(packing, capacity, row_group) * (1.0 - _MIN_RELATIVE_GAIN)
        active = np.flatnonzero(at_peak & ~done[group])
        if active.size == 0:
            return
        sub = packing.rows(active)
        n = active.size
        norm = sub.loads / capacity
        top = norm.argmax(axis=1)
        if cap is None and sub.full:
            flat, go = _best_swaps_equal(sub, top)
        else:
            cost, delta, allowed = _swap_costs(sub, cap, top)
            target = norm[np.arange(n), top] * (1.0 - _MIN_RELATIVE_GAIN)
            allowed = allowed & (delta > 0) & (cost < target[:, None, None, None])
            flat_cost = np.where(allowed, cost, _INF).reshape(n, -1)
            flat = flat_cost.argmin(axis=1)
            go = np.isfinite(flat_cost[np.arange(n), flat])
        done[group[active[~go]]] = True  # its peak row is stuck: the group's peak cannot drop
        sel = np.flatnonzero(go)
        rest = flat[sel] % per_src
        packing.swap(
            active[sel],
            (top[sel], flat[sel] // per_src),
            (rest // max_slots, rest % max_slots),
        )


def balanced_pack(
    weights: torch.Tensor | np.ndarray,
    slots: list[int],
    *,
    labels: torch.Tensor | np.ndarray | None = None,
    capacity: torch.Tensor | np.ndarray | None = None,
    refine_steps: int = MAX_REFINE_STEPS,
    row_group: torch.Tensor | np.ndarray | None = None,
) -> Packing:
    """Pack items weights [B, n] into len(slots) packs, pack p taking exactly slots[p] items.

    labels [B, n] (optional): items with the same label avoid sharing a pack when a swap allows.
    capacity [P] (optional): loads are compared as load / capacity.
    row_group [B] (optional): see refine(). Returns numpy arrays (see Packing).
    """
    if sum(slots) != weights.shape[1]:
        raise ValueError(
            f"packing needs as many items as slots: {weights.shape[1]} items, {sum(slots)} slots"
        )
    w = np.asarray(weights, dtype=np.float64)
    cap = np.ones(len(slots)) if capacity is None else np.asarray(capacity, dtype=np.float64)
    lab = None if labels is None else np.asarray(labels, dtype=np.int64)
    packing = _rounds(w, lab, slots, cap)
    if lab is not None:
        dedup(packing, cap)
    group = None if row_group is None else np.asarray(row_group, dtype=np.int64)
    if not rounds_are_optimal(packing, cap):
        refine(packing, cap, refine_steps, group)
    return packing
