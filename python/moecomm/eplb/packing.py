"""Balanced packing of weighted items into packs with fixed slot counts, batched over rows.

One row is one independent problem (a layer, or a layer's node). Every step is a handful of
tensor operations over all rows at once; Python loops run over rounds (slots per pack) and
improvement steps, never over items or rows.

1. Rounds: items sorted heaviest first; round r hands the next `active` items to the packs that
   still have a free slot r, heaviest item to the pack with the lowest normalized load.
2. De-duplication: an item whose label (logical expert) already sits in its pack is swapped with
   an item of another pack that holds neither label, choosing the swap that raises the pair's
   load least. Skipped where no such swap exists (a duplicate that cannot be avoided).
3. Refinement: swap one item of the most loaded pack with one item of any other pack, the swap
   that lowers the larger of the two loads most, never creating a duplicate; repeat while the
   row (or the group of rows it belongs to, e.g. the nodes of one layer) improves.

Loads are normalized by pack capacity (load / capacity), so servers of unequal speed work too.
"""

from __future__ import annotations

import torch

# Swaps must lower the heaviest pack by more than this fraction: float noise is not a gain and
# would let the loop run to its cap on ties.
_MIN_RELATIVE_GAIN = 1e-9
# Swap steps per group (refine). On the bench's 58 x 256 lognormal and Zipf loads, 16 and 64
# steps end within 0.01% imbalance of each other; a parallel pair exchange tried before it
# gained nothing measurable and was removed.
MAX_REFINE_STEPS = 16
# De-duplication swaps per row; each fixes one duplicate, and rows rarely hold more than a few.
MAX_DEDUP_STEPS = 64

_INF = float("inf")


