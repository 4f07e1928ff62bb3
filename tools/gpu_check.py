"""The GPU check, in stages that fit a lent GPU machine's device time: two calls of the device
tool, each stage with its own budget, results written as they come.

    make gpu-check [CALL=1|2] [STAGE=a,b] [OUT=gpu-check-results] [PACK=1]
    make gpu-check-plan
    python3 tools/gpu_check.py [--call 1|2] [--only a,b] [--out DIR] [--pack]
                               [--device auto|yes|no] [--python PATH] [--budget S] [--plan]

Stages, in order (tools/gpu_check_stages.py): preflight, build, joinleave, core, smoke,
regress, deepep, bench, sanitizer, (racecheck, by name only), host. Call 1 = preflight, build,
joinleave, core, smoke, regress (<= 7 min); call 2 = preflight, build (reused), deepep, bench,
sanitizer (<= 4 min); no CALL and no STAGE runs every stage but racecheck (with a device also
without joinleave and host). STAGE/--only runs the named stages and what they need (the build,
the preflight). Without a device (``nvidia-smi -L`` lists none; ``--device`` overrides) the
device stages are listed as skipped with the reason, and the rest runs with .venv.

The stages share the call's deadline: each ends where the plan's budgets say, so what one
leaves unused flows to the next. Every command runs in its own process group and is killed
when its stage's time is spent; each test file is one pytest with its own junit and its own
cap (tools/gpu_check_plan.py; `--plan` lists every GPU test file with its stage and cap).
OUT gets summary.json and summary.md, rewritten after every test file, and logs/<stage>.log,
junit/<stage>.<file>.xml (with --pack: logs.tar.gz and junit.tar.gz instead, refreshed after
every stage; the device tool brings back at most eight files). Exit status 0 when every stage
passed or was skipped.
Standard library only: it runs before anything is installed. docs/gpu-check.md has the rest.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_plan import plan_problems, plan_text, select
from gpu_check_run import CALL_RESERVE_S, Stage, run_stages
from gpu_check_stages import all_stages, discover_gpu_files, make_venv, test_python
from gpu_check_summary import clear_outputs, exit_code_of, pack, print_summary, write_summary
from gpu_check_types import Context


def detect_device() -> tuple[bool, str]:
    """(present, why): a GPU as the driver lists it; stdlib only (torch may be absent)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
            gpus = [ln for ln in out.stdout.splitlines() if ln.startswith("GPU ")]
            if out.returncode == 0 and gpus:
                return True, gpus[0]
            return False, f"nvidia-smi lists no GPU (exit {out.returncode})"
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, f"nvidia-smi failed: {exc}"
    if any(Path("/dev").glob("nvidia[0-9]*")):
        return True, "/dev/nvidia* present (no nvidia-smi)"
    return False, "no nvidia-smi and no /dev/nvidia*"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-check-results", help="folder for the results")
    ap.add_argument("--call", type=int, choices=[1, 2], default=None, help="one device call")
    ap.add_argument("--only", default=None, help="comma-separated stages (and what they need)")
    ap.add_argument("--plan", action="store_true", help="print the stages' budgets and exit")
    ap.add_argument(
        "--device",
        choices=["auto", "yes", "no"],
        default="auto",
        help="auto: a GPU if nvidia-smi lists one; yes/no: assume",
    )
    ap.add_argument("--budget", type=float, default=None, help="seconds for the run (overrides)")
    ap.add_argument("--python", default=sys.executable, help="the image's Python (CUDA torch)")
    ap.add_argument("--pack", action="store_true", help="logs and junit into two archives")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None, stages: list[Stage] | None = None) -> int:
    """``stages`` replaces the real ones (tests/tools/test_gpu_check.py: tiny fake stages, each
    with ``budget_s`` of its own, default 60 s)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--make-venv"]:
        # Internal: the build stage makes .gpu-venv with this (the image's) Python.
        info = make_venv(Path(argv[1]))
        print("GPU-CHECK-VENV " + json.dumps(info), flush=True)
        return 0 if info["pip_ok"] else 1
    a = parse_args(argv)
    if a.plan:
        found = discover_gpu_files(Path(__file__).resolve().parents[1])
        print(plan_text(found))
        problems = plan_problems(found)
        for p in problems:
            print(f"DOES NOT FIT: {p}")
        return 1 if problems else 0
    out = Path(a.out)
    if not out.is_absolute():
        out = Path.cwd() / out
    if a.device == "auto":
        device, why = detect_device()
    else:
        device, why = a.device == "yes", f"--device {a.device}"
    only = [s for s in (a.only or "").replace(" ", ",").split(",") if s] or None
    if stages is None:
        try:
            chosen, limit, label = select(a.call, only, device, all_stages())
        except ValueError as exc:
            print(f"gpu-check: {exc}", file=sys.stderr)
            return 2
        by_name = all_stages()
        plan = [(by_name[n], budget) for n, budget in chosen]
    else:
        plan = [(s, getattr(s, "budget_s", 60.0)) for s in stages]
        if only:
            plan = [(s, b) for s, b in plan if s.name in only]
        limit, label = 600.0, "test stages"
    if a.budget is not None:
        limit = a.budget
    clear_outputs(out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-")) if a.pack else out
    for folder in ("logs", "junit"):
        (work / folder).mkdir(parents=True, exist_ok=True)
    ctx = Context(
        out=out,
        device=device,
        device_reason=why,
        base_python=a.python,
        python=test_python(Path(__file__).resolve().parents[1], device),
        work=work,
        pack=a.pack,
        label=label,
        limit_s=limit,
    )
    ctx.deadline = time.monotonic() + limit - CALL_RESERVE_S
    where = "with a device: " if device else "no device: "
    print(f"[gpu-check] {label}, {where}{why}; limit {limit:.0f} s; results in {out}")
    print("[gpu-check] stages: " + ", ".join(f"{s.name} {b:.0f} s" for s, b in plan))
    try:
        results = run_stages(plan, ctx)
        code = exit_code_of(results)
        write_summary(ctx, code)
        if a.pack:
            pack(ctx)
    finally:
        if work != out:
            shutil.rmtree(work, ignore_errors=True)
    print_summary(ctx, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
