"""The moecomm SGLang transfer backend (moecomm.engines.sglang_kv) under SGLang 0.5.23's own
code (sglang_kv_procs.py): registered by name through SGLang's CLI choices, its TransferBackend
enum and get_kv_class; a prefill rank and a decode rank in two processes over SGLang's CPU KV
pool and metadata buffers; requests chunked and scattered, bit-exact; bad page indices failing
both sides with the reason; a prefill killed mid-transfer and a decode killed after publishing
its pages, each reported as KVPoll.Failed with failure_exception() naming the death within a
deadline. Two groups of two ranks, each ending with one kill."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import sglang_kv_procs as procs
from engine_checks import check, engines_or_skip

# Importing SGLang in a fresh process: ~10 s alone, far more on a loaded 2-core machine.
PROBE_TIMEOUT_S = 240


@pytest.mark.parametrize("name", procs.GROUP_PREFILL_DIES)
def test_sglang_kv_prefill_group(engine_group, name):
    check(engine_group("sglang_kv_procs", procs.GROUP_PREFILL_DIES, 2), name)


@pytest.mark.parametrize("name", procs.GROUP_DECODE_DIES)
def test_sglang_kv_decode_group(engine_group, name):
    check(engine_group("sglang_kv_procs", procs.GROUP_DECODE_DIES, 2), name)


def test_sglang_loads_the_backend_from_its_entry_point(tmp_path):
    """SGLang's load_plugins() in a fresh process, with moecomm's entry point installed (as pip
    writes it), registers the backend: the CLI choice, TransferBackend.MOECOMM, and
    get_kv_class in prefill.py and decode.py; other backends untouched."""
    engines_or_skip()
    probe = Path(__file__).with_name("sglang_kv_plugin_probe.py")
    out = subprocess.run(
        [sys.executable, str(probe), str(tmp_path)],
        cwd=probe.parent,
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["entry"] == {"moecomm": "moecomm.engines.sglang_kv:register"}
    assert got["choice_before"] is False and got["choice_after"] is True
    assert got["member"] == "MOECOMM"
    assert got["prefill_sender"] == "MoecommKVSender"
    assert got["decode_receiver"] == "MoecommKVReceiver"
    assert got["nixl_manager"] == "NixlKVManager"
