"""How good a placement is: GPU loads, imbalance, duplicates, replicas moved; load windows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .checks import as_weight, check_capacity, positive_int

# Default weight of each older load window relative to the next newer one: recent traffic
# predicts the next interval best, and 0.5 halves the influence of every step back in time.
WINDOW_DECAY = 0.5


def _slot_gpu(num_slots: int, num_gpus: int | Sequence[int]) -> torch.Tensor:
    """GPU of each physical slot: equal blocks for an int, consecutive runs for per-GPU counts."""
    if isinstance(num_gpus, int | np.integer):
        n = positive_int(num_gpus, "num_gpus")
        if num_slots % n:
            raise ValueError(f"num_replicas ({num_slots}) must be a multiple of num_gpus, got {n}")
        return torch.arange(num_slots) // (num_slots // n)
    counts = torch.as_tensor(list(num_gpus), dtype=torch.int64)
    if int(counts.sum()) != num_slots:
        raise ValueError(
            f"slots_per_gpu must sum to num_replicas ({num_slots}), got {counts.sum()}"
        )
    return torch.repeat_interleave(torch.arange(counts.numel()), counts)


def _as_phy2log(phy2log: torch.Tensor | np.ndarray, weight: torch.Tensor) -> torch.Tensor:
    p = torch.as_tensor(phy2log).detach().to(device="cpu", dtype=torch.int64)
    if p.dim() != 2 or p.size(0) != weight.size(0):
        raise ValueError(
            f"phy2log must be [layers={weight.size(0)}, num_replicas], got {tuple(p.shape)}"
        )
    if bool((p < 0).any()) or bool((p >= weight.size(1)).any()):
        raise ValueError(f"phy2log ids must lie in [0, {weight.size(1)}), got {p.min()}..{p.max()}")
    return p


def gpu_loads(
    phy2log: torch.Tensor | np.ndarray,
    weight: torch.Tensor | np.ndarray,
    num_gpus: int | Sequence[int],
) -> torch.Tensor:
    """[layers, gpus] load per GPU; a slot carries its expert's load / its replica count."""
    w = as_weight(weight)
    p = _as_phy2log(phy2log, w)
    layers, num_slots = p.shape
    counts = torch.zeros(layers, w.size(1), dtype=torch.float64)
    counts.scatter_add_(1, p, torch.ones(p.shape, dtype=torch.float64))
    slot_load = w.gather(1, p) / counts.gather(1, p)
    gpu = _slot_gpu(num_slots, num_gpus)
    out = torch.zeros(layers, int(gpu.max()) + 1, dtype=torch.float64)
    out.index_add_(1, gpu, slot_load)
    return out


def imbalance_per_layer(
    phy2log: torch.Tensor | np.ndarray,
    weight: torch.Tensor | np.ndarray,
    num_gpus: int | Sequence[int],
    *,
    gpu_capacity: Sequence[float] | torch.Tensor | None = None,
) -> torch.Tensor:
    """[layers] max GPU load / mean GPU load (loads divided by capacity when given).

    A layer with no load at all counts as perfectly balanced (1.0).
    """
    loads = gpu_loads(phy2log, weight, num_gpus)
    cap = check_capacity(gpu_capacity, loads.size(1))
    ln, cn = loads.numpy(), cap.numpy()
    mean = ln.sum(axis=1) / cn.sum()
    peak = (ln / cn).max(axis=1)
    ratio = np.divide(peak, mean, out=np.ones_like(peak), where=mean > 0)
    return torch.from_numpy(ratio)


def imbalance(
    phy2log: torch.Tensor | np.ndarray,
    weight: torch.Tensor | np.ndarray,
    num_gpus: int | Sequence[int],
    *,
    gpu_capacity: Sequence[float] | torch.Tensor | None = None,
) -> float:
    """Mean over layers of (max GPU load / mean GPU load); 1.0 is perfect."""
    return float(imbalance_per_layer(phy2log, weight, num_gpus, gpu_capacity=gpu_capacity).mean())


def duplicates(phy2log: torch.Tensor | np.ndarray, num_gpus: int | Sequence[int]) -> int:
    """Replicas that share a GPU with another replica of the same expert (summed over layers)."""
    p = torch.as_tensor(phy2log).detach().to(device="cpu", dtype=torch.int64)
    gpu = _slot_gpu(p.size(1), num_gpus)
    key = gpu[None, :] * (int(p.max()) + 1) + p
    sorted_key = key.sort(dim=1).values
    return int((sorted_key[:, 1:] == sorted_key[:, :-1]).sum())


def replicas_moved(
    old_phy2log: torch.Tensor | np.ndarray,
    new_phy2log: torch.Tensor | np.ndarray,
    num_gpus: int | Sequence[int],
) -> int:
    """Replicas a GPU must load to go from old to new: per GPU and expert, max(new - old, 0).

    Reordering slots within a GPU moves nothing; only weights that must arrive count.
    """
    old = torch.as_tensor(old_phy2log).detach().to(device="cpu", dtype=torch.int64)
    new = torch.as_tensor(new_phy2log).detach().to(device="cpu", dtype=torch.int64)
    if old.shape != new.shape:
        raise ValueError(f"placements differ in shape: {tuple(old.shape)} vs {tuple(new.shape)}")
    gpu = _slot_gpu(old.size(1), num_gpus)
    num_experts = int(max(old.max(), new.max())) + 1
    num_gpu = int(gpu.max()) + 1
    layers = old.size(0)

    def histogram(p: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(layers, num_gpu * num_experts, dtype=torch.int64)
        h.scatter_add_(1, gpu[None, :] * num_experts + p, torch.ones_like(p))
        return h

    return int((histogram(new) - histogram(old)).clamp(min=0).sum())


def combine_windows(
    windows: torch.Tensor | np.ndarray | Sequence[torch.Tensor],
    window_weights: Sequence[float] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Loads observed over several windows -> one [layers, experts] load table.

    windows: [num_windows, layers, experts], oldest first. window_weights (default: WINDOW_DECAY
    per step back, newest = 1) are normalized to sum 1, so the result stays on the input's scale.
    """
    if isinstance(windows, list | tuple):
        windows = torch.stack([torch.as_tensor(x) for x in windows])
    stack = torch.as_tensor(windows).detach().to(device="cpu", dtype=torch.float64)
    if stack.dim() != 3:
        raise ValueError(
            f"windows must be 3-D [num_windows, layers, experts], got shape {tuple(stack.shape)}"
        )
    num_windows = stack.size(0)
    if window_weights is None:
        ww = WINDOW_DECAY ** torch.arange(num_windows - 1, -1, -1, dtype=torch.float64)
    else:
        ww = torch.as_tensor(window_weights).detach().to(dtype=torch.float64).reshape(-1)
        if ww.numel() != num_windows:
            raise ValueError(
                f"window_weights must have one entry per window ({num_windows}), got {ww.numel()}"
            )
        if bool((ww < 0).any()) or float(ww.sum()) <= 0:
            raise ValueError(f"window_weights must be >= 0 and not all 0, got {ww.tolist()}")
    ww = ww / ww.sum()
    for i in range(num_windows):
        as_weight(stack[i], name=f"windows[{i}]")
    return (stack * ww[:, None, None]).sum(dim=0)
