"""Serving throughput, disaggregated vs monolithic, on the tiny model.

Two front ends on the same tiny checkpoint, each driven by the load generator at concurrency
1..32: the monolith (experts in the front-end process, --local-experts) and the disaggregated
system (1 front end, 2 expert-server processes holding experts 0-7 and 8-15). Ratio = output
token throughput of disaggregated / monolithic. Every run also checks the greedy outputs of the
two systems are identical (same prompts, temperature 0).

Each level runs `--repeats` times (default 3), the two systems alternating (mono, disagg, mono,
...), so a slow phase of this shared machine hits both; the table shows the median throughput of
each system and the median of the per-repeat ratios with their range (min-max).

With --pipeline, two more front ends over the same servers: the model in 2 pipeline stages with
each engine step as one micro-batch (`pipe2`, --stage-micro-batches 1: one stage computes at a
time) and cut into 2 micro-batches in flight at once (`pipe2ov`, the default: the stages overlap),
both without standby stages; the table then adds each one's throughput and the ratios
pipe2ov / disagg (the same servers, --stages 1), pipe2ov / mono and pipe2ov / pipe2 (what the
overlap gives).

Usage: python bench/serving/serving.py [--concurrency 1,4,16,32] [--repeats 3] [--pipeline]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
from _lib.common import format_table, write_json
from moecomm.testing import Processes
from moecomm_serving.cli.demo import CLI, ONE_THREAD
from moecomm_serving.cli.loadgen import run_bench

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


def start_systems(procs: Processes, ckpt: str, pipeline: bool = False) -> dict[str, str]:
    """The expert servers (together), then every front end (together); the URLs by system."""
    subprocess.run([*CLI, "tiny", "--out", ckpt], check=True, capture_output=True, timeout=120)
    servers = procs.start_many(
        (
            f"expert-server-{i}",
            [*CLI, "expert-server", "--checkpoint", ckpt, "--experts", experts, *ONE_THREAD],
        )
        for i, experts in enumerate(("0-7", "8-15"))
    )
    urls = ",".join(s.url for s in servers)
    common = [
        *CLI,
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
    fronts = [
        ("monolith", [*common, "--local-experts"]),
        ("disaggregated", [*common, "--servers", urls]),
    ]
    if pipeline:
        staged = [*common, "--servers", urls, "--stages", "2", "--no-standby-stages"]
        for name, micro in (("pipe2", 1), ("pipe2ov", 2)):
            fronts.append((name, [*staged, "--stage-micro-batches", str(micro)]))
    return {p.name: p.url for p in procs.start_many(fronts)}


# Short names of the systems in the rows.
KEYS = {"monolith": "mono", "disaggregated": "disagg", "pipe2": "pipe2", "pipe2ov": "pipe2ov"}


def run_level(systems: dict[str, str], c: int, a) -> dict:
    """One concurrency level, `a.repeats` times per system, alternating."""
    reps: dict[str, list[dict]] = {KEYS[name]: [] for name in systems}
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
            reps[KEYS[name]].append(rep)
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
    if "pipe2ov" in reps:  # medians of the per-repeat ratios, as above
        for ref in ("disagg", "mono", "pipe2"):
            row[f"pipe2ov_vs_{ref}"] = statistics.median(
                o["output_throughput"] / r["output_throughput"]
                for o, r in zip(reps["pipe2ov"], reps[ref], strict=True)
            )
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
    ap.add_argument(
        "--pipeline",
        action="store_true",
        help="also --stages 2 front ends, with and without overlap",
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="moecomm-bench-") as tmp,
        Processes(os.path.join(tmp, "procs"), cli=CLI) as procs,
    ):
        systems = start_systems(procs, os.path.join(tmp, "tiny"), a.pipeline)
        outputs = [probe(url) for url in systems.values()]
        same = all(o == outputs[0] for o in outputs)
        for c in [int(x) for x in a.concurrency.split(",")]:
            rows.append(run_level(systems, c, a))
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
    if a.pipeline:
        print(
            "\n--stages 2 over the same servers: one micro-batch per step (pipe2) and two in "
            "flight (pipe2ov)\n"
            + format_table(
                rows,
                [
                    ("concurrency", "conc", "d"),
                    ("pipe2_tok_s", "pipe2 tok/s", ".1f"),
                    ("pipe2ov_tok_s", "pipe2ov tok/s", ".1f"),
                    ("pipe2ov_vs_pipe2", "pipe2ov/pipe2", ".2f"),
                    ("pipe2ov_vs_disagg", "pipe2ov/disagg", ".2f"),
                    ("pipe2ov_vs_mono", "pipe2ov/mono", ".2f"),
                    ("pipe2_tpot_ms", "pipe2 TPOT ms", ".1f"),
                    ("pipe2ov_tpot_ms", "pipe2ov TPOT ms", ".1f"),
                    ("pipe2ov_failed", "failed", "d"),
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
