"""What tools/gpu_check.py reads back: pytest's junit XML, its ``-v`` progress lines and summary
line (what a killed pytest leaves), the per-test log its pytest plugin writes (below) and
compute-sanitizer's error summaries, and the statuses the runner, the summary writer and the
stages share. Pure functions over text and files: no import of the runner, the summary writer
or the stages. Standard library only: it runs before anything is installed.

It is also a pytest plugin (``-p gpu_check_reports`` with tools/ on PYTHONPATH): with
``GPU_CHECK_CASES`` set, each test's start and each phase's report is appended to that file as
one JSON line the moment it happens, so a pytest that a segfault or a kill ends still leaves
which tests finished, how, with their failure text, and which one was running."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

# A stage's or a test file's status, here because the runner (gpu_check_run), the summary
# writer (gpu_check_summary) and the stages all use them and none of them may import the other
# two in a circle.
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
# A stage some of whose test files were not run (its budget was spent) with none failed.
INCOMPLETE = "incomplete"
# A stage or a test file that did not start: its budget was spent, or a stage it needs failed.
NOT_RUN = "not-run"
STATUSES = (PASSED, FAILED, SKIPPED, INCOMPLETE, NOT_RUN)
# The run exits 0 only when every stage ended in one of these.
OK_STATUSES = (PASSED, SKIPPED)
COUNT_KEYS = ("passed", "failed", "skipped", "errors", "crashed")
# The per-test outcomes of a test file (a crashed test is one whose process died under it).
CASE_OUTCOMES = ("passed", "failed", "skipped", "error", "crashed", "not run")
CASES_ENV = "GPU_CHECK_CASES"
PLUGIN = "gpu_check_reports"
# A failure's text is kept to its last this many characters (the assertion and its E lines
# are at the end of pytest's long report).
CASE_TEXT_CHARS = 1500


# ---------------------------------------------------------------------------------------------
# pytest's junit XML


def parse_junit(path: Path) -> dict:
    """Counts of a pytest junit XML: tests, passed, failed, errors, skipped; the distinct skip
    reasons (most frequent first), the tests that did not pass and the first failure's message."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    reasons: dict[str, int] = {}
    failed_names: list[str] = []
    first_message = ""
    for suite in suites:
        for case in suite.iter("testcase"):
            counts["tests"] += 1
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            bad = case.find("error")
            if bad is None:
                bad = case.find("failure")
            if bad is not None:
                counts["errors" if bad.tag == "error" else "failed"] += 1
                failed_names.append(name)
                if not first_message:
                    first_message = (bad.get("message") or (bad.text or "")).strip()
            elif case.find("skipped") is not None:
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
    counts["first_failure"] = " ".join(first_message.split())[:240]
    return counts


# ---------------------------------------------------------------------------------------------
# pytest's text output

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


# `pytest -v`: one line per test phase as it ends ("tests/a.py::test_x[1] PASSED   [ 50%]");
# `-rA` adds "PASSED tests/a.py::test_x[1]" lines in the short summary at the end.
_PROGRESS = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
_SHORT = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS)\s+(\S+::\S+)")
_OUTCOME = {
    "PASSED": "passed",
    "XPASS": "passed",
    "FAILED": "failed",
    "SKIPPED": "skipped",
    "XFAIL": "skipped",
    "ERROR": "errors",
}


def parse_pytest_progress(text: str) -> dict | None:
    """Counts from the per-test lines of ``pytest -v -rA`` output, also when the run was killed
    half-way (no junit, no summary line): each (test, outcome) pair counts once, so a test that
    passed and then errored in teardown counts as pytest counts it (1 passed, 1 error). None
    when there is no such line."""
    seen: dict[tuple[str, str], None] = {}
    for line in text.splitlines():
        m = _PROGRESS.match(line.strip())
        if m:
            seen[(m.group(1), m.group(2))] = None
            continue
        m = _SHORT.match(line.strip())
        if m:
            seen[(m.group(2), m.group(1))] = None
    if not seen:
        return None
    counts = dict.fromkeys(COUNT_KEYS, 0)
    not_passed = []
    for node, outcome in seen:
        key = _OUTCOME[outcome]
        counts[key] += 1
        if key in ("failed", "errors"):
            not_passed.append(node)
    counts["tests"] = len({node for node, _ in seen})
    counts["not_passed"] = not_passed[:10]
    return counts


