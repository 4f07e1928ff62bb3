"""EaaS extensions (unequal servers, load windows) and the metrics, on hand-checkable inputs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from eplb_testlib import check_placement, lognormal
from moecomm.eplb import (
    combine_windows,
    duplicates,
    gpu_loads,
    imbalance,
    imbalance_per_layer,
    place_experts,
    replicas_moved,
)
from moecomm.eplb.assignment import max_weight_matching
from moecomm.eplb.packing import balanced_pack


def test_metrics_on_a_hand_made_placement():
    # 2 GPUs x 2 slots. Expert 0 (load 6) has two replicas (3 each), experts 1 and 2 one each.
    w = torch.tensor([[6.0, 2.0, 4.0]])
    phy2log = torch.tensor([[0, 1, 0, 2]])  # GPU0: 3 + 2 = 5, GPU1: 3 + 4 = 7
    assert torch.equal(gpu_loads(phy2log, w, 2), torch.tensor([[5.0, 7.0]], dtype=torch.float64))
    assert imbalance(phy2log, w, 2) == pytest.approx(7.0 / 6.0)
    assert duplicates(phy2log, 2) == 0
    assert duplicates(torch.tensor([[0, 0, 1, 2]]), 2) == 1
    # Per-server slot counts and capacities: GPU0 holds 3 slots and is twice as fast.
    loads = gpu_loads(phy2log, w, [3, 1])
    assert torch.equal(loads, torch.tensor([[8.0, 4.0]], dtype=torch.float64))
    cap_imb = imbalance_per_layer(phy2log, w, [3, 1], gpu_capacity=[2.0, 1.0])
    assert float(cap_imb[0]) == pytest.approx(1.0)  # 8 / 2 == 4 / 1: balanced for its speed
    # No load at all is perfectly balanced, not a division by zero.
    assert imbalance(phy2log, torch.zeros(1, 3), 2) == 1.0


def test_replicas_moved_counts_only_arrivals():
    old = torch.tensor([[0, 1, 2, 3]])
    assert replicas_moved(old, torch.tensor([[1, 0, 3, 2]]), 2) == 0  # reordered within GPUs
    assert replicas_moved(old, torch.tensor([[2, 1, 0, 3]]), 2) == 2  # one swap across GPUs
    assert replicas_moved(old, torch.tensor([[0, 1, 2, 2]]), 2) == 1  # one new replica
    with pytest.raises(ValueError, match="differ in shape"):
        replicas_moved(old, torch.tensor([[0, 1]]), 2)


def test_combine_windows():
    a, b, c = (torch.full((2, 4), v, dtype=torch.float64) for v in (1.0, 2.0, 4.0))
    # Default: each older window weighs half the next newer one (weights 1/4, 1/2, 1 -> /1.75).
    expected = (0.25 * 1.0 + 0.5 * 2.0 + 1.0 * 4.0) / 1.75
    assert torch.allclose(
        combine_windows(torch.stack([a, b, c])), torch.full((2, 4), expected, dtype=torch.float64)
    )
    assert torch.allclose(
        combine_windows([a, b, c], [1.0, 0.0, 1.0]), torch.full((2, 4), 2.5, dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="one entry per window"):
        combine_windows([a, b], [1.0])
    with pytest.raises(ValueError, match="3-D"):
        combine_windows(a)
    with pytest.raises(ValueError, match="non-negative"):
        combine_windows([a, -b])


def test_unequal_servers():
    w = lognormal(4, 32, seed=30)
    slots = [6, 6, 4, 4, 4, 4, 8, 4]
    phy2log, log2phy, logcnt = place_experts(w, slots)
    check_placement(phy2log, log2phy, logcnt, 32, sum(slots))
    assert duplicates(phy2log, slots) == 0
    # A capacity-aware placement is better balanced, judged with capacities, than one that
    # ignores them.
    cap = [2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 3.0, 1.0]
    aware, _, _ = place_experts(w, slots, gpu_capacity=cap)
    blind = phy2log
    assert imbalance(aware, w, slots, gpu_capacity=cap) < imbalance(
        blind, w, slots, gpu_capacity=cap
    )


@pytest.mark.parametrize(
    ("slots", "cap", "message"),
    [
        ([], None, "at least one GPU"),
        ([4, 0], None, "positive integer"),
        ([4, 4], None, "slots_per_gpu must hold"),
        ([20, 20], [1.0], "one entry per GPU"),
        ([20, 20], [1.0, 0.0], "finite and > 0"),
    ],
)
def test_unequal_server_errors(slots, cap, message):
    with pytest.raises(ValueError, match=message):
        place_experts(torch.ones(2, 32), slots, gpu_capacity=cap)


def test_matching_is_optimal_on_small_cases():
    rng = np.random.default_rng(31)
    for n in (1, 2, 3, 4, 5, 6):
        for _ in range(5):
            score = rng.integers(0, 6, (n, n)).astype(np.float64)
            perm = max_weight_matching(score)
            assert sorted(perm.tolist()) == list(range(n))
            best = max(
                sum(score[i, p[i]] for i in range(n)) for p in itertools.permutations(range(n))
            )
            assert score[np.arange(n), perm].sum() == best


def test_packing_keeps_every_item_once_and_refinement_helps():
    w = lognormal(32, 72, seed=32)
    slots = [9] * 8
    rounds_only = balanced_pack(w, slots, refine_steps=0)
    refined = balanced_pack(w, slots)
    wn = w.numpy()
    for packing in (rounds_only, refined):
        table = packing.table.reshape(32, -1)
        assert (np.sort(table, axis=1) == np.arange(72)).all()
        recomputed = np.take_along_axis(wn, table, axis=1).reshape(32, 8, 9).sum(axis=2)
        assert np.allclose(recomputed, packing.loads)
    peak_rounds = rounds_only.loads.max(axis=1)
    peak_refined = refined.loads.max(axis=1)
    assert (peak_refined <= peak_rounds).all()
    assert (peak_refined < peak_rounds).any()
    with pytest.raises(ValueError, match="as many items as slots"):
        balanced_pack(w, [9] * 7)
