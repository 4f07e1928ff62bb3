"""The moecomm SGLang transfer backend (moecomm.engines.sglang_kv) under SGLang 0.5.23's own
code (sglang_kv_procs.py): registered by name through SGLang's CLI choices, its TransferBackend
enum and get_kv_class; a prefill rank and a decode rank in two processes over SGLang's CPU KV
pool and metadata buffers; requests chunked and scattered, bit-exact; bad page indices failing
both sides with the reason; a prefill killed mid-transfer and a decode killed after publishing
its pages, each reported as KVPoll.Failed with failure_exception() naming the death within a
deadline. Two groups of two ranks, each ending with one kill."""

from __future__ import annotations

import pytest
import sglang_kv_procs as procs
from engine_checks import check


@pytest.mark.parametrize("name", procs.GROUP_PREFILL_DIES)
def test_sglang_kv_prefill_group(engine_group, name):
    check(engine_group("sglang_kv_procs", procs.GROUP_PREFILL_DIES, 2), name)


@pytest.mark.parametrize("name", procs.GROUP_DECODE_DIES)
def test_sglang_kv_decode_group(engine_group, name):
    check(engine_group("sglang_kv_procs", procs.GROUP_DECODE_DIES, 2), name)
