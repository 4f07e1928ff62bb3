"""The C++ packing steps (csrc/kernels/cpu/eplb_pack.cc), bit-identical to the numpy ones.

The numpy code in packing.py is the reference and the fallback: it runs when `moecomm._C` is
missing or predates these kernels, for servers of unequal size or capacity, and whenever
`ENABLED` is False (tests compare the two paths on random configurations). The refinement is a
sequence of dependent swaps per layer; in numpy every swap step costs a dozen array operations
over all layers, which kept `rebalance_experts` at 2-3x the plain-Python greedy, far from its
20x target. The kernels do the same arithmetic, in the same order, item by item.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

# Set MOECOMM_EPLB_NATIVE=0 to force the numpy reference path (or set ENABLED at run time).
ENABLED = os.environ.get("MOECOMM_EPLB_NATIVE", "1") != "0"


def _load() -> Any:
    try:
        from moecomm import _C
    except ImportError:  # pure-Python checkout without the extension
        return None
    return _C if hasattr(_C, "eplb_refine") else None


_C = _load()


def on() -> bool:
    """The kernels are built and enabled."""
    return ENABLED and _C is not None


def usable(packing: Any, capacity: np.ndarray | None) -> bool:
    """The kernels handle labelled, full packs of equal capacity (every rebalance_experts call)."""
    return (
        ENABLED
        and _C is not None
        and packing.slot_l is not None
        and packing.full
        and (capacity is None or not bool((capacity != 1.0).any()))
    )


def _addr(a: np.ndarray) -> int:
    assert a.flags.c_contiguous and a.flags.writeable
    return a.ctypes.data


def _args(packing: Any) -> tuple[int, ...]:
    rows, packs, slots = packing.table.shape
    assert packing.table.dtype == np.int64 and packing.slot_l.dtype == np.int64
    assert packing.slot_w.dtype == np.float64 and packing.loads.dtype == np.float64
    assert packing.slot_w.shape == packing.slot_l.shape == packing.table.shape
    assert packing.loads.shape == (rows, packs)
    return (
        rows,
        packs,
        slots,
        _addr(packing.table),
        _addr(packing.slot_w),
        _addr(packing.slot_l),
        _addr(packing.loads),
    )


def _group(packing: Any, row_group: np.ndarray | None) -> tuple[np.ndarray | None, int]:
    """(array kept alive, address or 0). Group ids index a table of rows entries."""
    if row_group is None:
        return None, 0
    group = np.ascontiguousarray(row_group, dtype=np.int64)
    rows = packing.table.shape[0]
    assert group.shape == (rows,) and (rows == 0 or (group.min() >= 0 and group.max() < rows))
    return group, group.ctypes.data


def rounds(
    weights: np.ndarray, labels: np.ndarray, packs: int, slots: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Greedy rounds for equal packs: (table, slot_w, slot_l, loads) as packing._rounds."""
    w = np.ascontiguousarray(weights, dtype=np.float64)
    lab = np.ascontiguousarray(labels, dtype=np.int64)
    rows = w.shape[0]
    assert w.shape == lab.shape == (rows, packs * slots)
    table = np.empty((rows, packs, slots), dtype=np.int64)
    slot_w = np.empty((rows, packs, slots))
    slot_l = np.empty((rows, packs, slots), dtype=np.int64)
    loads = np.empty((rows, packs))
    _C.eplb_rounds(
        rows,
        packs,
        slots,
        table.ctypes.data,
        slot_w.ctypes.data,
        slot_l.ctypes.data,
        loads.ctypes.data,
        w.ctypes.data,
        lab.ctypes.data,
    )
    return table, slot_w, slot_l, loads


def dedup(packing: Any, row_group: np.ndarray | None, max_steps: int) -> None:
    keep, group = _group(packing, row_group)
    _C.eplb_dedup(*_args(packing), group, max_steps)
    del keep


def refine(
    packing: Any, row_group: np.ndarray | None, max_steps: int, min_relative_gain: float
) -> None:
    keep, group = _group(packing, row_group)
    _C.eplb_refine(*_args(packing), group, max_steps, min_relative_gain)
    del keep


def replica_counts(
    weights: np.ndarray, num_slots: int, max_count: int | None, offset: float
) -> np.ndarray:
    """replicas.replica_counts (checked arguments), same counts."""
    w = np.ascontiguousarray(weights, dtype=np.float64)
    rows, experts = w.shape
    counts = np.empty((rows, experts), dtype=np.int64)
    cap = -1 if max_count is None else int(max_count)
    _C.eplb_replica_counts(w.ctypes.data, rows, experts, num_slots, cap, offset, counts.ctypes.data)
    return counts


def log2phy(phy2log: np.ndarray, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log2phy, logcnt) of policy.finalize, written straight into torch tensors."""
    assert phy2log.dtype == np.int64 and phy2log.flags.c_contiguous
    rows, slots = phy2log.shape
    width = slots - num_experts + 1
    out = torch.empty((rows, num_experts, width), dtype=torch.int64)
    cnt = torch.empty((rows, num_experts), dtype=torch.int64)
    _C.eplb_log2phy(phy2log.ctypes.data, rows, slots, num_experts, out.data_ptr(), cnt.data_ptr())
    return out, cnt
