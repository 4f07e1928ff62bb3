"""moecomm's vLLM KV connector (moecomm.engines.vllm_kv) driven by vLLM 0.33.0's own code: a
prefill instance and a decode instance, each in a process of its own with vLLM's Scheduler,
the worker-side connector vLLM's factory makes from ``kv_connector_module_path`` and CPU KV
caches allocated by vLLM (vllm_kv_procs.py); the router's part (prefill with
``do_remote_decode``, its ``kv_transfer_params`` to the decode) is played by the test.

Checked: the KV the decode holds when vLLM is told the load finished is bit-exact the
prefill's, every layer, every prompt token; the prefill's blocks are freed once sent; the
decode then decodes. A prefill killed mid-transfer ends the decode's load through vLLM's own
error path (``failed_recving`` + ``get_block_ids_with_load_errors``), under both
``kv_load_failure_policy`` values (fail: the request ends with an error; recompute: it is
recomputed and finishes), within a deadline. A decode killed mid-transfer frees the
prefill's blocks. A side channel with the wrong shared secret refuses the transfer, and the
decode reports the load failed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import vllm_kv_procs as vp
from engine_checks import engines_or_skip
from moecomm import prefork
from moecomm.testing.procs import reap_segments

START_S = 240.0  # importing vLLM in two processes at once on a loaded two-core machine
STEP_S = 60.0  # one request through an instance, or a transfer, on that machine
# A prefill killed mid-transfer must surface on the decode within this: the transfer's wait
# watches the sender's liveness, so it is the decode's step loop plus the poll, not a timeout.
FAILURE_DEADLINE_S = 20.0
PROMPT = [(i * 37 + 11) % 250 + 1 for i in range(40)]  # 3 blocks of 16, the last partial
DECODE_TOKENS = 3


class Inst:
    """One instance process and its command pipe."""

    def __init__(self, ctx, role, workdir, extra, policy="fail"):
        self.conn, child = ctx.Pipe()
        os.makedirs(workdir, exist_ok=True)
        self.proc = ctx.Process(
            target=vp.main, args=(role, workdir, extra, policy, child), daemon=True
        )
        self.proc.start()
        child.close()
        self.pid = self.proc.pid

    def ready(self, timeout=START_S):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"instance {self.pid} not up within {timeout:.0f} s")
        kind, value = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"instance {self.pid} failed to start:\n{value}")

    def __call__(self, cmd, *args, timeout=STEP_S):
        self.conn.send((cmd, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"instance {self.pid}: no answer to {cmd} in {timeout:.0f} s")
        kind, value = self.conn.recv()
        if kind != "ok":
            raise RuntimeError(f"instance {self.pid}: {cmd} failed:\n{value}")
        return value

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()  # a forked one may be reaped already
        self.proc.join(10)


@pytest.fixture
def instances(tmp_path):
    """`start(role, extra=None, policy="fail")` -> a started instance; all are killed and
    their shared memory reaped at the end, pass or fail."""
    engines_or_skip()
    ctx = prefork.process_context()
    started: list[Inst] = []

    def start(*specs):
        made = [
            Inst(ctx, role, str(tmp_path / f"{role}-{len(started) + i}"), extra or {}, policy)
            for i, (role, extra, policy) in enumerate(specs)
        ]
        started.extend(made)
        for inst in made:
            inst.ready()
        return made

    yield start
    for inst in started:
        with contextlib.suppress(Exception):
            if inst.proc.is_alive():
                inst("stop", timeout=10)
        inst.kill()
    reap_segments(i.pid for i in started)


def prefill(p: Inst, req_id: str) -> dict:
    """The router's first half: the prompt to the prefill, max_tokens 1; its output."""
    p("add", req_id, PROMPT, 1, {"do_remote_decode": True})
    return vp.wait_until(lambda: p("output", req_id), STEP_S, f"prefill of {req_id}")


