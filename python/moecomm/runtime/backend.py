"""The one dispatch/combine seam between a model and its experts.

A MoE layer talks to its routed experts through two calls, and everything that serves experts
answers them: :class:`moecomm.runtime.AttentionClient` (host memory, shm or nixl),
:class:`moecomm.runtime.DeviceClient` (GPU memory, CUDA IPC), the serving layer's in-process
``LocalExperts``, and the adapters built on top (``moecomm.compat.deep_ep``, pipeline stages):

- ``dispatch(x [T, H], topk_ids [T, K], topk_weights [T, K], layer_id) -> handle`` starts the
  work and may return before it is done;
- ``combine(handle) -> y [T, H]`` waits and returns
  ``y[t] = Σ_k w[t, k] · expert_{ids[t, k]}(x[t])``.

Splitting the two lets a scheduler run the attention of one micro-batch while another is with
the experts.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["ExpertsBackend", "run_experts"]


@runtime_checkable
class ExpertsBackend(Protocol):
    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer_id: int
    ) -> Any: ...

    def combine(self, handle: Any) -> torch.Tensor: ...


def run_experts(
    backend: ExpertsBackend,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    layer_id: int,
) -> torch.Tensor:
    """dispatch + combine in one call, for callers that do not overlap."""
    return backend.combine(backend.dispatch(x, topk_ids, topk_weights, layer_id))
