"""Shared helpers for the eplb tests: load generators and the placement invariants."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def baseline():
    """The published-greedy baseline module from bench/ (the tests compare against it)."""
    if str(BENCH_DIR / "ops") not in sys.path:
        sys.path.insert(0, str(BENCH_DIR / "ops"))
    import eplb_baseline

    return eplb_baseline


def lognormal(layers: int, experts: int, seed: int, sigma: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.exp(sigma * torch.randn(layers, experts, generator=g, dtype=torch.float64))


def zipf(layers: int, experts: int, seed: int, s: float = 1.0) -> torch.Tensor:
    """Zipf loads with a random expert order per layer (many exact ties between ratios)."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(experts, generator=g) for _ in range(layers)]) + 1
    return 1000.0 / ranks.to(torch.float64) ** s


def check_placement(
    phy2log: torch.Tensor,
    log2phy: torch.Tensor,
    logcnt: torch.Tensor,
    num_experts: int,
    num_replicas: int,
    *,
    group_nodes: tuple[int, int] | None = None,
) -> None:
    """Assert every documented invariant of (phy2log, log2phy, logcnt).

    group_nodes = (num_groups, num_nodes): also check every replica of a group lies
    on one node (hierarchical policy).
    """
    layers = phy2log.size(0)
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == torch.int64
    assert phy2log.shape == (layers, num_replicas)
    width = num_replicas - num_experts + 1
    assert log2phy.shape == (layers, num_experts, width)
    assert logcnt.shape == (layers, num_experts)
    assert int(phy2log.min()) >= 0 and int(phy2log.max()) < num_experts
    assert bool((logcnt >= 1).all()), "every expert needs a replica"
    recount = torch.zeros_like(logcnt).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    assert torch.equal(recount, logcnt)
    assert bool((logcnt.sum(dim=1) == num_replicas).all())
    # log2phy: the first logcnt entries are distinct slots of that expert, the rest -1.
    k = torch.arange(width)[None, None, :]
    filled = k < logcnt[:, :, None]
    assert bool((log2phy[~filled] == -1).all())
    slots = log2phy.clamp(min=0)
    owner = phy2log.gather(1, slots.view(layers, -1)).view(slots.shape)
    expert = torch.arange(num_experts)[None, :, None].expand_as(owner)
    assert bool((owner[filled] == expert[filled]).all())
    seen = torch.zeros(layers, num_replicas, dtype=torch.int64)
    seen.scatter_add_(1, slots.view(layers, -1), filled.view(layers, -1).to(torch.int64))
    assert bool((seen == 1).all()), "log2phy must list every slot exactly once"
    if group_nodes is not None:
        num_groups, num_nodes = group_nodes
        per_node = num_replicas // num_nodes
        node = (torch.arange(num_replicas) // per_node).expand(layers, -1)
        group = phy2log // (num_experts // num_groups)
        lo = torch.full((layers, num_groups), num_nodes).scatter_reduce(1, group, node, "amin")
        hi = torch.full((layers, num_groups), -1).scatter_reduce(1, group, node, "amax")
        assert torch.equal(lo, hi), "a group's replicas must stay on one node"
