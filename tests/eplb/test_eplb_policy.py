"""rebalance_experts: invariants, the published example, edge cases, errors, determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from eplb_testlib import baseline, check_placement, lognormal, zipf
from moecomm.eplb import duplicates, imbalance, rebalance_experts

# The published 2-layer x 12-expert example: 16 replicas, 4 groups, 2 nodes, 8 GPUs.
EXAMPLE_WEIGHT = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
EXAMPLE_CONFIG = (16, 4, 2, 8)
# Its published phy2log (an external reference: checks the baseline, not our code).
EXAMPLE_PHY2LOG = torch.tensor(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)

# (num_replicas, num_groups, num_nodes, num_gpus): hierarchical, global (groups % nodes != 0),
# one GPU per node, and more slots per GPU than usual.
CONFIGS = [
    (80, 8, 4, 16),
    (80, 8, 3, 40),
    (72, 4, 4, 4),
    (96, 8, 2, 8),
]
LOADS = {
    "lognormal": lambda: lognormal(6, 64, seed=1),
    "lognormal_wide": lambda: lognormal(6, 64, seed=2, sigma=2.0),
    "zipf": lambda: zipf(6, 64, seed=3),
}


def is_hierarchical(cfg):
    return cfg[1] % cfg[2] == 0


def test_baseline_reproduces_published_example():
    phy2log, _, _ = baseline().rebalance_experts(EXAMPLE_WEIGHT, *EXAMPLE_CONFIG)
    assert torch.equal(phy2log, EXAMPLE_PHY2LOG)


def test_published_example():
    phy2log, log2phy, logcnt = rebalance_experts(EXAMPLE_WEIGHT, *EXAMPLE_CONFIG)
    check_placement(phy2log, log2phy, logcnt, 12, 16, group_nodes=(4, 2))
    num_gpus = EXAMPLE_CONFIG[3]
    assert (
        imbalance(phy2log, EXAMPLE_WEIGHT, num_gpus)
        <= imbalance(EXAMPLE_PHY2LOG, EXAMPLE_WEIGHT, num_gpus) + 1e-12
    )
    assert duplicates(phy2log, num_gpus) <= duplicates(EXAMPLE_PHY2LOG, num_gpus)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("load", sorted(LOADS))
def test_invariants_and_never_less_balanced(cfg, load):
    w = LOADS[load]()
    num_replicas, num_groups, num_nodes, num_gpus = cfg
    phy2log, log2phy, logcnt = rebalance_experts(w, *cfg)
    groups = (num_groups, num_nodes) if is_hierarchical(cfg) else None
    check_placement(phy2log, log2phy, logcnt, 64, num_replicas, group_nodes=groups)
    base, _, _ = baseline().rebalance_experts(w, *cfg)
    ours_imb = imbalance(phy2log, w, num_gpus)
    base_imb = imbalance(base, w, num_gpus)
    assert ours_imb <= base_imb + 1e-12, (ours_imb, base_imb)


def test_duplicates_only_where_they_buy_balance():
    # Equal loads: every duplicate can go at no cost, so none may stay.
    w = torch.ones(3, 64)
    phy2log, _, _ = rebalance_experts(w, 96, 8, 4, 16)
    assert duplicates(phy2log, 16) == 0
    # Skewed loads: a duplicate stays only where removing it would raise the layer's heaviest
    # GPU (or no swap can remove it): far fewer than the greedy leaves, at no cost in balance.
    w = lognormal(6, 64, seed=4)
    cfg = (80, 8, 4, 16)
    ours, _, _ = rebalance_experts(w, *cfg)
    base, _, _ = baseline().rebalance_experts(w, *cfg)
    assert duplicates(ours, 16) * 2 <= duplicates(base, 16)
    assert imbalance(ours, w, 16) <= imbalance(base, w, 16)


def test_better_than_baseline_where_greedy_leaves_room():
    # Many slots per GPU: greedy packing leaves a gap that refinement swaps close.
    w = lognormal(8, 64, seed=5, sigma=1.5)
    cfg = (96, 8, 2, 8)
    ours, _, _ = rebalance_experts(w, *cfg)
    base, _, _ = baseline().rebalance_experts(w, *cfg)
    assert imbalance(ours, w, 8) < imbalance(base, w, 8)
    assert duplicates(ours, 8) < duplicates(base, 8)


def test_all_zero_loads_spread_replicas():
    w = torch.zeros(3, 64)
    phy2log, log2phy, logcnt = rebalance_experts(w, 80, 8, 4, 16)
    check_placement(phy2log, log2phy, logcnt, 64, 80, group_nodes=(8, 4))
    # 16 spare slots over 64 idle experts: nobody gets a third replica, expert 0 not favoured.
    assert int(logcnt.max()) == 2
    assert int((logcnt == 2).sum(dim=1).min()) == 16
    assert duplicates(phy2log, 16) == 0


def test_one_hot_expert():
    w = torch.ones(2, 64)
    w[:, 5] = 1e6
    phy2log, log2phy, logcnt = rebalance_experts(w, 80, 8, 3, 16)  # global policy
    check_placement(phy2log, log2phy, logcnt, 64, 80)
    # Greedy gives it all 16 spare slots (17 replicas on 16 GPUs: one GPU carries two). Counts
    # aware of the GPUs stop at one replica per GPU, which lowers the heaviest GPU.
    assert bool((logcnt[:, 5] == 16).all())
    assert duplicates(phy2log, 16) == 0
    base, _, base_cnt = baseline().rebalance_experts(w, 80, 8, 3, 16)
    assert bool((base_cnt[:, 5] == 17).all())
    assert imbalance(phy2log, w, 16) < imbalance(base, w, 16)


def test_one_hot_expert_capped_within_node():
    # Hierarchical: 8 spare slots per node but 4 GPUs; a 9th replica of the hot expert would
    # share a GPU, so the count is capped at the node's GPUs and the load is lower than greedy.
    w = torch.ones(2, 32)
    w[:, 3] = 1e4
    cfg = (48, 4, 2, 8)
    phy2log, log2phy, logcnt = rebalance_experts(w, *cfg)
    check_placement(phy2log, log2phy, logcnt, 32, 48, group_nodes=(4, 2))
    base, _, _ = baseline().rebalance_experts(w, *cfg)
    assert int(logcnt[:, 3].max()) <= 4
    assert imbalance(phy2log, w, 8) < imbalance(base, w, 8)


def test_replicas_equal_experts():
    w = lognormal(4, 32, seed=6)
    phy2log, log2phy, logcnt = rebalance_experts(w, 32, 4, 2, 8)
    check_placement(phy2log, log2phy, logcnt, 32, 32, group_nodes=(4, 2))
    assert bool((logcnt == 1).all())
    assert torch.equal(phy2log.sort(dim=1).values, torch.arange(32).expand(4, -1))


def test_one_layer_and_one_gpu_per_node():
    w = lognormal(1, 32, seed=7)
    phy2log, log2phy, logcnt = rebalance_experts(w, 48, 4, 4, 4)
    check_placement(phy2log, log2phy, logcnt, 32, 48, group_nodes=(4, 4))
    base, _, _ = baseline().rebalance_experts(w, 48, 4, 4, 4)
    assert imbalance(phy2log, w, 4) <= imbalance(base, w, 4) + 1e-12


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ((30, 4, 2, 8), "num_replicas must be >= num_logical_experts"),
        ((36, 4, 2, 8), "num_replicas must be a multiple of num_gpus"),
        ((40, 5, 5, 10), "multiple of num_groups"),
        ((48, 4, 2, 3), "num_gpus must be a multiple of num_nodes"),
        ((0, 4, 2, 8), "num_replicas must be a positive integer"),
        ((48, 4, 2, -1), "num_gpus must be a positive integer"),
        ((48, 4, 0, 8), "num_nodes must be a positive integer"),
    ],
)
def test_configuration_errors(cfg, message):
    with pytest.raises(ValueError, match=message):
        rebalance_experts(lognormal(2, 32, seed=8), *cfg)


def test_gpus_not_divisible_by_nodes():
    with pytest.raises(ValueError, match="num_gpus must be a multiple of num_nodes"):
        rebalance_experts(lognormal(2, 32, seed=9), 36, 4, 4, 6)


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (torch.ones(32), "must be 2-D"),
        (torch.ones(2, 32, 1), "must be 2-D"),
        (torch.full((2, 32), float("nan")), "must be finite"),
        (-torch.ones(2, 32), "non-negative"),
        ([[1.0] * 32], "torch.Tensor or numpy array"),
    ],
)
def test_bad_weight(weight, message):
    with pytest.raises(ValueError, match=message):
        rebalance_experts(weight, 48, 4, 2, 8)


def test_deterministic_input_untouched_numpy_accepted():
    w = zipf(4, 64, seed=10)
    before = w.clone()
    first = rebalance_experts(w, 80, 8, 4, 16)
    second = rebalance_experts(w, 80, 8, 4, 16)
    from_numpy = rebalance_experts(np.asarray(w.numpy()), 80, 8, 4, 16)
    assert torch.equal(w, before)
    for a, b, c in zip(first, second, from_numpy, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a, c)


def test_integer_loads_accepted():
    w = (lognormal(2, 32, seed=11) * 100).to(torch.int64)
    phy2log, log2phy, logcnt = rebalance_experts(w, 48, 4, 2, 8)
    check_placement(phy2log, log2phy, logcnt, 32, 48, group_nodes=(4, 2))


@pytest.mark.parametrize(
    ("weight", "cfg"),
    [
        # Integer loads with ties: the greedy breaks equal replica claims in the order a node
        # holds its groups (heaviest first); taking ids in plain order gave worse counts.
        ([[0.0, 4.0, 2.0, 2.0, 2.0, 4.0]], (12, 3, 1, 4)),
        # Four groups per node: our split had the lower node peak but the higher GPU peak, so
        # the greedy's own split must be tried too.
        ([[51.97, 4.174, 0.133, 6.062, 36.663, 0.432, 7.24, 14.467]], (12, 8, 2, 6)),
    ],
)
def test_never_less_balanced_regressions(weight, cfg):
    w = torch.tensor(weight, dtype=torch.float64)
    ours, log2phy, logcnt = rebalance_experts(w, *cfg)
    check_placement(ours, log2phy, logcnt, w.size(1), cfg[0], group_nodes=cfg[1:3])
    base, _, _ = baseline().rebalance_experts(w, *cfg)
    assert imbalance(ours, w, cfg[3]) <= imbalance(base, w, cfg[3]) + 1e-12