def test_kv_moves_bit_exact_and_the_prefill_frees_its_blocks(instances):
    p, d = instances(("kv_producer", None, "fail"), ("kv_consumer", None, "fail"))
    p_free, d_free = p("free_blocks"), d("free_blocks")
    out = prefill(p, "p1")
    params = out["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["transfer_mode"] == "moecomm"
    assert params["remote_request_id"] == "p1"
    assert len(params["remote_block_ids"][0]) == -(-len(PROMPT) // vp.BLOCK)
    assert p("free_blocks") == p_free - len(params["remote_block_ids"][0]), "blocks not held"
    want = p("prefill_kv", "p1", len(PROMPT))

    d("add", "d1", PROMPT, DECODE_TOKENS, params)
    got = vp.wait_until(lambda: d("loaded", "d1"), STEP_S, "the decode's load")
    assert len(got) == len(want) and got == want, "decode KV differs from the prefill's"
    done = vp.wait_until(lambda: d("output", "d1"), STEP_S, "the decode")
    assert done["finish_reason"] == "length"
    vp.wait_until(lambda: ("sent", "p1") in p("events"), STEP_S, "the prefill's send reported")
    vp.wait_until(lambda: p("free_blocks") == p_free, STEP_S, "the prefill's blocks freed")
    vp.wait_until(lambda: d("free_blocks") == d_free, STEP_S, "the decode's blocks freed")

    # The same prompt again: the decode's prefix cache holds its first full blocks, so only
    # the rest is loaded (the prefill's last blocks into the decode's newly allocated ones).
    params2 = prefill(p, "p2")["kv_transfer_params"]
    want2 = p("prefill_kv", "p2", len(PROMPT))
    d("add", "d2", PROMPT, DECODE_TOKENS, params2)
    got2 = vp.wait_until(lambda: d("loaded", "d2"), STEP_S, "the decode's second load")
    assert got2 == want2, "decode KV differs after a prefix hit"
    vp.wait_until(lambda: d("output", "d2"), STEP_S, "the second decode")
    vp.wait_until(lambda: p("free_blocks") == p_free, STEP_S, "the prefill's blocks freed")
    assert not [e for e in d("events") if e[0] in ("failed", "invalid_blocks")]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_killed_mid_transfer_reaches_vllms_error_path(instances, policy):
    p, d = instances(("kv_producer", None, "fail"), ("kv_consumer", None, policy))
    d_free = d("free_blocks")
    params = prefill(p, "p1")["kv_transfer_params"]
    p("die_mid_send", 1)  # SIGKILL inside the send, one of three layers written
    t0 = time.monotonic()
    d("add", "d1", PROMPT, DECODE_TOKENS, params)
    vp.wait_until(lambda: ("failed", "d1") in d("events"), FAILURE_DEADLINE_S, "the failed load")
    elapsed = time.monotonic() - t0
    p.proc.join(10)
    assert p.proc.exitcode == -signal.SIGKILL, f"prefill exit {p.proc.exitcode}"
    events = d("events")
    assert any(e[0] == "invalid_blocks" for e in events), events
    assert d("loaded", "d1") is None, "a failed load was reported as finished"
    done = vp.wait_until(lambda: d("output", "d1"), STEP_S, "the decode request's end")
    if policy == "fail":
        assert done["finish_reason"] == "error", done
    else:  # recomputed locally, then decoded
        assert done["finish_reason"] == "length", done
    vp.wait_until(lambda: d("free_blocks") == d_free, STEP_S, "the decode's blocks freed")
    print(f"prefill killed mid-transfer: decode reported it in {elapsed:.2f} s ({policy})")


def test_decode_killed_mid_transfer_frees_the_prefills_blocks(instances, tmp_path):
    p, d = instances(("kv_producer", None, "fail"), ("kv_consumer", None, "fail"))
    p_free = p("free_blocks")
    params = prefill(p, "p1")["kv_transfer_params"]
    go = str(tmp_path / "go")
    p("pause_mid_send", 1, go)  # the send stops after one layer until `go` exists
    d("add", "d1", PROMPT, DECODE_TOKENS, params)
    vp.wait_until(lambda: os.path.exists(go + ".paused"), STEP_S, "the send under way")
    d.kill()
    open(go, "w").close()
    vp.wait_until(lambda: ("sent", "p1") in p("events"), FAILURE_DEADLINE_S, "the send ended")
    vp.wait_until(lambda: p("free_blocks") == p_free, STEP_S, "the prefill's blocks freed")


def test_wrong_secret_is_refused_and_the_load_fails(instances):
    p, d = instances(
        ("kv_producer", {"token": "deployment-secret"}, "fail"),
        ("kv_consumer", {"token": "not-it"}, "fail"),
    )
    params = prefill(p, "p1")["kv_transfer_params"]
    d("add", "d1", PROMPT, DECODE_TOKENS, params)
    vp.wait_until(lambda: ("failed", "d1") in d("events"), FAILURE_DEADLINE_S, "the failed load")
    done = vp.wait_until(lambda: d("output", "d1"), STEP_S, "the decode request's end")
    assert done["finish_reason"] == "error", done
    assert ("sent", "p1") not in p("events")  # nothing was sent: the blocks wait for the lease
