"""Baseline for bench/ops/eplb.py: a straightforward implementation of the published greedy EPLB.

Written from the description of DeepSeek's Expert Parallelism Load Balancer, not from its code:

- replica counts: one replica per logical expert, then each redundant slot goes, one at a time,
  to the expert with the largest load per replica (ties: the lowest expert id);
- packing: items sorted by load, heaviest first, each goes to the lightest pack that still has
  room (every pack takes the same number of items), one Python loop per layer;
- hierarchical policy (num_groups % num_nodes == 0): pack expert groups onto nodes, replicate
  within each node, pack the node's replicas onto its GPUs; global policy otherwise (one node,
  one group).

It is kept deliberately plain: it is the reference that moecomm.eplb is timed and compared
against, and the published 2-layer example checks it (tests/eplb/test_baseline.py).
"""

from __future__ import annotations

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [rows, items] -> (pack index, rank in pack) per item, greedy heaviest-first."""
    rows, num_items = weight.shape
    per_pack = num_items // num_packs
    if per_pack == 1:
        idx = torch.arange(num_items, dtype=torch.int64).expand(rows, num_items).clone()
        return idx, torch.zeros_like(idx)
    order = weight.float().sort(-1, descending=True).indices
    # Plain Python lists per row: the fair way to write this loop (tensor scalar indexing would
    # make the baseline look several times slower than it needs to be).
    weight_rows = weight.float().tolist()
    pack_rows, rank_rows = [], []
    for r, row_order in enumerate(order.tolist()):
        loads = [0.0] * num_packs
        counts = [0] * num_packs
        row_weight = weight_rows[r]
        row_pack = [-1] * num_items
        row_rank = [-1] * num_items
        for item in row_order:
            open_packs = [p for p in range(num_packs) if counts[p] < per_pack]
            pack = min(open_packs, key=loads.__getitem__)
            row_pack[item] = pack
            row_rank[item] = counts[pack]
            loads[pack] += row_weight[item]
            counts[pack] += 1
        pack_rows.append(row_pack)
        rank_rows.append(row_rank)
    pack_index = torch.tensor(pack_rows, dtype=torch.int64)
    rank_in_pack = torch.tensor(rank_rows, dtype=torch.int64)
    return pack_index, rank_in_pack


def replicate_experts(
    weight: torch.Tensor, num_phy: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [rows, num_log] -> (phy2log, replica rank, logcnt), one redundant slot at a time."""
    rows, num_log = weight.shape
    rows_idx = torch.arange(rows)
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(rows, 1)
    rank = torch.zeros(rows, num_phy, dtype=torch.int64)
    logcnt = torch.ones(rows, num_log, dtype=torch.int64)
    for slot in range(num_log, num_phy):
        pick = (weight / logcnt).max(dim=-1).indices
        phy2log[:, slot] = pick
        rank[:, slot] = logcnt[rows_idx, pick]
        logcnt[rows_idx, pick] += 1
    return phy2log, rank, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=torch.int64).expand(perm.shape))
    return inv


def _hierarchical(
    weight: torch.Tensor, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layers, num_log = weight.shape
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_phy // num_gpus
    log_per_node = num_log // num_nodes

    # 1. groups -> nodes. "mlog" numbers experts node by node (node-major logical ids).
    group_load = weight.unflatten(-1, (num_groups, group_size)).sum(-1)
    g_pack, g_rank = balanced_packing(group_load, num_nodes)
    log2mlog = (
        ((g_pack * groups_per_node + g_rank) * group_size).unsqueeze(-1)
        + torch.arange(group_size, dtype=torch.int64)
    ).flatten(-2)
    mlog2log = _inverse(log2mlog)

    # 2. replicas within each node.
    node_load = weight.gather(-1, mlog2log).view(-1, log_per_node)
    phy2mlog, phy_rank, mlogcnt = replicate_experts(node_load, num_phy // num_nodes)

    # 3. a node's replicas -> its GPUs.
    phy_load = (node_load / mlogcnt).gather(-1, phy2mlog)
    pack, rank = balanced_packing(phy_load, num_gpus // num_nodes)
    phy2pphy = pack * per_gpu + rank
    pphy2phy = _inverse(phy2pphy)

    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    node_offset = torch.arange(0, num_log, log_per_node, dtype=torch.int64).view(1, -1, 1)
    pphy2mlog = (pphy2mlog.view(layers, num_nodes, -1) + node_offset).flatten(-2)
    pphy2log = mlog2log.gather(-1, pphy2mlog)
    pphy_rank = phy_rank.gather(-1, pphy2phy).view(layers, -1)
    logcnt = mlogcnt.view(layers, -1).gather(-1, log2mlog)
    return pphy2log, pphy_rank, logcnt


def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Published semantics: (phy2log, log2phy, logcnt); see moecomm.eplb.rebalance_experts."""
    layers, num_log = weight.shape
    weight = weight.float().cpu()
    if num_groups % num_nodes == 0:
        phy2log, phy_rank, logcnt = _hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phy_rank, logcnt = _hierarchical(weight, num_replicas, 1, 1, num_gpus)
    max_cnt = num_replicas - num_log + 1
    log2phy = torch.full((layers, num_log, max_cnt), -1, dtype=torch.int64)
    log2phy.view(layers, -1).scatter_(
        -1,
        phy2log * max_cnt + phy_rank,
        torch.arange(num_replicas, dtype=torch.int64).expand(layers, -1),
    )
    return phy2log, log2phy, logcnt
