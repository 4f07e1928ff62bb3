"""moecomm.compat.deep_ep between real processes: results bit-exact against a pure-torch
reference of DeepEP's low-latency semantics (deep_ep_procs.py), misuse rejected with clear errors,
dead and silent peers reported within the deadline.

The scenarios of one rank count run in one spawned group (spawning costs seconds per process);
each is reported as its own test."""

import os
import signal
import subprocess
import sys
import threading
import time
from unittest import mock

import moecomm
import pytest
import torch
import torch.distributed as dist
from deep_ep_procs import EXPERTS_PER_RANK, HIDDEN, SCENARIOS, TOPK, M, launch, make_inputs
from moecomm import prefork
from moecomm.compat.deep_ep import Buffer
from moecomm.testing import forking_env
from moecomm.wire.protocol import SlotLayout

ALL = list(SCENARIOS)
THREE_RANKS = ["fp8", "bf16", "hooks", "ragged", "process_group"]
GROUP_TIMEOUT_S = 120
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Results of every scenario, per rank count: {(num_ranks, name): [(status, seconds)]}."""
    out = {}
    reaped = []

    class Reaper:
        def process(self, p):
            reaped.append(p)
            return p

    try:
        for num_ranks, names in ((2, ALL), (3, THREE_RANKS)):
            path = str(tmp_path_factory.mktemp(f"store{num_ranks}") / "store")
            results = launch(num_ranks, path, names, Reaper(), GROUP_TIMEOUT_S)
            for name in names:
                out[num_ranks, name] = [
                    r.get(name, ("not run (an earlier one failed)", 0.0)) for r in results
                ]
    finally:
        for p in reaped:
            if p.is_alive():
                p.kill()  # a forked one may be reaped already
            p.join(5)
            moecomm.reap_stale_segments(p.pid)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("num_ranks", "name"), [(2, n) for n in ALL] + [(3, n) for n in THREE_RANKS]
)
def test_scenario(runs, num_ranks, name):
    for rank, (status, _) in enumerate(runs[num_ranks, name]):
        assert status == "ok", f"rank {rank} of {num_ranks}, scenario {name}:\n{status}"


# ---------------------------------------------------------------------------- one process
def test_constructor_rejects_bad_arguments(tmp_path):
    store = dist.FileStore(str(tmp_path / "s"), 1)
    with pytest.raises(ValueError, match="rank=, num_ranks= and store="):
        Buffer(None, low_latency_mode=True, rank=0, num_ranks=1)
    # DeepEP's default is the normal mode: constructing works, low-latency calls are refused.
    with Buffer(None, rank=0, num_ranks=1, store=store, timeout=5) as normal:
        assert normal.low_latency_mode is False
        x, idx, _ = make_inputs(0, 0, M, EXPERTS_PER_RANK)
        with pytest.raises(RuntimeError, match="low_latency_mode=True"):
            normal.low_latency_dispatch(x, idx, M, EXPERTS_PER_RANK)
    with pytest.raises(NotImplementedError, match="replica"):
        Buffer(None, low_latency_mode=True, rank=0, num_ranks=1, store=store, reroute_replicas=True)
    with pytest.raises(ValueError, match="or none"):
        Buffer(None, low_latency_mode=True, rank=0, num_ranks=1, store=store, hidden=128)
    with pytest.raises(ValueError, match="divisible"):
        Buffer(
            None,
            low_latency_mode=True,
            rank=0,
            num_ranks=2,
            store=store,
            num_max_dispatch_tokens_per_rank=4,
            hidden=128,
            num_experts=3,
            num_topk=2,
            timeout=0.5,
        )
    with pytest.raises(ValueError, match="timeout"):
        Buffer(None, low_latency_mode=True, rank=0, num_ranks=1, store=store, timeout=0)


def test_single_rank_round_trip_and_size_hint(tmp_path):
    store = dist.FileStore(str(tmp_path / "s"), 1)
    e = EXPERTS_PER_RANK
    with Buffer(None, low_latency_mode=True, rank=0, num_ranks=1, store=store, timeout=5) as buf:
        x, idx, w = make_inputs(0, 0, M, e)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, e, use_fp8=False)
        assert int(count.sum()) == int((idx >= 0).sum())
        out, _, hook = buf.low_latency_combine(recv, idx, w, handle)
        assert hook is None
        # Identity experts: out[t] = x[t] * Σ_k w[t, k] over the selected k, in f32.
        want = torch.zeros(M, HIDDEN)
        for k in range(TOPK):
            want = torch.where((idx[:, k] >= 0)[:, None], want + w[:, k : k + 1] * x.float(), want)
        assert torch.equal(out, want.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.low_latency_dispatch(x, idx, M, e)
    hint = Buffer.get_low_latency_rdma_size_hint(128, 7168, 2, 288)
    # Two peers, two slots each way: requests of 128 bf16 rows, answers of 128 * 8 copies.
    layout = SlotLayout(128, 7168, 8, "bf16", "bf16", max_response_tokens=128 * 8)
    per_peer = 2 * (layout.request_slot_bytes + layout.response_slot_bytes)
    assert 2 * per_peer <= hint < 2 * per_peer + 2 * 4096


def test_cuda_tensors_are_refused_with_a_pointer_to_the_device_path():
    from moecomm.compat.low_latency.layout import check_host

    fake = mock.Mock(spec=torch.Tensor)
    fake.device = torch.device("cuda", 0)
    with pytest.raises(NotImplementedError, match="device kernels"):
        check_host("x", fake)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        check_host("x", [1.0])


# ---------------------------------------------------------------------------- dead peers
def _idle_rank(store_path: str, conn) -> None:
    torch.set_num_threads(1)
    buf = Buffer(
        None,
        low_latency_mode=True,
        rank=1,
        num_ranks=2,
        store=dist.FileStore(store_path, 2),
        num_max_dispatch_tokens_per_rank=M,
        hidden=HIDDEN,
        num_experts=2 * EXPERTS_PER_RANK,
        num_topk=TOPK,
    )
    conn.send("ready")
    time.sleep(600)  # never dispatches
    buf.destroy()


@pytest.mark.timeout(120)
def test_silent_peer_times_out_and_dead_peer_is_reported_fast(tmp_path, reaper):
    ctx = prefork.process_context()
    parent, child = ctx.Pipe()
    path = str(tmp_path / "store")
    p = reaper.process(ctx.Process(target=_idle_rank, args=(path, child), daemon=True))
    p.start()
    deadline_s = 2.0
    buf = Buffer(
        None,
        low_latency_mode=True,
        rank=0,
        num_ranks=2,
        store=dist.FileStore(path, 2),
        num_max_dispatch_tokens_per_rank=M,
        hidden=HIDDEN,
        num_experts=2 * EXPERTS_PER_RANK,
        num_topk=TOPK,
        timeout=60,  # the set-up waits for the spawned rank, seconds on a loaded machine
    )
    buf.timeout = deadline_s  # what is measured: a dispatch's deadline
    try:
        assert parent.poll(60)
        x, idx, _ = make_inputs(0, 0, M, 2 * EXPERTS_PER_RANK)
        start = time.monotonic()
        with pytest.raises(moecomm.DeadlineExceededError, match="rank 1"):
            buf.low_latency_dispatch(x, idx, M, 2 * EXPERTS_PER_RANK)
        assert deadline_s * 0.9 < time.monotonic() - start < deadline_s + 3
        threading.Timer(0.3, os.kill, (p.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(moecomm.PeerLostError, match="rank 1"):
            buf.low_latency_dispatch(x, idx, M, 2 * EXPERTS_PER_RANK)
        assert time.monotonic() - start < deadline_s  # noticed by liveness, not the deadline
    finally:
        buf.destroy()
    p.join(10)
    assert moecomm.list_segments(p.pid) == []


# ---------------------------------------------------------------------------- benchmark
@pytest.mark.timeout(180)
def test_benchmark_quick_runs(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "ops", "vs_deepep.py"),
            "--quick",
            "--json",
            str(out),
        ],
        capture_output=True,
        env=forking_env(),  # its processes forked, as the suite's are
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Dispatch bandwidth" in proc.stdout and "GPU rows not run" in proc.stdout
    # The new modes through deep_ep.Buffer(low_latency_mode=False) and ElasticBuffer, checked.
    assert "normal cached dispatch" in proc.stdout and "combine exact: True" in proc.stdout
    assert out.exists()


def test_combine_reduces_in_ascending_k_order_in_f32():
    # 1 + 1e8 rounds the 1 away in f32; summed in the other order the 1 would survive.
    from moecomm.compat.low_latency.layout import weighted_sum

    rows = torch.tensor([[1.0], [float("nan")]], dtype=torch.bfloat16)
    w = torch.tensor([[1.0, 1e8, -1e8]])
    got = weighted_sum(rows, torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 3).long(), w)
    assert got.item() == 0.0
    # A -1 entry is skipped, whatever its source row holds (here a NaN).
    got = weighted_sum(rows, torch.tensor([[0, 1, 0]]), torch.tensor([[0, -1, 2]]), w)
    assert torch.equal(got, torch.tensor([[1.0]]) + torch.tensor([[-1e8]]))
