"""DynaPipe latency predictor: per-layer time of a chunk and sampling time, fitted online.

A chunk (one micro-batch through one layer) holds requests i with ``n_i`` new tokens computed
and context length ``L_i`` (tokens attended to: cached + new). Its time is modelled as

    T_layer = Σ_i (φ1·n_i + φ2·n_i·L_i + ε)  =  φ1·Σn + φ2·Σ(n·L) + ε·R

(``R`` requests): projections and experts cost per token, attention per (token, context) pair,
and every request pays a fixed overhead (its own attention call, cache append). Sampling on the
last stage is ``T_sample = α·N_decode + β`` over the ``N_decode`` sequences that sample a token.

Both are linear in their coefficients, so they are fitted by least squares over samples that the
pipeline stages profile themselves (:class:`LayerSample`, :class:`SampleSample`). A prediction
from already-reduced features is three multiplies; from a request list it is one pass over it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# Samples kept per model: enough for a well-conditioned fit, few enough that the fit follows a
# drifting machine (another tenant, thermal state) within a few hundred steps.
DEFAULT_HISTORY = 2048
# Least squares on fewer points than a few times the coefficient count just memorizes noise.
MIN_SAMPLES_PER_COEF = 3


@dataclass(frozen=True)
class LayerSample:
    """One profiled layer execution: the chunk's requests and the measured seconds."""

    num_new: tuple[int, ...]
    lengths: tuple[int, ...]
    seconds: float

    def __post_init__(self):
        if len(self.num_new) != len(self.lengths) or not self.num_new:
            raise ValueError(
                f"a layer sample needs one length per request, got {len(self.num_new)} "
                f"token counts and {len(self.lengths)} lengths"
            )


@dataclass(frozen=True)
class SampleSample:
    """One profiled sampling call: sequences that sampled a token and the measured seconds."""

    num_decode: int
    seconds: float


def layer_features(num_new: Sequence[int], lengths: Sequence[int]) -> tuple[float, float, float]:
    """``(Σn, Σn·L, R)`` of a chunk: the regressors of the per-layer model."""
    if len(num_new) != len(lengths):
        raise ValueError(f"{len(num_new)} token counts but {len(lengths)} lengths")
    sn = snl = 0
    for n, length in zip(num_new, lengths, strict=True):
        sn += n
        snl += n * length
    return float(sn), float(snl), float(len(num_new))


