"""The engine drives on CUDA tensors: vLLM's DeepEPLLPrepareAndFinalize and SGLang's
low-latency DeepEPDispatcher over moecomm's CUDA path (two ranks sharing GPU 0 over CUDA IPC),
the same scenarios and checks as on the host (vllm_procs.py, sglang_procs.py with
MOECOMM_ENGINES_DEVICE=cuda: inputs moved to the device, results compared on the host).
Skipped without a device (the gpu marker). The normal-mode, v2 and NIXL-EP drives stay on the
host: moecomm answers those on CPU tensors only.

Needs the engine environment on the GPU machine too (tools/engines_env.sh there: about 1 GB,
too large to carry) and a CUDA torch. Without it the tests are a machine skip (skip_for_machine:
they stay skipped under MOECOMM_REQUIRE_GPU=1, which no build can change), unless
MOECOMM_REQUIRE_ENGINES=1 asks for the environment (then they fail); the gpu-check leaves the
file out on such a machine and names it (tools/gpu_check_machine.py, UNCARRIED)."""

from __future__ import annotations

import engine_env
import pytest
import rank_group
from engine_checks import REQUIRE, check, engines_or_skip

VLLM = ["ll_top2", "ll_top8", "ll_topk_2_5_8_one_buffer"]
SGLANG = ["ll_top8_hook", "ll_top2_no_hook"]
CASES = [("vllm_procs", n) for n in VLLM] + [("sglang_procs", n) for n in SGLANG]


@pytest.fixture(scope="module")
def cuda_groups(tmp_path_factory):
    engines_or_skip()
    mp = pytest.MonkeyPatch()
    mp.setenv("MOECOMM_ENGINES_DEVICE", "cuda")
    cache: dict = {}
    try:

        def run(module: str, names: list[str]) -> dict:
            if module not in cache:
                workdir = str(tmp_path_factory.mktemp(f"{module}-cuda"))
                cache[module] = rank_group.run_group(module, names, 2, workdir)
            return cache[module]

        yield run
    finally:
        mp.undo()


@pytest.mark.gpu
@pytest.mark.parametrize(("module", "name"), CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_engine_drive_on_cuda(request, skip_for_machine, module, name):
    why = engine_env.why_unavailable()
    if why is not None and not REQUIRE:
        skip_for_machine(why)  # before the module's groups: nothing of them starts
    cuda_groups = request.getfixturevalue("cuda_groups")
    names = VLLM if module == "vllm_procs" else SGLANG
    check(cuda_groups(module, names), name)
