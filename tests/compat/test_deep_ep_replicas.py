"""moecomm's ``replicas=`` extension of the DeepEP-shaped Buffer's shrink mode: a masked rank's
experts that have a replica elsewhere are re-routed instead of dropped.

Four ranks as processes (deep_ep_replicas_procs.py), each with a replicas Buffer and a plain
shrink Buffer (``replicas=None``): (a) nobody masked: both equal the fault-free result; (b) one
rank stops calling and is masked: with replicas the combine equals the fault-free output for
every token whose experts all have a live copy (bit for bit), without replicas those copies are
dropped; (c) ``replicas=None`` keeps DeepEP's shapes exactly. Plus one-process argument checks."""

import moecomm
import pytest
import torch
import torch.distributed as dist
from deep_ep_procs import launch
from deep_ep_replicas_procs import DEAD, NUM_RANKS, replicas_rank
from moecomm.compat.deep_ep import Buffer
from moecomm.compat.low_latency.replicas import ReplicaPlan, check_replicas_arg

LAUNCH_TIMEOUT_S = 120


@pytest.mark.timeout(200)
def test_replicas_reroute_a_masked_ranks_experts(tmp_path):
    reaped = []

    class Reaper:
        def process(self, p):
            reaped.append(p)
            return p

    try:
        results = launch(
            NUM_RANKS,
            str(tmp_path / "store"),
            ["replicas"],
            Reaper(),
            LAUNCH_TIMEOUT_S,
            target=replicas_rank,
        )
    finally:
        for p in reaped:
            if p.is_alive():
                p.kill()  # a forked one may be reaped already
            p.join(5)
            moecomm.reap_stale_segments(p.pid)
    for rank, res in enumerate(results):
        status, _ = res["replicas"]
        assert status == "ok", f"rank {rank}:\n{status}"
    live = [res["replicas"][1] for r, res in enumerate(results) if r != DEAD]
    # The scenario exercised both cases: copies re-routed, copies with no live copy dropped,
    # and replica slots that received rows.
    assert sum(s["rerouted"] for s in live) > 0
    assert sum(s["dropped"] for s in live) > 0
    assert sum(s["served_as_replica"] for s in live) > 0


def test_replicas_argument_checks(tmp_path):
    store = dist.FileStore(str(tmp_path / "s"), 1)
    with pytest.raises(NotImplementedError, match="replicas="):
        Buffer(None, low_latency_mode=True, rank=0, num_ranks=1, store=store, reroute_replicas=True)
    with pytest.raises(ValueError, match="enable_shrink"):
        Buffer(None, low_latency_mode=True, rank=0, num_ranks=2, store=store, replicas={0: [1]})
    for bad in ({0: [2]}, {0: [1, 1]}, {-1: [1]}, {0: ["1"]}):
        with pytest.raises(ValueError, match="replicas"):
            check_replicas_arg(bad, False, True, 2)
    with pytest.raises(TypeError, match="dict"):
        check_replicas_arg([(0, 1)], False, True, 2)
    assert check_replicas_arg(None, False, False, 2) is None
    assert check_replicas_arg({3: []}, False, True, 2) == {}
    with pytest.raises(ValueError, match="primary"):
        ReplicaPlan({0: [0]}, 4, 2)
    with pytest.raises(ValueError, match="not in"):
        ReplicaPlan({4: [0]}, 4, 2)


def test_replica_plan_layout_and_routing():
    plan = ReplicaPlan({4: [0, 1], 1: [2], 3: [2]}, 6, 3)  # L = 2
    assert plan.local == [[0, 1, 4], [2, 3, 4], [4, 5, 1, 3]]
    assert plan.max_local == 4
    assert plan.ordinals(torch.zeros(3, dtype=torch.bool)).tolist() == [0] * 6
    # Rank 2 masked: 4 goes to its first replica (rank 0); 5 has none: primary (dropped).
    two = torch.tensor([False, False, True])
    assert plan.ordinals(two).tolist() == [0, 0, 0, 0, 1, 0]
    # Ranks 0 and 2 masked: 4 to its second replica (rank 1); 1's replica is masked too.
    assert plan.ordinals(torch.tensor([True, False, True])).tolist() == [0, 0, 0, 0, 2, 0]
    server, local = plan.map.resolve(torch.tensor([[4, 5, -1]]), plan.ordinals(two))
    assert server.tolist() == [[0, 2, -1]] and local.tolist() == [[2, 1, -1]]


def test_no_replicas_is_deepeps_layout(tmp_path):
    store = dist.FileStore(str(tmp_path / "s"), 1)
    kw = dict(num_max_dispatch_tokens_per_rank=2, hidden=128, num_experts=4, num_topk=2)
    with Buffer(None, low_latency_mode=True, rank=0, num_ranks=1, store=store, **kw) as b:
        assert b.local_experts == [0, 1, 2, 3]
        x = torch.randn(2, 128).to(torch.bfloat16)
        recv, count, _, _, _ = b.low_latency_dispatch(
            x, torch.tensor([[0, 3], [1, -1]]), 2, 4, use_fp8=False
        )
        assert tuple(recv.shape) == (4, 2, 128) and tuple(count.shape) == (4,)
        assert b.dropped_copies == 0
