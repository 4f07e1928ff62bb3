"""vLLM 0.33.0's DeepEP prepare/finalize classes on moecomm.compat.deep_ep (vllm_procs.py):
DeepEPLLPrepareAndFinalize (bf16, fp8 handed through and fp8 dequantized by vLLM, sync and
async, top-k 2/5/8, several top-k on the one buffer vLLM's manager caches),
DeepEPHTPrepareAndFinalize (normal mode) and DeepEPV2PrepareAndFinalize (ElasticBuffer, prefill
mode), against the plain torch reference (moe_reference.py): dispatched rows, fp8 bytes and
scales, counts and the LL combine bit-exact; the normal-mode combines exact on inputs whose
sums are exact in bf16.

Not driven on CPU (said here so that it stays true): DeepEPV2All2AllManager, whose constructor
asserts has_deep_ep_v2() (vllm/utils/import_utils.py: the runtime NCCL library must be >= 2.30.4;
a CPU torch has none) and whose get_handle probes NCCL GIN with a CUDA tensor
(_check_gin_support); the ElasticBuffer is built with the manager's own _make_all2all_kwargs
instead. DeepEPV2PrepareAndFinalize's decode mode (use_cudagraph=True) needs vLLM's forward
context with DP metadata and runs a Triton kernel on the received ids; not driven.
"""

from __future__ import annotations

import pytest
import vllm_procs
from engine_checks import check

TWO = list(vllm_procs.SCENARIOS)
THREE = ["ll_top8", "ll_topk_2_5_8_one_buffer", "ht_top8", "v2_prefill"]
CASES = [(2, name) for name in TWO] + [(3, name) for name in THREE]


@pytest.mark.parametrize(("num_ranks", "name"), CASES, ids=[f"{n}ranks-{s}" for n, s in CASES])
def test_vllm_deepep(engine_group, num_ranks, name):
    names = TWO if num_ranks == 2 else THREE
    check(engine_group("vllm_procs", names, num_ranks), name)
