"""moecomm.compat.deep_ep with CUDA tensors: the device kernels over CUDA IPC, two ranks as
processes on one node (sharing GPU 0 when there is only one). Every scenario checks the receive
against an independent reference (recv_x per expert = the tokens routed there, bf16 rows and
DeepEP's fp8 bytes and scales bit-exact; src_info, layout_range, counts exact) and the combine
bit for bit against Σ_k w·y (f32, k ascending) and against the host path on the same inputs
(deep_ep_cuda_procs.py); the contract_* scenarios walk the host contract test's flags and
configs (test_deep_ep_ll_contract.py, shrink aside) on CUDA tensors. GPU only: skipped without
a device (a failure under MOECOMM_REQUIRE_GPU=1).

Each scenario is its own test and is reported on its own: the selected scenarios (``-k``
works) run in one group of rank processes, each with fresh Buffers and its own deadline; a
failure does not stop the next scenario, and one that hangs is reported as timed out by name
while a new group runs the rest (deep_ep_cuda_procs.run_scenarios)."""

import pytest
import torch
from deep_ep_cuda_procs import SCENARIOS, run_scenarios, scenario_timeout

NAMES = list(SCENARIOS)
NUM_RANKS = 2
# Kept between the run's end and the test's timeout: killing the ranks, reaping, reporting.
TIMEOUT_MARGIN_S = 8.0


def _selected(request) -> list[str]:
    """The scenarios of this module that this run selected (after -k / -m / node ids)."""
    mine = {
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
    }
    return [n for n in NAMES if n in mine]


def _test_timeout(config) -> float | None:
    """The per-test timeout pytest-timeout applies (--timeout, else the ini's), or None."""
    for get in (lambda: config.getoption("timeout"), lambda: config.getini("timeout")):
        try:
            value = get()
        except (ValueError, KeyError):
            continue
        if value not in (None, "") and float(value) > 0:
            return float(value)
    return None


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected scenario, run in the first test's setup: so within that test's timeout
    (pytest-timeout's --timeout or the ini's; give a whole-module run a long one). Each
    scenario also has its own deadline (deep_ep_cuda_procs.scenario_timeout); what the run's
    time does not reach is reported as timed out or not run, by name."""
    timeout = _test_timeout(request.config)
    budget = None if timeout is None else max(timeout - TIMEOUT_MARGIN_S, 1.0)
    tmp = tmp_path_factory.mktemp("cuda_store")
    return run_scenarios(NUM_RANKS, tmp, _selected(request), budget_s=budget)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device and a CUDA build of torch"
)
@pytest.mark.parametrize("name", NAMES)
def test_scenario(runs, name):
    assert name in runs, f"scenario {name} was not run"
    for rank, (outcome, seconds) in enumerate(runs[name]):
        assert outcome == "ok", (
            f"rank {rank}, scenario {name} ({seconds:.1f} s of {scenario_timeout(name):.0f}):\n"
            f"{outcome}"
        )


def test_driver_reports_every_scenario_on_its_own(tmp_path):
    """The driver with stand-in scenarios on the host (no device): a failure on one rank, a
    hang, a dead rank and a broken context each cost only their own scenario; the others are
    still run (in a new group after the hang, the death and the broken context) and reported."""
    names = [
        "ok",
        "fail_rank1",
        "hang_rank0",
        "after_hang",
        "die_rank1",
        "after_death",
        "broken_rank0",
        "after_broken",
    ]
    got = run_scenarios(2, tmp_path, names, kind="selftest")
    assert set(got) == set(names)
    for name in ("ok", "after_hang", "after_death", "after_broken"):
        assert [o for o, _ in got[name]] == ["ok", "ok"], (name, got[name])
    assert got["fail_rank1"][0][0] == "ok" and "this rank fails" in got["fail_rank1"][1][0]
    assert got["hang_rank0"][1][0] == "ok" and "timed out" in got["hang_rank0"][0][0]
    assert "rank 1 died (exit code 3)" in got["die_rank1"][1][0]
    assert got["broken_rank0"][1][0] == "ok" and "this rank fails" in got["broken_rank0"][0][0]
    # The core scenarios come before the contract walks, so a stage cut short keeps them.
    contract = [i for i, n in enumerate(NAMES) if n.startswith("contract_")]
    assert contract and min(contract) > max(i for i, n in enumerate(NAMES) if i not in contract)
    # Out of time before the start: every scenario says so, by name.
    late = run_scenarios(2, tmp_path / "late", ["ok", "after"], kind="selftest", budget_s=0.0)
    assert {n: [o for o, _ in v] for n, v in late.items()} == {
        n: ["not run: the run's time (0 s) ran out"] * 2 for n in ("ok", "after")
    }
