"""The stage runner of tools/gpu_check.py: stages sharing one call-level deadline, commands and
pytest runs in their own process group killed when the stage's time is spent, one result row
per test file, and the summaries (gpu_check_summary: summary.json, summary.md, the archives)
rewritten as results come. Standard library only: it runs before anything is installed.

A stage's budget is its share of the call, not a clock of its own: stage k ends at the run's
start plus the budgets (and overheads) of stages 1..k, so the time a stage leaves unused flows
to the next one, and a stage that overruns is cut where the plan said it ends. Inside a stage a
test file gets at most its own cap (``pytest_file(cap=...)``) of what the stage has left.

A stage's body (tools/gpu_check_stages.py) runs its commands through a ``StageRun``: each
command gets what is left of the stage's time (or less), and is killed with its process group
when that is spent; a test file that cannot start any more is recorded "not run: stage budget
spent". Nothing here knows what the stages are."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from gpu_check_reports import (
    CASE_OUTCOMES,
    CASES_ENV,
    COUNT_KEYS,
    FAILED,
    FATAL,
    INCOMPLETE,
    NOT_RUN,
    PASSED,
    PLUGIN,
    SKIPPED,
    CaseLog,
    counts_of_run,
    fault_excerpt,
    parse_pytest_summary,
    read_cases,
    slug,
)
from gpu_check_summary import pack, write_summary
from gpu_check_types import Context, FileResult, Result

TOOLS = Path(__file__).resolve().parent
# What the plan reserves beside the stages' budgets: per stage (starting its first process,
# writing the summaries and the archives) and per call (the detection, the last summary).
STAGE_OVERHEAD_S = 2.0
CALL_RESERVE_S = 5.0
# A command past its timeout gets SIGINT (pytest then still writes its junit), SIGTERM after
# 3 s, SIGKILL after 2 more: it is started only with that much of its stage's time left over.
SIGINT_GRACE_S = 3.0
SIGTERM_GRACE_S = 2.0
KILL_GRACE_S = SIGINT_GRACE_S + SIGTERM_GRACE_S
# Nothing is started with less than this left.
MIN_RUN_S = 5.0
# pytest-timeout per test is this much below its file's timeout (start-up, the junit write).
PYTEST_MARGIN_S = 5.0
LOG_TAIL_LINES = 25
# A test file is resumed after at most this many crashes: each new pytest pays its start (torch,
# a CUDA context: seconds), so a file where everything crashes would otherwise spend the stage
# on itself; what is left then is reported "not run".
MAX_PARTS = 20


@dataclasses.dataclass
class Stage:
    """A stage: ``body(run)`` does its work through ``run`` (a StageRun) and may settle the
    result itself; otherwise its test files settle it. ``requires`` names stages that must have
    passed (when they are part of this run); ``requires_without_device`` replaces it on a machine
    without a device. ``require_pass``: on a device, a stage in which no test passed fails."""

    name: str
    body: Callable
    title: str = ""
    needs_device: bool = False
    requires: tuple = ()
    requires_without_device: tuple | None = None
    require_pass: bool = False
    no_device_reason: str | Callable[[Context], str] = ""
    # On failure the runner prints the last lines of the stage's log (not where the reason
    # already says everything: the preflight's one line).
    tail_on_failure: bool = True

    def needs(self, device: bool) -> tuple:
        if not device and self.requires_without_device is not None:
            return self.requires_without_device
        return self.requires


@dataclasses.dataclass
class Run:
    """What one command did."""

    returncode: int
    timed_out: bool
    duration_s: float
    timeout_s: float
    output: str
    stage_bound: bool  # its timeout was what was left of the stage


# ---------------------------------------------------------------------------------------------
# Running a command: own process group, timeout kills the group.


def kill_group(proc: subprocess.Popen) -> None:
    """SIGINT to the process group (pytest writes its junit on it), then SIGTERM, then SIGKILL
    to what is left."""
    for sig, grace in (
        (signal.SIGINT, SIGINT_GRACE_S),
        (signal.SIGTERM, SIGTERM_GRACE_S),
        (signal.SIGKILL, SIGTERM_GRACE_S),
    ):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
            # The leader is gone; children that ignored the signal must go too.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return


def run_command(cmd: list, log: Path, timeout_s: float, env: dict, cwd: Path) -> tuple[int, bool]:
    """Runs cmd with stdout+stderr appended to log; returns (returncode, timed_out)."""
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
            # Leftovers of a finished command (a server it forgot) must not outlive it either.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return rc, False
        except subprocess.TimeoutExpired:
            kill_group(proc)
            f.write(
                f"\n[gpu-check] timed out after {timeout_s:.0f} s: process group killed\n".encode()
            )
            return proc.returncode if proc.returncode is not None else -9, True


def exit_text(returncode: int) -> str:
    """ "exit status 2", or "killed by SIGSEGV" for a process a signal ended."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


