"""Stage supervision: how long `moecomm frontend --stages 2` takes to serve again after one of
its stage processes is killed (SIGKILL) or stopped (SIGSTOP) mid-stream, with the replacement
stages started then (`new`) or kept started in the background (`standby`), and what taking the
lost stage's layers over in a surviving stage would have to load at least.

Set-up: the tiny checkpoint, two expert servers (experts 0-11 and 4-15), one front end with
`--stages 2` over them (one per mode). Every trial sends STREAMS greedy streamed requests at
once; when the first has KILL_AFTER tokens, the bench kills (or stops) one stage and notes the
time. Reported per trial:

- `stall_s`: the longest time after the fault in which no stream received a token (client
  side; the tokens of the step that was running when the fault hit still arrive after it, so
  "the first token after the fault" would measure nothing); a stop includes the driver's
  STOPPED_DEADLINE_S;
- the front end's own account (its `pipeline restarted` line): `restart_s` = `spawn_s` (the
  failed pipeline closed and the new one ready: for `new`, processes spawned, weights loaded,
  expert clients connected, channels joined) + `reprefill_s` (every live sequence's tokens fed
  again);
- `step_s`: the median gap between tokens after the recovery (one engine step);
- `same_tokens`: every stream's tokens equal the fault-free run's; `new_pids`: no stage
  process of before the fault serves after it.

The alternative to a restart, surviving stages taking the lost stage's layers over, needs at
least the lost layers' weights read into a running process, plus the same re-prefill and the
rewiring of the channels; `takeover_load_s` times that read in this warm interpreter (the lower
bound of what it adds).

Usage: python bench/recovery/stage_recovery.py [--trials 3]
       [--json bench/results/stage_recovery.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
from _lib.common import format_table, write_json
from moecomm.testing import Proc, Processes
from moecomm_serving.cli.demo import CLI, ONE_THREAD
from moecomm_serving.model.checkpoint import Checkpoint
from moecomm_serving.model.transformer import stage_tensor_names

START_S = 180.0
REQUEST_TIMEOUT_S = 120.0
STREAMS = 6
MAX_NEW = 32
KILL_AFTER = 4
STEP_TOKENS = 64
# (fault, stage) of a trial: each stage killed (SIGKILL) and stopped (SIGSTOP).
FAULTS = (("kill", 0), ("kill", 1), ("stop", 0), ("stop", 1))
QUICK_FAULTS = (("kill", 1),)
RESTARTED = re.compile(
    r"pipeline restarted in ([\d.]+) s \(stages ([\d.]+) s, re-prefill ([\d.]+) s"
)


def stage_pids(fe: Proc) -> list[int]:
    """The serving pipeline's stage pids (printed at start and after every replacement)."""
    last = fe.wait_output("pipeline stage pids: ", 1, START_S)[-1]
    return [int(x) for x in last.split(": ")[1].split()]


async def run_streams(url: str, fault=None) -> tuple[list[list[int]], list[list[float]], float]:
    """STREAMS greedy streams at once; returns their tokens, each token's arrival time and the
    time of the fault (nan without one)."""
    when = [float("nan")]

    async def one(c, i):
        body = {"model": "tiny", "prompt": f"stage recovery stream {i}", "max_tokens": MAX_NEW}
        body.update(temperature=0, ignore_eos=True, return_token_ids=True, stream=True)
        ids, times = [], []
        async with c.stream(
            "POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S
        ) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                new = json.loads(line[6:])["choices"][0].get("token_ids") or []
                ids += new
                times += [time.monotonic()] * len(new)
                if fault is not None and i == 0 and len(ids) >= KILL_AFTER and when[0] != when[0]:
                    when[0] = time.monotonic()
                    fault()
        return ids, times

    async with httpx.AsyncClient() as c:
        got = await asyncio.gather(*[one(c, i) for i in range(STREAMS)])
    return [g[0] for g in got], [g[1] for g in got], when[0]


def trial(fe: Proc, url: str, want: list[list[int]], how: str, victim: int) -> dict:
    before = stage_pids(fe)
    restarts = fe.count("pipeline restarted")
    sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
    tokens, times, t_fault = asyncio.run(run_streams(url, lambda: os.kill(before[victim], sig)))
    line = fe.wait_output("pipeline restarted", restarts + 1, REQUEST_TIMEOUT_S)[-1]
    m = RESTARTED.match(line)
    after = [t for ts in times for t in ts if t > t_fault]
    steps = sorted(b - a for ts in times for a, b in itertools.pairwise(ts) if a > t_fault + 1.0)
    return {
        "fault": how,
        "stage": victim,
        "stall_s": max(b - a for a, b in itertools.pairwise([t_fault, *sorted(after)])),
        "restart_s": float(m.group(1)),
        "spawn_s": float(m.group(2)),
        "reprefill_s": float(m.group(3)),
        "step_s": statistics.median(steps) if steps else float("nan"),
        "same_tokens": tokens == want,
        "new_pids": not set(stage_pids(fe)) & set(before),
    }


