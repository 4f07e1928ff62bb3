"""DynaPipe pipeline stages: latency predictor, bubble-aware layer redistribution, and a stage
runtime with asynchronous KV-cache migration (see docs/pipeline.md)."""

from moecomm.pipeline.predictor import (
    FitReport,
    LatencyPredictor,
    LayerSample,
    LayerTimeModel,
    SampleSample,
    SampleTimeModel,
)
from moecomm.pipeline.scheduler import (
    DEFAULT_WINDOW,
    BubbleScheduler,
    Decision,
    best_k,
    misalignment,
    stage_counts,
    stage_ranges,
)

__all__ = [
    "DEFAULT_WINDOW",
    "BubbleScheduler",
    "Decision",
    "FitReport",
    "LatencyPredictor",
    "LayerSample",
    "LayerTimeModel",
    "SampleSample",
    "SampleTimeModel",
    "best_k",
    "misalignment",
    "stage_counts",
    "stage_ranges",
]
