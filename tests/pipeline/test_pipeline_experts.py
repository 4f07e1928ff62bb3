"""Pipeline stages whose MoE layers call expert servers (real `moecomm expert-server` processes,
one AttentionClient per stage process): greedy tokens equal the in-process model across a KV
migration, and a SIGKILLed expert server mid-generation loses nothing (every stage fails over
to the replicas)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from moecomm.pipeline.driver import run_decode
from moecomm.testing import start_local_cluster
from moecomm.wire.stage import stage_layout
from moecomm_serving.engine.stages import model_pipeline
from moecomm_serving.model.config import MoEConfig
from moecomm_serving.model.remote_experts import RemoteExperts
from test_stages import MAX_NEW, PROMPTS, reference

# The pipeline's progress before the kill, and its end after it, on a loaded 2-core machine.
START_S = 120.0
# Every expert of the tiny model (16) on two servers: the demo's 0-11 / 4-15 split plus a third
# server for the experts those two do not share, so any one server can die.
HOSTED = ("0-11", "4-15", "0-3,12-15")
# A stage's expert round trip: generous, the 2-core machine runs five processes here.
EXPERT_TIMEOUT_S = 20.0
# Steps submitted before the kill: past the prefills, with most of the decode still to come.
KILL_AFTER_STEPS = 8


@pytest.fixture(scope="module")
def expert_servers(tiny_dir):
    """Three expert-server processes (the kill test, last in this module, kills the first)."""
    with start_local_cluster(
        tiny_dir, servers=HOSTED, frontends=(), id_prefix="pipe-es"
    ) as cluster:
        yield cluster.server_urls, cluster.servers


def _remote(urls) -> RemoteExperts:
    return RemoteExperts(servers=tuple(urls), timeout=EXPERT_TIMEOUT_S)


@pytest.mark.timeout(240)
def test_stages_with_expert_servers_equal_the_in_process_model(tiny_dir, expert_servers):
    urls, _ = expert_servers
    want = reference(tiny_dir)
    # Slots sized for the largest micro-batch only: a layer's KV package (every sequence's
    # keys and values) is then larger than a slot and migrates in several chunks.
    rows = max(sum(len(p) for p in PROMPTS[g::2]) for g in range(2))
    c = MoEConfig.from_file(tiny_dir)
    # Switching at submission 5 (each group has run 3 steps, so every sequence caches its
    # prompt and 2 more tokens): a lower bound of the package that migrates.
    cached = sum(len(p) + 2 for p in PROMPTS)
    kv_bytes = cached * 2 * c.num_key_value_heads * c.head_dim * 4
    assert kv_bytes > stage_layout(rows, c.hidden_size, "f32").request_slot_bytes
    with model_pipeline(tiny_dir, 2, remote=_remote(urls), max_tokens=rows) as pipe:
        # A forced switch moves a layer (and its KV) between stages mid-run.
        run = run_decode(pipe, PROMPTS, MAX_NEW, forced={5: 1, 11: 0})
    assert run.tokens == want
    assert [k for _, k in run.remaps] == [1, 0]


@pytest.mark.timeout(240)
def test_killing_an_expert_server_mid_generation_loses_nothing(tiny_dir, expert_servers):
    urls, procs = expert_servers
    want = reference(tiny_dir)
    out: dict = {}
    with model_pipeline(tiny_dir, 2, remote=_remote(urls)) as pipe:

        def decode():
            try:
                out["run"] = run_decode(pipe, PROMPTS, MAX_NEW, forced={5: 1})
            except BaseException as e:  # re-raised below, in the test's thread
                out["error"] = e

        worker = threading.Thread(target=decode)
        worker.start()
        deadline = time.monotonic() + START_S
        while pipe.next_step < KILL_AFTER_STEPS and worker.is_alive():
            assert time.monotonic() < deadline, "the pipeline made no progress"
            time.sleep(0.01)
        os.kill(procs[0].pid, signal.SIGKILL)
        worker.join(START_S)
        assert not worker.is_alive()
    if "error" in out:
        raise out["error"]
    assert procs[0].popen.wait(10) == -signal.SIGKILL
    assert pipe.next_step > KILL_AFTER_STEPS + len(PROMPTS)  # the kill landed mid-generation
    assert out["run"].tokens == want
