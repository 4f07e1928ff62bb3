"""Randomized small configurations (fixed seed): invariants hold and we are never less balanced
than the published greedy, whatever the shape or the loads."""

from __future__ import annotations

import random

import torch
from eplb_testlib import baseline, check_placement
from moecomm.eplb import imbalance, rebalance_experts, rebalance_incremental

NUM_CASES = 150
SEED = 7


def random_case(rng: random.Random, index: int):
    while True:
        nodes, gpus_per_node = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 4])
        num_gpus = nodes * gpus_per_node
        groups, group_size = rng.choice([1, 2, 3, 4, 6, 8]), rng.choice([1, 2, 3, 4])
        experts = groups * group_size
        replicas = num_gpus * rng.choice([1, 2, 3, 4, 5])
        if replicas >= experts:
            break
    layers = rng.choice([1, 2, 3])
    kind = rng.choice(["lognormal", "zero", "hot", "integer", "equal"])
    g = torch.Generator().manual_seed(index)
    if kind == "lognormal":
        w = torch.exp(2 * torch.randn(layers, experts, generator=g))
    elif kind == "zero":
        w = torch.zeros(layers, experts)
    elif kind == "hot":
        w = torch.ones(layers, experts)
        w[:, rng.randrange(experts)] = 1e5
    elif kind == "integer":
        w = torch.randint(0, 5, (layers, experts), generator=g).float()
    else:
        w = torch.full((layers, experts), 3.0)
    return w, (replicas, groups, nodes, num_gpus)


def test_random_configurations():
    rng = random.Random(SEED)
    for index in range(NUM_CASES):
        w, cfg = random_case(rng, index)
        replicas, groups, nodes, num_gpus = cfg
        layout = (groups, nodes) if groups % nodes == 0 else None
        phy2log, log2phy, logcnt = rebalance_experts(w, *cfg)
        check_placement(phy2log, log2phy, logcnt, w.size(1), replicas, group_nodes=layout)
        base, _, _ = baseline().rebalance_experts(w, *cfg)
        ours_imb, base_imb = imbalance(phy2log, w, num_gpus), imbalance(base, w, num_gpus)
        assert ours_imb <= base_imb + 1e-9, (index, cfg, ours_imb, base_imb)
        g = torch.Generator().manual_seed(1000 + index)
        w_next = w * (1 + 0.1 * torch.rand(w.shape, generator=g))
        inc = rebalance_incremental(phy2log, w_next, *cfg)
        check_placement(*inc, w.size(1), replicas, group_nodes=layout)
