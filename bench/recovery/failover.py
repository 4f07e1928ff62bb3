"""EaaS Fig. 10 on one host: expert servers killed one by one under steady load.

N expert servers, every expert replicated on two of them (server s holds the experts e with
s in {e mod N, (e+1) mod N}); one attention client keeps `--inflight` micro-batches in flight
and records every completion. Servers are killed with SIGKILL at the given times (chosen so that
every expert keeps a live replica). Prints throughput before/after each kill against the
surviving capacity share, the time to recover (kill -> first completion after it, and the
longest gap between completions around the kill), failed requests, and writes JSON and a PNG.

Usage: python bench/recovery/failover.py [--servers 4] [--duration 12] [--kills 4,8] [--json PATH]
       [--png PATH]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
import itertools

from _lib.common import format_table, write_json
from moecomm.errors import MoecommError
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.testing.clients import connect_client

SPEC = ModelSpec(num_layers=2, num_experts=8, hidden=256, intermediate=128, seed=0)
TOPK = 2
TOKENS = 16
# Throughput is reported over bins of this width.
BIN_S = 0.25
# Steady-state windows compared before and after a kill, skipping the recovery itself.
WINDOW_S = 2.0
SETTLE_S = 0.5


def hosted(num_servers: int) -> list[dict[int, list[int]]]:
    return [
        {
            layer: [
                e for e in range(SPEC.num_experts) if s in (e % num_servers, (e + 1) % num_servers)
            ]
            for layer in range(SPEC.num_layers)
        }
        for s in range(num_servers)
    ]


def victims(num_servers: int, count: int) -> list[int]:
    """Every other server: with ring placement no expert loses both replicas."""
    return list(range(0, num_servers, 2))[:count]


def rate(times: list[float], start: float, end: float) -> float:
    n = sum(1 for t in times if start <= t < end)
    return n * TOKENS / max(end - start, 1e-9)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--duration", type=float, default=12.0)
    ap.add_argument("--kills", default="4,8", help="seconds after start, one server each")
    ap.add_argument("--timeout", type=float, default=0.5, help="per-request deadline (s)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    kill_at = [float(k) for k in a.kills.split(",") if k]
    order = victims(a.servers, len(kill_at))
    servers = [spawn_expert_server(SPEC, h, f"f{i}") for i, h in enumerate(hosted(a.servers))]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, SPEC.hidden, generator=g)
    ids = torch.stack(
        [torch.randperm(SPEC.num_experts, generator=g)[:TOPK] for _ in range(TOKENS)]
    ).to(torch.int32)
    w = torch.rand(TOKENS, TOPK, generator=g)
    done, failed, kills = [], 0, []
    try:
        c = connect_client(servers, SPEC.hidden, TOPK, TOKENS, 1, timeout=a.timeout)
        want = [c.combine(c.dispatch(x, ids, w, layer)) for layer in range(SPEC.num_layers)]
        start = time.monotonic()
        step = 0
        while (now := time.monotonic() - start) < a.duration:
            if len(kills) < len(kill_at) and now >= kill_at[len(kills)]:
                victim = servers[order[len(kills)]]
                os.kill(victim.process.pid, signal.SIGKILL)
                kills.append({"server": victim.server_id, "t": now})
            layer = step % SPEC.num_layers
            try:
                y = c.combine(c.dispatch(x, ids, w, layer))
                if not torch.equal(y, want[layer]):
                    failed += 1  # a wrong answer counts as a failure
                else:
                    done.append(time.monotonic() - start)
            except MoecommError:
                failed += 1
            step += 1
        failovers = c.failovers
        c.close()
    finally:
        for s in servers:
            s.stop()

    rows = []
    alive = a.servers
    for k in kills:
        before = rate(done, max(0.0, k["t"] - WINDOW_S), k["t"])
        after = rate(done, k["t"] + SETTLE_S, k["t"] + SETTLE_S + WINDOW_S)
        first = next((t for t in done if t > k["t"]), None)
        around = [t for t in done if k["t"] - 1.0 <= t <= k["t"] + 1.0]
        gap = max((b - a_ for a_, b in itertools.pairwise(around)), default=None)
        share = (alive - 1) / alive
        alive -= 1
        rows.append(
            {
                "server": k["server"],
                "t": k["t"],
                "before_tok_s": before,
                "after_tok_s": after,
                "after_over_before": after / before if before else 0.0,
                "capacity_share": share,
                "goal": after >= share * 0.98 * before,
                "first_completion_ms": (first - k["t"]) * 1e3 if first else None,
                "max_gap_ms": gap * 1e3 if gap else None,
            }
        )
    print(
        f"\n{a.servers} servers, every expert on 2; {TOKENS} tokens per request, top-{TOPK}; "
        f"deadline {a.timeout * 1e3:.0f} ms"
    )
    print(
        format_table(
            rows,
            [
                ("server", "killed", "s"),
                ("t", "at s", ".1f"),
                ("before_tok_s", "tok/s before", ".0f"),
                ("after_tok_s", "tok/s after", ".0f"),
                ("after_over_before", "after/before", ".2f"),
                ("capacity_share", "capacity share", ".2f"),
                ("goal", ">= 0.98 share", ""),
                ("first_completion_ms", "first done ms", ".1f"),
                ("max_gap_ms", "max gap ms", ".1f"),
            ],
        )
    )
    print(f"\ncompleted {len(done)} requests, failed {failed}, failovers {failovers}")
    bins = int(a.duration / BIN_S)
    series = [rate(done, i * BIN_S, (i + 1) * BIN_S) for i in range(bins)]
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.plot([i * BIN_S for i in range(bins)], series, drawstyle="steps-post")
        for k in kills:
            ax.axvline(k["t"], color="red", linestyle="--")
            ax.text(k["t"], max(series) * 1.02, f"kill {k['server']}", color="red")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("tokens/s")
        ax.set_title("throughput while expert servers are killed (every expert on 2 servers)")
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(a.png)), exist_ok=True)
        fig.savefig(a.png, dpi=100)
        print(f"wrote {a.png}")
    write_json(
        a.json,
        {
            "kills": rows,
            "completed": len(done),
            "failed": failed,
            "failovers": failovers,
            "bin_s": BIN_S,
            "throughput": series,
        },
    )
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
