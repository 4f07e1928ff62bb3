"""Stage supervision in the driver and in the front end's PipelinedModel (real stage processes,
no HTTP): a stopped stage is declared lost and killed; a lost stage is replaced (by the standby
or new stages) and the step re-run from the front end's token history, greedy logits equal to a
fault-free run; a fault a replacement does not fix fails the step after a bounded number of
tries."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from moecomm.pipeline.driver import STOPPED_DEADLINE_S, PipelineError
from moecomm_serving.engine.generate import generate
from moecomm_serving.engine.pipeline import MAX_RESTARTS_PER_STEP, PipelinedModel
from moecomm_serving.engine.stages import model_pipeline
from moecomm_serving.model.config import MoEConfig
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import SamplingParams

PROMPTS = [[(5 * i + j) % 250 + 1 for j in range(4 + 3 * i)] for i in range(3)]
STEPS = 6


def reference(path) -> list[list[int]]:
    """The fault-free tokens: the in-process model, greedy."""
    model = load_model(path, dtype=torch.float32)
    params = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    return [g.tokens for g in generate(model, PROMPTS, params)]


def _make(path, standby: bool) -> PipelinedModel:
    def start(initial_k: int = 0):
        return model_pipeline(path, 2, initial_k=initial_k, return_logits=True)

    config = MoEConfig.from_file(path)
    # With the standby, each step also goes as 2 micro-batches in flight (the front end's default).
    micro = 2 if standby else 1
    return PipelinedModel(
        start(), config, dynapipe=False, restart=start, standby=standby, micro_batches=micro
    )


def _decode(model: PipelinedModel, fault=None) -> list[list[int]]:
    """Greedy decode of PROMPTS for STEPS steps; `fault(model)` runs before step 2."""
    seqs = [model.new_sequence() for _ in PROMPTS]
    feeds = [list(p) for p in PROMPTS]
    out = [[] for _ in PROMPTS]
    for step in range(STEPS):
        if step == 2 and fault is not None:
            fault(model)
        logits = model.forward(feeds, seqs)
        for j, row in enumerate(logits):
            out[j].append(int(torch.argmax(row)))
        feeds = [o[-1:] for o in out]
    return out


@pytest.mark.timeout(180)
def test_stopped_stage_is_declared_lost_and_killed(tiny_dir):
    with model_pipeline(tiny_dir, 2) as pipe:
        pipe.submit([0], [0], [3], [5, 6, 7])
        pipe.result()
        victim = pipe.procs[0]
        os.kill(victim.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(PipelineError, match=r"stage 0 \(pid \d+\) stopped for more than") as e:
            pipe.submit([0], [3], [1], [9])
            pipe.result()
        assert e.value.stage == 0
        assert time.monotonic() - t0 < STOPPED_DEADLINE_S + 10  # not the 60 s step deadline
        victim.join(10)
        assert victim.exitcode == -signal.SIGKILL  # killed: it can never wake up and act


@pytest.mark.timeout(300)
@pytest.mark.parametrize("standby", [False, True])
def test_lost_stage_is_replaced_and_the_step_rerun(tiny_dir, standby):
    want = reference(tiny_dir)
    model = _make(tiny_dir, standby)
    try:
        before = model.pipe.pids

        def kill_last(m):
            os.kill(m.pipe.pids[1], signal.SIGKILL)

        assert _decode(model, kill_last) == want
        (rec,) = model.recoveries
        assert rec.stage is not None and rec.standby == standby
        assert rec.sequences == len(PROMPTS)
        assert rec.tokens == sum(len(p) for p in PROMPTS) + len(PROMPTS)  # prompts + 1 token each
        assert not set(model.pipe.pids) & set(before)
    finally:
        model.close()


@pytest.mark.timeout(300)
def test_a_fault_replacements_do_not_fix_fails_the_step(tiny_dir):
    model = _make(tiny_dir, False)
    try:
        seq = model.new_sequence()
        seq.length = 5  # the stages have no cache of it: every stage fails this step
        with pytest.raises(PipelineError, match="unknown here"):
            model.forward([[1]], [seq])
        assert len(model.recoveries) == MAX_RESTARTS_PER_STEP
    finally:
        model.close()
