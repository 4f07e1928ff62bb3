"""tools/gpu_check.py on a machine without a GPU: the plan fits the device budget, how it reads
pytest's and compute-sanitizer's reports (also what a killed pytest leaves), what it does with no
device, a stage over its budget, files a stage had no time for, the build's reuse, the preflight's
verdict, one pytest per DeepEP scenario, what it writes as it goes, a test file resumed after
the test that crashed its pytest (real pytest runs over synthetic files that segfault and
hang), and tools/gpu_triage.sh's per-test verdicts. A fake Python (a tiny
script that answers like pytest, pip and the import check) stands in for the real commands;
nothing here needs a device or builds anything, and it all takes seconds."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
gc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gc  # dataclasses look their module up by name
_spec.loader.exec_module(gc)
import gpu_check_files as gf  # noqa: E402
import gpu_check_machine as gm  # noqa: E402
import gpu_check_plan as gp  # noqa: E402
import gpu_check_reports as rp  # noqa: E402  (importable once gpu_check put tools/ on the path)
import gpu_check_run as gr  # noqa: E402
import gpu_check_stages as gs  # noqa: E402
import gpu_check_summary as gsum  # noqa: E402

PY = sys.executable

# Answers like the commands the stages run: `-c <import check>`, `-m pip ...`, and `-m pytest`
# over a "file" whose name says what to do (fail, hang, hang_noint: SIGINT ignored, peek: copy
# the summary as it is while this file runs).
FAKE_PYTHON = textwrap.dedent(
    """\
    #!{python}
    import json, os, shutil, signal, sys, time
    args = sys.argv[1:]
    if os.environ.get("FAKE_ARGS_LOG"):
        with open(os.environ["FAKE_ARGS_LOG"], "a") as f:
            keep = ("MOECOMM_DEVICE_DEADLINE_SCALE", "CUDA_LAUNCH_BLOCKING", "MOECOMM_REQUIRE_GPU")
            env = {{k: os.environ.get(k) for k in keep}}
            f.write(json.dumps({{"argv": args, "env": env}}) + "\\n")
    if args[:1] == ["-c"]:
        info = dict(built_cuda=True, built_nvshmem=True, available=True, device_count=1,
                    why_unavailable=None, torch="2.11", torch_cuda_available=True, moecomm="m")
        print("GPU-CHECK-IMPORT " + json.dumps(info))
        sys.exit(0)
    if args[:2] == ["-m", "pip"]:
        print("Successfully installed moecomm-0.1.0")
        sys.exit(0)
    if args[:2] != ["-m", "pytest"]:
        sys.exit(3)
    junit = next(a.split("=", 1)[1] for a in args if a.startswith("--junitxml="))
    target = next(a for a in args[2:] if ".py" in a and not a.startswith("-"))

    def write(failed=False):
        cases = "".join(
            f'<testcase classname="x" name="t{{i}}" time="0.1"/>' for i in (1, 2))
        if failed:
            cases += '<testcase classname="x" name="t3"><failure message="boom"/></testcase>'
        with open(junit, "w") as f:
            f.write(f'<testsuites><testsuite name="pytest">{{cases}}</testsuite></testsuites>')

    print(f"{{target}}::t1 PASSED  [ 33%]")
    print(f"{{target}}::t2 PASSED  [ 66%]", flush=True)
    if "fail" in target:
        print(f"{{target}}::t3 FAILED  [100%]")
        write(failed=True)
        print("1 failed, 2 passed in 0.10s")
        sys.exit(1)
    if "peek" in target:
        shutil.copy(os.environ["FAKE_PEEK_SRC"], os.environ["FAKE_PEEK_DST"])
    if "hang" in target:
        if "noint" in target:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        else:  # like pytest: on SIGINT it still writes its junit
            signal.signal(signal.SIGINT, lambda *_: (write(), sys.exit(2)))
        time.sleep(60)
    write()
    print("2 passed in 0.10s")
    """
)


@pytest.fixture
def fake_python(tmp_path) -> str:
    path = tmp_path / "fakebin" / "python"
    path.parent.mkdir()
    path.write_text(FAKE_PYTHON.format(python=PY))
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def fast(monkeypatch):
    """The runner's margins shrunk, so that budgets of a few seconds behave as real ones do."""
    for name, value in {
        "MIN_RUN_S": 0.3,
        "SIGINT_GRACE_S": 0.5,
        "SIGTERM_GRACE_S": 0.5,
        "KILL_GRACE_S": 1.0,
        "PYTEST_MARGIN_S": 0.5,
    }.items():
        monkeypatch.setattr(gr, name, value)


def make_ctx(tmp_path: Path, device: bool, python: str = PY, **kw) -> gr.Context:
    out = tmp_path / "out"
    c = gr.Context(out=out, device=device, device_reason="test", python=python, **kw)
    c.root = kw.get("root", tmp_path)
    c.deadline = time.monotonic() + 60
    return c


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


# ---------------------------------------------------------------------------------------------
# The plan


def test_the_plan_fits_the_device_budget():
    """Call 1 within 7 minutes, call 2 within 4, both within 11 of the 15 minutes of device time
    (the rest: the machine's start and the gap between the calls); the limits are written here,
    not read from the module, so that a budget raised there fails."""
    call1, call2 = gp.stage_total(gp.PLAN[1]), gp.stage_total(gp.PLAN[2])
    assert call1 <= 420, f"call 1 takes {call1:.0f} s of its 420"
    assert call2 <= 240, f"call 2 takes {call2:.0f} s of its 240"
    assert call1 + call2 <= 660, f"the two calls take {call1 + call2:.0f} s of 660"
    assert gp.stage_total(gp.plain_budgets()) <= 600  # the plain run: one command
    assert gp.plan_problems() == []
    # Each stage in a call has a budget (and overhead) counted.
    assert call1 >= sum(gp.PLAN[1].values()) + len(gp.PLAN[1]) * gr.STAGE_OVERHEAD_S
    # The diagnostic first after the build, the never-verdicted files before the passed ones.
    assert list(gp.PLAN[1]) == ["preflight", "build", "joinleave", "core", "smoke", "regress"]
    assert gp.PLAN[1]["joinleave"] <= 60  # one minute of device time
    assert {"deepep", "bench", "sanitizer"} <= set(gp.PLAN[2])
    assert gp.PLAN[2]["build"] <= 30  # reused, not built again
    assert set(gp.PLAIN_STAGES) == set(gp.STAGE_ORDER) - {"racecheck"}


