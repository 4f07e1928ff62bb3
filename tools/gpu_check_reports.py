"""What tools/gpu_check.py reads back: pytest's junit XML and summary line, compute-sanitizer's
error summaries, and the judges that turn them into a step's status; the sanitizer steps.
Standard library only."""

from __future__ import annotations

import os
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_check_run import FAILED, PASSED, ROOT, Context, Result, Step

ROUNDTRIP_TEST = "tests/gpu/test_device_roundtrip.py"
SANITIZER_TEST = "test_sizes_change_every_step_and_slots_are_reused_at_once"
# Steps of that test under the sanitizer (the test reads MOECOMM_ROUNDTRIP_STEPS).
SANITIZER_STEPS = "4"
SANITIZER_TEST_TIMEOUT_S = 180
# pytest-timeout per test inside the steps: a hung test fails alone instead of taking the step's
# whole time (and its junit report) with it.
GPU_TEST_TIMEOUT_S = 120


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
