"""min_replicas: every expert on at least k distinct GPUs in every plan (full, incremental,
unequal servers), for random loads and shapes (seeded); the planner says when capacity cannot
hold k; k = 1 is the published placement unchanged."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from eplb_testlib import check_placement, lognormal
from moecomm.eplb import (
    Placement,
    gpus_per_expert,
    place_experts,
    rebalance_experts,
    rebalance_incremental,
)
from moecomm.eplb.packing import Packing
from moecomm.eplb.policy import min_replicas_limit
from moecomm.eplb.redundancy import _label_counts, _swap_apart, limit, spread
from moecomm.eplb.replicas import replica_counts

NUM_CASES = 120
SEED = 28


def loads(rng: random.Random, layers: int, experts: int, index: int) -> torch.Tensor:
    kind = rng.choice(["lognormal", "zero", "hot", "integer"])
    g = torch.Generator().manual_seed(index)
    if kind == "lognormal":
        return torch.exp(2 * torch.randn(layers, experts, generator=g, dtype=torch.float64))
    if kind == "zero":
        return torch.zeros(layers, experts)
    if kind == "hot":
        w = torch.ones(layers, experts)
        w[:, rng.randrange(experts)] = 1e5
        return w
    return torch.randint(0, 5, (layers, experts), generator=g).double()


def random_config(rng: random.Random):
    """(experts, replicas, groups, nodes, gpus) that rebalance_experts accepts."""
    while True:
        nodes, per_node = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 4])
        gpus = nodes * per_node
        groups, group_size = rng.choice([1, 2, 3, 4, 6]), rng.choice([1, 2, 3, 4])
        experts = groups * group_size
        replicas = gpus * rng.choice([1, 2, 3, 4, 5, 6])
        if replicas >= experts:
            return experts, replicas, groups, nodes, gpus


def test_every_plan_holds_min_replicas_for_random_loads():
    rng = random.Random(SEED)
    held_k = 0
    for index in range(NUM_CASES):
        experts, replicas, groups, nodes, gpus = random_config(rng)
        k = rng.choice([2, 3])
        w = loads(rng, rng.choice([1, 2, 3]), experts, index)
        most, _ = min_replicas_limit(experts, replicas, groups, nodes, gpus)
        want = min(k, most)
        out = rebalance_experts(w, replicas, groups, nodes, gpus, min_replicas=k)
        layout = (groups, nodes) if groups % nodes == 0 else None
        check_placement(*out, experts, replicas, group_nodes=layout)
        spread_now = gpus_per_expert(out[0].numpy(), experts, [replicas // gpus] * gpus)
        assert spread_now.min() >= want, (index, k, most)
        assert isinstance(out, Placement) and out.min_replicas == k
        assert out.held == spread_now.min() >= want
        assert (out.note == "") == (k <= most), out.note
        held_k += k <= most
        # Incremental from a placement without the constraint, after a drift.
        prev = rebalance_experts(w, replicas, groups, nodes, gpus)[0]
        drift = w * torch.exp(
            0.3
            * torch.randn(
                w.shape, generator=torch.Generator().manual_seed(index), dtype=torch.float64
            )
        )
        inc = rebalance_incremental(prev, drift, replicas, groups, nodes, gpus, min_replicas=k)
        check_placement(*inc, experts, replicas, group_nodes=layout)
        assert inc.held >= want, (index, k, most)
        # From a placement that holds k: still held; kept as it is where no gain is enough
        # (a layer short of copies would be re-placed whatever the gain).
        again = rebalance_incremental(out[0], w, replicas, groups, nodes, gpus, min_replicas=k)
        assert again.held >= want
        kept = rebalance_incremental(
            out[0], drift, replicas, groups, nodes, gpus, min_replicas=k, min_gain=0.99
        )
        assert torch.equal(kept[0], out[0])
    assert held_k > NUM_CASES // 3  # most cases had room for k: the constraint was exercised


def test_unequal_servers_hold_min_replicas():
    rng = random.Random(SEED + 1)
    for index in range(60):
        experts = rng.choice([2, 3, 4, 6, 8])
        slots = [rng.randint(1, 6) for _ in range(rng.randint(2, 5))]
        if sum(slots) < experts:
            continue
        k = rng.choice([2, 3])
        cap = [rng.choice([1.0, 2.0]) for _ in slots]
        w = loads(rng, 2, experts, index)
        out = place_experts(w, slots, gpu_capacity=cap, min_replicas=k)
        check_placement(*out, experts, sum(slots))
        got = gpus_per_expert(out[0].numpy(), experts, slots).min()
        assert got >= min(k, limit(slots, experts)) and out.held == got, (slots, k)


def test_a_row_no_swap_can_fix_is_rebuilt():
    """Unequal packs where no single swap gives expert 0 a third pack (every item of the packs
    lacking it is a needed copy, or one whose move would crowd pack 0): spread() rebuilds the
    row, every expert on 3 packs, no item lost. (Found by a seeded search over small rows.)"""
    slots = [6, 3, 3, 2]
    labels = [[3, 0, 2, 0, 1, 2], [0, 0, 2], [1, 2, 3], [3, 1]]
    table = np.full((1, 4, 6), -1)
    slot_l = np.full((1, 4, 6), -1)
    item = 0
    for p, row in enumerate(labels):
        for s, label in enumerate(row):
            table[0, p, s], slot_l[0, p, s] = item, label
            item += 1
    weights = np.where(table >= 0, 1.0, 0.0)
    packing = Packing(table, weights.copy(), slot_l.copy(), weights.sum(axis=2))
    assert limit(slots, 4) >= 3
    counts = _label_counts(packing, 4)[0]
    assert not _swap_apart(packing, np.ones(4), 0, counts.copy(), 3)  # stuck: the fallback's case
    packing = Packing(table, weights.copy(), slot_l.copy(), weights.sum(axis=2))
    spread(packing, np.ones(4), 3)
    out = packing.slot_l[0]
    for label in range(4):
        assert sum(label in set(row[row >= 0].tolist()) for row in out) >= 3, out
    assert sorted(packing.table[0][packing.table[0] >= 0].tolist()) == list(range(item))
    assert ((packing.table[0] >= 0).sum(axis=1) == slots).all()  # every pack keeps its size
    assert np.allclose(packing.loads[0], packing.slot_w[0].sum(axis=1))


def test_counts_follow_the_greedy_above_the_floor():
    """replica_counts(min_count=k): k each, then one replica at a time to the largest load per
    replica (ties to the lower id), as the published greedy from a start of k."""
    rng = np.random.default_rng(SEED)
    for _ in range(50):
        experts, k = int(rng.integers(1, 9)), int(rng.integers(2, 4))
        slots = k * experts + int(rng.integers(0, 12))
        w = np.round(rng.lognormal(size=(3, experts)) * 4) + 1.0  # positive, with ties
        counts = replica_counts(w, slots, min_count=k)
        for row in range(3):
            ref = np.full(experts, k)
            for _ in range(slots - k * experts):
                ref[int(np.argmax(w[row] / ref))] += 1
            assert counts[row].tolist() == ref.tolist()


def test_capacity_that_cannot_hold_k_is_said(caplog):
    w = lognormal(2, 12, seed=1)
    with caplog.at_level(logging.WARNING, logger="moecomm.eplb"):
        out = rebalance_experts(w, 16, 1, 1, 4, min_replicas=2)  # 16 slots < 2 x 12
    check_placement(*out, 12, 16)
    assert out.held == 1 and "min_replicas=2 cannot hold" in out.note
    assert "at most 1 copy" in out.note and out.note in caplog.text
    # Three GPUs cannot hold four copies, however many slots.
    out = rebalance_experts(w, 48, 1, 1, 3, min_replicas=4)
    assert out.held == 3 and "at most 3 copies" in out.note
    with pytest.raises(ValueError, match="min_replicas must be a positive integer"):
        rebalance_experts(w, 16, 1, 1, 4, min_replicas=0)


def test_k_of_one_is_the_published_placement():
    w = lognormal(4, 16, seed=2)
    for cfg in ((32, 4, 2, 8), (24, 1, 1, 6)):
        old = rebalance_experts(w, *cfg)
        new = rebalance_experts(w, *cfg, min_replicas=1)
        assert all(torch.equal(a, b) for a, b in zip(old, new, strict=True))
        assert new.held == 1 and new.note == ""