def test_every_gpu_test_file_is_in_a_stage_with_a_cap_that_fits_it():
    """The files the check discovers (the gpu marker, as the core stage finds them) are each in
    one stage of one call, with a cap; a stage's caps add up to no more than its budget, so
    every file gets its cap; the passed files run after the never-verdicted ones."""
    found = gf.discover_gpu_files(ROOT)
    assert found, "no gpu-marked test file found"
    assert gp.plan_problems(found) == []
    for f in found:
        stage = gp.stage_of(f)
        assert stage is not None, f"{f} is in no stage"
        assert gp.call_of(stage) is not None, f"{f}: stage {stage} is in no call"
    for stage, files in gp.STAGE_FILES.items():
        assert sum(files.values()) <= gp.PLAN[gp.call_of(stage)][stage], stage
    passed_before = {
        "tests/ops/test_device_dispatch.py",
        "tests/ops/test_reorg.py",
        "tests/serving/model/test_model.py",
        gs.SMOKE_TEST,
    }
    assert passed_before.isdisjoint(gp.STAGE_FILES["core"])
    order = list(gp.PLAN[1])
    for f in passed_before:
        assert order.index(gp.stage_of(f)) > order.index("core"), f
    # The engine tests run only where their environment is (a machine skip otherwise).
    assert gp.ENGINES_TEST in gp.CONDITIONAL_FILES
    assert gp.ENGINES_TEST in {path for path, _, _ in gm.UNCARRIED}


def _constants(path: Path) -> dict:
    """The module-level constants of a test helper, read without importing it (torch)."""
    import ast

    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def test_the_deepep_scenarios_fit_their_stage_core_ones_first():
    """The rank set-up and every scenario's cap, plus the file's margin, fit the deepep file's
    cap: a scenario that hangs costs its own cap, and the ones after it still run."""
    procs = _constants(ROOT / "tests/compat/deep_ep_cuda_procs.py")
    test = _constants(ROOT / gs.DEEPEP_TEST)
    caps = procs["SCENARIO_TIMEOUT_S"]
    need = procs["SETUP_TIMEOUT_S"] + sum(caps.values()) + test["TIMEOUT_MARGIN_S"]
    assert need <= gp.STAGE_FILES["deepep"][gs.DEEPEP_TEST], need
    names = list(caps)
    first_contract = min(i for i, n in enumerate(names) if n.startswith("contract_"))
    assert all(n.startswith("contract_") for n in names[first_contract:]), names


def test_a_new_gpu_file_in_no_stage_fails_the_plan_and_still_runs(tmp_path, capsys):
    found = [*gf.discover_gpu_files(ROOT), "tests/gpu/test_brand_new_gpu.py"]
    problems = gp.plan_problems(found)
    assert problems == [
        "tests/gpu/test_brand_new_gpu.py: a gpu test file in no stage (gpu_check_plan.STAGE_FILES)"
    ]
    assert "UNPLANNED" in gp.plan_text(found)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_new_gpu.py").write_text(
        "import pytest\npytestmark = pytest.mark.gpu\n"
    )
    assert gf.stage_files(tmp_path, "core") == [("tests/test_new_gpu.py", gp.UNPLANNED_CAP_S)]
    # A planned file that is gone is named too.
    gone = [f for f in found if f != "tests/ops/test_reorg.py"]
    assert any("tests/ops/test_reorg.py: planned" in p for p in gp.plan_problems(gone))


def test_a_call_that_no_longer_fits_is_named(monkeypatch):
    monkeypatch.setitem(gp.STAGE_FILES["core"], "tests/gpu/test_ipc_gpu.py", 300.0)
    problems = gp.plan_problems()
    assert any("stage core: its files' caps" in p for p in problems)
    monkeypatch.setitem(gp.PLAN, 1, {**gp.PLAN[1], "core": 475.0})
    assert any(p.startswith("call 1:") for p in gp.plan_problems())