def _lstsq(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares with each column scaled to unit norm (Σn·L is orders above Σn), in float64."""
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(targets, dtype=torch.float64)[:, None]
    scale = a.norm(dim=0).clamp_min(1e-30)
    sol = torch.linalg.lstsq(a / scale, b, driver="gelsd").solution[:, 0] / scale
    return [float(x) for x in sol]


def _relative_errors(pred: Iterable[float], actual: Iterable[float]) -> list[float]:
    return [abs(p - a) / a for p, a in zip(pred, actual, strict=True) if a > 0]


@dataclass(frozen=True)
class FitReport:
    """Relative error of a fit over the samples it was fitted (or evaluated) on."""

    samples: int
    mean_rel_error: float
    median_rel_error: float
    p90_rel_error: float

    @classmethod
    def of(cls, pred: Sequence[float], actual: Sequence[float]) -> FitReport:
        errs = sorted(_relative_errors(pred, actual))
        if not errs:
            return cls(0, float("nan"), float("nan"), float("nan"))
        return cls(
            len(errs),
            sum(errs) / len(errs),
            errs[len(errs) // 2],
            errs[min(len(errs) - 1, int(0.9 * len(errs)))],
        )


class LayerTimeModel:
    """``T_layer = φ1·Σn + φ2·Σn·L + ε·R [+ c]``, fitted from :class:`LayerSample` s.

    With `chunk_term`, a per-chunk constant ``c`` is fitted too: the cost a layer pays once per
    micro-batch whatever its requests (projections and router launched once, the expert
    dispatch). DynaPipe's formula has none; on a CPU reference model it is a large share of a
    small decode chunk (see docs/pipeline.md for the measured difference).
    """

    def __init__(self, history: int = DEFAULT_HISTORY, chunk_term: bool = False):
        self.samples: deque[LayerSample] = deque(maxlen=history)
        self.phi1 = self.phi2 = self.eps = self.chunk = 0.0
        self.chunk_term = chunk_term
        self.fitted = False

    def add(self, sample: LayerSample) -> None:
        self.samples.append(sample)

    def fit(self) -> FitReport:
        """Refits on the kept samples; returns the in-sample relative error."""
        if len(self.samples) < 3 * MIN_SAMPLES_PER_COEF:
            raise ValueError(
                f"need at least {3 * MIN_SAMPLES_PER_COEF} layer samples to fit, "
                f"have {len(self.samples)}"
            )
        extra = [1.0] if self.chunk_term else []
        rows = [[*layer_features(s.num_new, s.lengths), *extra] for s in self.samples]
        coef = _lstsq(rows, [s.seconds for s in self.samples])
        self.phi1, self.phi2, self.eps = coef[:3]
        self.chunk = coef[3] if self.chunk_term else 0.0
        self.fitted = True
        return self.evaluate(self.samples)

    def predict_features(self, sum_new: float, sum_new_len: float, requests: float) -> float:
        # A fit on few, noisy samples can extrapolate below zero; no layer takes negative time.
        t = self.phi1 * sum_new + self.phi2 * sum_new_len + self.eps * requests + self.chunk
        return max(0.0, t)

    def predict(self, num_new: Sequence[int], lengths: Sequence[int]) -> float:
        """Seconds for one layer over a chunk of requests (``num_new[i]``, ``lengths[i]``)."""
        return self.predict_features(*layer_features(num_new, lengths))

    def evaluate(self, samples: Iterable[LayerSample]) -> FitReport:
        samples = list(samples)
        pred = [self.predict(s.num_new, s.lengths) for s in samples]
        return FitReport.of(pred, [s.seconds for s in samples])


class SampleTimeModel:
    """``T_sample = α·N_decode + β``, fitted from :class:`SampleSample` s."""

    def __init__(self, history: int = DEFAULT_HISTORY):
        self.samples: deque[SampleSample] = deque(maxlen=history)
        self.alpha = self.beta = 0.0
        self.fitted = False

    def add(self, sample: SampleSample) -> None:
        self.samples.append(sample)

    def fit(self) -> FitReport:
        if len(self.samples) < 2 * MIN_SAMPLES_PER_COEF:
            raise ValueError(
                f"need at least {2 * MIN_SAMPLES_PER_COEF} sampling samples to fit, "
                f"have {len(self.samples)}"
            )
        rows = [[float(s.num_decode), 1.0] for s in self.samples]
        self.alpha, self.beta = _lstsq(rows, [s.seconds for s in self.samples])
        self.fitted = True
        return self.evaluate(self.samples)

    def predict(self, num_decode: int) -> float:
        return max(0.0, self.alpha * num_decode + self.beta)

    def evaluate(self, samples: Iterable[SampleSample]) -> FitReport:
        samples = list(samples)
        pred = [self.predict(s.num_decode) for s in samples]
        return FitReport.of(pred, [s.seconds for s in samples])


class LatencyPredictor:
    """Both models together: what the bubble-aware scheduler asks about a batch."""

    def __init__(self, history: int = DEFAULT_HISTORY, chunk_term: bool = False):
        self.layer = LayerTimeModel(history, chunk_term)
        self.sample = SampleTimeModel(history)

    def add_layer(self, num_new: Sequence[int], lengths: Sequence[int], seconds: float) -> None:
        self.layer.add(LayerSample(tuple(num_new), tuple(lengths), float(seconds)))

    def add_sample(self, num_decode: int, seconds: float) -> None:
        self.sample.add(SampleSample(int(num_decode), float(seconds)))

    @property
    def ready(self) -> bool:
        return self.layer.fitted and self.sample.fitted

    def fit(self) -> tuple[FitReport, FitReport]:
        return self.layer.fit(), self.sample.fit()

    def predict(
        self, num_new: Sequence[int], lengths: Sequence[int], num_decode: int
    ) -> tuple[float, float]:
        """``(T_layer, T_sample)`` in seconds for a micro-batch."""
        return self.layer.predict(num_new, lengths), self.sample.predict(num_decode)
