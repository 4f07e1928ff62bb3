"""Pipeline stages as processes: greedy tokens equal in-process generation before, during and
after layer redistributions (KV caches migrating between stages), and clear errors on failure."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from moecomm.pipeline.driver import PipelineError, run_decode
from moecomm.pipeline.predictor import LatencyPredictor
from moecomm.pipeline.scheduler import BubbleScheduler
from moecomm_serving.engine.generate import generate
from moecomm_serving.engine.stages import model_pipeline
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import SamplingParams

MAX_NEW = 14
# Prompts of different lengths (ragged batches), deterministic.
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(3 + 2 * i)] for i in range(5)]


def reference(path) -> list[list[int]]:
    model = load_model(path, dtype=torch.float32)
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    return [g.tokens for g in generate(model, PROMPTS, params)]


@pytest.mark.timeout(120)
def test_three_stages_equal_generate_across_redistributions(nine_layer_dir):
    want = reference(nine_layer_dir)
    # Submission index -> k: uniform, two layers moved (3->0 and 6,7->1), back to one, back to
    # uniform, and two again; the switch lands while other micro-batches are in flight.
    forced = {4: 2, 11: 1, 17: 0, 23: 2}
    with model_pipeline(nine_layer_dir, 3) as pipe:
        run = run_decode(pipe, PROMPTS, MAX_NEW, forced=forced)
    assert run.tokens == want
    assert [k for _, k in run.remaps] == [2, 1, 0, 2]
    assert set(run.step_ks) == {0, 1, 2}  # steps really ran under every map
    assert run.step_ks[0] == 0 and run.step_ks[-1] == 2


@pytest.mark.timeout(120)
def test_dynapipe_loop_keeps_greedy_tokens(tiny_dir):
    """The full loop: stages profile themselves, the predictor is refitted, the scheduler
    (window 2, so it switches within this short run) moves a layer when it pays."""
    want = reference(tiny_dir)
    pred = LatencyPredictor()
    sched = BubbleScheduler(4, 2, window=2)
    with model_pipeline(tiny_dir, 2) as pipe:
        # Forced first switch makes the run cover a migration whatever the timings say.
        run = run_decode(pipe, PROMPTS, MAX_NEW, scheduler=sched, predictor=pred, forced={3: 1})
    assert run.tokens == want
    assert len(pred.layer.samples) > 0 and len(pred.sample.samples) > 0
    assert pred.ready  # fitted from the stages' own profiles


@pytest.mark.timeout(120)
def test_killed_stage_gives_a_clear_error(tiny_dir):
    with model_pipeline(tiny_dir, 2) as pipe:
        pipe.submit([0], [0], [3], [5, 6, 7])
        assert len(pipe.result()[1]) == 1
        victim = pipe.procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        with pytest.raises(PipelineError, match=r"stage 1 \(pid \d+\) exited .*signal 9"):
            pipe.submit([0], [3], [1], [9])
            pipe.result()
        assert pipe.closed
        pipe.close()  # the survivors are reaped in the background; close() waits for that
        assert all(not p.is_alive() for p in pipe.procs)


@pytest.mark.timeout(120)
def test_pipeline_rejects_bad_requests(tiny_dir):
    with model_pipeline(tiny_dir, 2, max_tokens=8) as pipe:
        with pytest.raises(ValueError, match="exceeds the slot's max_tokens 8"):
            pipe.submit([0], [0], [9], list(range(9)))
        with pytest.raises(ValueError, match="expected sum"):
            pipe.submit([0], [0], [2], [1])
        with pytest.raises(ValueError, match="contiguous cover"):
            pipe.remap([range(0, 1), range(2, 4)])
        with pytest.raises(ValueError, match="one non-empty range per stage"):
            pipe.remap([range(0, 4)])
        with pytest.raises(ValueError, match=r"stage 1 layers 1..3, but it preloaded only 2..3"):
            pipe.remap([range(0, 1), range(1, 4)])
        with pytest.raises(RuntimeError, match="no micro-batch in flight"):
            pipe.result()
        # a stage that hits an error reports it and the driver names it
        pipe.submit([0], [5], [1], [1])  # sequence 0 has no cache yet
        with pytest.raises(PipelineError, match=r"stage [01] failed: .*sequence 0 is unknown here"):
            pipe.result()
    with pytest.raises(ValueError, match="k must be in"):
        model_pipeline(tiny_dir, 2, k_max=2)


@pytest.mark.timeout(120)
def test_seeded_sampling_equals_generate(tiny_dir):
    """Sampled decoding: sequence j draws from a generator seeded seed + j, like a request with
    SamplingParams(seed=seed + j) in generate, so the tokens match through a redistribution."""
    seed = 1234
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.9, seed=seed)
    per_request = [
        SamplingParams(MAX_NEW, 0.9, 0.9, seed + j, ignore_eos=True) for j in range(len(PROMPTS))
    ]
    model = load_model(tiny_dir, dtype=torch.float32)
    want = [g.tokens for g in generate(model, PROMPTS, per_request)]
    with model_pipeline(tiny_dir, 2, sampling=sampling) as pipe:
        run = run_decode(pipe, PROMPTS, MAX_NEW, forced={5: 1})
    assert run.tokens == want
    assert want != reference(tiny_dir)  # really sampled, not greedy
