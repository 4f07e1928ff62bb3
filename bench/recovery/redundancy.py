"""Redundancy restored on its own: time from kill -9 of an expert server to every expert back at
k copies (`min_replicas`), the per-expert loading path against the batched one, in one run.

    python bench/recovery/redundancy.py [--kills N] [--min-replicas K] [--contenders A,B,..]
        [--json PATH]

Eight expert-server processes (moecomm.runtime.launch.spawn_expert_server: deterministic
weights, any expert loadable from the process's seed checkpoint) host 16 experts of 2 layers
(6.3 MB each, float32), every expert on K of them. One attention client here dispatches random
batches the whole time (every CHECK_EVERY-th output compared with the monolith: `wrong`; a
dispatch that raises: `lost`).
A PlacementController runs as `moecomm frontend --eplb-interval` runs it, with no load-driven
pass due (only its redundancy watch acts). Each trial kills -9 the server holding the most
experts and measures until the survivors publish every expert K times (polled every POLL_S);
--kills trials (default 6), down to K servers.

Contenders (each on fresh servers, same seeds, one after the other):
- per-expert/peer: the old path — one request per expert, pulled from a peer, each rebuilding
  its layer's weights and publishing its own epoch (PlacementController(batched=False));
- batched/peer: one request per target server, its experts pulled in one export per peer,
  each layer rebuilt once, one epoch;
- batched/checkpoint: the same batch read from the target's own checkpoint.

Per kill: restore = kill -> every expert at K copies (what the issue asks for); detect = kill
-> the restore pass's start (its snapshot of the survivors taken); plan = planning the moves;
fetch = the slowest server's time getting the weights (peer pull or
checkpoint read), build = its time rebuilding the layers and publishing; apply = the pass's
loads and publishing as the controller saw them. Median and p90 over the kills (nearest rank,
bench/common.percentile).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts

from _lib.common import format_table, percentile, write_json
from moecomm.runtime import AttentionClient
from moecomm.runtime.experts import LayerExperts
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.runtime.placement import REDUNDANCY_WATCH_S, PlacementController
from moecomm.testing.clients import connect_client

SPEC = ModelSpec(num_layers=2, num_experts=16, hidden=512, intermediate=1024, seed=3)
SERVERS, TOPK, MAX_TOKENS = 8, 2, 32
TOKEN = "bench"
# How often the bench polls the survivors' tables: its resolution on the restore time.
POLL_S = 0.005
# A restore must finish within this, or the trial fails: generous, the restore copies each
# expert into a rebuilt layer and the 2-core machine may be shared.
RESTORE_DEADLINE_S = 180.0
# Only the redundancy watch may move experts: no load-driven pass falls due during the run.
NEVER_S = 1e6
# Every CHECK_EVERY-th output is compared with the monolith (the comparison costs CPU the
# servers share on a small machine).
CHECK_EVERY = 4


def initial_hosted(k: int) -> list[dict[int, list[int]]]:
    """Server i holds a window of k * E / SERVERS experts starting at i * E / SERVERS: every
    expert on k servers."""
    e, per = SPEC.num_experts, -(-k * SPEC.num_experts // SERVERS)
    start = [i * e // SERVERS for i in range(SERVERS)]
    return [
        {la: sorted({(s + j) % e for j in range(per)}) for la in range(SPEC.num_layers)}
        for s in start
    ]


# The bench's own HTTP client, kept: polling with a fresh client per request (~25 ms of CPU
# each) would starve the controller, which shares this process.
HTTP = httpx.Client(timeout=10)


def published(url: str) -> dict[int, set[int]]:
    table = HTTP.get(f"{url}/experts", params={"load": "false"}).json()
    return {int(la): {e for e in ids if e >= 0} for la, ids in table["layers"].items()}


def min_copies(urls: list[str]) -> int:
    counts = [[0] * SPEC.num_experts for _ in range(SPEC.num_layers)]
    for url in urls:
        for la, ids in published(url).items():
            for e in ids:
                counts[la][e] += 1
    return min(min(c) for c in counts)


def restores(controller: PlacementController, seen: int) -> list:
    return [r for r in controller.reports[seen:] if r.trigger == "restore" and r.moves]


class Driver:
    """Dispatches random batches until stopped; counts completed, lost and wrong requests."""

    def __init__(self, client: AttentionClient, seed: int):
        self.client, self.seed = client, seed
        self.done = self.lost = self.wrong = 0
        self.stop = threading.Event()
        self.experts = SPEC.experts()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        step = 0
        while not self.stop.is_set():
            n = int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=g))
            ids = torch.randint(0, SPEC.num_experts, (n, TOPK), generator=g).to(torch.int32)
            x = torch.randn(n, SPEC.hidden, generator=g)
            w = torch.rand(n, TOPK, generator=g)
            layer = step % SPEC.num_layers
            try:
                y = self.client.combine(self.client.dispatch(x, ids, w, layer))
            except Exception as exc:  # counted: the figure is how many
                print(f"lost: {type(exc).__name__}: {exc}", flush=True)
                self.lost += 1
                continue
            if step % CHECK_EVERY == 0:
                (want,) = LayerExperts(layer, self.experts[layer]).forward([x], [ids], [w])
                if not torch.allclose(y, want, rtol=1e-5, atol=1e-5):
                    self.wrong += 1
            self.done += 1
            step += 1


CONTENDERS = {
    "per-expert/peer": {"batched": False, "weights_from": "peer"},
    "batched/peer": {"batched": True, "weights_from": "peer"},
    "batched/checkpoint": {"batched": True, "weights_from": "checkpoint"},
}


def run_contender(name: str, args, k: int) -> tuple[list[dict], dict]:
    """--kills trials of one contender on fresh servers; its rows and request counts."""
    rng = random.Random(args.seed)
    procs = [spawn_expert_server(SPEC, h, f"r{i}", TOKEN) for i, h in enumerate(initial_hosted(k))]
    live = list(procs)
    urls = [p.url for p in procs]  # the controller's list: dead servers stay (left out)
    client = connect_client(urls, SPEC.hidden, TOPK, MAX_TOKENS, token=TOKEN, timeout=20.0)
    controller = PlacementController(
        lambda: list(urls), TOKEN, min_replicas=k, min_tokens=10**12, **CONTENDERS[name]
    )
    driver = Driver(client, args.seed)
    rows = []
    try:
        controller.start(NEVER_S)
        driver.thread.start()
        for trial in range(args.kills):
            assert min_copies([p.url for p in live]) >= k
            time.sleep(0.5 + rng.random())  # serving before the kill, a random phase
            tables = {p.url: published(p.url) for p in live}
            most = max(sum(len(s) for s in tables[p.url].values()) for p in live)
            victim = rng.choice([p for p in live if sum(map(len, tables[p.url].values())) == most])
            seen = len(controller.reports)
            done_before = driver.done
            killed_wall = time.time()
            killed = time.perf_counter()
            victim.process.kill()
            live.remove(victim)
            while min_copies([p.url for p in live]) < k:
                if time.perf_counter() - killed > RESTORE_DEADLINE_S:
                    raise SystemExit(
                        f"{name} trial {trial}: copies not restored in {RESTORE_DEADLINE_S} s"
                    )
                time.sleep(POLL_S)
            restore_s = time.perf_counter() - killed
            # The pass reports once its loads are published and checked: shortly after.
            until = time.perf_counter() + RESTORE_DEADLINE_S
            while not (passes := restores(controller, seen)) and time.perf_counter() < until:
                time.sleep(POLL_S)
            r = passes[0] if passes else None
            rows.append(
                {
                    "contender": name,
                    "trial": trial,
                    "victim": victim.server_id,
                    "restore_ms": restore_s * 1e3,
                    "detect_ms": (r.started - killed_wall) * 1e3 if r else None,
                    "plan_ms": r.plan_seconds * 1e3 if r else None,
                    # Reported by batches only (the per-expert route gives its total alone).
                    "fetch_ms": max(r.fetch_seconds) * 1e3 if r and r.fetch_seconds else None,
                    "build_ms": max(r.build_seconds) * 1e3 if r and r.build_seconds else None,
                    "request_ms_median": percentile(r.load_seconds, 50) * 1e3
                    if r and r.load_seconds
                    else None,
                    "apply_ms": r.apply_seconds * 1e3 if r else None,
                    "loaded": sum(x.replicas_loaded for x in passes),
                    "requests": sum(x.load_batches for x in passes),
                    "mb": sum(x.bytes_moved for x in passes) / 1e6,
                    "sources": dict(r.sources) if r else {},
                    "errors": [e for x in passes for e in x.errors],
                    "requests_during": driver.done - done_before,
                }
            )
            print(format_table(rows[-1:], COLUMNS), flush=True)
    finally:
        driver.stop.set()
        controller.stop()
        driver.thread.join(60)
        client.close()
        for p in procs:
            p.stop()
    return rows, {"done": driver.done, "lost": driver.lost, "wrong": driver.wrong}


def summarize(name: str, rows: list[dict], counts: dict) -> dict:
    def med(key: str) -> float | None:
        got = [r[key] for r in rows if r[key] is not None]
        return percentile(got, 50) if got else None

    restore = [r["restore_ms"] for r in rows]
    return {
        "contender": name,
        "kills": len(rows),
        "restore_ms_median": percentile(restore, 50),
        "restore_ms_p90": percentile(restore, 90),
        "restore_ms_max": max(restore),
        "detect_ms_median": med("detect_ms"),
        "plan_ms_median": med("plan_ms"),
        "fetch_ms_median": med("fetch_ms"),
        "build_ms_median": med("build_ms"),
        "apply_ms_median": med("apply_ms"),
        "request_ms_median": med("request_ms_median"),
        "load_requests": sum(r["requests"] for r in rows),
        "loaded": sum(r["loaded"] for r in rows),
        "requests_done": counts["done"],
        "requests_lost": counts["lost"],
        "requests_wrong": counts["wrong"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=SERVERS - 2, help="at most servers - K")
    ap.add_argument("--min-replicas", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help=f"comma-separated, of {', '.join(CONTENDERS)}; the first is the ratios' reference",
    )
    ap.add_argument("--json", default="bench/results/redundancy.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    k = args.min_replicas
    if not 1 <= args.kills <= SERVERS - k:
        raise SystemExit(f"--kills must be in [1, {SERVERS - k}] with --min-replicas {k}")
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names:
        raise SystemExit(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    load_before = os.getloadavg()
    rows, summaries = [], []
    for name in names:
        got, counts = run_contender(name, args, k)
        rows += got
        summaries.append(summarize(name, got, counts))
    ref = summaries[0]["restore_ms_median"]
    for s in summaries:
        s["restore_median_vs_first"] = s["restore_ms_median"] / ref if ref else None
    print()
    print(format_table(rows, COLUMNS))
    print()
    print(format_table(summaries, SUMMARY_COLUMNS))
    load_after = os.getloadavg()
    print(f"\nload average before/after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    write_json(
        args.json,
        {
            "summary": summaries,
            "config": {
                "min_replicas": k,
                "kills": args.kills,
                "watch_s": REDUNDANCY_WATCH_S,
                "expert_mb": 3 * SPEC.hidden * SPEC.intermediate * 4 / 1e6,
                "loadavg_before_after": [load_before[0], load_after[0]],
            },
            "trials": rows,
            "command": " ".join(sys.argv),
        },
    )


SUMMARY_COLUMNS = [
    ("contender", "contender", ""),
    ("restore_ms_median", "restore ms p50", ".1f"),
    ("restore_ms_p90", "p90", ".1f"),
    ("detect_ms_median", "detect p50", ".1f"),
    ("plan_ms_median", "plan p50", ".1f"),
    ("fetch_ms_median", "fetch p50", ".1f"),
    ("build_ms_median", "build+publish p50", ".1f"),
    ("apply_ms_median", "apply p50", ".1f"),
    ("request_ms_median", "ms per load request", ".1f"),
    ("load_requests", "load requests", "d"),
    ("loaded", "loaded", "d"),
    ("requests_lost", "lost", "d"),
    ("requests_wrong", "wrong", "d"),
    ("restore_median_vs_first", "restore vs first", ".2f"),
]
COLUMNS = [
    ("contender", "contender", ""),
    ("trial", "kill", "d"),
    ("restore_ms", "kill->k copies ms", ".1f"),
    ("detect_ms", "detect ms", ".1f"),
    ("plan_ms", "plan ms", ".1f"),
    ("fetch_ms", "fetch ms", ".1f"),
    ("build_ms", "build+publish ms", ".1f"),
    ("apply_ms", "apply ms", ".1f"),
    ("request_ms_median", "ms per request", ".1f"),
    ("loaded", "loaded", "d"),
    ("requests", "load requests", "d"),
    ("mb", "MB", ".1f"),
    ("requests_during", "requests served", "d"),
]

if __name__ == "__main__":
    main()
