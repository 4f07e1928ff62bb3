"""rebalance_incremental: moves few replicas, stays close to a full rebalance, keeps invariants."""

from __future__ import annotations

import pytest
import torch
from eplb_testlib import check_placement, lognormal
from moecomm.eplb import (
    duplicates,
    imbalance,
    rebalance_experts,
    rebalance_incremental,
    replicas_moved,
)
from moecomm.eplb.incremental import _relabel

# 5% multiplicative drift of every expert's load, the acceptance scenario.
DRIFT = 0.05
MAX_MOVED_FRACTION = 0.20
MAX_IMBALANCE_EXCESS = 0.01

CONFIGS = [(288, 8, 4, 32), (288, 8, 3, 144)]


def drifted(w: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return w * (1.0 + DRIFT * torch.randn(w.shape, generator=g, dtype=torch.float64)).clamp(min=0)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_drift_moves_few_and_stays_balanced(cfg):
    w0 = lognormal(16, 256, seed=20)
    w1 = drifted(w0, seed=21)
    num_gpus = cfg[3]
    prev, _, _ = rebalance_experts(w0, *cfg)
    prev_copy, w1_copy = prev.clone(), w1.clone()
    phy2log, log2phy, logcnt = rebalance_incremental(prev, w1, *cfg)
    assert torch.equal(prev, prev_copy) and torch.equal(w1, w1_copy)
    groups = cfg[1:3] if cfg[1] % cfg[2] == 0 else None
    check_placement(phy2log, log2phy, logcnt, 256, cfg[0], group_nodes=groups)
    full, _, _ = rebalance_experts(w1, *cfg)
    moved = replicas_moved(prev, phy2log, num_gpus) / prev.numel()
    assert moved <= MAX_MOVED_FRACTION, moved
    ours = imbalance(phy2log, w1, num_gpus)
    assert ours <= imbalance(full, w1, num_gpus) * (1 + MAX_IMBALANCE_EXCESS)
    assert ours < imbalance(prev, w1, num_gpus)  # it did improve on doing nothing
    assert duplicates(phy2log, num_gpus) <= duplicates(full, num_gpus)


def test_unchanged_loads_move_nothing():
    w = lognormal(4, 64, seed=22)
    prev, _, _ = rebalance_experts(w, 80, 8, 4, 16)
    phy2log, _, _ = rebalance_incremental(prev, w, 80, 8, 4, 16)
    assert torch.equal(phy2log, prev)


def test_gain_below_threshold_keeps_previous():
    w0 = lognormal(4, 64, seed=23)
    prev, _, _ = rebalance_experts(w0, 80, 8, 4, 16)
    w1 = drifted(w0, seed=24)
    kept, _, _ = rebalance_incremental(prev, w1, 80, 8, 4, 16, min_gain=0.9)
    assert torch.equal(kept, prev)
    moved, _, _ = rebalance_incremental(prev, w1, 80, 8, 4, 16, min_gain=0.0)
    assert imbalance(moved, w1, 16) <= imbalance(prev, w1, 16)


def test_previous_breaking_the_policy_is_replaced():
    # A previous placement with one group split across nodes (and a missing expert) cannot be
    # repaired in place; the result must still satisfy the hierarchical invariants.
    w = lognormal(3, 64, seed=25)
    prev = torch.arange(80).remainder(64).expand(3, -1).clone()
    prev[0, 0], prev[0, 79] = prev[0, 79], prev[0, 0]
    prev[1, 3] = 4  # expert 3 has no replica left
    phy2log, log2phy, logcnt = rebalance_incremental(prev, w, 80, 8, 4, 16)
    check_placement(phy2log, log2phy, logcnt, 64, 80, group_nodes=(8, 4))


@pytest.mark.parametrize(("num_nodes", "num_gpus"), [(1, 16), (4, 16)])
def test_relabel_recovers_a_renumbered_placement(num_nodes, num_gpus):
    # The same placement with nodes, GPUs and slots renumbered moves nothing once relabelled:
    # the assignment must find the renumbering back, slot order included.
    w = lognormal(2, 64, seed=26)
    prev, _, _ = rebalance_experts(w, 64, 8, max(num_nodes, 3), num_gpus)
    g = torch.Generator().manual_seed(27)
    per_gpu, gpn = 64 // num_gpus, num_gpus // num_nodes
    blocks = prev.view(2, num_nodes, gpn, per_gpu)
    blocks = blocks[:, torch.randperm(num_nodes, generator=g)]
    blocks = blocks[:, :, torch.randperm(gpn, generator=g)]
    blocks = blocks[..., torch.randperm(per_gpu, generator=g)]
    shuffled = blocks.reshape(2, 64)
    assert not torch.equal(shuffled, prev)
    assert torch.equal(_relabel(shuffled, prev, num_nodes, num_gpus, 64), prev)


@pytest.mark.parametrize(
    ("prev_shape", "message"),
    [((2, 79), "previous_phy2log must be"), ((3, 80), "previous_phy2log must be")],
)
def test_shape_errors(prev_shape, message):
    with pytest.raises(ValueError, match=message):
        rebalance_incremental(
            torch.zeros(prev_shape, dtype=torch.int64), torch.ones(2, 64), 80, 8, 4, 16
        )


def test_bad_ids_and_thresholds():
    prev = torch.full((2, 80), 64)
    with pytest.raises(ValueError, match="ids must lie in"):
        rebalance_incremental(prev, torch.ones(2, 64), 80, 8, 4, 16)
    ok_prev, _, _ = rebalance_experts(torch.ones(2, 64), 80, 8, 4, 16)
    with pytest.raises(ValueError, match="min_gain must be in"):
        rebalance_incremental(ok_prev, torch.ones(2, 64), 80, 8, 4, 16, min_gain=1.5)
