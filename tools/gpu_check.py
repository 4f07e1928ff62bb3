"""The GPU check: one command that builds moecomm against the machine's CUDA torch, runs every
``gpu``-marked test, compute-sanitizer (memcheck, racecheck) on the device round trip and the
moecomm GPU row of bench/vs_deepep.py, and writes every log and a summary into one folder.

    make gpu-check [OUT=gpu-check-results] [PACK=1]
    python3 tools/gpu_check.py [--out DIR] [--device auto|yes|no] [--budget S] [--pack]

Standard library only: it runs before anything is installed. With a device (``nvidia-smi -L``
lists a GPU, or ``--device yes``) it makes ``.gpu-venv`` (a venv that sees the running Python's
packages: the image's CUDA torch, Triton, NVSHMEM), installs what the tests need from the
carried wheels (``.gpu-wheels``, tools/fetch_gpu_wheels.sh; ``pip --no-index``), builds moecomm
into it with ``MOECOMM_WITH_CUDA=ON`` and runs every step; any failed step makes the exit
status 1, and so does a gpu test run in which no test passed or every test was skipped.
Without a device it builds with ``make build`` (.venv), runs the parts that need no device
(tests/gpu/test_gpu_host.py, tests/test_cuda_build.py, the collection of the gpu tests, the
bench's fallback) and reports every device step as skipped, with the reason; it exits 0 unless a
step that ran failed.

Each step runs in its own process group with its own timeout (the group is killed when it
expires); the whole run keeps within --budget seconds (default 570, inside the device tool's
10 minutes). OUT gets ``summary.json``, ``summary.md`` and ``logs/<step>.log`` (plus the junit
files and the bench's JSON); ``--pack`` folds everything but the summaries into
``logs.tar.gz``, so that OUT holds three files (the device tool returns at most eight).
docs/gpu-check.md describes the steps.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
DEFAULT_BUDGET_S = 570.0
# Kept free of the budget for the summary and the kill of a step that overran.
RESERVE_S = 10.0
KILL_GRACE_S = 5.0
ROUNDTRIP_TEST = "tests/gpu/test_device_roundtrip.py"
SANITIZER_TEST = "test_sizes_change_every_step_and_slots_are_reused_at_once"
# Steps of that test under the sanitizer (the test reads MOECOMM_ROUNDTRIP_STEPS).
SANITIZER_STEPS = "4"
HOST_TESTS = ["tests/gpu/test_gpu_host.py", "tests/test_cuda_build.py"]
WHEELS_DIR = ".gpu-wheels"
REQUIREMENTS = "tools/gpu-requirements.txt"
GPU_VENV = ".gpu-venv"
LOG_TAIL_LINES = 25
# pytest-timeout per test inside the steps: a hung test fails alone instead of taking the step's
# whole time (and its junit report) with it.
GPU_TEST_TIMEOUT_S = 120
SANITIZER_TEST_TIMEOUT_S = 180
# gpu tests in these files need a module the GPU image lacks and the device tool cannot carry:
# when the module is missing the file is left out of the gpu run, and the summary says so
# (under MOECOMM_REQUIRE_GPU=1 their skip would otherwise fail the run for a reason that is
# the machine's, not moecomm's).
UNCARRIED = [
    (
        "tests/test_nixl_tensors.py",
        "nixl",
        "NIXL is not in the GPU image and its wheel (65 MiB) is over the device tool's 64 MiB",
    ),
]


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
# Reading pytest's reports.


def parse_junit(path: Path) -> dict:
    """Counts of a pytest junit XML: tests, passed, failed, errors, skipped, and the distinct
    skip reasons (most frequent first)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    reasons: dict[str, int] = {}
    failed_names = []
    for suite in suites:
        for case in suite.iter("testcase"):
            counts["tests"] += 1
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            kids = {child.tag for child in case}
            if "error" in kids:
                counts["errors"] += 1
                failed_names.append(name)
            elif "failure" in kids:
                counts["failed"] += 1
                failed_names.append(name)
            elif "skipped" in kids:
                counts["skipped"] += 1
                msg = case.find("skipped").get("message", "") or ""
                reasons[msg] = reasons.get(msg, 0) + 1
            else:
                counts["passed"] += 1
        # Collection errors appear as suite-level errors without a test case in some versions.
        suite_errors = int(suite.get("errors", 0) or 0)
        listed = sum(1 for c in suite.iter("testcase") if c.find("error") is not None)
        if suite_errors > listed:
            counts["errors"] += suite_errors - listed
    counts["skip_reasons"] = [
        f"{n}× {r}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])
    ][:5]
    counts["not_passed"] = failed_names[:10]
    return counts


