"""The reference model's experts through the GPU path (`moecomm frontend --device cuda`).

The reference model computes attention where it was loaded (the CPU, float32); its experts run on
GPU expert servers through a :class:`moecomm.runtime.DeviceClient`. This adapter is the seam in
between: activations go to the device once per layer, in chunks of the servers' ``max_tokens``,
and the combined output comes back in the caller's device and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from moecomm.runtime.device_client import DeviceClient, DeviceHandle

__all__ = ["DeviceExperts"]


@dataclass
class _Pending:
    handles: list[DeviceHandle]  # in flight, or...
    done: list[torch.Tensor]  # ...combined already (more chunks than the client has slots)
    device: torch.device
    dtype: torch.dtype


class DeviceExperts:
    """An ExpertsBackend over a DeviceClient for a model whose tensors live elsewhere."""

    def __init__(self, client: DeviceClient):
        self.client = client

    def dispatch(self, x, topk_ids, topk_weights, layer_id: int) -> _Pending:
        c = self.client
        step = c.layout.max_tokens
        dev = c.device
        xd = x.to(dev, torch.bfloat16)
        ids = topk_ids.to(dev, torch.int32).contiguous()
        w = topk_weights.to(dev, torch.float32).contiguous()
        starts = range(0, max(x.shape[0], 1), step)
        chunks = [(xd[i : i + step], ids[i : i + step], w[i : i + step]) for i in starts]
        if len(chunks) <= len(c.workspaces):
            handles = [c.dispatch(*ch, layer_id) for ch in chunks]
            return _Pending(handles, [], x.device, x.dtype)
        # More chunks than slots in flight: each one round trip after the other.
        done = [c.combine(c.dispatch(*ch, layer_id)) for ch in chunks]
        return _Pending([], done, x.device, x.dtype)

    def combine(self, pending: _Pending) -> torch.Tensor:
        parts = pending.done + [self.client.combine(h) for h in pending.handles]
        return torch.cat(parts).to(pending.device, pending.dtype)

    def close(self) -> None:
        self.client.close()