# ---------------------------------------------------------------------------------------------
# A stage at work


class StageRun:
    """The handle a stage's body works through: its budget, its log, its commands and files."""

    def __init__(self, stage: Stage, ctx: Context, res: Result, until: float | None = None) -> None:
        """``until``: the stage's planned end (monotonic clock); without one, its start plus
        its budget."""
        self.stage, self.ctx, self.res = stage, ctx, res
        self.start = time.monotonic()
        end = self.start + res.budget_s if until is None else until
        self.deadline = min(end, ctx.deadline)
        self.log = ctx.path(f"{stage.name}.log")
        # What the stage may spend: its budget plus what the stages before it left unused.
        res.figures["time_given_s"] = round(self.deadline - self.start, 1)

    @property
    def name(self) -> str:
        return self.stage.name

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def echo(self, text: str) -> None:
        self.ctx.echo(f"[gpu-check] {self.name}: {text}")

    def note(self, text: str) -> None:
        """A line in the stage's log (and nowhere else)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as f:
            f.write(f"[gpu-check] {text}\n")

    def extend(self, budget_s: float, why: str) -> None:
        """Raises the stage's budget to budget_s, the call's deadline with it (the build of a
        machine that was not warm: the plan assumed it reused)."""
        extra = self.start + budget_s - self.deadline
        if extra <= 0:
            return
        self.ctx.deadline += extra
        self.ctx.plan_shift += extra
        self.deadline += extra
        self.res.figures["budget_extended"] = f"{self.res.budget_s:.0f} -> {budget_s:.0f} s: {why}"
        self.res.budget_s = budget_s
        self.echo(f"budget raised to {budget_s:.0f} s ({why}); this call runs {extra:.0f} s longer")

    def command(
        self,
        cmd: list,
        *,
        label: str,
        env: dict | None = None,
        timeout: float | None = None,
    ) -> Run | None:
        """Runs cmd in its own process group with its output appended to logs/<stage>.log, for
        at most ``timeout`` seconds and never past the stage's budget; None when too little of
        the budget is left to start it."""
        avail = self.left() - KILL_GRACE_S
        limit = avail if timeout is None else min(timeout, avail)
        if limit < MIN_RUN_S:
            return None
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.note(f"{label} (timeout {limit:.0f} s)")
        offset = self.log.stat().st_size
        self.res.log = self.ctx.rel(self.log)
        self.res.commands.append(" ".join(map(str, cmd)))
        t0 = time.monotonic()
        rc, timed_out = run_command(cmd, self.log, limit, full_env, self.ctx.root)
        duration = time.monotonic() - t0
        with open(self.log, "rb") as f:
            f.seek(offset)
            output = f.read().decode(errors="replace")
        return Run(rc, timed_out, round(duration, 2), limit, output, limit >= avail - 0.5)

    def pytest_file(
        self,
        name: str,
        args: list,
        *,
        env: dict | None = None,
        cap: float | None = None,
        test_timeout: float = 60.0,
        prefix: tuple = (),
        judge: Callable[[FileResult, Run], None] | None = None,
    ) -> FileResult:
        """One test file (or node id): ``pytest -v -rA`` (progress lines a killed run still
        leaves), its own junit, pytest-timeout per test below the file's timeout (``cap``, or
        what is left of the stage), and the per-test log of gpu_check_reports' plugin. When the
        process dies under a test (a signal, a "Fatal Python error", a kill at its timeout) that
        test is recorded "crashed" and a new pytest runs the file's tests that have no result
        yet, until none is left or the stage's budget is spent (each part at most ``cap``). The
        row is added to the stage and the summaries are rewritten at once."""
        junit = self.ctx.junit_path(self.name, name)
        junit.parent.mkdir(parents=True, exist_ok=True)
        cases_log = self.ctx.path(f"{self.name}.{slug(name)}.cases.jsonl")
        cases_log.parent.mkdir(parents=True, exist_ok=True)
        cases_log.unlink(missing_ok=True)
        env = {**(env or {}), CASES_ENV: str(cases_log), "PYTHONPATH": _plugin_path(env)}
        parts: list[tuple[Run, Path]] = []
        crashes: dict[str, str] = {}  # nodeid -> what ended its process
        log = None
        while True:
            part_junit = junit if not parts else junit.with_suffix(f".part{len(parts)}.xml")
            part_junit.unlink(missing_ok=True)
            avail = self.left() - KILL_GRACE_S
            limit = avail if cap is None else min(cap, avail)
            if limit < MIN_RUN_S:
                break
            per_test = int(max(3.0, min(test_timeout, limit - PYTEST_MARGIN_S)))
            done = [*(log.outcomes if log else ()), *crashes]
            cmd = [
                *prefix,
                self.ctx.python,
                "-m",
                "pytest",
                "-v",
                "-rA",
                "-p",
                "no:cacheprovider",
                "-p",
                PLUGIN,
                *args,
                *(f"--deselect={n}" for n in done),
                f"--junitxml={part_junit}",
                f"--timeout={per_test}",
            ]
            label = f"pytest {name}" + (f" (resumed, part {len(parts) + 1})" if parts else "")
            run = self.command(cmd, label=label, env=env, timeout=limit)
            if run is None:  # the budget went while the command was being prepared
                break
            parts.append((run, part_junit))
            log = read_cases(cases_log)
            why = crash_text(run)
            running = [n for n in (log.unfinished if log else ()) if n not in crashes]
            if why is None or not running:
                break  # done, or it died outside a test: nothing to step past
            excerpt = fault_excerpt(run.output)
            crashes[running[-1]] = why + (f"; {excerpt}" if excerpt else "")
            self.note(f"{running[-1]} crashed ({why}); the file's other tests run on")
            left = [n for n in log.collected if n not in log.outcomes and n not in crashes]
            if not left or len(parts) >= MAX_PARTS:
                break
        if not parts:
            return self.add_file(
                FileResult(self.name, name, NOT_RUN, "not run: stage budget spent")
            )
        if crashes:
            unrun = (
                f"not resumed again after {MAX_PARTS} pytest runs"
                if len(parts) >= MAX_PARTS
                else "the stage's budget was spent after a crash"
            )
            fr = resumed_result(self.name, name, parts, log, crashes, unrun)
        else:
            run, _ = parts[0]
            fr = file_result(self.name, name, run, junit)
            if log is not None:
                fr.cases = case_rows(log, {})
        # Each pytest run its own junit (a crashed one leaves none): the row names those there.
        written = [self.ctx.rel(j) for _, j in parts if j.exists()]
        fr.junit = ", ".join(written) or None
        if judge is not None:
            judge(fr, parts[-1][0])
        return self.add_file(fr)

    def add_file(self, fr: FileResult) -> FileResult:
        self.res.files.append(fr)
        line = f"  {fr.name}: {fr.status.upper()} ({fr.duration_s:.1f} s)"
        self.ctx.echo(line + (f" — {fr.reason}" if fr.reason else ""))
        write_summary(self.ctx)
        return fr


def _plugin_path(env: dict | None) -> str:
    """PYTHONPATH with tools/ first, so that ``-p gpu_check_reports`` loads in the test Python
    (a virtual environment that has nothing of tools/)."""
    rest = (env or {}).get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return os.pathsep.join(p for p in (str(TOOLS), rest) if p)


def crash_text(run: Run) -> str | None:
    """What ended a pytest under a test, or None when it ended by itself: a kill at its
    timeout, a signal, a "Fatal Python error" (faulthandler), another exit without pytest's
    summary (pytest-timeout's thread method ends the process with os._exit)."""
    if run.timed_out:
        who = "the stage timeout" if run.stage_bound else f"its {run.timeout_s:.0f} s timeout"
        return f"killed by {who} after {run.duration_s:.0f} s"
    if run.returncode < 0:
        return exit_text(run.returncode)
    fatal = next((ln.strip() for ln in run.output.splitlines() if FATAL in ln), "")
    if fatal:
        return f"{exit_text(run.returncode)}: {fatal[fatal.index(FATAL) :][:120]}"
    if run.returncode != 0 and parse_pytest_summary(run.output) is None:
        return f"{exit_text(run.returncode)} without pytest's summary"
    return None


def case_rows(log: CaseLog, crashes: dict, unrun: str = "") -> list[dict]:
    """One row per test of the file, in collection order: its outcome and a note (the failure's
    last lines, the skip reason, what ended a crashed test's process, ``unrun`` for a test that
    never ran)."""
    rows = {}
    for node in [*log.collected, *log.outcomes, *crashes]:
        if node in rows:
            continue
        if node in crashes:
            outcome, note = "crashed", crashes[node]
        elif node in log.outcomes:
            outcome, note = log.outcomes[node]
        else:
            outcome, note = "not run", unrun
        rows[node] = {"test": node, "outcome": outcome, "note": note}
    return list(rows.values())


def resumed_result(
    stage: str, name: str, parts: list, log: CaseLog, crashes: dict, unrun: str
) -> FileResult:
    """The row of a file whose pytest died under a test and was resumed: counts per test from
    the plugin's log over all its parts, failed (a crash is a failure)."""
    rows = case_rows(log, crashes, unrun)
    count = {o: sum(r["outcome"] == o for r in rows) for o in CASE_OUTCOMES}
    fr = FileResult(
        stage,
        name,
        FAILED,
        duration_s=round(sum(r.duration_s for r, _ in parts), 2),
        tests=len(rows),
        passed=count["passed"],
        failed=count["failed"],
        skipped=count["skipped"],
        errors=count["error"],
        crashed=count["crashed"],
        counts_from="per-test log",
        killed=any(r.timed_out for r, _ in parts),
        cases=rows,
        parts=len(parts),
    )
    fr.not_passed = [r["test"] for r in rows if r["outcome"] not in ("passed", "skipped")][:10]
    first = next(iter(crashes))
    fr.reason = f"crashed in {first.split('::')[-1]} ({crashes[first].split(';')[0]})"
    if len(crashes) > 1:
        fr.reason += f" and {len(crashes) - 1} more"
    fr.reason += (
        f"; {len(parts)} pytest runs: {fr.passed} passed, {fr.failed} failed, {fr.errors} "
        f"errors, {fr.crashed} crashed, {count['not run']} not run"
    )
    return fr


def _counts_text(fr: FileResult) -> str:
    return (
        f"{fr.passed} passed, {fr.failed} failed, {fr.skipped} skipped, {fr.errors} errors"
        f" (from its {fr.counts_from})"
    )


def file_result(stage: str, name: str, run: Run, junit: Path | None) -> FileResult:
    """A test file's row from what its pytest left: the junit, else the ``-v`` lines of its
    output; a killed run says so, with what had finished before."""
    counts, source = counts_of_run(junit, run.output)
    fr = FileResult(stage, name, FAILED, duration_s=run.duration_s, counts_from=source)
    if counts:
        for k in (*COUNT_KEYS, "tests"):
            setattr(fr, k, counts.get(k, 0))
        fr.not_passed = list(counts.get("not_passed", []))
    first = (counts or {}).get("first_failure", "")
    if run.timed_out:
        fr.killed = True
        who = "the stage timeout" if run.stage_bound else f"its {run.timeout_s:.0f} s timeout"
        fr.reason = f"killed by {who} after {run.duration_s:.0f} s"
        fr.reason += f"; before that: {_counts_text(fr)}" if counts else "; no test had finished"
    elif counts is None:
        if run.returncode == 5:
            fr.status, fr.reason = SKIPPED, "no test selected (pytest exit 5)"
        else:
            fr.reason = f"{exit_text(run.returncode)}, and no pytest report"
    elif fr.failed or fr.errors:
        fr.reason = f"{fr.failed} failed, {fr.errors} errors"
        if fr.not_passed:
            fr.reason += f": {', '.join(n.split('::')[-1] for n in fr.not_passed[:3])}"
        if first:
            fr.reason += f" — {first[:160]}"
    elif run.returncode not in (0, 5):
        fr.reason = f"{exit_text(run.returncode)} ({fr.passed} passed)"
    elif fr.passed == 0 and fr.skipped:
        fr.status = SKIPPED
        fr.reason = f"all {fr.skipped} skipped"
        reasons = (counts or {}).get("skip_reasons") or []
        if reasons:
            fr.reason += f": {reasons[0]}"
    elif fr.passed == 0:
        fr.status, fr.reason = SKIPPED, "no test selected"
    else:
        fr.status = PASSED
        fr.reason = f"{fr.passed} passed" + (f", {fr.skipped} skipped" if fr.skipped else "")
    return fr


def settle_from_files(res: Result, require_pass: bool) -> None:
    """A stage's status from its test files, unless its body settled it."""
    files = res.files
    totals = {k: sum(getattr(f, k) for f in files) for k in (*COUNT_KEYS, "tests")}
    if files:
        res.figures.update(totals)
        res.figures["files"] = len(files)
    if res.status:
        return
    bad = [f for f in files if f.status == FAILED]
    not_run = [f for f in files if f.status == NOT_RUN]
    left = f"; {len(not_run)} not run: stage budget spent" if not_run else ""
    if not files:
        res.status, res.reason = FAILED, "nothing ran"
    elif bad:
        res.status = FAILED
        res.reason = f"{len(bad)} of {len(files)} failed: " + "; ".join(
            f"{f.name}: {f.reason}" for f in bad[:3]
        )
        res.reason += left
    elif require_pass and totals["passed"] == 0 and not not_run:
        res.status = FAILED
        res.reason = (
            f"no gpu test passed ({totals['tests']} run, {totals['skipped']} skipped) on a "
            "machine with a device"
        )
    elif not_run:
        res.status = INCOMPLETE
        res.reason = f"{totals['passed']} passed in {len(files) - len(not_run)} files{left}"
    else:
        res.status = PASSED
        res.reason = f"{totals['passed']} passed, {totals['skipped']} skipped in {len(files)} files"


def _blocked(stage: Stage, ctx: Context) -> tuple[str, str] | None:
    if stage.needs_device and not ctx.device:
        why = f"[machine] no CUDA device ({ctx.device_reason})"
        extra = stage.no_device_reason(ctx) if callable(stage.no_device_reason) else ""
        extra = extra or (stage.no_device_reason if isinstance(stage.no_device_reason, str) else "")
        return SKIPPED, why + (f"; {extra}" if extra else "")
    for need in stage.needs(ctx.device):
        got = ctx.results.get(need)
        if got is not None and got.status != PASSED:
            was = "was not run" if got.status == NOT_RUN else got.status
            return NOT_RUN, f"not run: stage {need} {was}"
    if ctx.remaining() < MIN_RUN_S + KILL_GRACE_S:
        return NOT_RUN, "not run: call budget spent"
    return None


def run_stage(stage: Stage, budget_s: float, ctx: Context, until: float | None = None) -> Result:
    """One stage: blocked (skipped, not run) or its body within its time; ``until`` is its
    planned end (run_stages), else it gets ``budget_s`` from now."""
    res = Result(stage.name, budget_s=budget_s)
    ctx.results[stage.name] = res
    ctx.order.append(res)
    ctx.in_progress = stage.name
    t0 = time.monotonic()
    try:
        blocked = _blocked(stage, ctx)
        if blocked:
            res.status, res.reason = blocked
        else:
            write_summary(ctx)
            stage.body(StageRun(stage, ctx, res, until))
            settle_from_files(res, stage.require_pass and ctx.device)
    except Exception as exc:  # a bug in a stage must not hide the other stages
        res.status = FAILED
        res.reason = f"gpu-check error: {type(exc).__name__}: {exc}"
        log = ctx.path(f"{stage.name}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(traceback.format_exc())
        res.log = ctx.rel(log)
    finally:
        res.duration_s = round(time.monotonic() - t0, 2)
        ctx.in_progress = None
    return res


def planned_ends(start: float, budgets: list[float]) -> list[float]:
    """Each stage's planned end: the run's start plus the budgets and per-stage overheads of it
    and every stage before it (what a stage leaves unused flows to the next)."""
    ends, total = [], start
    for b in budgets:
        total += b + STAGE_OVERHEAD_S
        ends.append(total)
    return ends


def run_stages(plan: list[tuple[Stage, float]], ctx: Context) -> list[Result]:
    """Runs the stages in order against one deadline: stage k may run until the run's start
    plus the budgets of stages 1..k (shifted by any budget a stage raised), so unused time flows
    forward; the summaries (and with --pack the archives) are rewritten after every stage and
    every test file."""
    ends = planned_ends(time.monotonic(), [b for _, b in plan])
    for (stage, budget), end in zip(plan, ends, strict=True):
        until = end + ctx.plan_shift
        given = min(until, ctx.deadline) - time.monotonic()
        ctx.echo(
            f"[gpu-check] {stage.name} ({budget:.0f} s, {given:.0f} s with what earlier stages "
            f"left): {stage.title or 'running'} ..."
        )
        res = run_stage(stage, budget, ctx, until)
        line = f"[gpu-check] {res.name}: {res.status.upper()} ({res.duration_s:.1f} s)"
        ctx.echo(line + (f" — {res.reason}" if res.reason else ""))
        if res.status == FAILED and res.log and not res.files and stage.tail_on_failure:
            ctx.echo(f"[gpu-check] last lines of {res.log}:\n{tail(ctx.work / res.log)}")
        write_summary(ctx)
        if ctx.pack:
            pack(ctx)
    return ctx.order