_SUMMARY_WORDS = {
    "passed": "passed",
    "failed": "failed",
    "error": "errors",
    "errors": "errors",
    "skipped": "skipped",
    "deselected": "deselected",
    "xfailed": "xfailed",
    "xpassed": "xpassed",
    "warning": "warnings",
    "warnings": "warnings",
}


def parse_pytest_summary(text: str) -> dict | None:
    """Counts from pytest's last summary line (``== 3 passed, 1 skipped in 2.1s ==`` or the
    ``-q`` form ``3 passed, 1 skipped in 2.1s``); None when there is none. ``--collect-only -q``
    lines (``12/400 tests collected (388 deselected) in 3.0s``) give ``collected``."""
    found = None
    for line in text.splitlines():
        line = line.strip().strip("=").strip()
        m = re.match(r"^(\d+)(?:/(\d+))? tests? collected", line)
        if m:
            found = {"collected": int(m.group(1))}
            continue
        if not re.search(r"\bin [\d.]+s\b", line) and "no tests ran" not in line:
            continue
        got = {}
        for n, word in re.findall(r"(\d+) ([a-z]+)", line):
            if word in _SUMMARY_WORDS:
                got[_SUMMARY_WORDS[word]] = int(n)
        if got or "no tests ran" in line:
            found = got
    return found


def judge_gpu_tests(res: Result, ctx: Context, junit: Path | None = None) -> None:
    """A gpu test run counts only if tests passed: on a device, 0 passed or all skipped fails
    the step whatever pytest's exit status."""
    if ctx.results_notes:
        res.figures["left_out"] = list(ctx.results_notes)
    counts = None
    if junit is not None and junit.exists():
        try:
            counts = parse_junit(junit)
        except ET.ParseError as exc:
            res.figures["junit_error"] = str(exc)
    if counts is None and res.log:
        summary = parse_pytest_summary(Path(res.log).read_text(errors="replace"))
        if summary is not None:
            counts = {k: summary.get(k, 0) for k in ("passed", "failed", "errors", "skipped")}
            counts["tests"] = sum(counts.values())
    if counts is None:
        if res.status == PASSED:
            res.status, res.reason = FAILED, "no pytest report (junit or summary line) found"
        return
    res.figures.update(counts)
    if res.status != PASSED:
        res.reason += f" ({counts['passed']} passed, {counts['failed']} failed, "
        res.reason += f"{counts['errors']} errors, {counts['skipped']} skipped)"
        return
    if counts["tests"] == 0 or counts["passed"] == 0:
        res.status = FAILED
        res.reason = (
            f"no gpu test passed ({counts['tests']} run, {counts['skipped']} skipped) on a "
            "machine with a device"
        )
    elif counts["skipped"] == counts["tests"]:
        res.status, res.reason = FAILED, "every gpu test was skipped on a machine with a device"
    elif counts["failed"] or counts["errors"]:
        res.status = FAILED
        res.reason = f"{counts['failed']} failed, {counts['errors']} errors"
    else:
        res.reason = f"{counts['passed']} passed, {counts['skipped']} skipped"
    if ctx.results_notes:
        res.reason += f"; left out: {'; '.join(ctx.results_notes)}"


def judge_pytest(res: Result, ctx: Context, junit: Path | None = None) -> None:
    """Plain pytest step: figures from the report; the exit status decides."""
    counts = None
    if junit is not None and junit.exists():
        try:
            counts = parse_junit(junit)
        except ET.ParseError:
            counts = None
    if counts is None and res.log:
        counts = parse_pytest_summary(Path(res.log).read_text(errors="replace"))
    if counts:
        res.figures.update(counts)
        if res.status == PASSED:
            res.reason = ", ".join(
                f"{counts[k]} {k}" for k in ("passed", "skipped") if counts.get(k) is not None
            )


def judge_collect(res: Result, ctx: Context) -> None:
    summary = parse_pytest_summary(Path(res.log).read_text(errors="replace")) if res.log else None
    n = (summary or {}).get("collected")
    if n is None and summary is not None and "errors" in summary:
        n = 0
    res.figures["gpu_tests_collected"] = n
    if res.status == PASSED:
        if not n:
            res.status, res.reason = FAILED, "no gpu-marked test collected"
        else:
            res.reason = f"{n} gpu-marked tests collected"


