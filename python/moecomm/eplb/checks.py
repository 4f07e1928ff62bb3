"""Argument checks for the public entry points: one place, clear messages, inputs never modified."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def as_weight(weight: torch.Tensor | np.ndarray, name: str = "weight") -> torch.Tensor:
    """A float64 CPU copy of a 2-D, finite, non-negative load table [layers, experts]."""
    if not isinstance(weight, torch.Tensor | np.ndarray):
        raise ValueError(f"{name} must be a torch.Tensor or numpy array, got {type(weight)}")
    # copy=True: the caller's tensor is never aliased, so nothing below can modify it.
    w = torch.as_tensor(weight).detach().to(device="cpu", dtype=torch.float64, copy=True)
    if w.dim() != 2:
        raise ValueError(
            f"{name} must be 2-D [layers, num_logical_experts], got shape {tuple(w.shape)}"
        )
    if w.size(0) == 0 or w.size(1) == 0:
        raise ValueError(
            f"{name} must have at least one layer and one expert, got {tuple(w.shape)}"
        )
    # numpy for the checks: small torch reductions can wait on the intra-op thread pool.
    values = w.numpy()
    if not np.isfinite(values).all():
        raise ValueError(f"{name} must be finite, got NaN or inf")
    if values.min() < 0:
        raise ValueError(f"{name} must be non-negative loads, got a minimum of {values.min()}")
    return w


def positive_int(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_config(
    num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> bool:
    """Validate a rebalance_experts configuration; returns True for the hierarchical policy."""
    num_replicas = positive_int(num_replicas, "num_replicas")
    num_groups = positive_int(num_groups, "num_groups")
    num_nodes = positive_int(num_nodes, "num_nodes")
    num_gpus = positive_int(num_gpus, "num_gpus")
    if num_replicas < num_experts:
        raise ValueError(
            f"num_replicas must be >= num_logical_experts ({num_experts}), got {num_replicas}"
        )
    if num_replicas % num_gpus:
        raise ValueError(
            f"num_replicas must be a multiple of num_gpus ({num_gpus}), got {num_replicas}"
        )
    hierarchical = num_groups % num_nodes == 0
    if hierarchical:
        if num_experts % num_groups:
            raise ValueError(
                f"num_logical_experts must be a multiple of num_groups ({num_groups}), "
                f"got {num_experts}"
            )
        if num_gpus % num_nodes:
            raise ValueError(
                f"num_gpus must be a multiple of num_nodes ({num_nodes}), got {num_gpus}"
            )
    return hierarchical


def check_slots(slots_per_gpu: Sequence[int], num_experts: int) -> list[int]:
    slots = [positive_int(s, "slots_per_gpu entries") for s in slots_per_gpu]
    if not slots:
        raise ValueError("slots_per_gpu must name at least one GPU, got an empty sequence")
    if sum(slots) < num_experts:
        raise ValueError(
            f"slots_per_gpu must hold >= num_logical_experts ({num_experts}) slots, "
            f"got {sum(slots)}"
        )
    return slots


def check_capacity(capacity: Sequence[float] | torch.Tensor | None, num_gpus: int) -> torch.Tensor:
    if capacity is None:
        return torch.ones(num_gpus, dtype=torch.float64)
    cap = torch.as_tensor(capacity).detach().to(dtype=torch.float64, copy=True).reshape(-1)
    if cap.numel() != num_gpus:
        raise ValueError(
            f"gpu_capacity must have one entry per GPU ({num_gpus}), got {cap.numel()}"
        )
    if not np.isfinite(cap.numpy()).all() or cap.numpy().min() <= 0:
        raise ValueError(f"gpu_capacity must be finite and > 0, got {cap.tolist()}")
    return cap
