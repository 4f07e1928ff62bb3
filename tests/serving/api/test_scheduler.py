"""The engine without HTTP: admission under the token budget, back-pressure, stop."""

from __future__ import annotations

import threading

import pytest
from moecomm_serving.engine.scheduler import (
    Engine,
    EngineBusyError,
    EngineRequest,
    run_to_completion,
)
from moecomm_serving.types import ErrorEvent, SamplingParams

TIMEOUT_S = 60.0


def test_token_budget_limits_prefills_per_step(model, tok, solo):
    prompts = [tok.encode(w) for w in ("abcd", "efgh", "ijkl")]  # 5 tokens each with BOS
    # room for one prefill plus decodes, never two prefills: prompts join one step at a time
    engine = Engine(model, max_batch_tokens=7).start()
    try:
        got = run_to_completion(engine, prompts, SamplingParams(6, ignore_eos=True), TIMEOUT_S)
    finally:
        engine.stop()
    assert got == [solo(p, max_new_tokens=6, ignore_eos=True) for p in prompts]
    assert engine.stats.mixed_steps >= 2  # each later prompt's prefill joined running decodes
    assert engine.stats.max_batch_size >= 2


def test_long_prompt_is_prefilled_in_chunks(model, tok, solo):
    long_prompt = tok.encode("a prompt far longer than one step's token budget " * 2)
    short = tok.encode("short")
    budget = 16  # the long prompt needs several steps; the short one's decodes run meanwhile
    engine = Engine(model, max_batch_tokens=budget).start()
    try:
        params = SamplingParams(5, ignore_eos=True)
        got = run_to_completion(engine, [short, long_prompt], params, TIMEOUT_S)
    finally:
        engine.stop()
    assert got == [solo(p, max_new_tokens=5, ignore_eos=True) for p in (short, long_prompt)]
    assert engine.stats.prefill_chunks >= len(long_prompt) // budget
    assert engine.stats.mixed_steps >= 1


def test_full_queue_and_stopped_engine_refuse(model):
    # the idle engine holds its first request in the batching window, so the queue stays full
    engine = Engine(model, max_batch_tokens=64, max_num_seqs=4, max_queue=1, batch_wait_s=30.0)
    engine.start()
    got = []
    failed = threading.Event()

    def emit(ev):
        got.append(ev)
        failed.set()

    first = EngineRequest([1, 2], SamplingParams(), emit, deadline=float("inf"))
    engine.submit(first)
    with pytest.raises(EngineBusyError, match="max_queue"):
        engine.submit(EngineRequest([1, 2], SamplingParams(), emit, deadline=float("inf")))
    engine.stop()
    assert failed.wait(TIMEOUT_S)
    assert isinstance(got[0], ErrorEvent) and got[0].status == 503
    with pytest.raises(EngineBusyError, match="not running"):
        engine.submit(EngineRequest([1, 2], SamplingParams(), emit, deadline=float("inf")))


def test_bad_limits_are_refused(model):
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Engine(model, max_batch_tokens=0)