# ---------------------------------------------------------------------------------------------
# compute-sanitizer


def find_sanitizer() -> str | None:
    for cand in (
        shutil.which("compute-sanitizer"),
        "/usr/local/cuda/bin/compute-sanitizer",
        "/usr/local/cuda/compute-sanitizer/compute-sanitizer",
    ):
        if cand and os.access(cand, os.X_OK):
            return cand
    nvcc = shutil.which("nvcc")
    if nvcc:
        cand = Path(os.path.realpath(nvcc)).parent / "compute-sanitizer"
        if os.access(cand, os.X_OK):
            return str(cand)
    return None


SANITIZER_ERRORS = re.compile(r"ERROR SUMMARY:\s*(\d+) errors?")
RACECHECK_HAZARDS = re.compile(
    r"RACECHECK SUMMARY:\s*(\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)"
)


def parse_sanitizer(text: str) -> dict:
    """Totals over every process compute-sanitizer followed."""
    errors = [int(n) for n in SANITIZER_ERRORS.findall(text)]
    out = {"processes_checked": len(errors), "sanitizer_errors": sum(errors)}
    hz = RACECHECK_HAZARDS.findall(text)
    if hz:
        out["race_hazards"] = sum(int(h[0]) for h in hz)
        out["race_errors"] = sum(int(h[1]) for h in hz)
        out["race_warnings"] = sum(int(h[2]) for h in hz)
    return out


def sanitizer_step(tool: str) -> Step:
    def precheck(ctx: Context):
        if not (ctx.root / ROUNDTRIP_TEST).exists():
            return FAILED, f"missing: {ROUNDTRIP_TEST} does not exist"
        if find_sanitizer() is None:
            return FAILED, "compute-sanitizer not found (PATH, /usr/local/cuda/bin)"
        return None

    def cmd(ctx: Context) -> list:
        return [
            find_sanitizer(),
            "--tool",
            tool,
            "--target-processes",
            "all",
            "--error-exitcode",
            "86",
            ctx.python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            # One test, few steps: every kernel of the round trip runs, under a tool that slows
            # kernels by orders of magnitude (the whole file is the gpu-tests step's job).
            "-k",
            SANITIZER_TEST,
            ROUNDTRIP_TEST,
            f"--timeout={SANITIZER_TEST_TIMEOUT_S}",
            f"--junitxml={ctx.path(tool + '.xml')}",
        ]

    def judge(res: Result, ctx: Context) -> None:
        text = Path(res.log).read_text(errors="replace") if res.log else ""
        res.figures.update(parse_sanitizer(text))
        junit = ctx.path(tool + ".xml")
        if junit.exists():
            c = parse_junit(junit)
            res.figures.update({k: c[k] for k in ("tests", "passed", "skipped", "failed")})
        if res.status != PASSED:
            if res.returncode == 86:
                res.reason = f"{tool} reported {res.figures['sanitizer_errors']} errors"
            return
        if res.figures["processes_checked"] == 0:
            res.status, res.reason = FAILED, "no compute-sanitizer summary in the log"
        elif res.figures["sanitizer_errors"]:
            res.status = FAILED
            res.reason = f"{tool} reported {res.figures['sanitizer_errors']} errors"
        elif not res.figures.get("passed"):
            res.status, res.reason = FAILED, "the round-trip test did not pass under the tool"
        else:
            res.reason = (
                f"0 errors in {res.figures['processes_checked']} processes, "
                f"{res.figures.get('passed', 0)} tests passed"
            )

    missing = "" if (ROOT / ROUNDTRIP_TEST).exists() else f"{ROUNDTRIP_TEST} is also missing"
    return Step(
        f"sanitizer-{tool}",
        cmd,
        timeout_s=200,
        env={"MOECOMM_ROUNDTRIP_STEPS": SANITIZER_STEPS},
        title=f"compute-sanitizer --tool {tool} on {ROUNDTRIP_TEST}",
        needs_device=True,
        precheck=precheck,
        judge=judge,
        no_device_reason=missing,
        requires=("build",),
    )


# ---------------------------------------------------------------------------------------------
# The steps.


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


