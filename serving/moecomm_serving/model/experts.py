"""Experts backends: where a MoE layer's routed experts run.

The model talks to its experts through moecomm's one seam, :class:`moecomm.runtime.ExpertsBackend`
(``dispatch`` starts, ``combine`` waits), so a connected :class:`moecomm.runtime.AttentionClient`
or :class:`moecomm.runtime.DeviceClient` *is* a backend. :class:`LocalExperts` computes
in-process with the expert servers' own kernel (:class:`moecomm.runtime.experts.LayerExperts`),
so local and remote results come from the same code.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from moecomm.runtime.backend import ExpertsBackend, run_experts
from moecomm.runtime.experts import ExpertWeights, LayerExperts

__all__ = ["ExpertsBackend", "LocalExperts", "run_experts"]


class LocalExperts:
    """All experts of some layers, computed in-process (the monolithic reference).

    Args:
        experts: ``{layer: {expert: ExpertWeights}}``; every layer must hold all its experts
            ``0..E-1`` (a partial layer would silently drop routed tokens).
    """

    def __init__(self, experts: Mapping[int, Mapping[int, ExpertWeights]]):
        self.layers: dict[int, LayerExperts] = {}
        for layer, ex in experts.items():
            le = LayerExperts(layer, ex)
            if le.logical_ids != list(range(le.num_local)):
                raise ValueError(
                    f"layer {layer}: local experts must be 0..E-1 without gaps, got "
                    f"{le.logical_ids}"
                )
            self.layers[int(layer)] = le

    def dispatch(self, x, topk_ids, topk_weights, layer_id: int) -> torch.Tensor:
        le = self.layers.get(layer_id)
        if le is None:
            raise ValueError(f"no local experts for layer {layer_id} (have {sorted(self.layers)})")
        if x.dim() != 2 or x.shape[1] != le.hidden:
            raise ValueError(f"x must be [num_tokens, {le.hidden}], got {list(x.shape)}")
        if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
            raise ValueError(
                f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} "
                f"must both be [{x.shape[0]}, K]"
            )
        if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= le.num_local):
            raise ValueError(f"layer {layer_id}: expert ids outside [0, {le.num_local})")
        (y,) = le.forward([x], [topk_ids.to(torch.int32)], [topk_weights.to(torch.float32)])
        return y

    def combine(self, handle: torch.Tensor) -> torch.Tensor:
        # dispatch already computed the result; the handle is the output itself.
        return handle
