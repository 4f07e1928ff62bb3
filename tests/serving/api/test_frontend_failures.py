"""An experts backend that fails: a stream ends with an error event (no [DONE], no retry), a
plain request gets a 5xx with the reason, /health turns 503, and the engine keeps serving."""

from __future__ import annotations

import httpx
import pytest
import torch
from frontend_helpers import MODEL_NAME, sse_chunks
from moecomm_serving.api.app import FrontendSettings, make_frontend_app
from moecomm_serving.model.transformer import load_model

TIMEOUT_S = 60.0
PROMPT = "Fail over"


class FlakyExperts:
    """A real experts backend (the local experts) that raises on chosen dispatch calls, the way
    a lost expert server surfaces through an AttentionClient; it also counts failovers."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0
        self.fail_at: set[int] = set()
        self.failovers = 0

    def fail_after(self, n: int, times: int = 1) -> None:
        """The n-th dispatch from now (0: the next one) and the `times - 1` after it raise."""
        self.fail_at = {self.calls + n + i for i in range(times)}

    def dispatch(self, x, topk_ids, topk_weights, layer_id):
        call = self.calls
        self.calls += 1
        if call in self.fail_at:
            raise RuntimeError(f"expert server lost (layer {layer_id})")
        return self.inner.dispatch(x, topk_ids, topk_weights, layer_id)

    def combine(self, handle):
        return self.inner.combine(handle)


@pytest.fixture(scope="module")
def flaky(tiny_dir, model):
    return FlakyExperts(model.experts)


@pytest.fixture(scope="module")
def flaky_served(serve, tiny_dir, flaky):
    return serve(load_model(tiny_dir, experts=flaky, dtype=torch.float32))


def complete(served, stream: bool, max_tokens: int = 8):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens}
    body.update(temperature=0.0, ignore_eos=True, stream=stream, return_token_ids=True)
    return httpx.post(f"{served.url}/v1/completions", json=body, timeout=TIMEOUT_S)


def test_stream_failing_half_way_ends_with_an_error_event(flaky_served, flaky, model, tok, solo):
    layers = len(model.config.sparse_layers)  # one dispatch per MoE layer and step
    flaky.fail_after(2 * layers)  # steps 0 (prefill) and 1 succeed, step 2 fails
    steps_failed = flaky_served.stats.step_failures
    r = complete(flaky_served, stream=True)
    assert r.status_code == 200  # the stream had started
    chunks, done = sse_chunks(r.text)
    assert not done  # no [DONE] after a failure
    *tokens, last = chunks
    want = solo(tok.encode(PROMPT), max_new_tokens=8, ignore_eos=True)
    assert [c["choices"][0]["token_ids"][0] for c in tokens] == want[:2]
    assert last["error"]["code"] == 500
    assert "expert server lost" in last["error"]["message"]
    assert flaky_served.stats.step_failures == steps_failed + 1
    # not retried: the engine ran no further step for the failed request
    assert flaky_served.frontend.engine.num_running == 0
    # the engine keeps serving: the next request is complete and exact
    again = complete(flaky_served, stream=True)
    chunks, done = sse_chunks(again.text)
    assert done
    assert [c["choices"][0]["token_ids"][0] for c in chunks] == want


def test_plain_request_failing_gets_500_and_others_go_on(flaky_served, flaky, tok, solo):
    flaky.fail_after(0)
    r = complete(flaky_served, stream=False)
    assert r.status_code == 500
    assert "forward step failed: expert server lost" in r.json()["error"]["message"]
    ok = complete(flaky_served, stream=False)
    assert ok.status_code == 200
    want = solo(tok.encode(PROMPT), max_new_tokens=8, ignore_eos=True)
    assert ok.json()["choices"][0]["token_ids"] == want


def test_health_runs_a_real_forward(flaky_served, flaky):
    steps, calls = flaky_served.stats.steps, flaky.calls
    r = httpx.get(f"{flaky_served.url}/health", timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert flaky_served.stats.steps == steps + 1
    assert flaky.calls > calls  # the probe went through the experts
    flaky.fail_after(0)
    r = httpx.get(f"{flaky_served.url}/health", timeout=TIMEOUT_S)
    assert r.status_code == 503
    assert "expert server lost" in r.json()["error"]
    assert httpx.get(f"{flaky_served.url}/health", timeout=TIMEOUT_S).status_code == 200


def test_metrics_count_failures_and_failovers(flaky_served, flaky):
    flaky.failovers = 3  # what an AttentionClient reports after re-sending to replicas
    flaky.fail_after(0)
    assert complete(flaky_served, stream=False).status_code == 500
    text = httpx.get(f"{flaky_served.url}/metrics", timeout=TIMEOUT_S).text
    assert "moecomm_failovers_total 3\n" in text
    errors = next(
        line
        for line in text.splitlines()
        if line.startswith('moecomm_requests_total{outcome="error"}')
    )
    assert int(errors.split()[-1]) >= 1


def test_step_budget_must_fit_the_backend_slots(tiny_dir, flaky, tok):
    class Layout:
        max_tokens = 32  # an AttentionClient's per-dispatch row limit

    flaky.layout = Layout()
    try:
        m = load_model(tiny_dir, experts=flaky, dtype=torch.float32)
        with pytest.raises(ValueError, match="exceeds the experts backend's max_tokens 32"):
            make_frontend_app(m, tok, FrontendSettings(MODEL_NAME, max_batch_tokens=64))
        make_frontend_app(m, tok, FrontendSettings(MODEL_NAME, max_batch_tokens=32))
    finally:
        del flaky.layout