ENV_SCRIPT = r"""
import json, platform, shutil, subprocess, sys
info = {"python": sys.version.split()[0], "executable": sys.executable,
        "machine": platform.machine()}
def run(*cmd):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return (r.stdout + r.stderr).strip()
    except Exception as exc:
        return f"unavailable: {exc}"
for tool, args in (("nvidia-smi", ["--query-gpu=name,driver_version,memory.total",
                                   "--format=csv,noheader"]),
                   ("nvcc", ["--version"]), ("compute-sanitizer", ["--version"])):
    path = shutil.which(tool)
    info[tool] = run(path, *args).splitlines()[-1] if path else "not found"
try:
    import torch
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["torch_cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
except Exception as exc:
    info["torch"] = f"not importable: {exc}"
try:
    import triton
    info["triton"] = triton.__version__
except Exception as exc:
    info["triton"] = f"not importable: {exc}"
print("GPU-CHECK-ENV " + json.dumps(info))
"""

IMPORT_SCRIPT = r"""
import json
import moecomm, moecomm.cuda, torch
info = {"moecomm": moecomm.__file__, "torch": torch.__version__,
        "torch_cuda_available": torch.cuda.is_available(),
        "built_cuda": moecomm.cuda.built("_cuda"), "built_nvshmem": moecomm.cuda.built("_nvshmem"),
        "available": moecomm.cuda.available(), "device_count": moecomm.cuda.device_count(),
        "why_unavailable": moecomm.cuda.why_unavailable()}
print("GPU-CHECK-IMPORT " + json.dumps(info))
"""


def _json_line(res: Result, tag: str) -> dict | None:
    if not res.log:
        return None
    for line in Path(res.log).read_text(errors="replace").splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1 :])
    return None


def judge_last_line(res: Result, ctx: Context) -> None:
    """The reason of a passed build: its last line of output ("Nothing to be done", "Successfully
    installed ...")."""
    if res.status == PASSED and res.log:
        lines = [ln for ln in Path(res.log).read_text(errors="replace").splitlines()[1:] if ln]
        res.reason = (lines[-1].strip() if lines else "done")[:160]


def judge_env(res: Result, ctx: Context) -> None:
    info = _json_line(res, "GPU-CHECK-ENV")
    if info:
        res.figures.update(info)
        res.reason = f"python {info['python']}, torch {info.get('torch')}"
        if info.get("gpu"):
            res.reason += f", {info['gpu']}"
    if ctx.device and info and info.get("torch_cuda_available") is not True:
        res.status = FAILED
        res.reason = (
            f"this Python's torch ({info.get('torch')}) sees no CUDA device: run gpu-check "
            "with the image's Python (PYTHON=...) — moecomm must be built against a CUDA torch"
        )


def judge_import(res: Result, ctx: Context) -> None:
    info = _json_line(res, "GPU-CHECK-IMPORT")
    if not info:
        return
    res.figures.update(info)
    res.reason = (
        f"_cuda built: {info['built_cuda']}, _nvshmem built: {info['built_nvshmem']}, "
        f"devices: {info['device_count']}"
    )
    if ctx.device:
        problems = []
        if not info["built_cuda"]:
            problems.append("moecomm._cuda was not built")
        if not info["built_nvshmem"]:
            problems.append("moecomm._nvshmem was not built")
        if not info["available"]:
            problems.append(f"moecomm sees no device ({info['why_unavailable']})")
        if problems:
            res.status, res.reason = FAILED, "; ".join(problems)
    elif not info["built_cuda"] and shutil.which("nvcc"):
        res.status, res.reason = FAILED, "nvcc is here but moecomm._cuda was not built"


def judge_bench(res: Result, ctx: Context) -> None:
    path = ctx.path("vs_deepep.json")
    if not path.exists():
        if res.status == PASSED:
            res.status, res.reason = FAILED, "the bench wrote no JSON"
        return
    data = json.loads(path.read_text())
    row = data.get("gpu_row") or {}
    for k in ("name", "dispatch_us", "combine_us", "dispatch_gbps", "combine_gbps", "calc_diff"):
        if k in row:
            res.figures[k] = row[k]
    if res.status != PASSED:
        return
    if row.get("not_run"):
        if ctx.device:
            res.status, res.reason = FAILED, f"moecomm GPU row not run: {row['not_run']}"
        else:
            res.status, res.reason = SKIPPED, f"moecomm GPU row not run: {row['not_run']}"
    elif row.get("ok") != "yes":
        res.status = FAILED
        res.reason = f"moecomm GPU row is wrong: calc_diff {row.get('calc_diff')}"
    else:
        res.reason = (
            f"dispatch {row['dispatch_us']:.1f} µs, combine {row['combine_us']:.1f} µs "
            f"(calc_diff {row['calc_diff']:.1e})"
        )


