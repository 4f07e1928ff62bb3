"""The latency predictor recovers known coefficients from synthetic timings."""

import random
import time

import pytest
from moecomm.pipeline.predictor import (
    LatencyPredictor,
    LayerSample,
    LayerTimeModel,
    SampleSample,
    SampleTimeModel,
    layer_features,
)

SEED = 7
PHI1, PHI2, EPS = 2.0e-5, 3.0e-8, 4.0e-5  # s/token, s/(token·context), s/request
ALPHA, BETA = 1.5e-5, 2.0e-4  # s/sequence, s


def synthetic_chunk(rng: random.Random):
    """A mixed chunk: mostly decode requests (n = 1), sometimes a prefill chunk."""
    reqs = rng.randint(1, 24)
    num_new = [1 if rng.random() < 0.8 else rng.randint(8, 128) for _ in range(reqs)]
    lengths = [n + rng.randint(0, 2000) for n in num_new]
    return num_new, lengths


def true_layer_time(num_new, lengths):
    return sum(
        PHI1 * n + PHI2 * n * length + EPS for n, length in zip(num_new, lengths, strict=True)
    )


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_layer_model_recovers_coefficients(noise):
    rng = random.Random(SEED)
    model = LayerTimeModel()
    for _ in range(400):
        nn, ll = synthetic_chunk(rng)
        t = true_layer_time(nn, ll) * (1 + rng.uniform(-noise, noise))
        model.add(LayerSample(tuple(nn), tuple(ll), t))
    report = model.fit()
    tol = 1e-9 if noise == 0 else 0.05
    assert model.phi1 == pytest.approx(PHI1, rel=tol)
    assert model.phi2 == pytest.approx(PHI2, rel=tol)
    assert model.eps == pytest.approx(EPS, rel=max(tol, 0.1 if noise else 0))
    assert report.samples == 400
    assert report.mean_rel_error <= noise / 2 + 1e-9  # uniform noise has mean |u| = noise / 2
    # Held-out chunks are predicted as well as the fitted ones.
    held = []
    for _ in range(100):
        nn, ll = synthetic_chunk(rng)
        held.append(LayerSample(tuple(nn), tuple(ll), true_layer_time(nn, ll)))
    assert model.evaluate(held).mean_rel_error <= max(1e-9, noise / 4)


def test_sample_model_recovers_coefficients():
    rng = random.Random(SEED + 1)
    model = SampleTimeModel()
    for _ in range(200):
        n = rng.randint(1, 64)
        model.add(SampleSample(n, ALPHA * n + BETA))
    report = model.fit()
    assert model.alpha == pytest.approx(ALPHA, rel=1e-9)
    assert model.beta == pytest.approx(BETA, rel=1e-9)
    assert report.mean_rel_error < 1e-9


def test_predictor_combined_and_prediction_cost():
    rng = random.Random(SEED + 2)
    p = LatencyPredictor()
    assert not p.ready
    for _ in range(100):
        nn, ll = synthetic_chunk(rng)
        p.add_layer(nn, ll, true_layer_time(nn, ll))
        p.add_sample(len(nn), ALPHA * len(nn) + BETA)
    p.fit()
    assert p.ready
    nn, ll = [1] * 16, [500 + i for i in range(16)]
    t_layer, t_sample = p.predict(nn, ll, 16)
    assert t_layer == pytest.approx(true_layer_time(nn, ll), rel=1e-9)
    assert t_sample == pytest.approx(ALPHA * 16 + BETA, rel=1e-9)
    # A prediction is pure arithmetic: microseconds, not milliseconds (a loose sanity bound,
    # the measured cost is in bench/pipeline.py).
    t0 = time.perf_counter()
    for _ in range(1000):
        p.predict(nn, ll, 16)
    assert (time.perf_counter() - t0) / 1000 < 1e-3


def test_features_and_negative_inputs():
    assert layer_features([1, 4], [10, 20]) == (5.0, 90.0, 2.0)
    with pytest.raises(ValueError, match="lengths"):
        layer_features([1, 2], [3])
    with pytest.raises(ValueError, match="one length per request"):
        LayerSample((1,), (), 0.1)
    with pytest.raises(ValueError, match="need at least"):
        LayerTimeModel().fit()
    with pytest.raises(ValueError, match="need at least"):
        SampleTimeModel().fit()