def counts_of_run(junit: Path | None, text: str) -> tuple[dict | None, str]:
    """A pytest run's counts and where they came from: its junit when it wrote one, else the
    ``-v`` lines of its output, else its summary line; (None, "") when there is nothing."""
    if junit is not None and junit.exists():
        try:
            return parse_junit(junit), "junit"
        except ET.ParseError:
            pass
    got = parse_pytest_progress(text)
    if got is not None:
        return got, "output"
    summary = parse_pytest_summary(text)
    if summary is not None and "collected" not in summary:
        counts = {k: summary.get(k, 0) for k in COUNT_KEYS}
        counts["tests"] = sum(counts.values())
        return counts, "summary line"
    return None, ""


# ---------------------------------------------------------------------------------------------
# The pytest plugin: a per-test log that survives the process


def _append_case(entry: dict) -> None:
    path = os.environ.get(CASES_ENV)
    if not path:
        return
    # One write per line, file closed at once: what a later segfault cannot take back.
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def pytest_collection_finish(session) -> None:
    _append_case({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid, location) -> None:
    _append_case({"start": nodeid})


def pytest_runtest_logreport(report) -> None:
    entry = {"test": report.nodeid, "when": report.when, "outcome": report.outcome}
    if hasattr(report, "wasxfail"):
        entry["xfail"] = True
    if report.failed:
        entry["text"] = report.longreprtext[-CASE_TEXT_CHARS:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        entry["text"] = str(report.longrepr[2])[:CASE_TEXT_CHARS]
    _append_case(entry)


@dataclasses.dataclass
class CaseLog:
    """What the plugin's log says: the tests collected (in the first pytest's order; a resumed
    one collects what it did not deselect), the outcome of each finished test with its
    text, and the tests that started and did not finish."""

    collected: list
    outcomes: dict  # nodeid -> (outcome, text)
    unfinished: list


def _outcome_of(phases: dict) -> tuple[str, str]:
    """One test's outcome from its phase reports, as pytest counts it: a failed call "failed",
    a failed setup or teardown "error", a skip or an xfail "skipped"."""
    for when in ("setup", "call", "teardown"):
        rep = phases.get(when)
        if rep and rep["outcome"] == "failed":
            key = "failed" if when == "call" and not rep.get("xfail") else "error"
            return key, (f"{when}: " if when != "call" else "") + rep.get("text", "")
    for when in ("setup", "call"):
        rep = phases.get(when)
        if rep and rep["outcome"] == "skipped":
            return "skipped", ("xfail: " if rep.get("xfail") else "") + rep.get("text", "")
    return "passed", ""


def read_cases(path: Path) -> CaseLog | None:
    """The plugin's log; None when there is none (the plugin did not load)."""
    if not path.exists():
        return None
    collected: list = []
    phases: dict[str, dict] = {}
    started: dict[str, None] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:  # a line cut by a kill in mid-write
            continue
        if "collected" in entry:  # a resumed pytest collects what is left: a subset
            collected += [n for n in entry["collected"] if n not in collected]
        elif "start" in entry:
            started[entry["start"]] = None
        elif "test" in entry:
            phases.setdefault(entry["test"], {})[entry["when"]] = entry
    outcomes = {node: _outcome_of(ph) for node, ph in phases.items() if "teardown" in ph}
    unfinished = [n for n in started if n not in outcomes]
    return CaseLog(collected, outcomes, unfinished)


FATAL = "Fatal Python error"
# Frames of a faulthandler dump kept for a crashed test: the innermost ones outside the
# interpreter's and pytest's own files say where it died.
FAULT_FRAMES = 6


def fault_excerpt(text: str) -> str:
    """The last faulthandler dump of a pytest's output, shortened: its "Fatal Python error"
    line and the innermost frames not in site-packages; "" when there is none."""
    at = text.rfind(FATAL)
    if at < 0:
        return ""
    lines = text[at:].splitlines()
    keep = [lines[0].strip()]
    frames = [
        ln.strip()
        for ln in lines[1:]
        if ln.strip().startswith("File ") and "site-packages" not in ln and "<frozen" not in ln
    ]
    keep += frames[:FAULT_FRAMES]
    return "; ".join(keep)


def slug(text: str) -> str:
    """A file-name-safe form of a test file or id (letters, digits, '.', '_', '-' only: what the
    device tool brings back)."""
    text = text.removeprefix("tests/").replace(".py::", ".").removesuffix(".py")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:120] or "x"


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