def default_steps(ctx: Context, gpu_venv: Path | None = None) -> list[Step]:
    """The gpu-check steps. With a device: the image's Python (the one running this script, or
    --python) checked first, a venv over it, the carried wheels, the CUDA build, then the tests
    with the venv's Python. Without one: `make build` (.venv), then .venv's Python."""
    gpu_venv = gpu_venv or ctx.root / GPU_VENV
    base = ctx.python
    env_step = Step(
        "env",
        lambda c: [c.python, "-c", ENV_SCRIPT],
        timeout_s=60,
        title="the machine, its Python, torch, nvcc, compute-sanitizer",
        judge=judge_env,
    )
    steps = []
    if ctx.device:
        py = str(gpu_venv / "bin" / "python")
        wheels = ctx.root / WHEELS_DIR
        links = ["--find-links", str(wheels)] if wheels.is_dir() else []
        pip = ["-m", "pip", "install", "--no-index", "--disable-pip-version-check"]
        setup_cmd = [base, str(Path(__file__).resolve()), "--make-venv", str(gpu_venv), "--"]
        setup_cmd += [*pip, *links, "-r", str(ctx.root / REQUIREMENTS)]
        build_cmd = [py, *pip, "--no-build-isolation", "--no-deps", "-v", "-e", "."]
        steps += [
            env_step,
            Step(
                "setup",
                setup_cmd,
                timeout_s=180,
                title=f"{GPU_VENV} over {base}; test wheels from {WHEELS_DIR} (no index)",
                judge=lambda r, c: _setup_reason(r, c, wheels.is_dir()),
                requires=("env",),
            ),
            Step(
                "build",
                build_cmd,
                timeout_s=360,
                title="pip install -e . against the image's CUDA torch, MOECOMM_WITH_CUDA=ON",
                judge=judge_last_line,
                env={
                    "MOECOMM_WITH_CUDA": "ON",
                    "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 8),
                },
                requires=("setup",),
            ),
        ]
    else:
        venv = ctx.root / ".venv" / "bin" / "python"
        py = str(venv)
        steps += [
            Step(
                "build",
                [os.environ.get("MAKE", "make"), "--no-print-directory", "build"],
                timeout_s=540,
                title="make build (.venv; no device here)",
                judge=judge_last_line,
            ),
            env_step,
        ]
    ctx.python = py  # the env step reads it when it runs: .venv's here, the image's there
    if ctx.device:
        env_step.cmd = [base, "-c", ENV_SCRIPT]
    gpu_junit, host_junit = ctx.path("gpu-tests.xml"), ctx.path("host-tests.xml")
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    steps += [
        Step(
            "import",
            [py, "-c", IMPORT_SCRIPT],
            timeout_s=120,
            title="import moecomm; which GPU modules were built; what it sees",
            judge=judge_import,
            requires=("build",),
        ),
        Step(
            "gpu-collect",
            [*pytest, "--collect-only", "-m", "gpu"],
            timeout_s=240,
            title="collect every gpu-marked test (no device needed)",
            only_without_device=True,
            judge=judge_collect,
            requires=("build",),
        ),
        Step(
            "gpu-tests",
            lambda c: [
                *pytest,
                "-rA",
                "-m",
                "gpu",
                f"--timeout={GPU_TEST_TIMEOUT_S}",
                f"--junitxml={gpu_junit}",
                *_left_out(c, py),
            ],
            timeout_s=300,
            title="pytest -m gpu (MOECOMM_REQUIRE_GPU=1)",
            needs_device=True,
            env={"MOECOMM_REQUIRE_GPU": "1", "PYTHONUNBUFFERED": "1"},
            judge=lambda r, c: judge_gpu_tests(r, c, gpu_junit),
            requires=("build",),
        ),
        Step(
            "bench",
            [py, "bench/vs_deepep.py", "--gpu-only", "--json", str(ctx.path("vs_deepep.json"))],
            timeout_s=200,
            title="bench/vs_deepep.py --gpu-only (moecomm GPU row)",
            env={"PYTHONUNBUFFERED": "1"},
            judge=judge_bench,
            requires=("build",),
        ),
        sanitizer_step("memcheck"),
        sanitizer_step("racecheck"),
        Step(
            "host-tests",
            [*pytest, *HOST_TESTS, f"--junitxml={host_junit}"],
            timeout_s=300,
            title="the GPU modules' host behaviour and the CUDA compile checks",
            judge=lambda r, c: judge_pytest(r, c, host_junit),
            requires=("build",),
        ),
    ]
    return steps


