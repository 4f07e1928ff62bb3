"""DynaPipe pipeline stages: latency predictor, bubble-aware layer redistribution, and a stage
runtime with asynchronous KV-cache migration (see docs/pipeline.md)."""

from moecomm.pipeline.driver import DecodeRun, Pipeline, PipelineError, run_decode
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
from moecomm.pipeline.stage import StageCompute

__all__ = [
    "DEFAULT_WINDOW",
    "BubbleScheduler",
    "Decision",
    "DecodeRun",
    "FitReport",
    "LatencyPredictor",
    "LayerSample",
    "LayerTimeModel",
    "Pipeline",
    "PipelineError",
    "SampleSample",
    "SampleTimeModel",
    "StageCompute",
    "best_k",
    "misalignment",
    "run_decode",
    "stage_counts",
    "stage_ranges",
]
