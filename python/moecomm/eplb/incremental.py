"""Re-placement that moves few experts: start from the placement that is already loaded.

Per layer, two candidates are built and the cheaper acceptable one is kept:

- repair: keep the previous placement, change only the replica counts that the new loads call
  for (a surplus replica leaves the most loaded GPU holding it; a missing one goes to the least
  loaded free slot), then de-duplicate and make a few improving swaps;
- full: a fresh rebalance_experts placement whose nodes and GPUs are relabelled to overlap the
  previous one as much as possible (an assignment problem per layer), with slots inside a GPU
  ordered so that experts that stay keep their slot.

The repair is kept when its heaviest GPU is within `tolerance` of the full one; a layer keeps
its previous placement untouched when neither gains `min_gain` over it — unless it has an
expert on fewer than `min_replicas` GPUs: such a layer is always re-placed (both candidates
hold the constraint).
"""

from __future__ import annotations

import numpy as np
import torch

from .assignment import max_weight_matching
from .checks import as_weight, check_config
from .packing import Packing, dedup, refine
from .policy import finalize, min_replicas_limit, rebalance_experts
from .redundancy import Placement, check_min_replicas, gpus_per_expert, result, spread
from .replicas import replica_counts

# A layer is re-placed only if its heaviest GPU drops by at least this fraction: smaller gains
# are within the noise of load statistics and not worth moving weights for.
DEFAULT_MIN_GAIN = 0.01
# The repair candidate wins if its heaviest GPU is at most this fraction above a full
# rebalance's: the bar is "imbalance within 1% of a full rebalance".
DEFAULT_TOLERANCE = 0.01
# Improving swaps allowed after a repair, tried in order: the first budget whose result is within
# `tolerance` of a full rebalance wins. Each swap moves two replicas per GPU pair, so small budgets
# first; on the bench's 5% drift case 4 swaps settle most layers and 16 most of the rest.
REPAIR_SWAPS = (4, 16)


def _histogram(phy2log: torch.Tensor, slot_pack: torch.Tensor, num_packs: int, num_experts: int):
    """[L, packs, experts] replica counts per pack."""
    layers = phy2log.size(0)
    h = torch.zeros(layers, num_packs * num_experts, dtype=torch.float64)
    h.scatter_add_(
        1,
        slot_pack[None, :] * num_experts + phy2log,
        torch.ones(phy2log.shape, dtype=torch.float64),
    )
    return h.view(layers, num_packs, num_experts)


def _match(new_hist: torch.Tensor, old_hist: torch.Tensor) -> np.ndarray:
    """[L, n, E] x [L, n, E] -> perm [L, n]: new unit perm[l, j] takes the place of old unit j."""
    # Replicas in common; a GPU rarely holds an expert twice, so the product of counts is the
    # overlap (and one batched matmul instead of a [L, n, n, E] minimum).
    overlap = torch.bmm(new_hist, old_hist.transpose(1, 2))
    perms = np.stack([max_weight_matching(o.T.numpy()) for o in overlap])  # rows = old units
    return perms