def _left_out(ctx: Context, python: str) -> list[str]:
    """--ignore for each UNCARRIED file whose module this Python cannot import; recorded in
    ctx.results_notes for the gpu-tests step's figures."""
    args, notes = [], []
    for path, module, why in UNCARRIED:
        probe = (
            f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
        )
        try:
            missing = subprocess.run([python, "-c", probe], timeout=60).returncode != 0
        except (OSError, subprocess.TimeoutExpired):
            missing = True
        if missing:
            args.append(f"--ignore={path}")
            notes.append(f"{path}: {module} not importable ({why})")
    ctx.results_notes = notes
    return args


def _setup_reason(res: Result, ctx: Context, had_wheels: bool) -> None:
    if res.status == PASSED:
        res.reason = "test requirements satisfied" + (
            f" (from {WHEELS_DIR} where missing)" if had_wheels else ""
        )
    elif not had_wheels:
        res.reason += (
            f"; a test requirement is missing and {WHEELS_DIR} was not carried "
            "(tools/fetch_gpu_wheels.sh, then carry it)"
        )


def make_venv(path: Path) -> None:
    """A venv that sees the running Python's packages, also when that Python is itself a venv
    (--system-site-packages alone would show the base interpreter's, not the image's torch)."""
    import site
    import venv

    if not (path / "bin" / "python").exists():
        venv.EnvBuilder(system_site_packages=False, with_pip=False, symlinks=True).create(path)
    parents = [p for p in site.getsitepackages() if os.path.isdir(p)]
    user = site.getusersitepackages()
    if isinstance(user, str) and os.path.isdir(user):
        parents.append(user)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    own = path / "lib" / ver / "site-packages"
    own.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in parents)
    (own / "_gpu_check_parent.pth").write_text(lines)


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


def main(argv: list[str] | None = None, steps: list[Step] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--make-venv"]:
        # Internal: the setup step makes the venv with this (the base) Python, then runs the
        # rest of the command line with the venv's Python.
        path = Path(argv[1])
        make_venv(path)
        rest = argv[3:] if argv[2:3] == ["--"] else argv[2:]
        return subprocess.call([str(path / "bin" / "python"), *rest])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-check-results", help="folder for logs and summary")
    ap.add_argument(
        "--device",
        choices=["auto", "yes", "no"],
        default="auto",
        help="auto: a GPU if nvidia-smi lists one; yes/no: assume",
    )
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds, all steps")
    ap.add_argument("--python", default=sys.executable, help="the image's Python (CUDA torch)")
    ap.add_argument("--pack", action="store_true", help="fold the logs into logs.tar.gz")
    ap.add_argument("--only", default=None, help="comma-separated step names to run")
    a = ap.parse_args(argv)
    started = time.time()
    out = Path(a.out)
    if not out.is_absolute():
        out = Path.cwd() / out
    # Only what an earlier run wrote goes: OUT may be a folder with other files in it (the
    # device tool's $OUT, or a mistyped path), which are never touched.
    for name in ("summary.json", "summary.md", "logs.tar.gz"):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "logs", ignore_errors=True)
    (out / "logs").mkdir(parents=True)
    if a.device == "auto":
        device, why = detect_device()
    else:
        device, why = a.device == "yes", f"--device {a.device}"
    ctx = Context(out=out, device=device, device_reason=why, python=a.python, budget_s=a.budget)
    ctx.deadline = time.monotonic() + a.budget
    if steps is None:
        steps = default_steps(ctx)
    if a.only:
        names = set(a.only.split(","))
        steps = [s for s in steps if s.name in names]
    where = "with a device: " if device else "no device: "
    print(f"[gpu-check] {where}{why}; budget {a.budget:.0f} s; results in {out}")
    results = run_steps(steps, ctx)
    code = exit_code_of(results)
    write_summary(ctx, results, started, code)
    print_summary(results, ctx, code)
    if a.pack:
        pack_logs(out)
    return code


if __name__ == "__main__":
    sys.exit(main())
