"""DynaPipe latency predictor: per-layer time of a chunk and sampling time, fitted online.

A chunk (one micro-batch through one layer) holds requests i with ``n_i`` new tokens computed
and context length ``L_i`` (tokens attended to: cached + new). DynaPipe models its time as

    T_layer = Σ_i (φ1·n_i + φ2·n_i·L_i + ε)  =  φ1·Σn + φ2·Σ(n·L) + ε·R

(``R`` requests): projections and experts cost per token, attention per (token, context) pair,
and every request pays a fixed overhead (its own attention call, cache append). Measured on the
CPU reference model (docs/pipeline.md) that formula misses three things, each an optional term:

- ``chunk_term``: ``+ c``, paid once per micro-batch whatever its requests (projections, router
  and expert dispatch are one call each): most of a small decode chunk.
- ``context_term``: ``+ λ·ΣL``, attention work per request proportional to its context alone
  (reading the cache, the causal mask, the softmax row): a prefill request of n tokens costs
  less than n decode requests at the same context, which Σn·L alone cannot express.
- ``cold_term``: ``+ cold·(κ + ρ·R)``, the extra of a *cold* call: the first call of a layer on
  a new batch shape after other work ran (fresh activation and attention buffers, caches evicted
  by other layers). Samples and predictions say whether they are cold.

Sampling on the last stage is ``T_sample = α·N_decode + β`` over the ``N_decode`` sequences that
sample a token (a draw per sequence dominates it; measured, extra terms in N fit no better than
the noise, docs/pipeline.md).

Both are linear in their coefficients, so they are fitted by least squares over samples that the
pipeline stages profile themselves (:class:`LayerSample`, :class:`SampleSample`). A prediction
from a request list is one pass over it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

# Samples kept per model: enough for a well-conditioned fit, few enough that the fit follows a
# drifting machine (another tenant, thermal state) within a few hundred steps.
DEFAULT_HISTORY = 2048
# Least squares on fewer points than a few times the coefficient count just memorizes noise.
MIN_SAMPLES_PER_COEF = 3
# Every layer term the reference model on a CPU needs (the bench's measurement, docs/pipeline.md);
# read-only, being shared by every caller that spreads it into a model.
MACHINE_LAYER_TERMS = MappingProxyType(
    {"chunk_term": True, "context_term": True, "cold_term": True}
)


def _check_seconds(what: str, seconds: float) -> None:
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what}: seconds must be finite and >= 0, got {seconds}")


@dataclass(frozen=True)
class LayerSample:
    """One profiled layer execution: the chunk's requests, the measured seconds, and whether it
    was a cold call (first on a new shape after other work)."""

    num_new: tuple[int, ...]
    lengths: tuple[int, ...]
    seconds: float
    cold: bool = False

    def __post_init__(self):
        if len(self.num_new) != len(self.lengths) or not self.num_new:
            raise ValueError(
                f"a layer sample needs one length per request, got {len(self.num_new)} "
                f"token counts and {len(self.lengths)} lengths"
            )
        for n, length in zip(self.num_new, self.lengths, strict=True):
            if n < 0 or length < n:
                raise ValueError(
                    f"a request needs 0 <= new tokens <= context length (the context includes "
                    f"the new tokens), got n = {n}, L = {length}"
                )
        _check_seconds("layer sample", self.seconds)


@dataclass(frozen=True)
class SampleSample:
    """One profiled sampling call: sequences that sampled a token and the measured seconds."""

    num_decode: int
    seconds: float

    def __post_init__(self):
        if self.num_decode < 0:
            raise ValueError(f"num_decode must be >= 0, got {self.num_decode}")
        _check_seconds("sampling sample", self.seconds)


def chunk_features(
    num_new: Sequence[int], lengths: Sequence[int]
) -> tuple[float, float, float, float]:
    """``(Σn, Σn·L, R, ΣL)`` of a chunk: the regressors of the per-layer model."""
    if len(num_new) != len(lengths):
        raise ValueError(f"{len(num_new)} token counts but {len(lengths)} lengths")
    sn = snl = sl = 0
    for n, length in zip(num_new, lengths, strict=True):
        sn += n
        snl += n * length
        sl += length
    return float(sn), float(snl), float(len(num_new)), float(sl)


def layer_features(num_new: Sequence[int], lengths: Sequence[int]) -> tuple[float, float, float]:
    """``(Σn, Σn·L, R)`` of a chunk: the regressors of DynaPipe's formula."""
    return chunk_features(num_new, lengths)[:3]


