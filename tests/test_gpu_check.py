"""tools/gpu_check.py on a machine without a GPU: how it reads pytest's and compute-sanitizer's
reports, when a gpu test run counts as failed, what it does with no device, a step over its
timeout, a missing round-trip test, and what it writes. Fake steps (tiny Python commands) stand
in for the real ones; nothing here needs a device or builds anything."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
gc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gc  # dataclasses look their module up by name
_spec.loader.exec_module(gc)
import gpu_check_reports as rp  # noqa: E402  (importable once gpu_check put tools/ on the path)
import gpu_check_run as gr  # noqa: E402

PY = sys.executable


def junit(path: Path, cases: list[str]) -> Path:
    """A pytest-style junit file; each case is passed|failed|error|skipped[:reason]."""
    body = []
    for i, c in enumerate(cases):
        kind, _, why = c.partition(":")
        inner = {
            "passed": "",
            "failed": '<failure message="assert 0">trace</failure>',
            "error": '<error message="fixture broke">trace</error>',
            "skipped": f'<skipped type="pytest.skip" message="{why}">x</skipped>',
        }[kind]
        body.append(
            f'<testcase classname="tests.gpu.test_x" name="t{i}" time="0.1">{inner}</testcase>'
        )
    n = {k: sum(c.startswith(k) for c in cases) for k in ("failed", "error", "skipped")}
    path.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" '
        f'errors="{n["error"]}" failures="{n["failed"]}" skipped="{n["skipped"]}" '
        f'tests="{len(cases)}" time="1.0">{"".join(body)}</testsuite></testsuites>'
    )
    return path


def ctx(tmp_path: Path, device: bool, **kw) -> gc.Context:
    c = gc.Context(out=tmp_path, device=device, device_reason="test", **kw)
    c.deadline = time.monotonic() + 60
    return c


def test_parse_junit_counts_and_skip_reasons(tmp_path):
    path = junit(
        tmp_path / "r.xml",
        ["passed", "passed", "failed", "error", "skipped:no device", "skipped:no device"],
    )
    c = rp.parse_junit(path)
    assert (c["tests"], c["passed"], c["failed"], c["errors"], c["skipped"]) == (6, 2, 1, 1, 2)
    assert c["skip_reasons"] == ["2× no device"]
    assert len(c["not_passed"]) == 2


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("==== 3 passed, 2 skipped, 1 deselected in 1.23s ====", {"passed": 3, "skipped": 2}),
        ("1 failed, 2 passed, 1 error in 0.50s", {"failed": 1, "passed": 2, "errors": 1}),
        ("36/1200 tests collected (1164 deselected) in 17.0s", {"collected": 36}),
        ("no tests ran in 0.01s", {}),
        ("nothing that looks like a summary", None),
    ],
)
def test_parse_pytest_summary(text, want):
    got = rp.parse_pytest_summary("some output\n" + text + "\n")
    if want is None:
        assert got is None
    else:
        assert {k: got.get(k) for k in want} == want


@pytest.mark.parametrize(
    ("cases", "status", "words"),
    [
        (["skipped:needs a CUDA device", "skipped:needs a CUDA device"], "failed", "no gpu test"),
        ([], "failed", "no gpu test passed"),
        (["passed", "skipped:needs 2 GPUs"], "passed", "1 passed, 1 skipped"),
    ],
)
def test_a_gpu_run_counts_only_if_tests_passed(tmp_path, cases, status, words):
    res = gc.Result("gpu-tests", gc.PASSED, log=None)
    gc.judge_gpu_tests(res, ctx(tmp_path, True), junit(tmp_path / "g.xml", cases))
    assert res.status == status
    assert words in res.reason


def test_a_gpu_run_without_junit_falls_back_to_the_summary_line(tmp_path):
    log = tmp_path / "gpu-tests.log"
    log.write_text("....\n4 skipped in 2.00s\n")
    res = gc.Result("gpu-tests", gc.PASSED, log=str(log))
    gc.judge_gpu_tests(res, ctx(tmp_path, True), tmp_path / "absent.xml")
    assert res.status == gc.FAILED and res.figures["skipped"] == 4


def test_without_a_device_device_steps_are_skipped_and_the_run_exits_0(tmp_path, capsys):
    steps = [
        gc.Step("cpu-part", [PY, "-c", "print('host ok')"], timeout_s=30),
        gc.Step("device-part", [PY, "-c", "raise SystemExit(3)"], 30, needs_device=True),
    ]
    code = gc.main(["--out", str(tmp_path / "out"), "--device", "no"], steps=steps)
    assert code == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    got = {s["name"]: s for s in summary["steps"]}
    assert got["cpu-part"]["status"] == "passed"
    assert got["device-part"]["status"] == "skipped"
    assert "no CUDA device" in got["device-part"]["reason"]
    assert "host ok" in (tmp_path / "out" / got["cpu-part"]["log"]).read_text()
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| device-part | skipped |" in md
    out = capsys.readouterr().out
    assert "skipped: device-part" in out


def test_with_a_device_a_failed_step_fails_the_run_and_its_dependants(tmp_path):
    steps = [
        gc.Step("build", [PY, "-c", "raise SystemExit(2)"], timeout_s=30),
        gc.Step("tests", [PY, "-c", "pass"], timeout_s=30, needs_device=True, requires=("build",)),
    ]
    code = gc.main(["--out", str(tmp_path / "out"), "--device", "yes"], steps=steps)
    assert code == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    build, tests = summary["steps"]
    assert (build["status"], build["reason"], build["returncode"]) == ("failed", "exit status 2", 2)
    assert tests["status"] == "failed" and "build failed" in tests["reason"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for a reaper is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_step_over_its_timeout_is_killed_with_its_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid));"
        "time.sleep(60)"
    )
    step = gc.Step("slow", [PY, "-c", script], timeout_s=1.5)
    start = time.monotonic()
    res = gr.run_step(step, ctx(tmp_path, True))
    assert time.monotonic() - start < 10
    assert res.status == gc.FAILED and res.timed_out
    assert "timed out" in res.reason
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the step's child outlived the timeout"
    assert "process group killed" in Path(res.log).read_text()


def test_the_budget_caps_every_step(tmp_path):
    c = ctx(tmp_path, True)
    c.deadline = time.monotonic() + gr.RESERVE_S + 1  # less than a step needs
    res = gr.run_step(gc.Step("late", [PY, "-c", "pass"], timeout_s=30), c)
    assert res.status == gc.FAILED and "no time left" in res.reason


def test_a_missing_round_trip_test_fails_the_sanitizer_steps_as_missing(tmp_path):
    c = ctx(tmp_path, True, root=tmp_path)  # a tree without tests/gpu/test_device_roundtrip.py
    for tool in ("memcheck", "racecheck"):
        res = gr.run_step(gc.sanitizer_step(tool), c)
        assert res.status == gc.FAILED
        assert res.reason.startswith("missing")


def test_sanitizer_reports_are_summed_over_processes():
    text = (
        "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"
        "========= ERROR SUMMARY: 2 errors\n"
        "========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)\n"
    )
    got = rp.parse_sanitizer(text)
    assert got["processes_checked"] == 2 and got["sanitizer_errors"] == 2
    assert (got["race_hazards"], got["race_errors"], got["race_warnings"]) == (3, 1, 2)


@pytest.mark.parametrize(("device", "status"), [(False, "skipped"), (True, "failed")])
def test_a_gpu_bench_row_that_did_not_run(tmp_path, device, status):
    c = ctx(tmp_path, device)
    c.path("x").parent.mkdir(parents=True, exist_ok=True)
    c.path("vs_deepep.json").write_text(json.dumps({"gpu_row": {"not_run": "no CUDA device"}}))
    res = gc.Result("bench", gc.PASSED)
    gc.judge_bench(res, c)
    assert res.status == status and "no CUDA device" in res.reason


def test_pack_leaves_the_summaries_and_one_archive(tmp_path):
    out = tmp_path / "out"
    steps = [gc.Step("a", [PY, "-c", "print('x')"], timeout_s=30)]
    assert gc.main(["--out", str(out), "--device", "no", "--pack"], steps=steps) == 0
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "summary.json", "summary.md"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "logs/a.log" in tar.getnames()


def test_the_default_steps_cover_the_brief(tmp_path):
    no_dev = gc.default_steps(ctx(tmp_path, False))
    names = [s.name for s in no_dev]
    for want in ("build", "env", "import", "gpu-collect", "gpu-tests", "bench"):
        assert want in names
    assert {"sanitizer-memcheck", "sanitizer-racecheck", "host-tests"} <= set(names)
    by = {s.name: s for s in no_dev}
    assert by["gpu-tests"].needs_device and by["sanitizer-memcheck"].needs_device
    assert by["gpu-tests"].env["MOECOMM_REQUIRE_GPU"] == "1"
    dev = gc.default_steps(ctx(tmp_path, True))
    assert [s.name for s in dev][:3] == ["env", "setup", "build"]
    build = next(s for s in dev if s.name == "build")
    assert build.env["MOECOMM_WITH_CUDA"] == "ON" and "-e" in build.cmd


def test_a_gpu_test_file_whose_module_cannot_be_carried_is_left_out_and_said(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "UNCARRIED", [("tests/x.py", "no_such_module_4711", "too big")])
    c = ctx(tmp_path, True)
    assert gc._left_out(c, PY) == ["--ignore=tests/x.py"]
    res = gc.Result("gpu-tests", gc.PASSED)
    gc.judge_gpu_tests(res, c, junit(tmp_path / "g.xml", ["passed"]))
    assert res.status == gc.PASSED
    assert "left out: tests/x.py: no_such_module_4711 not importable (too big)" in res.reason
    monkeypatch.setattr(gc, "UNCARRIED", [("tests/y.py", "json", "")])
    assert gc._left_out(ctx(tmp_path, True), PY) == []


def test_a_rerun_replaces_its_own_files_and_nothing_else(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("not ours")
    steps = [gc.Step("a", [PY, "-c", "print('x')"], timeout_s=30)]
    for _ in range(2):
        assert gc.main(["--out", str(out), "--device", "no"], steps=steps) == 0
    assert (out / "keep.txt").read_text() == "not ours"
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["a.log"]