def _align_slots(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """old, new [B, S] (the slots of one GPU each row): reorder `new` so every expert that
    stays keeps its old slot; the others fill the remaining slots in order."""
    rows, slots = new.shape
    out = torch.full_like(new, -1)
    taken = torch.zeros(rows, slots, dtype=torch.bool)
    placed = torch.zeros(rows, slots, dtype=torch.bool)
    row_idx = torch.arange(rows)
    for i in range(slots):  # slots per GPU: a handful
        cand = (old == new[:, i : i + 1]) & ~taken
        has = cand.any(dim=1)
        j = cand.to(torch.int8).argmax(dim=1)
        r = row_idx[has]
        out[r, j[has]] = new[r, i]
        taken[r, j[has]] = True
        placed[r, i] = True
    free_pos = taken.to(torch.int8).argsort(dim=1, stable=True)  # free slots first
    rest = placed.to(torch.int8).argsort(dim=1, stable=True)  # unplaced items first
    num_free = (~taken).sum(dim=1, keepdim=True)
    fill = torch.arange(slots)[None, :] < num_free
    r, t = fill.nonzero(as_tuple=True)
    out[r, free_pos[r, t]] = new.gather(1, rest)[r, t]
    return out


def _relabel(
    full: torch.Tensor, prev: torch.Tensor, num_nodes: int, num_gpus: int, num_experts: int
) -> torch.Tensor:
    """Permute nodes, then GPUs within nodes, then slots within GPUs of `full` to match `prev`."""
    layers, num_slots = full.shape
    per_gpu = num_slots // num_gpus
    gpus_per_node = num_gpus // num_nodes
    gpu_slots = full.view(layers, num_gpus, per_gpu)
    slot_gpu = torch.arange(num_slots) // per_gpu
    if num_nodes > 1:
        slot_node = slot_gpu // gpus_per_node
        perm = _match(
            _histogram(full, slot_node, num_nodes, num_experts),
            _histogram(prev, slot_node, num_nodes, num_experts),
        )
        node_blocks = gpu_slots.view(layers, num_nodes, gpus_per_node, per_gpu)
        node_blocks = node_blocks[torch.arange(layers)[:, None], torch.from_numpy(perm)]
        gpu_slots = node_blocks.reshape(layers, num_gpus, per_gpu)
    # GPUs within each node: one matching per (layer, node).
    flat = gpu_slots.reshape(layers, num_slots)
    new_h = _histogram(flat, slot_gpu, num_gpus, num_experts)
    old_h = _histogram(prev, slot_gpu, num_gpus, num_experts)
    shape = (layers * num_nodes, gpus_per_node, num_experts)
    perm = torch.from_numpy(_match(new_h.view(shape), old_h.view(shape)))  # [L*nodes, gpn]
    node_base = (torch.arange(layers * num_nodes) % num_nodes * gpus_per_node)[:, None]
    src_gpu = (perm + node_base).view(layers, num_gpus)
    gpu_slots = gpu_slots[torch.arange(layers)[:, None], src_gpu]
    aligned = _align_slots(
        prev.view(layers * num_gpus, per_gpu), gpu_slots.reshape(layers * num_gpus, per_gpu)
    )
    return aligned.view(layers, num_slots)


def _valid_layers(
    prev: np.ndarray, num_experts: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """[L] bool: every expert present and, for the hierarchical policy, every group on one node."""
    layers, num_slots = prev.shape
    row = np.arange(layers)[:, None]
    counts = np.bincount((row * num_experts + prev).ravel(), minlength=layers * num_experts)
    ok = (counts.reshape(layers, num_experts) > 0).all(axis=1)
    if num_nodes == 1:
        return ok
    slot_node = (np.arange(num_slots) // (num_slots // num_gpus)) // (num_gpus // num_nodes)
    node = np.broadcast_to(slot_node, prev.shape).ravel()
    key = (row * num_groups + prev // (num_experts // num_groups)).ravel()
    lo = np.full(layers * num_groups, num_nodes)
    hi = np.full(layers * num_groups, -1)
    np.minimum.at(lo, key, node)
    np.maximum.at(hi, key, node)
    ok &= (lo == hi).reshape(layers, num_groups).all(axis=1)
    home = row * num_nodes + np.clip(lo, 0, num_nodes - 1).reshape(layers, num_groups)
    per_node = np.bincount(home.ravel(), minlength=layers * num_nodes)
    return ok & (per_node.reshape(layers, num_nodes) == num_groups // num_nodes).all(axis=1)


def _repair(
    w: np.ndarray, prev: np.ndarray, num_nodes: int, num_gpus: int, swaps: int, min_count: int = 1
):
    """Keep prev, fix replica counts for the loads w, de-duplicate, a few improving swaps; every
    expert ends on at least min_count GPUs.

    Works per (layer, node): the node's experts stay on it, so groups stay where they are.
    Returns the new phy2log [L, N].
    """
    layers, num_slots = prev.shape
    num_experts = w.shape[1]
    per_gpu = num_slots // num_gpus
    gpus_per_node = num_gpus // num_nodes
    node_slots = num_slots // num_nodes
    rows = layers * num_nodes
    row = np.arange(rows)[:, None]
    slots = prev.reshape(rows, node_slots)
    # The node's experts, in id order (every row holds num_experts / num_nodes of them).
    present = np.zeros((rows, num_experts), dtype=bool)
    present[row, slots] = True
    experts = np.nonzero(present)[1].reshape(rows, -1)  # [rows, E_node] logical ids
    node_experts = experts.shape[1]
    # slot -> local expert id: a search in the row-offset flattening (sorted within rows).
    local = np.searchsorted((row * num_experts + experts).ravel(), (row * num_experts + slots))
    local = local - row * node_experts
    row_w = np.take_along_axis(w.repeat(num_nodes, axis=0), experts, axis=1)
    old_cnt = np.bincount((row * node_experts + local).ravel(), minlength=rows * node_experts)
    old_cnt = old_cnt.reshape(rows, node_experts)
    new_cnt = replica_counts(row_w, node_slots, max_count=gpus_per_node, min_count=min_count)
    surplus = np.maximum(old_cnt - new_cnt, 0)
    deficit = np.maximum(new_cnt - old_cnt, 0)

    # Loads with the old counts; a surplus replica leaves the most loaded GPU holding its expert.
    slot_gpu = np.arange(node_slots) // per_gpu
    slot_load = np.take_along_axis(row_w / np.maximum(old_cnt, 1), local, axis=1)
    gpu_load = slot_load.reshape(rows, gpus_per_node, per_gpu).sum(axis=2)
    gpu_rank = np.argsort(np.argsort(-gpu_load, axis=1, kind="stable"), axis=1, kind="stable")
    order = np.argsort(local * gpus_per_node + gpu_rank[:, slot_gpu], axis=1, kind="stable")
    sorted_local = np.take_along_axis(local, order, axis=1)
    starts = np.take_along_axis(np.cumsum(old_cnt, axis=1) - old_cnt, sorted_local, axis=1)
    pos = np.arange(node_slots)[None, :] - starts  # 0 = on the most loaded GPU
    freed = np.empty((rows, node_slots), dtype=bool)
    np.put_along_axis(freed, order, pos < np.take_along_axis(surplus, sorted_local, 1), axis=1)
    gpu_load -= (slot_load * freed).reshape(rows, gpus_per_node, per_gpu).sum(axis=2)

    # Missing replicas, heaviest per-replica load first, into freed slots, lightest GPU first.
    num_moves = int(deficit.sum(axis=1).max())
    new_local = local.copy()
    if num_moves:
        per_rep = row_w / new_cnt
        ends = np.cumsum(deficit, axis=1)
        k = np.arange(num_moves)
        who = np.minimum((ends[:, None, :] <= k[None, :, None]).sum(axis=2), node_experts - 1)
        real = k[None, :] < ends[:, -1:]
        who_w = np.where(real, np.take_along_axis(per_rep, who, axis=1), -1.0)
        by_w = np.argsort(-who_w, axis=1, kind="stable")
        who = np.take_along_axis(who, by_w, axis=1)
        real = np.take_along_axis(real, by_w, axis=1)
        freed_load = np.where(freed, gpu_load[:, slot_gpu], np.inf)
        dest = np.argsort(freed_load, axis=1, kind="stable")[:, :num_moves]
        r, t = np.nonzero(real)
        new_local[r, dest[r, t]] = who[r, t]

    # De-duplicate and improve with the packing machinery: item = slot, label = local expert.
    shape = (rows, gpus_per_node, per_gpu)
    slot_w = np.take_along_axis(row_w / new_cnt, new_local, axis=1).reshape(shape)
    table = np.broadcast_to(np.arange(node_slots), (rows, node_slots)).reshape(shape).copy()
    packing = Packing(table, slot_w, new_local.reshape(shape), slot_w.sum(axis=2))
    capacity = np.ones(gpus_per_node)
    # Only the bottleneck node of each layer needs swaps (the others do not set its latency).
    group = np.arange(layers).repeat(num_nodes)
    dedup(packing, capacity, group)
    refine(packing, capacity, swaps, group)
    dedup(packing, capacity, group)
    spread(packing, capacity, min_count)  # copies that missing replicas put on one GPU
    result_local = packing.slot_l.reshape(rows, node_slots)
    return np.take_along_axis(experts, result_local, axis=1).reshape(layers, num_slots)


def _layer_peak(phy2log: np.ndarray, w: np.ndarray, num_gpus: int) -> np.ndarray:
    """[L] heaviest GPU load per layer."""
    layers = phy2log.shape[0]
    row = np.arange(layers)[:, None]
    counts = np.bincount((row * w.shape[1] + phy2log).ravel(), minlength=w.size)
    per_replica = w / np.maximum(counts.reshape(w.shape), 1)
    slot_w = np.take_along_axis(per_replica, phy2log, axis=1)
    return slot_w.reshape(layers, num_gpus, -1).sum(axis=2).max(axis=1)


def rebalance_incremental(
    previous_phy2log: torch.Tensor | np.ndarray,
    weight: torch.Tensor | np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    min_gain: float = DEFAULT_MIN_GAIN,
    tolerance: float = DEFAULT_TOLERANCE,
    swaps: tuple[int, ...] = REPAIR_SWAPS,
    min_replicas: int = 1,
) -> Placement:
    """Like rebalance_experts, but starting from `previous_phy2log` [layers, num_replicas] and
    moving as few replicas as it can (see the module docstring). Same outputs and policies;
    neither input is modified.

    min_gain: a layer keeps its previous placement unless its heaviest GPU drops by this
      fraction. tolerance: the low-movement repair is used when its heaviest GPU is within this
      fraction of a full rebalance's. swaps: budgets of improving swaps after a repair, smallest
      first. min_replicas: as in rebalance_experts; a layer whose previous placement has an
      expert on fewer GPUs is re-placed whatever the gain.
    """
    w = as_weight(weight)
    layers, num_experts = w.shape
    hierarchical = check_config(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    prev = torch.as_tensor(previous_phy2log).detach().to(device="cpu", dtype=torch.int64)
    if prev.shape != (layers, num_replicas):
        raise ValueError(
            f"previous_phy2log must be [layers={layers}, num_replicas={num_replicas}], "
            f"got {tuple(prev.shape)}"
        )
    if prev.numel() and not 0 <= int(prev.numpy().min()) <= int(prev.numpy().max()) < num_experts:
        raise ValueError(f"previous_phy2log ids must lie in [0, {num_experts})")
    for name, value in (("min_gain", min_gain), ("tolerance", tolerance)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")
    nodes = num_nodes if hierarchical else 1
    groups = num_groups if hierarchical else 1
    check_min_replicas(min_replicas)
    most, _ = min_replicas_limit(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    k = min(min_replicas, most)

    planned = rebalance_experts(
        w, num_replicas, num_groups, num_nodes, num_gpus, min_replicas=min_replicas
    )
    full = planned[0].numpy()
    prev_np, w_np = prev.numpy(), w.numpy()

    def relabelled(rows: np.ndarray) -> np.ndarray:
        # Relabelling leaves loads unchanged, so it is solved only for the layers that use it.
        out = full.copy()
        if rows.size:
            sub = _relabel(torch.from_numpy(full[rows]), prev[rows], nodes, num_gpus, num_experts)
            out[rows] = sub.numpy()
        return out

    # Layers whose previous placement breaks the policy (an expert missing, a group split across
    # nodes) cannot be repaired: they start from the relabelled full placement instead.
    valid = _valid_layers(prev_np, num_experts, groups, nodes, num_gpus)
    start = np.where(valid[:, None], prev_np, relabelled(np.flatnonzero(~valid)))
    if k > 1:  # a layer short of copies is never kept as it is
        slots = [num_replicas // num_gpus] * num_gpus
        valid_kept = valid & (gpus_per_expert(prev_np, num_experts, slots).min(axis=1) >= k)
    else:
        valid_kept = valid
    peak_prev = np.where(valid_kept, _layer_peak(prev_np, w_np, num_gpus), np.inf)
    peak_full = _layer_peak(full, w_np, num_gpus)
    chosen, peak_new = start, peak_full
    use_any = np.zeros(layers, dtype=bool)
    # Larger swap budgets first, so the smallest acceptable budget overwrites the others.
    for budget in sorted(swaps, reverse=True):
        repaired = _repair(w_np, start, nodes, num_gpus, budget, k)
        peak_rep = _layer_peak(repaired, w_np, num_gpus)
        use_rep = peak_rep <= peak_full * (1.0 + tolerance)
        chosen = np.where(use_rep[:, None], repaired, chosen)
        peak_new = np.where(use_rep, peak_rep, peak_new)
        use_any |= use_rep
    # Layers no repair could match take the full placement, relabelled to overlap prev.
    need_full = ~use_any & valid
    chosen = np.where(need_full[:, None], relabelled(np.flatnonzero(need_full)), chosen)
    keep = peak_new > peak_prev * (1.0 - min_gain)
    placed = finalize(np.where(keep[:, None], prev_np, chosen), num_experts)
    return result(placed, [num_replicas // num_gpus] * num_gpus, min_replicas, planned.note)