def _lstsq(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares with each column scaled to unit norm (Σn·L is orders above Σn), in float64.

    gelsd gives the minimum-norm solution when a column is all zero (a cold term with no cold
    sample yet), so such a coefficient comes out 0 instead of breaking the fit."""
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
        mid = len(errs) // 2
        median = errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2
        return cls(
            len(errs),
            sum(errs) / len(errs),
            median,
            errs[min(len(errs) - 1, int(0.9 * len(errs)))],
        )


class LayerTimeModel:
    """``T_layer = φ1·Σn + φ2·Σn·L + ε·R [+ c] [+ λ·ΣL] [+ cold·(κ + ρ·R)]``, fitted from
    :class:`LayerSample` s; each bracket is switched on by its flag (see the module docstring).
    Without flags it is DynaPipe's formula."""

    def __init__(
        self,
        history: int = DEFAULT_HISTORY,
        chunk_term: bool = False,
        context_term: bool = False,
        cold_term: bool = False,
    ):
        self.samples: deque[LayerSample] = deque(maxlen=history)
        self.phi1 = self.phi2 = self.eps = self.chunk = 0.0
        self.lam = self.cold_chunk = self.cold_req = 0.0
        self.chunk_term, self.context_term, self.cold_term = chunk_term, context_term, cold_term
        self.fitted = False

    @property
    def num_coefs(self) -> int:
        return 3 + self.chunk_term + self.context_term + 2 * self.cold_term

    def _row(self, sn: float, snl: float, r: float, sl: float, cold: bool) -> list[float]:
        row = [sn, snl, r]
        if self.chunk_term:
            row.append(1.0)
        if self.context_term:
            row.append(sl)
        if self.cold_term:
            c = 1.0 if cold else 0.0
            row += [c, c * r]
        return row

    def add(self, sample: LayerSample) -> None:
        self.samples.append(sample)

    def fit(self) -> FitReport:
        """Refits on the kept samples; returns the in-sample relative error."""
        need = self.num_coefs * MIN_SAMPLES_PER_COEF
        if len(self.samples) < need:
            raise ValueError(
                f"need at least {need} layer samples to fit {self.num_coefs} coefficients, "
                f"have {len(self.samples)}"
            )
        rows = [self._row(*chunk_features(s.num_new, s.lengths), s.cold) for s in self.samples]
        coef = iter(_lstsq(rows, [s.seconds for s in self.samples]))
        self.phi1, self.phi2, self.eps = next(coef), next(coef), next(coef)
        self.chunk = next(coef) if self.chunk_term else 0.0
        self.lam = next(coef) if self.context_term else 0.0
        if self.cold_term:
            self.cold_chunk, self.cold_req = next(coef), next(coef)
        self.fitted = True
        return self.evaluate(self.samples)

    def predict_features(
        self,
        sum_new: float,
        sum_new_len: float,
        requests: float,
        sum_len: float | None = None,
        cold: bool = False,
    ) -> float:
        if sum_len is None and self.context_term:
            raise ValueError("this model has a context term: pass sum_len (Σ L)")
        t = self.phi1 * sum_new + self.phi2 * sum_new_len + self.eps * requests + self.chunk
        if self.context_term:
            t += self.lam * sum_len
        if cold:
            t += self.cold_chunk + self.cold_req * requests
        # A fit on few, noisy samples can extrapolate below zero; no layer takes negative time.
        return max(0.0, t)

    def predict(self, num_new: Sequence[int], lengths: Sequence[int], cold: bool = False) -> float:
        """Seconds for one layer over a chunk of requests (``num_new[i]``, ``lengths[i]``)."""
        sn, snl, r, sl = chunk_features(num_new, lengths)
        return self.predict_features(sn, snl, r, sl, cold)

    def evaluate(self, samples: Iterable[LayerSample]) -> FitReport:
        samples = list(samples)
        pred = [self.predict(s.num_new, s.lengths, s.cold) for s in samples]
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
    """Both models together: what the bubble-aware scheduler asks about a batch. The keyword
    flags are :class:`LayerTimeModel`'s; all off is DynaPipe's formula."""

    def __init__(
        self,
        history: int = DEFAULT_HISTORY,
        chunk_term: bool = False,
        context_term: bool = False,
        cold_term: bool = False,
    ):
        self.layer = LayerTimeModel(history, chunk_term, context_term, cold_term)
        self.sample = SampleTimeModel(history)

    def add_layer(
        self, num_new: Sequence[int], lengths: Sequence[int], seconds: float, cold: bool = False
    ) -> None:
        self.layer.add(LayerSample(tuple(num_new), tuple(lengths), float(seconds), cold))

    def add_sample(self, num_decode: int, seconds: float) -> None:
        self.sample.add(SampleSample(int(num_decode), float(seconds)))

    @property
    def ready(self) -> bool:
        return self.layer.fitted and self.sample.fitted

    def fit(self) -> tuple[FitReport, FitReport]:
        return self.layer.fit(), self.sample.fit()

    def predict(
        self, num_new: Sequence[int], lengths: Sequence[int], num_decode: int, cold: bool = False
    ) -> tuple[float, float]:
        """``(T_layer, T_sample)`` in seconds for a micro-batch."""
        return self.layer.predict(num_new, lengths, cold), self.sample.predict(num_decode)