class Packing:
    """A batch of packings. `table[row, pack, k]` is the item in slot k of that pack (-1 = none);
    `slot_w` / `slot_l` hold that item's weight (0 for none) and label (-1 for none), kept beside
    the table so improvement steps need no gathers; `loads[row, pack]` sums `slot_w`.
    """

    def __init__(
        self,
        table: torch.Tensor,
        slot_w: torch.Tensor,
        slot_l: torch.Tensor | None,
        loads: torch.Tensor,
    ):
        self.table = table
        self.slot_w = slot_w
        self.slot_l = slot_l
        self.loads = loads

    def rows(self, idx: torch.Tensor) -> Packing:
        """A copy of the given rows (the active set of an improvement loop)."""
        labels = None if self.slot_l is None else self.slot_l[idx]
        return Packing(self.table[idx], self.slot_w[idx], labels, self.loads[idx])

    def swap(
        self,
        rows: torch.Tensor,
        src: tuple[torch.Tensor, torch.Tensor],
        dst: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Swap slot src=(pack, k) with slot dst=(pack, k) in each of `rows`, in place."""
        (sp, sk), (dp, dk) = src, dst
        delta = self.slot_w[rows, sp, sk] - self.slot_w[rows, dp, dk]
        tensors = [self.table, self.slot_w] + ([] if self.slot_l is None else [self.slot_l])
        for t in tensors:
            a, b = t[rows, sp, sk], t[rows, dp, dk]
            t[rows, sp, sk] = b
            t[rows, dp, dk] = a
        self.loads[rows, sp] -= delta
        self.loads[rows, dp] += delta


def _rounds(
    weights: torch.Tensor, labels: torch.Tensor | None, slots: list[int], capacity: torch.Tensor
) -> Packing:
    rows = weights.size(0)
    num_packs = len(slots)
    max_slots = max(slots)
    order = weights.sort(dim=1, descending=True, stable=True).indices
    sorted_w = weights.gather(1, order)
    slots_t = torch.tensor(slots, dtype=torch.int64)
    loads = torch.zeros(rows, num_packs, dtype=weights.dtype)
    table = torch.full((rows, num_packs, max_slots), -1, dtype=torch.int64)
    slot_w = torch.zeros(rows, num_packs, max_slots, dtype=weights.dtype)
    row_idx = torch.arange(rows).unsqueeze(1)
    start = 0
    for r in range(max_slots):
        active = slots_t > r
        count = int(active.sum())
        key = (loads / capacity).masked_fill(~active, _INF)
        # Lightest (normalized) packs first; stable so equal loads keep pack order (determinism).
        packs = key.sort(dim=1, stable=True).indices[:, :count]
        chunk = slice(start, start + count)
        table[row_idx, packs, r] = order[:, chunk]
        slot_w[row_idx, packs, r] = sorted_w[:, chunk]
        loads.scatter_add_(1, packs, sorted_w[:, chunk])
        start += count
    slot_l = None
    if labels is not None:
        slot_l = labels.gather(1, table.clamp(min=0).view(rows, -1)).view(table.shape)
        slot_l = slot_l.masked_fill(table < 0, -1)
    return Packing(table, slot_w, slot_l, loads)


def _swap_costs(
    sub: Packing, capacity: torch.Tensor, src_pack: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (item a of src_pack, item b of another pack) swap of each row of `sub`.

    Returns (cost, delta, allowed), each [B, Sa, P, Sb]: cost is the larger normalized load of the
    two packs after the swap, delta = w_a - w_b; allowed excludes empty slots, the source pack
    itself and swaps that would put two items of one label in a pack.
    """
    rows, num_packs, _ = sub.table.shape
    row_idx = torch.arange(rows)
    src_w = sub.slot_w[row_idx, src_pack]  # [B, Sa]
    delta = src_w[:, :, None, None] - sub.slot_w[:, None, :, :]
    src_load = sub.loads[row_idx, src_pack][:, None, None, None]
    src_cap = capacity[src_pack][:, None, None, None]
    new_src = (src_load - delta) / src_cap
    new_dst = (sub.loads[:, None, :, None] + delta) / capacity[None, None, :, None]
    cost = torch.maximum(new_src, new_dst)
    valid = sub.table >= 0
    allowed = valid[row_idx, src_pack][:, :, None, None] & valid[:, None, :, :]
    not_src = torch.arange(num_packs)[None, :] != src_pack[:, None]  # [B, P]
    allowed &= not_src[:, None, :, None]
    if sub.slot_l is not None:
        src_l = sub.slot_l[row_idx, src_pack]  # [B, Sa]
        same = sub.slot_l[:, None, :, :] == src_l[:, :, None, None]  # [B, Sa, P, Sb]
        a_label_in_dst = same.any(dim=3, keepdim=True)  # a's label already in pack p
        b_label_in_src = same.any(dim=1, keepdim=True)  # b's label already in the source pack
        allowed &= ~(a_label_in_dst | b_label_in_src)
    return cost, delta, allowed


def _duplicate_slots(slot_l: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[B, P, S] bool: the item repeats a label held by an earlier slot of the same pack."""
    max_slots = table.size(2)
    same = slot_l[:, :, :, None] == slot_l[:, :, None, :]
    earlier = torch.ones(max_slots, max_slots, dtype=torch.bool).tril(diagonal=-1)
    valid = (table >= 0)[:, :, :, None]
    return (same & earlier & valid).any(dim=3)


def _dedup(packing: Packing, capacity: torch.Tensor) -> None:
    assert packing.slot_l is not None
    rows, _, max_slots = packing.table.shape
    dup = _duplicate_slots(packing.slot_l, packing.table).view(rows, -1)
    active = dup.any(dim=1).nonzero().squeeze(1)
    for _ in range(MAX_DEDUP_STEPS):
        if active.numel() == 0:
            return
        sub = packing.rows(active)
        n = active.numel()
        dup = _duplicate_slots(sub.slot_l, sub.table).view(n, -1)
        has = dup.any(dim=1)
        first = dup.to(torch.int8).argmax(dim=1)  # first duplicate slot of each row
        src_pack, src_slot = first // max_slots, first % max_slots
        cost, _, allowed = _swap_costs(sub, capacity, src_pack)
        sub_idx = torch.arange(n)
        # Only the duplicate item itself may leave its pack.
        cost = cost[sub_idx, src_slot].masked_fill(~allowed[sub_idx, src_slot], _INF)
        best = cost.view(n, -1).min(dim=1)
        go = has & ~torch.isinf(best.values)  # no allowed swap: the duplicate is unavoidable here
        sel = go.nonzero().squeeze(1)
        dst = best.indices[sel]
        packing.swap(
            active[sel],
            (src_pack[sel], src_slot[sel]),
            (dst // max_slots, dst % max_slots),
        )
        active = active[sel]


def refine(
    packing: Packing,
    capacity: torch.Tensor,
    max_steps: int = MAX_REFINE_STEPS,
    row_group: torch.Tensor | None = None,
) -> None:
    """Swap one item of the heaviest pack with one item of any other pack, the swap that lowers
    the larger of the two loads most; repeat while it helps.

    row_group [B] (optional): rows of one group are judged together by their heaviest pack (the
    nodes of one layer: only the layer's slowest GPU sets its latency). Only rows at their
    group's peak are refined, and a group stops once its peak row cannot improve.
    """
    rows, num_packs, max_slots = packing.table.shape
    per_src = num_packs * max_slots
    group = torch.arange(rows) if row_group is None else row_group
    num_groups = int(group.max()) + 1 if rows else 0
    done = torch.zeros(num_groups, dtype=torch.bool)
    for _ in range(max_steps):
        peak = (packing.loads / capacity).max(dim=1).values
        group_peak = torch.full((num_groups,), -_INF, dtype=peak.dtype)
        group_peak = group_peak.scatter_reduce(0, group, peak, reduce="amax")
        at_peak = peak >= group_peak[group] * (1.0 - _MIN_RELATIVE_GAIN)
        active = (at_peak & ~done[group]).nonzero().squeeze(1)
        if active.numel() == 0:
            return
        sub = packing.rows(active)
        n = active.numel()
        top = (sub.loads / capacity).max(dim=1)
        cost, delta, allowed = _swap_costs(sub, capacity, top.indices)
        target = top.values * (1.0 - _MIN_RELATIVE_GAIN)
        allowed &= (delta > 0) & (cost < target[:, None, None, None])
        best = cost.masked_fill(~allowed, _INF).view(n, -1).min(dim=1)
        go = ~torch.isinf(best.values)
        done[group[active[~go]]] = True  # its peak row is stuck: the group's peak cannot drop
        sel = go.nonzero().squeeze(1)
        flat = best.indices[sel]
        rest = flat % per_src
        packing.swap(
            active[sel],
            (top.indices[sel], flat // per_src),
            (rest // max_slots, rest % max_slots),
        )


def balanced_pack(
    weights: torch.Tensor,
    slots: list[int],
    *,
    labels: torch.Tensor | None = None,
    capacity: torch.Tensor | None = None,
    refine_steps: int = MAX_REFINE_STEPS,
    row_group: torch.Tensor | None = None,
) -> Packing:
    """Pack items weights [B, n] into len(slots) packs, pack p taking exactly slots[p] items.

    labels [B, n] (optional): items with the same label avoid sharing a pack when a swap allows.
    capacity [P] (optional): loads are compared as load / capacity.
    row_group [B] (optional): see refine().
    """
    if sum(slots) != weights.size(1):
        raise ValueError(
            f"packing needs as many items as slots: {weights.size(1)} items, {sum(slots)} slots"
        )
    weights = weights.to(torch.float64)
    if capacity is None:
        capacity = torch.ones(len(slots), dtype=torch.float64)
    packing = _rounds(weights, labels, slots, capacity)
    if labels is not None:
        _dedup(packing, capacity)
    refine(packing, capacity, refine_steps, row_group)
    return packing
