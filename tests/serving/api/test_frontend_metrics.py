"""/metrics in Prometheus text: latency histograms, token counters and rates, queue depth,
failovers; and /health on a healthy server."""

from __future__ import annotations

import httpx
from frontend_helpers import MODEL_NAME
from moecomm_serving.api.metrics import Histogram

TIMEOUT_S = 60.0
REQUESTS = 3
MAX_TOKENS = 5


def samples(text: str) -> dict[str, float]:
    """``name{labels} value`` lines of the exposition, keyed by ``name{labels}``."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_metrics_after_requests(serve, model):
    served = serve(model)
    for i in range(REQUESTS):
        body = {"model": MODEL_NAME, "prompt": f"metrics {i}", "max_tokens": MAX_TOKENS}
        body.update(ignore_eos=True, stream=i % 2 == 1)
        r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=TIMEOUT_S)
        assert r.status_code == 200
    r = httpx.get(f"{served.url}/metrics", timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = samples(r.text)
    p = "moecomm_"
    assert m[f"{p}time_to_first_token_seconds_count"] == REQUESTS
    assert m[f"{p}time_per_output_token_seconds_count"] == REQUESTS
    assert m[f"{p}e2e_request_latency_seconds_count"] == REQUESTS
    assert m[f"{p}inter_token_latency_seconds_count"] == REQUESTS * (MAX_TOKENS - 1)
    assert m[f'{p}time_to_first_token_seconds_bucket{{le="+Inf"}}'] == REQUESTS
    assert m[f"{p}time_to_first_token_seconds_sum"] > 0
    assert m[f"{p}generation_tokens_total"] == REQUESTS * MAX_TOKENS
    assert m[f"{p}generation_tokens_per_second"] > 0
    assert m[f'{p}requests_total{{outcome="success"}}'] == REQUESTS
    assert m[f"{p}queue_depth"] == 0
    assert m[f"{p}running_requests"] == 0
    assert m[f"{p}failovers_total"] == 0  # local experts never fail over
    assert f"# TYPE {p}inter_token_latency_seconds histogram\n" in r.text
    assert f"# TYPE {p}queue_depth gauge\n" in r.text
    assert f"# TYPE {p}failovers_total counter\n" in r.text


def test_health_ok(served):
    steps = served.stats.steps
    r = httpx.get(f"{served.url}/health", timeout=TIMEOUT_S)
    assert r.status_code == 200
    assert r.json()["status"] == "ok" and r.json()["forward_s"] > 0
    assert served.stats.steps == steps + 1  # a real forward, not a port check


def test_histogram_buckets_are_cumulative():
    h = Histogram("x", "test", buckets=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    lines = h.render()
    assert 'x_bucket{le="0.1"} 2' in lines  # le is inclusive
    assert 'x_bucket{le="1.0"} 3' in lines
    assert 'x_bucket{le="+Inf"} 4' in lines
    assert "x_count 4" in lines
