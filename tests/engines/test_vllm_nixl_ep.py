"""vLLM 0.33.0's NIXL-EP path on moecomm.compat.nixl_ep (nixl_procs.py): NixlEPPrepareAndFinalize
(bf16 / fp8, sync / async, top-k 2/5/8) and NixlEPAll2AllManager's buffer set-up, mask cycle and
a rank killed (masked, reported by query_fault, disconnected, the survivors exact), and top-k
growing on the one buffer vLLM keeps for every MoE layer."""

from __future__ import annotations

import nixl_procs
import pytest
from engine_checks import check

OWN_GROUP = ["topk_grows_on_one_buffer"]  # needs the process's buffer fresh
NAMES = [name for name in nixl_procs.SCENARIOS if name not in OWN_GROUP]


@pytest.mark.parametrize("name", NAMES)
def test_vllm_nixl_ep(engine_group, name):
    check(engine_group("nixl_procs", NAMES, 3), name)


@pytest.mark.parametrize("name", OWN_GROUP)
def test_vllm_nixl_ep_own_group(engine_group, name):
    check(engine_group("nixl_procs", [name], 2), name)
