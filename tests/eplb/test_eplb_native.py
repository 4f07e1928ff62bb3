"""The C++ packing steps (moecomm.eplb.native) give bit-identical placements to the numpy
reference path, on random configurations and on a bench-sized skewed case."""

from __future__ import annotations

import random

import pytest
import torch
from moecomm.eplb import native, rebalance_experts, rebalance_incremental
from test_eplb_random import random_case

NUM_CASES = 120
SEED = 23

pytestmark = pytest.mark.skipif(native._C is None, reason="moecomm._C without the eplb kernels")


def both(fn, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(native, "ENABLED", True)
        fast = fn()
        m.setattr(native, "ENABLED", False)
        reference = fn()
    return fast, reference


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_native_matches_numpy_random(monkeypatch):
    rng = random.Random(SEED)
    for index in range(NUM_CASES):
        w, cfg = random_case(rng, index)
        if index % 2:  # heavier skew than the shared generator, more refinement work
            g = torch.Generator().manual_seed(index)
            w = torch.exp(3 * torch.randn(w.shape, generator=g))
        fast, ref = both(lambda w=w, cfg=cfg: rebalance_experts(w, *cfg), monkeypatch)
        assert same(fast, ref), (index, cfg)
        g = torch.Generator().manual_seed(5000 + index)
        w_next = w * (1 + 0.1 * torch.rand(w.shape, generator=g))
        prev = ref[0]
        inc = both(lambda p=prev, w=w_next, cfg=cfg: rebalance_incremental(p, w, *cfg), monkeypatch)
        assert same(*inc), (index, cfg)


@pytest.mark.parametrize("cfg", [(288, 8, 4, 32), (288, 8, 18, 144)])
def test_native_matches_numpy_bench_shape(monkeypatch, cfg):
    g = torch.Generator().manual_seed(3)
    w = torch.exp(1.5 * torch.randn(12, 256, generator=g, dtype=torch.float64))
    fast, ref = both(lambda: rebalance_experts(w, *cfg), monkeypatch)
    assert same(fast, ref)
