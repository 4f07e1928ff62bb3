"""moecomm.compat.deep_ep with CUDA tensors: the device kernels over CUDA IPC, two ranks as
processes on one node (sharing GPU 0 when there is only one). Every scenario checks the receive
against an independent reference (recv_x per expert = the tokens routed there, bf16 rows and
DeepEP's fp8 bytes and scales bit-exact; src_info, layout_range, counts exact) and the combine
bit for bit against Σ_k w·y (f32, k ascending) and against the host path on the same inputs
(deep_ep_cuda_procs.py); the contract_* scenarios walk the host contract test's flags and
configs (test_deep_ep_ll_contract.py, shrink aside) on CUDA tensors. GPU only: skipped without
a device (a failure under MOECOMM_REQUIRE_GPU=1)."""

import os
import signal

import moecomm
import pytest
import torch
from deep_ep_cuda_procs import SCENARIOS, launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device and a CUDA build of torch"
    ),
]

NAMES = list(SCENARIOS)
# All scenarios run in one launch; the contract_* ones walk 8 flag combinations per input.
GROUP_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    reaped = []

    class Reaper:
        def process(self, p):
            reaped.append(p)
            return p

    try:
        path = str(tmp_path_factory.mktemp("cuda_store") / "store")
        results = launch(2, path, NAMES, Reaper(), GROUP_TIMEOUT_S)
    finally:
        for p in reaped:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)
            moecomm.reap_stale_segments(p.pid)
    return results


@pytest.mark.timeout(GROUP_TIMEOUT_S + 100)
@pytest.mark.parametrize("name", NAMES)
def test_scenario(runs, name):
    for rank, result in enumerate(runs):
        if "setup" in result:
            pytest.fail(f"rank {rank} could not set up:\n{result['setup'][0]}")
        status, _ = result.get(name, ("not run (an earlier one failed)", 0.0))
        assert status == "ok", f"rank {rank}, scenario {name}:\n{status}"
