"""Serving throughput, disaggregated vs monolithic, on the tiny model.

Two front ends on the same tiny checkpoint, each driven by the load generator at concurrency
1..32: the monolith (experts in the front-end process, --local-experts) and the disaggregated
system (1 front end, 2 expert-server processes holding experts 0-7 and 8-15). Ratio = output
token throughput of disaggregated / monolithic. Every run also checks the greedy outputs of the
two systems are identical (same prompts, temperature 0).

Each level runs `--repeats` times (default 3), the two systems alternating (mono, disagg, mono,
...), so a slow phase of this shared machine hits both; the table shows the median throughput of
each system and the median of the per-repeat ratios with their range (min-max).

Usage: python bench/serving.py [--concurrency 1,4,16,32] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import format_table, write_json
from moecomm_serving.demo import CLI, ONE_THREAD, Processes
from moecomm_serving.loadgen import run_bench

MAX_BATCH_TOKENS = 64
TARGET_AT_32 = 0.9
PROBE_PROMPTS = ["equal outputs", "from both systems"]


def probe(url: str) -> list[str]:
    out = []
    for p in PROBE_PROMPTS:
        r = httpx.post(
            f"{url}/v1/completions",
            timeout=120,
            json={"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0},
        )
        r.raise_for_status()
        out.append(r.json()["choices"][0]["text"])
    return out


def start_systems(procs: Processes, ckpt: str) -> dict[str, str]:
    import subprocess

    subprocess.run([*CLI, "tiny", "--out", ckpt], check=True, capture_output=True, timeout=120)
    urls = []
    for i, experts in enumerate(("0-7", "8-15")):
        line = procs.start(
            f"expert-server-{i}",
            ["expert-server", "--checkpoint", ckpt, "--experts", experts, *ONE_THREAD],
            "expert server",
        )
        urls.append(line.split(" listening on ")[1].split(": layers")[0])
    common = [
        "frontend",
        "--checkpoint",
        ckpt,
        "--model-name",
        "tiny",
        "--port",
        "0",
        "--max-batch-tokens",
        str(MAX_BATCH_TOKENS),
        *ONE_THREAD,
    ]
    mono = procs.start("monolith", [*common, "--local-experts"], "frontend")
    disagg = procs.start("disaggregated", [*common, "--servers", ",".join(urls)], "frontend")
    return {
        "monolith": mono.split(" listening on ")[1],
        "disaggregated": disagg.split(" listening on ")[1],
    }


def run_level(systems: dict[str, str], c: int, a) -> dict:
    """One concurrency level, `a.repeats` times per system, alternating."""
    reps: dict[str, list[dict]] = {"mono": [], "disagg": []}
    for _ in range(a.repeats):
        for name, url in systems.items():
            rep = run_bench(
                url,
                num_prompts=a.prompts_per_level * c,
                input_len=a.input_len,
                output_len=a.output_len,
                range_ratio=0.0,
                model="tiny",
                max_concurrency=c,
                seed=c,
            )
            reps["mono" if name == "monolith" else "disagg"].append(rep)
    row: dict = {"concurrency": c, "repeats": a.repeats}
    for key, rs in reps.items():
        row[f"{key}_tok_s"] = statistics.median(r["output_throughput"] for r in rs)
        row[f"{key}_tok_s_all"] = [r["output_throughput"] for r in rs]
        row[f"{key}_ttft_ms"] = statistics.median(r["ttft_ms"]["median"] for r in rs)
        row[f"{key}_tpot_ms"] = statistics.median(r["tpot_ms"]["median"] for r in rs)
        row[f"{key}_failed"] = sum(r["failed_requests"] for r in rs)
    ratios = [
        d["output_throughput"] / m["output_throughput"]
        for m, d in zip(reps["mono"], reps["disagg"], strict=True)
    ]
    row["ratios"] = ratios
    row["ratio"] = statistics.median(ratios)
    row["ratio_range"] = f"{min(ratios):.2f}-{max(ratios):.2f}"
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument(
        "--prompts-per-level", type=int, default=2, help="requests per level = this x concurrency"
    )
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="runs per level and system")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    procs = Processes()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="moecomm-bench-") as tmp:
            systems = start_systems(procs, os.path.join(tmp, "tiny"))
            same = probe(systems["monolith"]) == probe(systems["disaggregated"])
            for c in [int(x) for x in a.concurrency.split(",")]:
                rows.append(run_level(systems, c, a))
    finally:
        procs.stop_all()
    print(
        f"\ntiny model (4 layers, 16 experts, top-2, hidden 256), {a.input_len} prompt / "
        f"{a.output_len} output tokens; greedy outputs identical: {same}"
    )
    print(
        format_table(
            rows,
            [
                ("concurrency", "conc", "d"),
                ("mono_tok_s", "mono tok/s", ".1f"),
                ("disagg_tok_s", "disagg tok/s", ".1f"),
                ("ratio", "disagg/mono (median)", ".2f"),
                ("ratio_range", "range", "s"),
                ("mono_ttft_ms", "mono TTFT ms", ".0f"),
                ("disagg_ttft_ms", "disagg TTFT ms", ".0f"),
                ("mono_tpot_ms", "mono TPOT ms", ".1f"),
                ("disagg_tpot_ms", "disagg TPOT ms", ".1f"),
                ("disagg_failed", "failed", "d"),
            ],
        )
    )
    at32 = next((r["ratio"] for r in rows if r["concurrency"] == 32), None)
    if at32 is not None:
        print(
            f"\ntarget: >= {TARGET_AT_32}x monolithic throughput at concurrency 32 (median of "
            f"{a.repeats}): {at32:.2f}x {'met' if at32 >= TARGET_AT_32 else 'MISSED'}"
        )
    write_json(a.json, {"levels": rows, "greedy_identical": same})
    return 0


if __name__ == "__main__":
    sys.exit(main())
