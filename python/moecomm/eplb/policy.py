"""Full re-placement: the EPLB-compatible entry point and the unequal-server extension."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .checks import as_weight, check_capacity, check_config, check_slots
from .packing import MAX_REFINE_STEPS, balanced_pack, dedup, refine, rounds_are_optimal
from .replicas import expand_replicas, replica_counts

# Divisor offsets tried, with counts capped at the GPUs available, beside the published counts
# (see replicas.replica_counts). Measured on the bench loads, offsets -0.5 or 1 lowered imbalance
# only on the hierarchical Zipf case (by 0.9% / 0.3%) for about twice the time, so only the
# capped published rule is tried by default.
COUNT_OFFSETS = (0.0,)


def place_rows(
    weights: torch.Tensor,
    slots: list[int],
    capacity: torch.Tensor | None = None,
    row_group: torch.Tensor | None = None,
) -> torch.Tensor:
    """weights [B, E] -> phy2log [B, sum(slots)] (local expert ids), pack p owning the next
    slots[p] physical slots.

    Replica counts: the published ones, and, for the rows where they differ, the ones capped at
    the packs available (for each COUNT_OFFSETS entry). Each is packed (rounds, de-duplication)
    and every row keeps the candidate with the lighter heaviest pack; the swap refinement and a
    last de-duplication then run once, on the kept packing. row_group: see packing.refine.
    """
    rows = weights.size(0)
    num_slots = sum(slots)
    cap = capacity if capacity is not None else torch.ones(len(slots), dtype=torch.float64)
    counts = replica_counts(weights, num_slots)  # the published counts first: ties keep them
    origin = torch.arange(rows)
    for offset in COUNT_OFFSETS:
        if offset == 0.0 and int(counts.max()) <= len(slots):
            continue  # the cap does not bind anywhere: same counts as the published ones
        alt = replica_counts(weights, num_slots, max_count=len(slots), offset=offset)
        differ = (alt != counts[:rows]).any(dim=1).nonzero().squeeze(1)
        counts = torch.cat([counts, alt[differ]])
        origin = torch.cat([origin, differ])
    expert, _ = expand_replicas(counts)
    item_w = weights[origin].gather(1, expert) / counts.gather(1, expert)
    packing = balanced_pack(item_w, slots, labels=expert, capacity=capacity, refine_steps=0)
    if counts.size(0) > rows:
        # Per original row, the candidate with the lightest heaviest pack (first on ties).
        score = (packing.loads / cap.numpy()).max(axis=1)
        origin_np = origin.numpy()
        best = np.full(rows, np.inf)
        np.minimum.at(best, origin_np, score)
        cand = np.flatnonzero(score <= best[origin_np])
        pick = np.full(rows, counts.size(0), dtype=np.int64)
        np.minimum.at(pick, origin_np[cand], cand)
        packing = packing.rows(pick)
    group = None if row_group is None else row_group.numpy()
    if not rounds_are_optimal(packing, cap.numpy()):
        refine(packing, cap.numpy(), MAX_REFINE_STEPS, group)
    # Duplicates the first pass kept for balance may go now, below the group's (layer's) peak.
    dedup(packing, cap.numpy(), group)
    # Labels are the local expert ids; -1 marks the padding of servers with fewer slots.
    labels = packing.slot_l.reshape(rows, -1)
    return torch.from_numpy(labels[labels >= 0].reshape(rows, num_slots))


def finalize(
    phy2log: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """phy2log [L, N] -> (phy2log, log2phy [L, E, N - E + 1] padded with -1, logcnt [L, E])."""
    layers, num_slots = phy2log.shape
    logcnt = torch.zeros(layers, num_experts, dtype=torch.int64)
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    # Replica rank = how many earlier slots hold the same expert (stable sort keeps slot order;
    # numpy sorts 16-bit keys by radix, much faster than a comparison sort).
    key = phy2log.numpy().astype(np.int16 if num_experts <= np.iinfo(np.int16).max else np.int64)
    order = torch.from_numpy(np.argsort(key, axis=1, kind="stable"))
    starts = (logcnt.cumsum(dim=1) - logcnt).gather(1, phy2log.gather(1, order))
    rank_sorted = torch.arange(num_slots).expand(layers, num_slots) - starts
    rank = torch.empty_like(phy2log).scatter_(1, order, rank_sorted)
    # Published width: one expert can hold at most every redundant slot plus its own.
    width = num_slots - num_experts + 1
    log2phy = torch.full((layers, num_experts, width), -1, dtype=torch.int64)
    log2phy.view(layers, -1).scatter_(
        1, phy2log * width + rank, torch.arange(num_slots).expand(layers, num_slots)
    )
    return phy2log, log2phy, logcnt


def _hierarchical(
    w: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> torch.Tensor:
    layers, num_experts = w.shape
    group_size = num_experts // num_groups
    gpus_per_node = num_gpus // num_nodes
    per_gpu = num_replicas // num_gpus
    # 1. Groups onto nodes (all replicas of a group stay on its node); one node holds them all.
    if num_nodes == 1:
        groups = torch.arange(num_groups).expand(layers, 1, num_groups)
    else:
        group_w = w.view(layers, num_groups, group_size).sum(dim=2)
        packed = balanced_pack(group_w, [num_groups // num_nodes] * num_nodes)
        groups = torch.from_numpy(packed.table)
    # node_experts[l, n, i]: logical id of the i-th expert held by node n.
    node_experts = (groups[..., None] * group_size + torch.arange(group_size)).reshape(
        layers, num_nodes, -1
    )
    node_w = w.gather(1, node_experts.reshape(layers, -1)).view(layers * num_nodes, -1)
    # 2+3. Replicas within each node, packed onto the node's GPUs, all nodes in one batch.
    layer_of_row = torch.arange(layers).repeat_interleave(num_nodes)
    local = place_rows(node_w, [per_gpu] * gpus_per_node, row_group=layer_of_row)
    return node_experts.view(layers * num_nodes, -1).gather(1, local).view(layers, num_replicas)


def rebalance_experts(
    weight: torch.Tensor | np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    """
    w = as_weight(weight)
    hierarchical = check_config(w.size(1), num_replicas, num_groups, num_nodes, num_gpus)
    if hierarchical:
        phy2log = _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log = _hierarchical(w, num_replicas, 1, 1, num_gpus)
    return finalize(phy2log, w.size(1))


def place_experts(
    weight: torch.Tensor | np.ndarray,
    slots_per_gpu: Sequence[int],
    *,
    gpu_capacity: Sequence[float] | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global placement over servers of unequal size (EaaS extension).

    slots_per_gpu[g]: expert slots server g holds; its slots are the next slots_per_gpu[g] physical
    slots (server 0 first). gpu_capacity[g] (default 1 each): relative speed; balance is judged on
    load / capacity. Returns (phy2log, log2phy, logcnt) as rebalance_experts, with
    num_replicas = sum(slots_per_gpu).
    """
    w = as_weight(weight)
    slots = check_slots(slots_per_gpu, w.size(1))
    capacity = check_capacity(gpu_capacity, len(slots))
    return finalize(place_rows(w, slots, capacity), w.size(1))
