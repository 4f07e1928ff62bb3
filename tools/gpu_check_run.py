"""The step runner of tools/gpu_check.py: steps with their own process group and timeout
inside one time budget, their results, and the summary (summary.json, summary.md, the log
archive). Standard library only: it runs before anything is installed."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
# The whole run stays under the device tool's 10-minute limit per command.
DEFAULT_BUDGET_S = 570.0
# Kept free of the budget for the summary and the kill of a step that overran.
RESERVE_S = 10.0
KILL_GRACE_S = 5.0
LOG_TAIL_LINES = 25


@dataclasses.dataclass
class Result:
    name: str
    status: str
    reason: str = ""
    duration_s: float = 0.0
    figures: dict = dataclasses.field(default_factory=dict)
    log: str | None = None
    returncode: int | None = None
    timed_out: bool = False
    command: str | None = None


@dataclasses.dataclass
class Context:
    out: Path
    device: bool
    device_reason: str
    python: str = sys.executable
    root: Path = ROOT
    deadline: float = float("inf")
    budget_s: float = DEFAULT_BUDGET_S
    env: dict = dataclasses.field(default_factory=dict)
    results: dict = dataclasses.field(default_factory=dict)
    results_notes: list = dataclasses.field(default_factory=list)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def path(self, name: str) -> Path:
        return self.out / "logs" / name


@dataclasses.dataclass
class Step:
    """One step. ``cmd`` (a list, or a callable of the context giving one) runs with its output
    in logs/<name>.log; ``judge`` turns (result, context) into the final status and figures.
    ``precheck`` may settle the step before it runs: it returns (status, reason) or None."""

    name: str
    cmd: list | Callable[[Context], list] | None
    timeout_s: float
    title: str = ""
    needs_device: bool = False
    only_without_device: bool = False
    env: dict | Callable[[Context], dict] = dataclasses.field(default_factory=dict)
    precheck: Callable[[Context], tuple[str, str] | None] | None = None
    judge: Callable[[Result, Context], None] | None = None
    no_device_reason: str = ""
    requires: tuple = ()


# ---------------------------------------------------------------------------------------------
# Running a command: own process group, timeout kills the group.


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's process group, SIGKILL to what is left after a grace period."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(KILL_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(KILL_GRACE_S)


def run_command(cmd: list, log: Path, timeout_s: float, env: dict, cwd: Path) -> tuple[int, bool]:
    """Runs cmd with stdout+stderr into log; returns (returncode, timed_out)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n".encode())
        f.flush()
        try:
            proc = subprocess.Popen(
                [str(c) for c in cmd],
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            f.write(f"cannot start: {exc}\n".encode())
            return 127, False
        try:
            rc = proc.wait(timeout_s)
            # Leftovers of a finished step (a server it forgot) must not outlive it either.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return rc, False
        except subprocess.TimeoutExpired:
            kill_group(proc)
            f.write(
                f"\n[gpu-check] timed out after {timeout_s:.0f} s: process group killed\n".encode()
            )
            return proc.returncode if proc.returncode is not None else -9, True


def tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def run_step(step: Step, ctx: Context) -> Result:
    res = Result(step.name, SKIPPED)
    start = time.monotonic()
    try:
        if step.needs_device and not ctx.device:
            res.reason = f"no CUDA device ({ctx.device_reason})"
            if step.no_device_reason:
                res.reason += f"; {step.no_device_reason}"
            return res
        if step.only_without_device and ctx.device:
            res.reason = "runs only without a device (covered by the device steps)"
            return res
        for need in step.requires:
            got = ctx.results.get(need)
            if got is not None and got.status != PASSED:
                res.status, res.reason = FAILED, f"not run: step {need} {got.status}"
                return res
        if step.precheck is not None:
            settled = step.precheck(ctx)
            if settled is not None:
                res.status, res.reason = settled
                return res
        if step.cmd is None:
            res.status = PASSED
        else:
            left = ctx.remaining() - RESERVE_S
            if left < 5:
                res.status = FAILED
                res.reason = f"no time left in the {ctx.budget_s:.0f} s budget"
                return res
            timeout = min(step.timeout_s, left)
            cmd = step.cmd(ctx) if callable(step.cmd) else step.cmd
            env = dict(os.environ)
            env.update(ctx.env)
            env.update(step.env(ctx) if callable(step.env) else step.env)
            res.log = str(ctx.path(f"{step.name}.log"))
            res.command = " ".join(map(str, cmd))
            rc, timed_out = run_command(cmd, Path(res.log), timeout, env, ctx.root)
            res.returncode, res.timed_out = rc, timed_out
            if timed_out:
                res.status = FAILED
                res.reason = f"timed out after {timeout:.0f} s (process group killed)"
            elif rc != 0:
                res.status = FAILED
                res.reason = f"exit status {rc}"
            else:
                res.status = PASSED
        if step.judge is not None and not res.timed_out:
            step.judge(res, ctx)
        elif step.judge is not None:
            # Figures from whatever the step wrote before it was killed; the status stays.
            status, reason = res.status, res.reason
            step.judge(res, ctx)
            res.status, res.reason = status, reason
        return res
    except Exception as exc:  # a bug in a judge must not hide the other steps
        res.status = FAILED
        res.reason = f"gpu-check error: {type(exc).__name__}: {exc}"
        return res
    finally:
        res.duration_s = round(time.monotonic() - start, 2)


def run_steps(steps: list[Step], ctx: Context, echo: Callable[[str], None] = print) -> list:
    results = []
    for step in steps:
        echo(f"[gpu-check] {step.name}: {step.title or 'running'} ...")
        res = run_step(step, ctx)
        ctx.results[step.name] = res
        results.append(res)
        line = f"[gpu-check] {step.name}: {res.status.upper()} ({res.duration_s:.1f} s)"
        if res.reason:
            line += f" — {res.reason}"
        echo(line)
        if res.status == FAILED and res.log:
            echo(f"[gpu-check] last lines of {res.log}:\n{tail(Path(res.log))}")
    return results


# ---------------------------------------------------------------------------------------------
# Summary


def write_summary(ctx: Context, results: list[Result], started: float, exit_code: int) -> None:
    ctx.out.mkdir(parents=True, exist_ok=True)
    data = {
        "device": ctx.device,
        "device_reason": ctx.device_reason,
        "python": ctx.python,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1),
        "exit_code": exit_code,
        "counts": {s: sum(r.status == s for r in results) for s in (PASSED, FAILED, SKIPPED)},
        "steps": [dataclasses.asdict(r) for r in results],
    }
    for r in data["steps"]:
        if r["log"]:
            r["log"] = os.path.relpath(r["log"], ctx.out)
    (ctx.out / "summary.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (ctx.out / "summary.md").write_text(summary_markdown(data))


def _figures_text(fig: dict) -> str:
    keep = []
    for k, v in fig.items():
        if isinstance(v, (list, dict)) or v is None or v == "":
            continue
        if isinstance(v, float):
            v = f"{v:.3g}"
        keep.append(f"{k}={v}")
    return ", ".join(keep)[:300]


def summary_markdown(data: dict) -> str:
    where = "with a device" if data["device"] else "without a device"
    lines = [
        "# gpu-check summary",
        "",
        f"{data['started_utc']}, {where} ({data['device_reason']}), python `{data['python']}`, "
        f"{data['duration_s']} s, exit {data['exit_code']}; "
        + ", ".join(f"{n} {s}" for s, n in data["counts"].items()),
        "",
        "| step | status | seconds | reason | key figures | log |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["steps"]:
        reason = (r["reason"] or "").replace("|", "\\|").replace("\n", " ")
        figs = _figures_text(r["figures"]).replace("|", "\\|")
        lines.append(
            f"| {r['name']} | {r['status']} | {r['duration_s']:.1f} | {reason} | {figs} | "
            f"{r['log'] or ''} |"
        )
    for r in data["steps"]:
        extra = {k: v for k, v in r["figures"].items() if isinstance(v, list) and v}
        for k, v in extra.items():
            lines.append(f"\n{r['name']} {k}:\n" + "\n".join(f"- {x}" for x in v))
    return "\n".join(lines) + "\n"


def print_summary(results: list[Result], ctx: Context, exit_code: int) -> None:
    where = "with a device" if ctx.device else f"WITHOUT a device ({ctx.device_reason})"
    print(f"\n[gpu-check] summary, {where}:")
    width = max(len(r.name) for r in results)
    for r in results:
        print(f"  {r.name:<{width}}  {r.status:<7}  {r.duration_s:6.1f} s  {r.reason}")
    skipped = [r.name for r in results if r.status == SKIPPED]
    if skipped:
        print(f"[gpu-check] skipped: {', '.join(skipped)} (reasons above)")
    print(f"[gpu-check] wrote {ctx.out / 'summary.json'} and {ctx.out / 'summary.md'}")
    print(f"[gpu-check] exit {exit_code}")


def pack_logs(out: Path) -> None:
    """Everything but the summaries into logs.tar.gz (the device tool returns 8 files)."""
    logs = out / "logs"
    if not logs.is_dir():
        return
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname="logs")
    shutil.rmtree(logs)


def exit_code_of(results: list[Result]) -> int:
    return 1 if any(r.status == FAILED for r in results) else 0