def takeover_load(ckpt: str, layers: range, repeats: int = 5) -> float:
    """Median seconds to read `layers`' non-expert weights (the experts live on the servers)
    in this warm interpreter: the least a surviving stage would do to take them over."""
    ck = Checkpoint(ckpt)
    names = stage_tensor_names(ck.config, layers)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ck.read(names, torch.float32, "cpu")
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def run_mode(
    procs: Processes, ckpt: str, urls: list[str], standby: bool, trials: int, faults=FAULTS
) -> tuple[list[dict], list]:
    """A front end with (or without) its standby stages; `trials` of every fault."""
    flag = "--standby-stages" if standby else "--no-standby-stages"
    fe = procs.moecomm(
        f"frontend-{'standby' if standby else 'new'}",
        [
            "frontend", "--checkpoint", ckpt, "--model-name", "tiny", "--port", "0",
            "--servers", ",".join(urls), "--stages", "2", flag,
            "--max-batch-tokens", str(STEP_TOKENS), *ONE_THREAD,
        ],
        wait=False,
    )  # fmt: skip
    rows = []
    try:
        url = fe.wait_ready(START_S)["url"]
        want, _, _ = asyncio.run(run_streams(url))  # fault-free, and warms the stages up
        for _ in range(trials):
            for how, victim in faults:
                if standby:  # a trial measures a replacement by a standby that is up
                    restarts = fe.count("pipeline restarted")
                    fe.wait_output("pipeline standby stages ready", restarts + 1, START_S)
                row = trial(fe, url, want, how, victim)
                row["mode"] = "standby" if standby else "new"
                rows.append(row)
                print(row, flush=True)
        return rows, [ln for ln in fe.lines() if ln.startswith("pipeline stage lost")]
    finally:
        fe.stop()  # its stages with it (its process group), their shared memory reaped


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trials", type=int, default=3, help="trials per (mode, fault, stage)")
    ap.add_argument("--quick", action="store_true", help="one trial of one fault per mode")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows, lost = [], []
    with (
        tempfile.TemporaryDirectory(prefix="moecomm-recovery-") as tmp,
        Processes(os.path.join(tmp, "procs"), cli=CLI) as procs,
    ):
        ckpt = os.path.join(tmp, "tiny")
        subprocess.run([*CLI, "tiny", "--out", ckpt], check=True, capture_output=True)
        servers = procs.start_many(
            (
                f"server-{i}",
                [*CLI, "expert-server", "--checkpoint", ckpt, "--experts", e, *ONE_THREAD],
            )
            for i, e in enumerate(("0-11", "4-15"))
        )
        urls = [s.url for s in servers]
        for standby in (False, True):
            if a.quick:
                got, lines = run_mode(procs, ckpt, urls, standby, 1, QUICK_FAULTS)
            else:
                got, lines = run_mode(procs, ckpt, urls, standby, a.trials)
            rows += got
            lost += lines
        load = takeover_load(ckpt, range(2, 4))
    print(
        format_table(
            rows,
            [
                ("mode", "stages from", "s"),
                ("fault", "fault", "s"),
                ("stage", "stage", "d"),
                ("stall_s", "stall s", ".3f"),
                ("restart_s", "restart s", ".3f"),
                ("spawn_s", "stages s", ".3f"),
                ("reprefill_s", "re-prefill s", ".3f"),
                ("step_s", "step s", ".3f"),
                ("same_tokens", "same tokens", "d"),
            ],
        )
    )
    summary: dict = {}
    for mode in ("new", "standby"):
        for how in ("kill", "stop"):
            rs = [r for r in rows if r["mode"] == mode and r["fault"] == how]
            if not rs:  # --quick
                continue
            keys = ("stall_s", "restart_s", "spawn_s", "reprefill_s", "step_s")
            summary[f"{mode}/{how}"] = {k: statistics.median(r[k] for r in rs) for k in keys}
            summary[f"{mode}/{how}"]["max_stall_s"] = max(r["stall_s"] for r in rs)
            summary[f"{mode}/{how}"]["trials"] = len(rs)
    summary["takeover_load_s"] = load
    summary["all_same_tokens"] = all(r["same_tokens"] for r in rows)
    summary["all_new_pids"] = all(r["new_pids"] for r in rows)
    print(json.dumps(summary, indent=1))
    write_json(a.json, {"trials": rows, "summary": summary, "lost_lines": lost})
    return 0 if summary["all_same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
