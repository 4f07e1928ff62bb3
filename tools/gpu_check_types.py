"""The records of tools/gpu_check.py's runs: a run's context (``Context``), a stage's result
(``Result``) and a test file's row (``FileResult``). Plain dataclasses, below both the runner
(gpu_check_run), which fills them, and the summary writer (gpu_check_summary), which reads
them, so neither imports the other for them. Standard library only: it runs before anything is
installed."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gpu_check_reports import slug

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class FileResult:
    """One test file (or one scenario) of a stage: one pytest process, one junit file."""

    stage: str
    name: str
    status: str
    reason: str = ""
    duration_s: float = 0.0
    tests: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    counts_from: str = ""
    crashed: int = 0
    killed: bool = False
    junit: str | None = None
    not_passed: list = dataclasses.field(default_factory=list)
    # Per test, when the plugin's log was there: {"test", "outcome", "note"} (CASE_OUTCOMES).
    cases: list = dataclasses.field(default_factory=list)
    # pytest processes it took: more than 1 when a crash made the runner resume the file.
    parts: int = 1


@dataclasses.dataclass
class Result:
    """One stage."""

    name: str
    status: str = ""
    reason: str = ""
    budget_s: float = 0.0
    duration_s: float = 0.0
    figures: dict = dataclasses.field(default_factory=dict)
    log: str | None = None
    files: list = dataclasses.field(default_factory=list)
    commands: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Context:
    """One run. ``out`` gets the summaries; ``work`` the logs and junit files (``out`` itself,
    or a scratch folder packed into ``out`` after every stage with --pack)."""

    out: Path
    device: bool
    device_reason: str
    base_python: str = sys.executable
    python: str = sys.executable
    root: Path = ROOT
    work: Path | None = None
    pack: bool = False
    label: str = "all stages"
    limit_s: float | None = None
    deadline: float = float("inf")
    # Seconds a stage added to the plan after the run began (a build that was not reused):
    # every later stage's planned end moves by as much.
    plan_shift: float = 0.0
    started: float = dataclasses.field(default_factory=time.time)
    results: dict = dataclasses.field(default_factory=dict)
    order: list = dataclasses.field(default_factory=list)
    in_progress: str | None = None
    notes: list = dataclasses.field(default_factory=list)
    echo: Callable[[str], None] = print

    def __post_init__(self) -> None:
        if self.work is None:
            self.work = self.out

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def path(self, name: str) -> Path:
        return self.work / "logs" / name

    def junit_path(self, stage: str, name: str) -> Path:
        return self.work / "junit" / f"{stage}.{slug(name)}.xml"

    def rel(self, path: Path | str) -> str:
        return os.path.relpath(path, self.work)
