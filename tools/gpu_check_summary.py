"""The summaries of tools/gpu_check.py's runs: summary.json and summary.md rewritten as results
come (a run killed at any point leaves the last complete pair), the line-per-stage summary it
prints at the end, the archives of its logs and junit files (--pack), clearing what an earlier
run left in OUT, and the run's exit status. Standard library only: it runs before anything is
installed.

It reads the run's records (gpu_check_types: Context, Result, FileResult) and never imports the
runner, which imports it: the records and the statuses both use live below both
(gpu_check_types, gpu_check_reports)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tarfile
import time
from pathlib import Path

from gpu_check_reports import COUNT_KEYS, OK_STATUSES, PASSED, SKIPPED, STATUSES
from gpu_check_types import Context, Result


def exit_code_of(results: list[Result]) -> int:
    return 0 if all(r.status in OK_STATUSES for r in results) else 1


def summary_data(ctx: Context, exit_code: int | None = None) -> dict:
    stages = [dataclasses.asdict(r) for r in ctx.order]
    files = [f for r in ctx.order for f in r.files]
    return {
        "label": ctx.label,
        "device": ctx.device,
        "device_reason": ctx.device_reason,
        "python": ctx.python,
        "base_python": ctx.base_python,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ctx.started)),
        "duration_s": round(time.time() - ctx.started, 1),
        "limit_s": ctx.limit_s,
        "in_progress": ctx.in_progress,
        "complete": exit_code is not None,
        "exit_code": exit_code,
        "packed": ctx.pack,
        "counts": {s: sum(r.status == s for r in ctx.order) for s in STATUSES},
        "tests": {k: sum(getattr(f, k) for f in files) for k in ("tests", *COUNT_KEYS)},
        "notes": list(ctx.notes),
        "stages": stages,
    }


def write_summary(ctx: Context, exit_code: int | None = None) -> None:
    """summary.json and summary.md in OUT, replaced atomically: a run killed at any point leaves
    the last complete pair."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    data = summary_data(ctx, exit_code)
    for name, text in (
        ("summary.json", json.dumps(data, indent=2, default=str) + "\n"),
        ("summary.md", summary_markdown(data)),
    ):
        tmp = ctx.out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, ctx.out / name)


def _figures_text(fig: dict) -> str:
    keep = []
    for k, v in fig.items():
        if isinstance(v, (list, dict)) or v is None or v == "":
            continue
        if isinstance(v, float):
            v = f"{v:.3g}"
        keep.append(f"{k}={v}")
    return ", ".join(keep)[:300]


def _cell(text) -> str:
    return str(text or "").replace("|", "\\|").replace("\n", " ")


# A test's note in summary.md is cut to this (summary.json keeps the plugin's whole text).
CASE_NOTE_CHARS = 240


def _case_lines(rows: list) -> list:
    """summary.md's per-test section: each test of a file that did not pass, with its outcome
    and note (the passed ones of such a file are counted, and listed in summary.json)."""
    out = []
    for f in rows:
        bad = [c for c in f.get("cases", []) if c["outcome"] not in ("passed", "skipped")]
        if not bad:
            continue
        ok = sum(c["outcome"] == "passed" for c in f["cases"])
        head = f"{f['stage']} {f['name']} ({ok} passed"
        head += f", {f['parts']} pytest runs):" if f.get("parts", 1) > 1 else "):"
        out.append(f"- {head}")
        for c in bad:
            note = " ".join(c["note"].split())
            if len(note) > CASE_NOTE_CHARS:  # a crash says why first, a failure at its end
                crash = c["outcome"] == "crashed"
                note = note[:CASE_NOTE_CHARS] + "…" if crash else "…" + note[-CASE_NOTE_CHARS:]
            out.append(f"  - `{c['test']}` **{c['outcome']}**" + (f": {note}" if note else ""))
    return ["", "## Tests that did not pass", "", *out] if out else []


