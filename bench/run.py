"""Every benchmark of bench/ in one command: a short pass of each (`make bench`: seconds each on a
quiet machine, JSON into a scratch folder, the committed figures untouched) or the runs behind
the committed figures (`make bench-full`: bench/results/, as README's benchmark section says).

Each benchmark runs as its own process, one after the other (they time things: never two at
once); a failing one is reported and the rest still run. The table at the end gives each one's
wall time and exit status; the summary JSON goes beside the results.

Usage: python bench/run.py [--full] [--only rtt,pd] [--out DIR] [--list]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lib.common import format_table, write_json

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
# Where a short pass writes: a scratch folder (build/ is not committed).
QUICK_OUT = os.path.join(ROOT, "build", "bench-quick")
FULL_OUT = os.path.join(BENCH, "results")
# A short pass that runs longer than this is stuck (the slowest, the PD split, is ~1 min alone
# on a quiet two-core machine: six processes start); a full run can take hours (the soaks).
QUICK_TIMEOUT_S = 900.0
FULL_TIMEOUT_S = 4 * 3600.0


@dataclass(frozen=True)
class Bench:
    """One benchmark script: its short-pass flags, the flags of its committed figures (None: it
    has none), and how it is told where to write (`json`, `png`: the flag names, None when it
    takes none). (bench/ops/vs_deepep.py runs the GPU row itself where there is a GPU.)"""

    path: str  # under bench/, without .py: "<group>/<script>"
    quick: tuple[str, ...]
    full: tuple[str, ...] | None
    json: str | None = "--json"
    png: str | None = None

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


# fmt: off
BENCHES = (
    Bench("wire/rtt", ("--iters-signal", "500", "--iters-decode", "50", "--warmup", "10",
                  "--signal-runs", "1"), ()),
    Bench("ops/expert_compute", ("--iters", "2", "--warmup", "1"), ()),
    Bench("wire/disagg_layer", ("--iters", "3", "--batches", "1,16"), ()),
    Bench("wire/death_notice", ("--trials", "2", "--live", "0.2"), ()),
    Bench("wire/kv_transfer", ("--quick",), (), png="--plot"),
    Bench("ops/eplb", (), ()),
    Bench("ops/vs_deepep", ("--quick",), ()),
    Bench("ops/deepep_modes", ("--quick",), None),
    Bench("serving/pipeline", ("--quick",), ("--stages", "2", "3")),
    Bench("wire/cross_host", ("--quick",), (), png="--png"),
    # its figure lives in docs/ (README shows it)
    Bench("recovery/failover", ("--duration", "4", "--kills", "2"), ("--png", "docs/failover.png")),
    Bench("recovery/redundancy", ("--kills", "1"), ()),
    Bench("recovery/replacement", ("--quick",), (), png="--png"),
    Bench("recovery/chaos_reroute", ("--seeds", "1"), ("--seeds", "10")),
    Bench("scale/scale", ("--quick",), ()),
    Bench("soak/soak", ("--round-trips", "2000", "--clients", "2"), ("--round-trips", "100000"),
          png="--plot"),
    Bench("serving/serving", ("--concurrency", "1", "--repeats", "1", "--prompts-per-level", "2"),
          ("--repeats", "5", "--prompts-per-level", "6")),
    Bench("serving/prefix_cache", ("--requests", "3", "--prefix", "64", "--threads", "1"),
          ("--threads", "1", "--requests", "16")),
    Bench("serving/frontend_memory", ("--requests", "60", "--every", "30", "--baseline", "30"), ()),
    Bench("recovery/stage_recovery", ("--quick",), ("--trials", "2")),
    Bench("serving/pd", ("--quick",), (), png="--plot"),
    Bench("serving/soak_frontend", ("--duration-s", "20", "--interval-s", "10", "--clients", "2"),
          ("--duration-s", "1800", "--interval-s", "60"), png="--plot"),
)
# fmt: on


def command(b: Bench, full: bool, out: str) -> list[str]:
    args = list((b.full or ()) if full else b.quick)
    if b.json:
        args += [b.json, os.path.join(out, f"{b.name}.json")]
    if b.png:
        args += [b.png, os.path.join(out, f"{b.name}.png")]
    return [sys.executable, os.path.join(BENCH, f"{b.path}.py"), *args]


def run(b: Bench, full: bool, out: str, log_dir: str) -> dict:
    """Runs one benchmark; its row (status, seconds, the command, its log)."""
    cmd = command(b, full, out)
    row = {"bench": b.name, "command": " ".join(cmd[1:])}
    if full and b.full is None:
        return {**row, "status": "no committed figures", "s": 0.0}
    log = os.path.join(log_dir, f"{b.name}.log")
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                timeout=FULL_TIMEOUT_S if full else QUICK_TIMEOUT_S,
            ).returncode
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            status = "timed out"
    return {**row, "status": status, "s": round(time.monotonic() - t0, 1), "log": log}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the committed figures (bench/results)")
    ap.add_argument("--only", default="", help="comma-separated benchmark names")
    ap.add_argument(
        "--out", default=None, help=f"where results go (default {QUICK_OUT}; --full: {FULL_OUT})"
    )
    ap.add_argument("--list", action="store_true", help="print the commands and stop")
    a = ap.parse_args(argv)
    names = [n for n in a.only.split(",") if n]
    unknown = set(names) - {b.name for b in BENCHES}
    if unknown:
        ap.error(f"no benchmark {sorted(unknown)}; known: {[b.name for b in BENCHES]}")
    todo = [b for b in BENCHES if not names or b.name in names]
    out = a.out or (FULL_OUT if a.full else QUICK_OUT)
    if a.list:
        for b in todo:
            print(" ".join(command(b, a.full, out)[1:]))
        return 0
    # each run's output, and the summary: never committed
    log_dir = os.path.join(ROOT, "build", "bench-full" if a.full else "bench-quick", "logs")
    os.makedirs(out, exist_ok=True)
    os.makedirs(log_dir, exist_ok=True)
    rows = []
    for b in todo:
        print(f"--- {b.name}", flush=True)
        rows.append(run(b, a.full, out, log_dir))
        print(f"    {rows[-1]['status']} in {rows[-1]['s']} s", flush=True)
    cols = [("bench", "benchmark", "s"), ("s", "s", ".1f"), ("status", "status", "s")]
    print(format_table(rows, cols))
    failed = [r for r in rows if r["status"] not in ("ok", "no committed figures")]
    summary = {"full": a.full, "loadavg": os.getloadavg(), "rows": rows}
    write_json(os.path.join(log_dir, "summary.json"), summary)
    if failed:
        print("failed: " + ", ".join(f"{r['bench']} ({r['status']}: {r['log']})" for r in failed))
    print(json.dumps({"ran": len(rows), "failed": len(failed)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
