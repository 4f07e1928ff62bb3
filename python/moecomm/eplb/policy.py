"""Full re-placement: the EPLB-compatible entry point and the unequal-server extension."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import native
from .checks import as_weight, check_capacity, check_config, check_slots
from .packing import MAX_REFINE_STEPS, balanced_pack, dedup, refine, rounds_are_optimal
from .redundancy import Placement, check_min_replicas, effective, limit, result, spread
from .replicas import expand_replicas, replica_counts

# Divisor offsets tried, with counts capped at the GPUs available, beside the published counts
# (see replicas.replica_counts). Measured on the bench loads, offsets -0.5 or 1 lowered imbalance
# only on the hierarchical Zipf case (by 0.9% / 0.3%) for about twice the time, so only the
# capped published rule is tried by default.
COUNT_OFFSETS = (0.0,)


def place_rows(
    weights: np.ndarray,
    slots: list[int],
    capacity: np.ndarray | None = None,
    row_group: np.ndarray | None = None,
    min_count: int = 1,
) -> np.ndarray:
    """weights [B, E] -> phy2log [B, sum(slots)] (local expert ids), pack p owning the next
    slots[p] physical slots; every expert on at least min_count distinct packs (the caller
    checked that they fit: redundancy.limit).

    Replica counts: the published ones, and, for the rows where they differ, the ones capped at
    the packs available (for each COUNT_OFFSETS entry). Each is packed (rounds, de-duplication)
    and every row keeps the candidate with the lighter heaviest pack; the swap refinement and a
    last de-duplication then run once, on the kept packing. row_group: see packing.refine.
    """
    rows = weights.shape[0]
    num_slots = sum(slots)
    cap = np.ones(len(slots)) if capacity is None else capacity
    # The published counts first: ties keep them.
    counts = replica_counts(weights, num_slots, min_count=min_count)
    origin = np.arange(rows)
    for offset in COUNT_OFFSETS:
        if offset == 0.0 and int(counts.max()) <= len(slots):
            continue  # the cap does not bind anywhere: same counts as the published ones
        alt = replica_counts(
            weights, num_slots, max_count=len(slots), offset=offset, min_count=min_count
        )
        differ = np.flatnonzero((alt != counts[:rows]).any(axis=1))
        counts = np.concatenate([counts, alt[differ]])
        origin = np.concatenate([origin, differ])
    expert = expand_replicas(counts)
    item_w = np.take_along_axis(weights[origin], expert, axis=1) / np.take_along_axis(
        counts, expert, axis=1
    )
    packing = balanced_pack(item_w, slots, labels=expert, capacity=cap, refine_steps=0)
    if counts.shape[0] > rows:
        # Per original row, the candidate with the lightest heaviest pack (first on ties).
        score = (packing.loads / cap).max(axis=1)
        best = np.full(rows, np.inf)
        np.minimum.at(best, origin, score)
        cand = np.flatnonzero(score <= best[origin])
        pick = np.full(rows, counts.shape[0], dtype=np.int64)
        np.minimum.at(pick, origin[cand], cand)
        packing = packing.rows(pick)
    if not rounds_are_optimal(packing, cap):
        refine(packing, cap, MAX_REFINE_STEPS, row_group)
    # Duplicates the first pass kept for balance may go now, below the group's (layer's) peak.
    dedup(packing, cap, row_group)
    # Redundancy is a hard constraint, after balance: the steps above never lower the packs an
    # expert is on, so the experts still short are swapped apart last.
    spread(packing, cap, min_count)
    # Labels are the local expert ids; -1 marks the padding of servers with fewer slots.
    labels = packing.slot_l.reshape(rows, -1)
    return labels[labels >= 0].reshape(rows, num_slots)


def finalize(
    phy2log: np.ndarray, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """phy2log [L, N] -> (phy2log, log2phy [L, E, N - E + 1] padded with -1, logcnt [L, E]),
    as int64 torch tensors."""
    phy2log = np.ascontiguousarray(phy2log, dtype=np.int64)
    layers, num_slots = phy2log.shape
    if native.on():
        log2phy_t, logcnt_t = native.log2phy(phy2log, num_experts)
        return torch.from_numpy(phy2log), log2phy_t, logcnt_t
    row_base = (np.arange(layers) * num_experts)[:, None]
    logcnt = np.bincount((row_base + phy2log).ravel(), minlength=layers * num_experts)
    logcnt = logcnt.reshape(layers, num_experts)
    # Replica rank = how many earlier slots hold the same expert (stable sort keeps slot order;
    # numpy sorts 16-bit keys by radix, much faster than a comparison sort).
    key = phy2log.astype(np.int16 if num_experts <= np.iinfo(np.int16).max else np.int64)
    order = np.argsort(key, axis=1, kind="stable")
    starts = np.take_along_axis(
        np.cumsum(logcnt, axis=1) - logcnt, np.take_along_axis(phy2log, order, axis=1), axis=1
    )
    rank = np.empty_like(phy2log)
    np.put_along_axis(rank, order, np.arange(num_slots)[None, :] - starts, axis=1)
    # Published width: one expert can hold at most every redundant slot plus its own.
    width = num_slots - num_experts + 1
    log2phy = np.full((layers, num_experts * width), -1, dtype=np.int64)
    np.put_along_axis(
        log2phy, phy2log * width + rank, np.broadcast_to(np.arange(num_slots), phy2log.shape), 1
    )
    return (
        torch.from_numpy(phy2log),
        torch.from_numpy(log2phy.reshape(layers, num_experts, width)),
        torch.from_numpy(logcnt.astype(np.int64)),
    )


def _place_split(
    w: np.ndarray, groups: np.ndarray, group_size: int, slots: list[int], min_count: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Place replicas for a group-to-node split groups [L, nodes, groups per node].

    Returns (phy2log [L, N], heaviest GPU load per layer [L])."""
    layers, num_nodes, _ = groups.shape
    # node_experts[l * nodes + n, i]: logical id of the i-th expert held by node n.
    node_experts = (groups[..., None] * group_size + np.arange(group_size)).reshape(
        layers * num_nodes, -1
    )
    node_w = np.take_along_axis(w.repeat(num_nodes, axis=0), node_experts, axis=1)
    # Replicas within each node, packed onto the node's GPUs, all nodes in one batch.
    layer_of_row = np.arange(layers).repeat(num_nodes)
    local = place_rows(node_w, slots, row_group=layer_of_row, min_count=min_count)
    # Heaviest GPU of each layer, from the node rows' own loads.
    flat = (np.arange(local.shape[0])[:, None] * node_w.shape[1] + local).ravel()
    counts = np.bincount(flat, minlength=node_w.size).reshape(node_w.shape)
    slot_w = np.take_along_axis(node_w / np.maximum(counts, 1), local, axis=1)
    gpu = slot_w.reshape(layers, -1, slots[0]).sum(axis=2)
    phy2log = np.take_along_axis(node_experts, local, axis=1).reshape(layers, -1)
    return phy2log, gpu.max(axis=1)