def summary_markdown(data: dict) -> str:
    where = "with a device" if data["device"] else "without a device"
    if data["complete"]:
        state = f"exit {data['exit_code']}"
    else:
        state = f"IN PROGRESS (stage {data['in_progress'] or '-'}), or killed"
    limit = f" of the {data['limit_s']:.0f} s limit" if data.get("limit_s") else ""
    t = data["tests"]
    counts = ", ".join(f"{n} {s}" for s, n in data["counts"].items() if n)
    lines = [
        f"# gpu-check summary: {data['label']}",
        "",
        f"{data['started_utc']}, {where} ({data['device_reason']}), python `{data['python']}`; "
        f"{data['duration_s']} s{limit}; {state}. Stages: {counts or 'none yet'}. Tests: "
        f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped, "
        f"{t['errors']} errors, {t['crashed']} crashed.",
    ]
    if data["packed"]:
        lines += ["", "Logs and junit files are in logs.tar.gz and junit.tar.gz next to this."]
    lines += [
        "",
        "| stage | status | seconds | budget | reason | key figures | log |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in data["stages"]:
        lines.append(
            f"| {r['name']} | {r['status']} | {r['duration_s']:.1f} | {r['budget_s']:.0f} | "
            f"{_cell(r['reason'])} | {_cell(_figures_text(r['figures']))} | {r['log'] or ''} |"
        )
    rows = [f for r in data["stages"] for f in r["files"]]
    if rows:
        lines += [
            "",
            "## Test files",
            "",
            "| stage | test file | status | passed | failed | skipped | errors | crashed | "
            "seconds | note | junit |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for f in rows:
            lines.append(
                f"| {f['stage']} | {_cell(f['name'])} | {f['status']} | {f['passed']} | "
                f"{f['failed']} | {f['skipped']} | {f['errors']} | {f['crashed']} | "
                f"{f['duration_s']:.1f} | {_cell(f['reason'])} | {f['junit'] or ''} |"
            )
        lines += _case_lines(rows)
    for r in data["stages"]:
        for k, v in r["figures"].items():
            if isinstance(v, list) and v:
                lines.append(f"\n{r['name']} {k}:\n" + "\n".join(f"- {x}" for x in v))
    for note in data["notes"]:
        lines.append(f"\nNote: {note}")
    return "\n".join(lines) + "\n"


def print_summary(ctx: Context, exit_code: int) -> None:
    where = "with a device" if ctx.device else f"WITHOUT a device ({ctx.device_reason})"
    print(f"\n[gpu-check] summary of {ctx.label}, {where}:")
    width = max((len(r.name) for r in ctx.order), default=5)
    for r in ctx.order:
        print(
            f"  {r.name:<{width}}  {r.status:<10} {r.duration_s:6.1f} s / {r.budget_s:3.0f} s  "
            f"{r.reason}"
        )
        for f in r.files:
            if f.status not in (PASSED,):
                print(f"  {'':<{width}}    {f.name}: {f.status} — {f.reason}")
            for c in f.cases:
                if c["outcome"] == "crashed":
                    print(f"  {'':<{width}}      crashed: {c['test']} — {c['note'][:200]}")
    skipped = [r.name for r in ctx.order if r.status == SKIPPED]
    if skipped:
        print(f"[gpu-check] skipped: {', '.join(skipped)} (reasons above)")
    took = time.time() - ctx.started
    limit = f" (limit {ctx.limit_s:.0f} s)" if ctx.limit_s else ""
    print(f"[gpu-check] took {took:.0f} s{limit}")
    print(f"[gpu-check] wrote {ctx.out / 'summary.json'} and {ctx.out / 'summary.md'}")
    print(f"[gpu-check] exit {exit_code}")


ARCHIVES = {"logs": "logs.tar.gz", "junit": "junit.tar.gz"}


def pack(ctx: Context) -> None:
    """logs/ and junit/ of the scratch folder into OUT/logs.tar.gz and OUT/junit.tar.gz (the
    device tool brings back at most 8 files), replaced atomically."""
    for folder, archive in ARCHIVES.items():
        src = ctx.work / folder
        if not src.is_dir():
            continue
        tmp = ctx.out / f".{archive}.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(src, arcname=folder)
        os.replace(tmp, ctx.out / archive)


def clear_outputs(out: Path) -> None:
    """Only what an earlier run wrote goes: OUT may be a folder with other files in it (the
    device tool's $OUT, or a mistyped path), which are never touched."""
    for name in ("summary.json", "summary.md", *ARCHIVES.values()):
        (out / name).unlink(missing_ok=True)
    for folder in ARCHIVES:
        shutil.rmtree(out / folder, ignore_errors=True)