def test_a_plan_that_does_not_fit_is_named(monkeypatch, capsys):
    monkeypatch.setitem(gp.PLAN, 2, {**gp.PLAN[2], "deepep": 400.0})
    problems = gp.plan_problems()
    assert any(p.startswith("call 2") for p in problems)
    assert any("two calls" in p for p in problems)
    assert gc.main(["--plan"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_the_plan_prints_each_call_with_its_total_and_every_file_with_its_cap(capsys):
    assert gc.main(["--plan"]) == 0
    out = capsys.readouterr().out
    assert "call 1: make gpu-check CALL=1" in out and "call 2: make gpu-check CALL=2" in out
    assert out.count("fits (<= ") == 4  # two calls, both together, the plain run
    for f in gf.discover_gpu_files(ROOT):
        (line,) = [ln for ln in out.splitlines() if ln.strip().startswith(f + " ")]
        assert "cap" in line, line
    assert "machine skip" in next(ln for ln in out.splitlines() if gp.ENGINES_TEST in ln)


def test_unused_stage_time_flows_to_the_next_stage():
    """Stage k ends at the run's start plus the budgets of stages 1..k: a stage that finishes
    early leaves its time to the next, one that overruns is cut where the plan says."""
    ends = gr.planned_ends(100.0, [10.0, 20.0, 30.0])
    o = gr.STAGE_OVERHEAD_S
    assert ends == [110.0 + o, 130.0 + 2 * o, 160.0 + 3 * o]


def test_a_stage_gets_what_the_stage_before_it_left(tmp_path, fake_python, fast):
    """Two stages of 4 s each: the first takes about 1 s, so the second may run ~7 s."""
    given = {}

    def quick(run):
        time.sleep(1.0)
        run.res.status = rp.PASSED

    def second(run):
        given["left"] = run.left()
        run.res.status = rp.PASSED

    ctx = make_ctx(tmp_path, True, python=fake_python)
    plan = [(gr.Stage("one", quick), 4.0), (gr.Stage("two", second), 4.0)]
    results = gr.run_stages(plan, ctx)
    assert [r.status for r in results] == [rp.PASSED, rp.PASSED]
    assert given["left"] > 5.5, given  # its 4 s plus most of the 3 s the first left
    assert results[1].figures["time_given_s"] > 5.5


@pytest.mark.parametrize(
    ("call", "only", "device", "names"),
    [
        (1, None, True, ["preflight", "build", "joinleave", "core", "smoke", "regress"]),
        (2, None, True, ["preflight", "build", "deepep", "bench", "sanitizer"]),
        (None, ["smoke"], True, ["preflight", "build", "smoke"]),
        (None, ["smoke", "core"], True, ["preflight", "build", "core", "smoke"]),
        (None, ["preflight", "host"], False, ["preflight", "host"]),
        (None, ["smoke"], False, ["smoke"]),  # skipped here: the build need not run
        (None, None, False, list(gp.PLAIN_STAGES)),
        (None, None, True, list(gp.PLAIN_DEVICE_STAGES)),
    ],
)
def test_which_stages_a_run_selects(call, only, device, names):
    chosen, limit, _ = gp.select(call, only, device, gs.all_stages())
    assert [n for n, _ in chosen] == names
    if call and device:
        assert limit == gp.CALL_LIMITS_S[call]
        assert dict(chosen) == gp.PLAN[call]
    if not device:
        assert limit == gp.NO_DEVICE_LIMIT_S  # no device time spent: make build, host tests


def test_an_unknown_stage_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown stage"):
        gp.select(None, ["smok"], True, gs.all_stages())
    assert gc.main(["--out", str(tmp_path), "--only", "smok", "--device", "no"]) == 2


# ---------------------------------------------------------------------------------------------
# Reading reports


def test_parse_junit_counts_and_skip_reasons(tmp_path):
    path = junit(
        tmp_path / "r.xml",
        ["passed", "passed", "failed", "error", "skipped:no device", "skipped:no device"],
    )
    c = rp.parse_junit(path)
    assert (c["tests"], c["passed"], c["failed"], c["errors"], c["skipped"]) == (6, 2, 1, 1, 2)
    assert c["skip_reasons"] == ["2× no device"]
    assert len(c["not_passed"]) == 2
    assert c["first_failure"] == "assert 0"


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


def test_the_progress_lines_of_a_killed_pytest_give_its_counts():
    text = (
        "tests/a.py::test_x[1] PASSED                                   [ 20%]\n"
        "tests/a.py::test_x[2] FAILED                                   [ 40%]\n"
        "tests/a.py::test_y SKIPPED (needs 2 GPUs)                      [ 60%]\n"
        "tests/a.py::test_z PASSED                                      [ 80%]\n"
        "tests/a.py::test_z ERROR                                       [ 80%]\n"
        "tests/a.py::test_hangs \n"
        "[gpu-check] timed out after 40 s: process group killed\n"
    )
    got = rp.parse_pytest_progress(text)
    assert (got["passed"], got["failed"], got["skipped"], got["errors"]) == (2, 1, 1, 1)
    assert got["tests"] == 4
    assert rp.parse_pytest_progress("collecting ...\n") is None


def test_progress_lines_and_junit_agree_on_a_real_pytest_run(tmp_path):
    (tmp_path / "test_mini.py").write_text(
        "import pytest\n"
        "def test_a(): pass\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_b(n): assert n == 1\n"
        "def test_c(): pytest.skip('no device')\n"
    )
    xml = tmp_path / "r.xml"
    junit_opt = [f"--junitxml={xml}", "-o", "addopts="]
    out = subprocess.run(
        [PY, "-m", "pytest", "-v", "-rA", "-p", "no:cacheprovider", "test_mini.py", *junit_opt],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    from_lines, from_junit = rp.parse_pytest_progress(out), rp.parse_junit(xml)
    for k in ("passed", "failed", "skipped", "errors", "tests"):
        assert from_lines[k] == from_junit[k], k
    assert (from_junit["passed"], from_junit["failed"], from_junit["skipped"]) == (2, 1, 1)


def test_slug_of_a_test_file():
    assert rp.slug("tests/ops/test_reorg.py") == "ops_test_reorg"


def test_sanitizer_reports_are_summed_over_processes():
    text = (
        "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"
        "========= ERROR SUMMARY: 2 errors\n"
        "========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)\n"
    )
    got = rp.parse_sanitizer(text)
    assert got["processes_checked"] == 2 and got["sanitizer_errors"] == 2
    assert (got["race_hazards"], got["race_errors"], got["race_warnings"]) == (3, 1, 2)


# ---------------------------------------------------------------------------------------------
# Running stages


def test_without_a_device_device_stages_are_skipped_and_the_run_exits_0(tmp_path, capsys):
    def cpu(run):
        r = run.command([PY, "-c", "print('host ok')"], label="host part")
        run.res.status, run.res.reason = rp.PASSED, r.output.strip().splitlines()[-1]

    stages = [
        gr.Stage("cpu-part", cpu),
        gr.Stage("device-part", lambda run: 1 / 0, needs_device=True),
    ]
    code = gc.main(["--out", str(tmp_path / "out"), "--device", "no"], stages=stages)
    assert code == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    got = {s["name"]: s for s in summary["stages"]}
    assert got["cpu-part"]["status"] == "passed"
    assert got["device-part"]["status"] == "skipped"
    assert got["device-part"]["reason"].startswith("[machine] no CUDA device")
    assert "host ok" in (tmp_path / "out" / got["cpu-part"]["log"]).read_text()
    assert summary["complete"] and summary["exit_code"] == 0
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| device-part | skipped |" in md
    assert "skipped: device-part" in capsys.readouterr().out


def test_a_failed_stage_blocks_what_needs_it_and_fails_the_run(tmp_path):
    def fail(run):
        step = run.command([PY, "-c", "raise SystemExit(2)"], label="x")
        gs.step_ok(run, step, "the build")

    stages = [
        gr.Stage("build", fail),
        gr.Stage("tests", lambda run: None, needs_device=True, requires=("build",)),
        gr.Stage("other", lambda run: setattr(run.res, "status", rp.PASSED)),
    ]
    code = gc.main(["--out", str(tmp_path / "out"), "--device", "yes"], stages=stages)
    assert code == 1
    build, tests, other = json.loads((tmp_path / "out" / "summary.json").read_text())["stages"]
    assert build["status"] == "failed" and build["reason"].startswith("the build: exit status 2")
    assert gr.exit_text(-11) == "killed by SIGSEGV"
    assert tests["status"] == "not-run" and "stage build failed" in tests["reason"]
    assert other["status"] == "passed"  # what does not need the build still runs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for a reaper is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_stage_over_its_budget_is_killed_with_its_children_and_the_next_runs(tmp_path, fast):
    pidfile = tmp_path / "child.pid"
    script = (
        "import signal, subprocess, sys, time;"
        "signal.signal(signal.SIGINT, signal.SIG_IGN);"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid));"
        "time.sleep(60)"
    )

    def slow(run):
        gs.step_ok(run, run.command([PY, "-c", script], label="slow"), "slow")

    ctx = make_ctx(tmp_path, True)
    start = time.monotonic()
    res = gr.run_stage(gr.Stage("slow", slow), 2.5, ctx)
    assert time.monotonic() - start < 6
    assert res.status == rp.FAILED and "killed by the stage timeout" in res.reason
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the stage's child outlived its budget"
    assert "process group killed" in ctx.path("slow.log").read_text()
    after = gr.run_stage(gr.Stage("next", lambda run: setattr(run.res, "status", "passed")), 5, ctx)
    assert after.status == rp.PASSED


def test_files_report_as_they_come_killed_ones_with_what_ran(tmp_path, fake_python, fast):
    """One pytest per file; the summary is rewritten after each; a file killed by its timeout
    still reports what had finished (from its junit, written on SIGINT, or else from its -v
    lines); the files left when the stage's budget is spent are "not run"."""
    ctx = make_ctx(tmp_path, True, python=fake_python)
    os.environ["FAKE_PEEK_SRC"] = str(ctx.out / "summary.json")
    os.environ["FAKE_PEEK_DST"] = str(tmp_path / "peek.json")
    try:

        def body(run):
            run.pytest_file("tests/ok.py", ["tests/ok.py"])
            run.pytest_file("tests/peek.py", ["tests/peek.py"])
            run.pytest_file("tests/fail.py", ["tests/fail.py"])
            run.pytest_file("tests/hang.py", ["tests/hang.py"], cap=1.0)
            run.pytest_file("tests/hang_noint.py", ["tests/hang_noint.py"])
            run.pytest_file("tests/late.py", ["tests/late.py"])

        res = gr.run_stage(gr.Stage("core", body, require_pass=True), 5.0, ctx)
    finally:
        del os.environ["FAKE_PEEK_SRC"], os.environ["FAKE_PEEK_DST"]
    rows = {f.name: f for f in res.files}
    assert rows["tests/ok.py"].status == rp.PASSED and rows["tests/ok.py"].passed == 2
    assert rows["tests/ok.py"].junit == "junit/core.ok.xml"
    assert (rows["tests/fail.py"].status, rows["tests/fail.py"].failed) == (rp.FAILED, 1)
    hang = rows["tests/hang.py"]
    assert hang.killed and hang.reason.startswith("killed by its 1 s timeout")
    assert (hang.passed, hang.counts_from) == (2, "junit")
    noint = rows["tests/hang_noint.py"]
    assert noint.killed and noint.reason.startswith("killed by the stage timeout after")
    assert (noint.passed, noint.counts_from, noint.junit) == (2, "output", None)
    assert "2 passed, 0 failed" in noint.reason
    assert rows["tests/late.py"].status == rp.NOT_RUN
    assert rows["tests/late.py"].reason == "not run: stage budget spent"
    assert res.status == rp.FAILED and "3 of 6 failed" in res.reason and "1 not run" in res.reason
    # While peek.py ran, the summary already held ok.py's row.
    peek = json.loads((tmp_path / "peek.json").read_text())
    assert peek["in_progress"] == "core" and not peek["complete"]
    assert [f["name"] for f in peek["stages"][0]["files"]] == ["tests/ok.py"]
    md = gsum.summary_markdown(gsum.summary_data(ctx, 1))
    assert "| core | tests/hang_noint.py | failed | 2 | 0 | 0 | 0 |" in md
    assert "not run: stage budget spent" in md


def test_a_stage_the_call_has_no_time_for_is_not_run(tmp_path):
    ctx = make_ctx(tmp_path, True)
    ctx.deadline = time.monotonic() + 1
    res = gr.run_stage(gr.Stage("late", lambda run: 1 / 0), 30, ctx)
    assert (res.status, res.reason) == (rp.NOT_RUN, "not run: call budget spent")


def test_on_a_device_a_stage_where_nothing_passed_fails(tmp_path):
    res = gr.Result("smoke")
    res.files = [gr.FileResult("smoke", "a.py", rp.SKIPPED, "all 2 skipped", tests=2, skipped=2)]
    gr.settle_from_files(res, require_pass=True)
    assert res.status == rp.FAILED and "no gpu test passed" in res.reason
    res = gr.Result("host", files=list(res.files))
    gr.settle_from_files(res, require_pass=False)
    assert res.status == rp.PASSED


def test_pack_leaves_the_summaries_and_two_archives(tmp_path, fake_python, monkeypatch):
    monkeypatch.setattr(gs, "test_python", lambda root, device: fake_python)
    monkeypatch.setattr(gc, "test_python", lambda root, device: fake_python)
    out = tmp_path / "out"
    stages = [gr.Stage("core", lambda run: run.pytest_file("tests/a.py", ["tests/a.py"]))]
    assert gc.main(["--out", str(out), "--device", "yes", "--pack"], stages=stages) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["junit.tar.gz", "logs.tar.gz", "summary.json", "summary.md"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "logs/core.log" in tar.getnames()
    with tarfile.open(out / "junit.tar.gz") as tar:
        assert "junit/core.a.xml" in tar.getnames()


def test_a_rerun_replaces_its_own_files_and_nothing_else(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("not ours")

    def body(run):
        run.command([PY, "-c", "print('x')"], label="x")
        run.res.status = rp.PASSED

    for _ in range(2):
        assert gc.main(["--out", str(out), "--device", "no"], stages=[gr.Stage("a", body)]) == 0
    assert (out / "keep.txt").read_text() == "not ours"
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["a.log"]
    assert (out / "logs" / "a.log").read_text().count("$ ") == 1


# ---------------------------------------------------------------------------------------------
# The stages


def _tree(root: Path, python: str) -> None:
    for rel, text in {
        "csrc/a.cc": "int a;",
        "bindings/b.cc": "int b;",
        "cmake/F.cmake": "#",
        "CMakeLists.txt": "project(x)",
        "pyproject.toml": "[project]",
        "tools/gpu-requirements.txt": "pytest>=8\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    venv_py = root / gm.GPU_VENV / "bin" / "python"
    venv_py.parent.mkdir(parents=True)
    venv_py.symlink_to(python)


def test_the_build_stamp_follows_the_inputs_and_the_python(tmp_path):
    _tree(tmp_path, PY)
    assert gm.build_current(tmp_path, PY) == (
        False,
        "no build stamp (the last build did not finish)",
    )
    gm.write_stamp(tmp_path, PY)
    assert gm.build_current(tmp_path, PY)[0]
    assert not gm.build_current(tmp_path, "/usr/bin/false")[0]  # another Python
    (tmp_path / "csrc" / "a.cc").write_text("int a = 1;")
    assert gm.build_current(tmp_path, PY) == (False, "the build's inputs or its Python changed")


def test_the_build_runs_once_and_is_reused_on_a_warm_machine(tmp_path, fake_python, fast):
    _tree(tmp_path, fake_python)
    ctx = make_ctx(tmp_path, True, python=str(tmp_path / gm.GPU_VENV / "bin" / "python"))
    ctx.base_python = PY
    stage = gs.all_stages()["build"]
    first = gr.run_stage(stage, 15.0, ctx)  # call 2's budget, but nothing to reuse
    assert first.status == rp.PASSED, first.reason
    assert first.figures["reused"] is False and first.reason.startswith("built in")
    assert first.budget_s == gs.BUILD_FULL_S and "not reused" in first.figures["budget_extended"]
    assert gm.stamp_path(tmp_path).exists()
    log = ctx.path("build.log").read_text()
    assert "MOECOMM_WITH_CUDA=ON" in log and "-e ." in log
    again = gr.run_stage(stage, 15.0, ctx)
    assert again.status == rp.PASSED and again.reason.startswith("reused: the build is current")
    assert again.budget_s == 15.0


def _probe_info(**changes) -> dict:
    info = {
        "python": "3.12.3",
        "gpu_count": 1,
        "gpus": [{"name": "NVIDIA H100 80GB HBM3", "driver": "580.159.04"}],
        "driver": "580.159.04",
        "driver_cuda": "13.0",
        "compute_mode": "Default",
        "nvidia_smi": "/usr/bin/nvidia-smi",
        "mps": "off",
        "venv_pip": "ensurepip (bundled pip 24.0)",
        "scikit_build_core": "0.11.1",
        "pybind11": "2.13.6",
        "cmake": {"path": "/usr/bin/cmake", "version": "3.31.6"},
        "ninja": {"path": "/usr/bin/ninja", "version": "1.11.1"},
        "nvshmem": "wheel /x/nvidia/nvshmem",
        "triton": "3.6.0",
        "torch": "2.11.0+cu130",
        "torch_cuda": "13.0",
        "torch_cuda_available": True,
        "nvcc": {"path": "/usr/local/cuda/bin/nvcc", "version": "13.0.48"},
        "compute_sanitizer": "/usr/local/cuda/bin/compute-sanitizer",
        "test_requirements_missing": ["fastapi"],
        "test_requirements_uncarried": [],
    }
    info.update(changes)
    return info


def test_preflight_fails_fast_in_one_line_naming_what_is_missing():
    status, reason, _ = gm.judge_preflight(_probe_info(), device=True)
    assert status == rp.PASSED and reason.startswith("nothing missing; 1× NVIDIA H100")
    assert "MPS off" in reason and "pip: ensurepip" in reason
    status, reason, _ = gm.judge_preflight(
        _probe_info(nvcc={"path": None}, nvshmem=None, compute_sanitizer=None, venv_pip=None),
        device=True,
    )
    assert status == rp.FAILED and "\n" not in reason
    assert reason.startswith(
        "missing: pip (no ensurepip and no pip in this Python), nvidia.nvshmem"
    )
    assert "nvcc" in reason and "compute-sanitizer" in reason and "not building" in reason
    status, reason, _ = gm.judge_preflight(_probe_info(torch_cuda=None), device=True)
    assert status == rp.FAILED and "torch with CUDA" in reason
    status, reason, _ = gm.judge_preflight(
        _probe_info(test_requirements_uncarried=["fastapi"]), device=True
    )
    assert status == rp.FAILED and "make gpu-wheels" in reason
    # Without a device nothing is missing enough to stop: make build installs .venv's.
    status, reason, _ = gm.judge_preflight(_probe_info(nvcc={"path": None}), device=False)
    assert status == rp.PASSED and reason.startswith("missing: nvcc")


def test_preflight_records_the_kernel_and_whether_the_sanitizer_opens_the_device():
    info = _probe_info(
        uname_r="4.4.0",
        uname_v="#1 SMP Sun Jan 10 15:06:54 PST 2016",
        sanitizer_device=False,
        sanitizer_device_why="exit 1: ========= Error: Target application terminated",
    )
    status, reason, figures = gm.judge_preflight(info, device=True)
    assert status == rp.PASSED  # the sanitizer is not a build requirement
    assert "kernel 4.4.0" in reason and "compute-sanitizer cannot open the device" in reason
    assert figures["uname_r"] == "4.4.0" and figures["sanitizer_device"] is False
    # The probe itself records the kernel from the standard library alone.
    probe = gs.TOOLS / "gpu_check_probe.py"
    spec = importlib.util.spec_from_file_location("gpu_check_probe_t", probe)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.kernel()["uname_r"] == os.uname().release
    assert mod.sanitizer_device(None, 1)["sanitizer_device"] is None
    assert mod.sanitizer_device("/bin/true", 0)["sanitizer_device"] is None


def test_a_sanitizer_that_cannot_open_the_device_skips_its_stage_for_the_machine(tmp_path):
    (tmp_path / gs.SMOKE_TEST).parent.mkdir(parents=True)
    (tmp_path / gs.SMOKE_TEST).write_text("")
    ctx = make_ctx(tmp_path, True)
    pre = gr.Result("preflight", status=rp.PASSED)
    pre.figures.update(uname_r="4.4.0", sanitizer_device=False, sanitizer_device_why="refused")
    ctx.results["preflight"] = pre
    res = gr.run_stage(gs.all_stages()["sanitizer"], 20.0, ctx)
    assert res.status == rp.SKIPPED
    assert res.reason.startswith("[machine] compute-sanitizer cannot open the device")
    assert "4.4.0" in res.reason and "refused" in res.reason
    assert gsum.exit_code_of([pre, res]) == 0


@pytest.mark.parametrize(
    ("rows", "status", "words"),
    [
        ([{"name": "cold", "status": "OK"}, {"name": "warm", "status": "OK"}], rp.PASSED, "all 2"),
        (
            [{"name": "cold", "status": "TIMEOUT"}, {"name": "warm", "status": "OK"}],
            rp.FAILED,
            "1 of 2 variants did not see the put: cold",
        ),
        ([], rp.FAILED, "no variant ran"),
    ],
)
def test_the_join_leave_diagnostic_is_judged_by_its_variants(rows, status, words):
    res = gr.Result("joinleave")
    gs.judge_joinleave(res, {"variants": [{**r, "line": r["name"]} for r in rows]})
    assert res.status == status and words in res.reason
    assert res.figures["joinleave"] == [r["name"] for r in rows]


def test_the_join_leave_diagnostic_formats_what_the_test_lost():
    spec = importlib.util.spec_from_file_location("jl_diag", ROOT / gs.JOINLEAVE_SCRIPT)
    diag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diag)
    row = {
        "name": "cold", "status": "TIMEOUT", "observed": 0, "want": 11, "elapsed_s": 4.002,
        "word": 11, "payload_ok": True, "connected_s": 0.8, "put_start_s": 0.9,
        "put_done_s": 4.1, "peer_started_s": -0.5, "peer_ready_s": 0.2,
    }  # fmt: skip
    line = diag.format_row(row)
    for part in ("status=TIMEOUT", "observed=0x0 (want 0xb)", "elapsed=4.002s",
                 "word=0xb payload=ok", "connected=+0.800s", "put returned=+4.100s"):  # fmt: skip
        assert part in line, (part, line)
    assert diag.verdict([row]) == 1 and diag.verdict([{**row, "status": "OK"}]) == 0
    assert diag.peer_env("eager") == {
        "MOECOMM_PRELOAD_KERNELS": "0",
        "CUDA_MODULE_LOADING": "EAGER",
    }
    assert diag.peer_env("warm") == {"MOECOMM_PRELOAD_KERNELS": "1"}
    with pytest.raises(SystemExit):
        diag.parse_args(["--variants", "cold,lukewarm"])


def test_the_probe_runs_with_the_standard_library_alone(tmp_path):
    """-I -S: no site-packages at all, as on a machine where nothing is installed yet."""
    args = ["--requirements", str(ROOT / gm.REQUIREMENTS), "--wheels", str(tmp_path)]
    out = subprocess.run(
        [PY, "-I", "-S", str(ROOT / "tools" / "gpu_check_probe.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    info = gm.json_line(out, "GPU-CHECK-PREFLIGHT")
    assert info is not None and info["python"] == sys.version.split()[0]
    assert info["torch"].startswith("not importable")
    assert "pytest" in info["test_requirements_uncarried"]
    status, reason, _ = gm.judge_preflight(info, device=True)
    assert status == rp.FAILED and "torch" in reason and "\n" not in reason


def test_core_finds_its_files_by_the_gpu_marker():
    assert gf.uses_gpu_marker("import pytest\npytestmark = [pytest.mark.gpu]\n")
    assert gf.uses_gpu_marker("from pytest import mark\n@mark.gpu\ndef test_x(): pass\n")
    assert not gf.uses_gpu_marker("TEXT = 'pytestmark = pytest.mark.gpu'  # mark.gpu\n")
    found = gf.discover_gpu_files(ROOT)
    assert "tests/tools/test_gpu_check.py" not in found  # it only writes the marker into strings
    assert "tests/gpu/test_device_roundtrip.py" in found and gs.DEEPEP_TEST in found
    assert "tests/gpu/test_gpu_host.py" not in found  # no gpu marker in it
    core = gf.core_files(ROOT)
    assert gs.DEEPEP_TEST not in core and gs.SMOKE_TEST not in core
    assert "tests/wire/test_nixl_tensors.py" in core and gp.ENGINES_TEST in core
    assert "tests/ops/test_reorg.py" in [f for f, _ in gf.stage_files(ROOT, "regress")]


def test_a_file_whose_module_cannot_be_carried_is_left_out_and_said(
    tmp_path, monkeypatch, fake_python, fast
):
    (tmp_path / "tests").mkdir()
    for name in ("x_gpu", "y_gpu"):
        (tmp_path / "tests" / f"test_{name}.py").write_text(
            "import pytest\npytestmark = pytest.mark.gpu\n"
        )
    monkeypatch.setattr(gm, "UNCARRIED", [("tests/test_x_gpu.py", "no_such_module_4711", "big")])
    ctx = make_ctx(tmp_path, True, python=PY)
    assert gm.left_out(ctx) == {"tests/test_x_gpu.py": "no_such_module_4711 not importable (big)"}
    ctx.python = fake_python  # runs the files; the probe above needed a real Python
    monkeypatch.setattr(gm, "left_out", lambda c: {"tests/test_x_gpu.py": "nixl-like (big)"})
    res = gr.run_stage(gs.all_stages()["core"], 20.0, ctx)
    rows = {f.name: f for f in res.files}
    assert rows["tests/test_x_gpu.py"].status == rp.SKIPPED
    # A machine skip, named as such (the tag of tests/conftest.py's skip_for_machine).
    assert rows["tests/test_x_gpu.py"].reason == "[machine] left out: nixl-like (big)"
    assert rows["tests/test_y_gpu.py"].status == rp.PASSED
    assert res.status == rp.PASSED and res.figures["left_out"] == [
        "tests/test_x_gpu.py: nixl-like (big)"
    ]
    monkeypatch.undo()
    monkeypatch.setattr(gm, "UNCARRIED", [("tests/test_y_gpu.py", "json", "")])
    assert gm.left_out(make_ctx(tmp_path, True)) == {}
    # A check that is a snippet: what it printed last is the reason.
    snippet = "import sys; print('the env is absent: run make-env'); sys.exit(1)"
    monkeypatch.setattr(gm, "UNCARRIED", [("tests/test_y_gpu.py", snippet, "1 GB")])
    assert gm.left_out(make_ctx(tmp_path, True)) == {
        "tests/test_y_gpu.py": "the env is absent: run make-env (1 GB)"
    }


def test_the_engine_tests_are_a_machine_skip_where_their_environment_is_absent(
    tmp_path, monkeypatch
):
    """The real check of the engine environment, run by the tests' Python from the repository
    root: with MOECOMM_ENGINES_DIR at an empty folder it is absent, and said so."""
    monkeypatch.setenv("MOECOMM_ENGINES_DIR", str(tmp_path / "no-engines"))
    ctx = make_ctx(tmp_path, True, python=PY, root=ROOT)
    out = gm.left_out(ctx)
    assert "the engine environment is absent" in out[gp.ENGINES_TEST]


def test_deepep_runs_the_scenario_file_once_with_the_stage_budget(tmp_path, fake_python, fast):
    """One pytest over the file (its fixture starts the rank group once and reports each
    scenario itself); the per-test timeout is what the stage has left, since the first test's
    setup runs every scenario."""
    (tmp_path / gs.DEEPEP_TEST).parent.mkdir(parents=True)
    (tmp_path / gs.DEEPEP_TEST).write_text("")
    ctx = make_ctx(tmp_path, True, python=fake_python)
    res = gr.run_stage(gs.all_stages()["deepep"], 20.0, ctx)
    assert res.status == rp.PASSED, res.reason
    (row,) = res.files
    assert row.name == gs.DEEPEP_TEST and row.junit.startswith("junit/deepep.")
    log = ctx.path("deepep.log").read_text()
    (cmd,) = [ln for ln in log.splitlines() if ln.startswith("$ ") and "pytest" in ln]
    assert f"{gs.DEEPEP_TEST} -m gpu" in cmd
    timeout = int(next(a for a in cmd.split() if a.startswith("--timeout=")).split("=")[1])
    assert 10 <= timeout <= 20


def test_the_sanitizer_runs_memcheck_on_the_smoke_test_alone(tmp_path, fake_python, monkeypatch):
    calls = tmp_path / "calls.jsonl"
    fake_san = tmp_path / "compute-sanitizer"
    fake_san.write_text(
        f"#!{PY}\nimport os, subprocess, sys\n"
        f"open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:6]) + '\\n')\n"
        "rc = subprocess.call(sys.argv[5:])\n"
        "print('========= ERROR SUMMARY: 0 errors')\nsys.exit(rc)\n"
    )
    fake_san.chmod(0o755)
    monkeypatch.setattr(gs, "find_sanitizer", lambda: str(fake_san))
    monkeypatch.setenv("FAKE_ARGS_LOG", str(tmp_path / "args.jsonl"))
    (tmp_path / gs.SMOKE_TEST).parent.mkdir(parents=True)
    (tmp_path / gs.SMOKE_TEST).write_text("")
    ctx = make_ctx(tmp_path, True, python=fake_python)
    res = gr.run_stage(gs.all_stages()["sanitizer"], 30.0, ctx)
    assert res.status == rp.PASSED, res.reason
    assert res.figures["processes_checked"] == 1 and res.figures["sanitizer_errors"] == 0
    assert calls.read_text().split() == [
        "--tool",
        "memcheck",
        "--error-exitcode",
        "86",
        fake_python,
    ]
    (args,) = [json.loads(x) for x in (tmp_path / "args.jsonl").read_text().splitlines()]
    assert gs.SMOKE_TEST in args["argv"] and "--target-processes" not in args["argv"]
    assert args["argv"][args["argv"].index("-k") + 1] == gs.SANITIZER_SELECT
    assert args["env"]["MOECOMM_DEVICE_DEADLINE_SCALE"] == "20"


def test_a_missing_smoke_test_fails_the_device_stages_that_run_it(tmp_path):
    ctx = make_ctx(tmp_path, True)  # a tree without tests/gpu/test_smoke_loopback.py
    for name in ("smoke", "sanitizer"):
        res = gr.run_stage(gs.all_stages()[name], 30.0, ctx)
        assert res.status == rp.FAILED and res.reason.startswith("missing")
    no_device = make_ctx(tmp_path / "nd", False, root=tmp_path)
    res = gr.run_stage(gs.all_stages()["smoke"], 30.0, no_device)
    assert res.status == rp.SKIPPED and "is also missing" in res.reason


@pytest.mark.parametrize(("device", "status"), [(False, "skipped"), (True, "failed")])
def test_a_gpu_bench_row_that_did_not_run(device, status):
    res = gr.Result("bench")
    gs.judge_bench(res, {"not_run": "no CUDA device"}, device)
    assert res.status == status and "no CUDA device" in res.reason
    gs.judge_bench(
        res, {"ok": "yes", "dispatch_us": 80.0, "combine_us": 90.0, "calc_diff": 1e-4}, True
    )
    assert res.status == rp.PASSED and "dispatch 80.0 µs" in res.reason


# ---------------------------------------------------------------------------------------------
# A test file whose pytest dies under a test: the runner resumes it after that test

SYNTH_CRASHES = textwrap.dedent(
    """\
    import os, signal, time

    def test_a_passes():
        pass

    def test_b_fails():
        assert 1 == 2, "b is wrong"

    def test_c_segfaults():
        os.kill(os.getpid(), signal.SIGSEGV)

    def test_d_passes():
        pass

    def test_e_hangs():
        # pytest-timeout's SIGALRM cannot end it: only the runner's kill at the file's timeout.
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        time.sleep(120)

    def test_f_passes():
        pass
    """
)


# A file's (or a stage's) timeout in these tests: long enough for a real pytest to start and
# run a few tests on a loaded 2-core machine, short enough to wait out a hang.
HANG_CAP_S = 15.0


def _synth_tree(root: Path, name: str, text: str) -> str:
    (root / "tests").mkdir(parents=True, exist_ok=True)
    (root / "tests" / name).write_text(text)
    return f"tests/{name}"


def test_a_crashed_file_is_resumed_after_the_test_that_killed_it(tmp_path, fast):
    """A real pytest (this venv's) over a file whose third test segfaults and whose fifth hangs
    past the file's timeout: three pytest runs, every test with its own verdict, the failure's
    text kept from the run the segfault ended, in summary.json and summary.md."""
    rel = _synth_tree(tmp_path, "test_synth.py", SYNTH_CRASHES)
    ctx = make_ctx(tmp_path, True)

    def body(run):
        run.pytest_file(rel, [rel], cap=HANG_CAP_S, test_timeout=60.0)

    res = gr.run_stage(gr.Stage("core", body), 4 * HANG_CAP_S, ctx)
    (fr,) = res.files
    got = {c["test"].split("::")[-1]: c for c in fr.cases}
    assert list(got) == sorted(got)  # the file's order
    assert {k: c["outcome"] for k, c in got.items()} == {
        "test_a_passes": "passed",
        "test_b_fails": "failed",
        "test_c_segfaults": "crashed",
        "test_d_passes": "passed",
        "test_e_hangs": "crashed",
        "test_f_passes": "passed",
    }, fr.cases
    assert "b is wrong" in got["test_b_fails"]["note"]  # written before the segfault
    segv = got["test_c_segfaults"]["note"]
    assert segv.startswith("killed by SIGSEGV") and "Fatal Python error: Segmentation fault" in segv
    assert "test_synth.py" in segv  # the faulthandler frame of the test itself
    assert got["test_e_hangs"]["note"].startswith(f"killed by its {HANG_CAP_S:.0f} s timeout")
    assert (fr.status, fr.parts, fr.passed, fr.failed, fr.crashed) == (rp.FAILED, 3, 3, 1, 2)
    assert fr.counts_from == "per-test log" and fr.killed
    assert fr.reason.startswith("crashed in test_c_segfaults (killed by SIGSEGV) and 1 more")
    assert "0 not run" in fr.reason
    # The segfault left no junit (the part killed at its timeout may have written one on SIGINT).
    assert fr.junit.endswith("junit/core.test_synth.part2.xml"), fr.junit
    assert "core.test_synth.xml" not in fr.junit
    log = ctx.path("core.log").read_text()
    assert log.count("--deselect=tests/test_synth.py::test_c_segfaults") == 2
    summary = json.loads((ctx.out / "summary.json").read_text())
    assert summary["tests"]["crashed"] == 2 and summary["tests"]["passed"] == 3
    assert len(summary["stages"][0]["files"][0]["cases"]) == 6
    md = (ctx.out / "summary.md").read_text()
    assert "| core | tests/test_synth.py | failed | 3 | 1 | 0 | 0 | 2 |" in md
    assert "- `tests/test_synth.py::test_c_segfaults` **crashed**: killed by SIGSEGV" in md
    assert "`tests/test_synth.py::test_b_fails` **failed**" in md


def test_tests_after_a_crash_the_stage_has_no_time_for_are_not_run(tmp_path, fast, monkeypatch):
    """The stage's budget is spent (made so at once after the first pytest, not waited for):
    the crashed test is named, the tests that never ran are "not run", one pytest only."""
    rel = _synth_tree(
        tmp_path,
        "test_late.py",
        "import os, signal\n"
        "def test_a_segfaults():\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
        "def test_b_passes():\n    pass\n"
        "def test_c_passes():\n    pass\n",
    )
    command = gr.StageRun.command

    def then_no_time(self, *args, **kw):
        got = command(self, *args, **kw)
        self.deadline = time.monotonic()
        return got

    monkeypatch.setattr(gr.StageRun, "command", then_no_time)
    ctx = make_ctx(tmp_path, True)
    body = lambda run: run.pytest_file(rel, [rel])  # noqa: E731
    res = gr.run_stage(gr.Stage("core", body), 4 * HANG_CAP_S, ctx)
    (fr,) = res.files
    assert [c["outcome"] for c in fr.cases] == ["crashed", "not run", "not run"], fr.cases
    assert fr.cases[1]["note"] == "the stage's budget was spent after a crash"
    assert (fr.parts, fr.crashed, fr.junit) == (1, 1, None)
    assert "2 not run" in fr.reason and res.status == rp.FAILED


def test_a_file_that_ends_normally_has_its_per_test_rows(tmp_path, fast):
    rel = _synth_tree(
        tmp_path,
        "test_plain.py",
        "import pytest\ndef test_a():\n    pass\n"
        "def test_b():\n    pytest.skip('no device here')\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('fixture broke')\n"
        "def test_c(broken):\n    pass\n",
    )
    ctx = make_ctx(tmp_path, True)
    res = gr.run_stage(gr.Stage("core", lambda run: run.pytest_file(rel, [rel])), 30.0, ctx)
    (fr,) = res.files
    assert (fr.parts, fr.counts_from, fr.passed, fr.skipped, fr.errors) == (1, "junit", 1, 1, 1)
    outcomes = {c["test"].split("::")[-1]: (c["outcome"], c["note"]) for c in fr.cases}
    assert outcomes["test_a"] == ("passed", "")
    assert outcomes["test_b"][0] == "skipped" and "no device here" in outcomes["test_b"][1]
    assert outcomes["test_c"][0] == "error" and "fixture broke" in outcomes["test_c"][1]


# ---------------------------------------------------------------------------------------------
# tools/gpu_triage.sh


def test_triage_gives_per_test_verdicts_and_packs_what_each_node_left(tmp_path):
    """The triage script with this venv's Python (no build): a tiny pytest node gets its junit
    and one verdict per test; a `cmd:` node that segfaults is named a crash with its signal;
    the tarball holds each node's output and the junit."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_tiny.py").write_text(
        "import pytest\npytestmark = pytest.mark.gpu\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2, 'tiny is wrong'\n"
    )
    out = tmp_path / "out"
    segv = '$PY -c "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"'
    env = {
        **os.environ,
        "OUT": str(out),
        "TRIAGE_PY": str(ROOT / ".venv" / "bin" / "python"),
        "TRIAGE_BUDGET_S": "200",
        "TRIAGE_NODE_S": "60",
    }
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "tools" / "gpu_triage.sh"),
            str(tmp_path / "t" / "test_tiny.py"),
            f"cmd:{segv}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = next(ln for ln in lines if ln.startswith("[1] "))
    assert first.startswith("[1] rc=1 ") and "1 failed, 1 passed" in first
    # junit's classname is the module's dotted path from pytest's rootdir, which depends on
    # where tmp_path lies (test_tiny, or tt.t.test_tiny): match the module's own name.
    verdicts = {
        (ln.split()[0], ln.split()[1].rsplit(".", 1)[-1]): ln.split(": ", 1)[-1]
        for ln in lines
        if ln.startswith("    PASSED ") or ln.startswith("    FAILED ")
    }
    assert ("PASSED", "test_tiny::test_ok") in verdicts, lines
    failed = verdicts[("FAILED", "test_tiny::test_bad:")]
    assert failed == "AssertionError: tiny is wrong assert 1 == 2", lines
    second = next(ln for ln in lines if ln.startswith("[2] "))
    assert second.startswith("[2] CRASH rc=139 (SIGSEGV) :: "), second
    with tarfile.open(out / "triage.tar.gz") as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
        assert {"01.txt", "01.xml", "02.txt"} <= names
        head = tar.extractfile("./01.txt").read().decode()
    # The per-test timeout is well below the node's limit, so a hang fails inside pytest.
    assert "(node limit 60 s, per test 36 s)" in head