def _hierarchical(
    w: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    min_count: int = 1,
) -> np.ndarray:
    layers, num_experts = w.shape
    group_size = num_experts // num_groups
    gpus_per_node = num_gpus // num_nodes
    slots = [num_replicas // num_gpus] * gpus_per_node
    per_node = num_groups // num_nodes
    # 1. Groups onto nodes (all replicas of a group stay on its node). A node's groups are held
    # heaviest first, the order in which the greedy breaks ties between equal replica claims.
    group_w = w.reshape(layers, num_groups, group_size).sum(axis=2)
    packed = balanced_pack(group_w, [per_node] * num_nodes)
    phy2log, peak = _place_split(w, packed.table, group_size, slots, min_count)
    if per_node > 2 and num_nodes > 1:
        # A lower node peak does not always give a lower GPU peak: where the greedy's own split
        # differs from ours, place both and keep the better per layer. (With two groups per node
        # both splits pair heaviest with lightest and are equal.)
        greedy = _greedy_split(group_w, num_nodes)
        differ = np.flatnonzero((greedy != packed.table).any(axis=(1, 2)))
        if differ.size:
            alt, alt_peak = _place_split(w[differ], greedy[differ], group_size, slots, min_count)
            better = alt_peak < peak[differ]
            phy2log[differ[better]] = alt[better]
    return phy2log


def _greedy_split(group_w: np.ndarray, num_nodes: int) -> np.ndarray:
    """The published greedy's groups-to-nodes packing, [L, nodes, groups per node]: groups
    heaviest first, each to the least loaded node with room. Sequential over the groups (a
    handful), vectorized over layers; only used as a second candidate (see _hierarchical)."""
    layers, num_groups = group_w.shape
    per_node = num_groups // num_nodes
    order = np.argsort(-group_w, axis=1, kind="stable")
    loads = np.zeros((layers, num_nodes))
    filled = np.zeros((layers, num_nodes), dtype=np.int64)
    table = np.empty((layers, num_nodes, per_node), dtype=np.int64)
    r = np.arange(layers)
    for j in range(num_groups):
        g = order[:, j]
        node = np.where(filled < per_node, loads, np.inf).argmin(axis=1)
        table[r, node, filled[r, node]] = g
        loads[r, node] += group_w[r, g]
        filled[r, node] += 1
    return table


def min_replicas_limit(
    num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[int, str]:
    """(most copies of every expert on distinct GPUs a rebalance_experts configuration fits,
    what bounds it). In the hierarchical policy a group's replicas stay on its node, so each
    node's experts share its GPUs."""
    nodes = num_nodes if num_groups % num_nodes == 0 else 1
    per_node = num_gpus // nodes
    per_gpu = num_replicas // num_gpus
    where = f"{per_node} GPUs of {per_gpu} slots" + (" per node" if nodes > 1 else "")
    return limit([per_gpu] * per_node, num_experts // nodes), where


def rebalance_experts(
    weight: torch.Tensor | np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    min_replicas: int = 1,
) -> Placement:
    """EPLB-compatible placement of `num_replicas` physical expert slots.

    weight: [layers, num_logical_experts] loads (torch or numpy, never modified).
    Returns int64 tensors:
      phy2log [layers, num_replicas]: logical expert of each slot; slot s lives on GPU
        s // (num_replicas // num_gpus).
      log2phy [layers, num_logical_experts, num_replicas - num_logical_experts + 1]: the slots of
        each expert, padded with -1.
      logcnt [layers, num_logical_experts]: replica count of each expert (>= 1).
    Hierarchical policy when num_groups % num_nodes == 0 (groups packed onto nodes, every replica
    of a group on its node), global policy otherwise.
    min_replicas: every expert on at least this many distinct GPUs (default 1: the published
    placement, unchanged); where the configuration cannot hold it, as many as fit, said by a
    log line and the result's `note` (a Placement: the triple, plus min_replicas, held, note).
    """
    w = as_weight(weight)
    hierarchical = check_config(w.size(1), num_replicas, num_groups, num_nodes, num_gpus)
    most, where = min_replicas_limit(w.size(1), num_replicas, num_groups, num_nodes, num_gpus)
    k, note = effective(check_min_replicas(min_replicas), most, where)
    w_np = w.numpy()
    if hierarchical:
        phy2log = _hierarchical(w_np, num_replicas, num_groups, num_nodes, num_gpus, k)
    else:
        phy2log = _hierarchical(w_np, num_replicas, 1, 1, num_gpus, k)
    slots = [num_replicas // num_gpus] * num_gpus
    return result(finalize(phy2log, w.size(1)), slots, min_replicas, note)


def place_experts(
    weight: torch.Tensor | np.ndarray,
    slots_per_gpu: Sequence[int],
    *,
    gpu_capacity: Sequence[float] | torch.Tensor | None = None,
    min_replicas: int = 1,
) -> Placement:
    """Global placement over servers of unequal size (EaaS extension).

    slots_per_gpu[g]: expert slots server g holds; its slots are the next slots_per_gpu[g] physical
    slots (server 0 first). gpu_capacity[g] (default 1 each): relative speed; balance is judged on
    load / capacity. Returns (phy2log, log2phy, logcnt) as rebalance_experts, with
    num_replicas = sum(slots_per_gpu). min_replicas: as in rebalance_experts.
    """
    w = as_weight(weight)
    slots = check_slots(slots_per_gpu, w.size(1))
    capacity = check_capacity(gpu_capacity, len(slots))
    where = f"{len(slots)} GPUs of {slots} slots"
    k, note = effective(check_min_replicas(min_replicas), limit(slots, w.size(1)), where)
    phy2log = place_rows(w.numpy(), slots, capacity.numpy(), min_count=k)
    return result(finalize(phy2log, w.size(1)), slots, min_replicas, note)
