"""Expert placement: moecomm.eplb against the published greedy EPLB (bench/ops/eplb_baseline.py).

    python bench/ops/eplb.py [--json PATH] [--threads N] [--sweep]

Every case uses fixed seeds. Columns:
- base_ms / ours_ms: median wall time of one call (bench/_lib/common.py time_calls), the two timed
  alternately; time_ratio is ours / base (< 1: we are faster), speedup its inverse.
- imb_*: imbalance = mean over layers of max GPU load / mean GPU load (1.0 is perfect).
- dup_*: replicas sharing a GPU with another replica of their expert, summed over layers.
- moved_*: (incremental cases) fraction of replicas a GPU must load, going from the placement
  made for the loads before a 5% drift to the one made after it.
- valid: every output passed the placement invariants (ids, counts, log2phy, groups on nodes).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts

import eplb_baseline
from _lib.common import format_table, percentile, time_calls, write_json
from moecomm.eplb import (
    duplicates,
    imbalance,
    rebalance_experts,
    rebalance_incremental,
    replicas_moved,
)

# DeepSeek-V3-like shape from the issue: 58 MoE layers x 256 routed experts, 288 slots.
LAYERS, EXPERTS, REPLICAS, GROUPS = 58, 256, 288, 8
# Hierarchical: 4 nodes x 8 GPUs. Global: 144 GPUs as 18 nodes of 8 (8 groups % 18 != 0).
HIER = (REPLICAS, GROUPS, 4, 32)
GLOBAL = (REPLICAS, GROUPS, 18, 144)
# Load drift for the incremental case: each expert's load times (1 + 5% standard normal).
DRIFT = 0.05
# Timing: ROUNDS rounds, each one baseline call then OURS_PER_ROUND calls of ours, so both see
# the same background load on the shared 2-core machine (the baseline takes up to ~0.3 s a call).
ROUNDS, OURS_PER_ROUND, WARMUP = 11, 5, 2


def lognormal(seed: int, sigma: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.exp(sigma * torch.randn(LAYERS, EXPERTS, generator=g, dtype=torch.float64))


def zipf(seed: int, s: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(EXPERTS, generator=g) for _ in range(LAYERS)]) + 1
    return 1000.0 / ranks.to(torch.float64) ** s


def valid(phy2log, log2phy, logcnt, cfg) -> bool:
    num_replicas, num_groups, num_nodes, _ = cfg
    layers = phy2log.size(0)
    recount = torch.zeros_like(logcnt).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    ok = bool((logcnt >= 1).all()) and torch.equal(recount, logcnt)
    slots = log2phy.clamp(min=0)
    owner = phy2log.gather(1, slots.view(layers, -1)).view(slots.shape)
    filled = torch.arange(log2phy.size(2))[None, None, :] < logcnt[:, :, None]
    ok &= bool((log2phy[~filled] == -1).all())
    ok &= bool((owner == torch.arange(EXPERTS)[None, :, None])[filled].all())
    if num_groups % num_nodes == 0:
        node = (torch.arange(num_replicas) // (num_replicas // num_nodes)).expand(layers, -1)
        group = phy2log // (EXPERTS // num_groups)
        lo = torch.full((layers, num_groups), num_nodes).scatter_reduce(1, group, node, "amin")
        hi = torch.full((layers, num_groups), -1).scatter_reduce(1, group, node, "amax")
        ok &= torch.equal(lo, hi)
    return ok


def median_ms(samples_ns) -> float:
    return percentile(samples_ns, 50) / 1e6


def interleaved(base_fn, ours_fn) -> tuple[list[int], list[int]]:
    """Samples of both, alternated round by round (time_calls does each timing)."""
    time_calls(base_fn, 0, WARMUP)
    time_calls(ours_fn, 0, WARMUP)
    base_ns: list[int] = []
    ours_ns: list[int] = []
    for _ in range(ROUNDS):
        base_ns += time_calls(base_fn, 1, warmup=0)
        ours_ns += time_calls(ours_fn, OURS_PER_ROUND, warmup=0)
    return base_ns, ours_ns


def full_case(name: str, w: torch.Tensor, cfg) -> dict:
    num_gpus = cfg[3]
    base = eplb_baseline.rebalance_experts(w, *cfg)
    ours = rebalance_experts(w, *cfg)
    base_ns, ours_ns = interleaved(
        lambda: eplb_baseline.rebalance_experts(w, *cfg), lambda: rebalance_experts(w, *cfg)
    )
    row = {
        "case": name,
        "gpus": num_gpus,
        "base_ms": median_ms(base_ns),
        "ours_ms": median_ms(ours_ns),
        "imb_base": imbalance(base[0], w, num_gpus),
        "imb_ours": imbalance(ours[0], w, num_gpus),
        "dup_base": duplicates(base[0], num_gpus),
        "dup_ours": duplicates(ours[0], num_gpus),
        "valid": valid(*ours, cfg) and valid(*base, cfg),
    }
    row["time_ratio"] = row["ours_ms"] / row["base_ms"]
    row["speedup"] = row["base_ms"] / row["ours_ms"]
    return row


def incremental_case(name: str, w0: torch.Tensor, cfg, seed: int) -> dict:
    num_gpus = cfg[3]
    g = torch.Generator().manual_seed(seed)
    w1 = w0 * (1.0 + DRIFT * torch.randn(w0.shape, generator=g, dtype=torch.float64)).clamp(min=0)
    base_prev = eplb_baseline.rebalance_experts(w0, *cfg)[0]
    base_new = eplb_baseline.rebalance_experts(w1, *cfg)[0]
    prev = rebalance_experts(w0, *cfg)[0]
    full = rebalance_experts(w1, *cfg)[0]
    inc = rebalance_incremental(prev, w1, *cfg)
    base_ns, inc_ns = interleaved(
        lambda: eplb_baseline.rebalance_experts(w1, *cfg),
        lambda: rebalance_incremental(prev, w1, *cfg),
    )
    total = prev.numel()
    row = {
        "case": name,
        "gpus": num_gpus,
        "base_ms": median_ms(base_ns),
        "ours_ms": median_ms(inc_ns),
        "imb_base": imbalance(base_new, w1, num_gpus),
        "imb_full": imbalance(full, w1, num_gpus),
        "imb_ours": imbalance(inc[0], w1, num_gpus),
        "imb_prev": imbalance(prev, w1, num_gpus),
        "dup_base": duplicates(base_new, num_gpus),
        "dup_ours": duplicates(inc[0], num_gpus),
        "moved_base": replicas_moved(base_prev, base_new, num_gpus) / total,
        "moved_full": replicas_moved(prev, full, num_gpus) / total,
        "moved_ours": replicas_moved(prev, inc[0], num_gpus) / total,
        "valid": valid(*inc, cfg),
    }
    row["time_ratio"] = row["ours_ms"] / row["base_ms"]
    row["speedup"] = row["base_ms"] / row["ours_ms"]
    row["imb_vs_full"] = row["imb_ours"] / row["imb_full"] - 1.0
    return row


def cases(sweep: bool):
    yield "full", "hier/lognormal1", lognormal(0, 1.0), HIER
    yield "full", "hier/zipf1", zipf(1, 1.0), HIER
    yield "full", "global/lognormal1", lognormal(2, 1.0), GLOBAL
    yield "full", "global/zipf1", zipf(3, 1.0), GLOBAL
    yield "incremental", "drift5%/hier", lognormal(4, 1.0), HIER
    yield "incremental", "drift5%/global", lognormal(5, 1.0), GLOBAL
    if sweep:
        for seed, sigma in ((10, 0.5), (11, 2.0)):
            yield "full", f"hier/lognormal{sigma:g}", lognormal(seed, sigma), HIER
            yield "full", f"global/lognormal{sigma:g}", lognormal(seed, sigma), GLOBAL
        for seed, s in ((12, 0.6), (13, 1.4)):
            yield "full", f"hier/zipf{s:g}", zipf(seed, s), HIER
            yield "full", f"global/zipf{s:g}", zipf(seed, s), GLOBAL
        for seed in (14, 15):
            yield "incremental", f"drift5%/hier/s{seed}", lognormal(seed, 1.0), HIER
            yield "incremental", f"drift5%/global/s{seed}", lognormal(seed, 1.0), GLOBAL


COLUMNS = [
    ("case", "case", ""),
    ("gpus", "gpus", "d"),
    ("base_ms", "base ms", ".2f"),
    ("ours_ms", "ours ms", ".2f"),
    ("time_ratio", "ours/base", ".3f"),
    ("speedup", "speedup", ".1f"),
    ("imb_base", "imb base", ".4f"),
    ("imb_ours", "imb ours", ".4f"),
    ("dup_base", "dup base", "d"),
    ("dup_ours", "dup ours", "d"),
    ("valid", "valid", ""),
]
INC_COLUMNS = [
    ("case", "case", ""),
    ("ours_ms", "inc ms", ".2f"),
    ("imb_prev", "imb kept", ".4f"),
    ("imb_full", "imb full", ".4f"),
    ("imb_ours", "imb inc", ".4f"),
    ("imb_vs_full", "inc/full-1", "+.4f"),
    ("moved_base", "moved base", ".3f"),
    ("moved_full", "moved full", ".3f"),
    ("moved_ours", "moved inc", ".3f"),
    ("dup_ours", "dup inc", "d"),
    ("valid", "valid", ""),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on 2 shared cores more threads only wait)",
    )
    parser.add_argument("--sweep", action="store_true", help="more skews and seeds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows, inc_rows = [], []
    for kind, name, w, cfg in cases(args.sweep):
        if kind == "full":
            rows.append(full_case(name, w, cfg))
        else:
            inc_rows.append(incremental_case(name, w, cfg, seed=100))
    print(
        f"moecomm.eplb vs published greedy; {LAYERS} layers x {EXPERTS} experts, "
        f"{REPLICAS} replicas, {GROUPS} groups; torch threads {args.threads}"
    )
    print(format_table(rows, COLUMNS))
    print()
    print(f"incremental after a {DRIFT:.0%} drift (moved = fraction of replicas to load)")
    print(format_table(inc_rows, INC_COLUMNS))
    summary = {
        "median_speedup_hier": percentile([r["speedup"] for r in rows if "hier" in r["case"]], 50),
        "median_speedup_global": percentile(
            [r["speedup"] for r in rows if "global" in r["case"]], 50
        ),
        "never_less_balanced": all(r["imb_ours"] <= r["imb_base"] + 1e-12 for r in rows),
        "max_moved_incremental": max((r["moved_ours"] for r in inc_rows), default=0.0),
        "max_imb_excess_incremental": max((r["imb_vs_full"] for r in inc_rows), default=0.0),
        "all_valid": all(r["valid"] for r in rows + inc_rows),
    }
    print()
    print(
        ", ".join(
            f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}" for k, v in summary.items()
        )
    )
    write_json(
        args.json,
        {
            "benchmark": "eplb",
            "threads": args.threads,
            "shape": {"layers": LAYERS, "experts": EXPERTS, "replicas": REPLICAS},
            "rows": rows + inc_rows,
            "summary": summary,
        },
    )
    return 0 if summary["all_valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
