"""Whole-deployment chaos through the OpenAI front end (issue 28, item 6): one deployment of real
processes — the membership monitor, three expert servers with every expert on two of them, and
`moecomm frontend --stages 2` (standby stages on) with live re-placement and --min-replicas 2,
all found through the monitor — serves streamed and non-streamed completions from three client
threads the whole time, while each trial's seeded plan kills (SIGKILL) or stops (SIGSTOP, then
SIGCONT) an expert server, a pipeline stage process and the monitor; killed servers and the
monitor are started again after a while, the front end replaces lost stages itself.

Every request of every trial gets its complete answer with the greedy tokens of the in-process
model (the fault-free run of the same prompt); the front end never stops serving; /metrics
counts the stage replacements; after the last trial nothing of the deployment is left: no
process, no shared-memory segment. The trials share the deployment, as a deployment that
never stops would: each begins where the one before left it (whole again, checked).

CI runs CI_SEEDS; MOECOMM_LONG=1 runs LONG_TRIALS. A failing trial prints its seed; replay it
alone with

    MOECOMM_CHAOS_SEED=<seed> .venv/bin/python -m pytest tests/chaos/test_deployment_chaos.py
"""

from __future__ import annotations

import pytest
import torch
from deployment import Deployment
from deployment_client import PROMPTS
from deployment_figures import DEPLOY_FIGURES
from deployment_plan import TARGETS, plan_deployment_trial
from deployment_trial import RECOVERY_NEW, RECOVERY_STANDBY, run_deployment_trial
from moecomm_serving.api.metrics import ServingMetrics
from moecomm_serving.engine.generate import generate
from moecomm_serving.model.tokenizer import load_tokenizer
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import SamplingParams
from test_chaos import SEED_ENV, trial_seeds

# Together these plans strike every kind of fault — kill and stop of a server, a stage and the
# monitor (test_the_ci_seeds_strike_every_kind_of_fault keeps it so) — in ~1-2 min on 2 cores.
CI_SEEDS = (2, 4, 7)
LONG_TRIALS = 100
# A trial: ~6 s of traffic, restarts and the drain of its last requests, a stage replacement
# without standby (~20 s on a loaded machine); its own deadlines fail a hang first.
TRIAL_TIMEOUT_S = 300
# The deployment starts seven Python processes (monitor, three servers, front end, stages).
START_TIMEOUT_S = 400


def _replay(seed: int) -> str:
    return f"{SEED_ENV}={seed} .venv/bin/python -m pytest tests/chaos/test_deployment_chaos.py"


@pytest.fixture(scope="module")
def expected(tiny_mixtral_dir) -> dict[int, list[int]]:
    """The fault-free greedy tokens of every prompt of the traffic, by the in-process model."""
    model = load_model(tiny_mixtral_dir, dtype=torch.float32)
    tok = load_tokenizer(tiny_mixtral_dir, model.config)
    out = {}
    for i, (text, max_tokens) in enumerate(PROMPTS):
        params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        (g,) = generate(model, [tok.encode(text)], params)
        out[i] = list(g.tokens)
    return out


@pytest.fixture(scope="module")
def deployment(tiny_mixtral_dir, expected):
    dep = Deployment(tiny_mixtral_dir)
    try:
        dep.start()
        yield dep
    finally:
        if not getattr(dep, "closed", False):
            dep.close()


def test_the_ci_seeds_strike_every_kind_of_fault():
    kinds = {(f.target, f.action) for s in CI_SEEDS for f in plan_deployment_trial(s).faults}
    assert kinds == {(t, a) for t in TARGETS for a in ("kill", "stop")}


def test_metrics_render_stage_recoveries_by_kind():
    """Both kinds are always rendered (0 before the first recovery, and in a front end with no
    stages), as a Prometheus counter."""
    counts = {"standby": 0, "new": 0}
    m = ServingMetrics(lambda: 0, lambda: 0, lambda: 3, stage_recoveries=lambda: dict(counts))
    text = m.render()
    assert "# TYPE moecomm_stage_recoveries_total counter" in text
    assert f"{RECOVERY_STANDBY} 0\n" in text and f"{RECOVERY_NEW} 0\n" in text
    counts.update(standby=2, new=1)
    text = m.render()
    assert f"{RECOVERY_STANDBY} 2\n" in text and f"{RECOVERY_NEW} 1\n" in text
    assert "moecomm_failovers_total 3\n" in text
    plain = ServingMetrics(lambda: 0, lambda: 0, lambda: 0).render()
    assert f"{RECOVERY_STANDBY} 0\n" in plain and f"{RECOVERY_NEW} 0\n" in plain


@pytest.mark.timeout(START_TIMEOUT_S + TRIAL_TIMEOUT_S)
@pytest.mark.parametrize("seed", trial_seeds(CI_SEEDS, LONG_TRIALS), ids=lambda s: f"seed{s}")
def test_whole_deployment_chaos_loses_no_request(seed, deployment, expected):
    plan = plan_deployment_trial(seed)
    result = run_deployment_trial(deployment, plan, expected)
    DEPLOY_FIGURES.add(seed, result.plan, not result.problems, result.wall_s, result.figures)
    DEPLOY_FIGURES.write_partial()
    f = result.figures
    assert not result.problems, (
        f"deployment chaos trial seed={seed} failed; replay: {_replay(seed)}\n"
        f"plan: {result.plan}\nfigures: {f}\n" + "\n".join(result.problems[:20])
    )
    assert f["requests"] > 0 and f["failed"] == 0 and f["wrong"] == 0, f
    assert f["request_errors_metric"] == 0, f  # the front end counted no failed request either
    # A killed stage is always replaced (traffic never pauses), and /metrics counts it.
    recoveries = f["stage_recoveries_standby"] + f["stage_recoveries_new"]
    if f["stage_kills"]:
        assert recoveries >= 1, f
    assert recoveries == len(f["stage_recovery_s"]), f  # one line per counted replacement


@pytest.mark.timeout(120)
def test_the_deployment_stops_cleanly_and_leaves_nothing(deployment):
    """Runs after the trials (file order): the front end (and its stages), the servers and the
    monitor stop on request, exit 0, and leave no process and no shared-memory segment."""
    codes = deployment.close()
    deployment.closed = True
    problems = [f"{name}: exit code {code} at stop" for name, code in codes.items() if code != 0]
    problems += deployment.leftovers()
    assert not problems, "\n".join(problems)
