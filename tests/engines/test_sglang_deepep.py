"""SGLang 0.5.23's DeepEPDispatcher on moecomm.compat.deep_ep (sglang_procs.py): low-latency
mode (bf16 and fp8 wire, with and without the receive hook, top-k 2/5/8) and normal mode
(bf16, DeepGEMM's 128-row expert alignment, sync and async_finish), SGLang building the Buffer
itself from its ServerArgs, against the plain torch reference: rows, fp8 bytes and scales,
masked_m / per-expert counts, local top-k ids and weights, and both combines bit-exact."""

from __future__ import annotations

import pytest
import sglang_procs
from engine_checks import check

NAMES = list(sglang_procs.SCENARIOS)


@pytest.mark.parametrize("name", NAMES)
def test_sglang_deepep(engine_group, name):
    check(engine_group("sglang_procs", NAMES, 2), name)
