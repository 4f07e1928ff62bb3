"""The stages of tools/gpu_check.py: what each runs and how its result is judged. What the check
learns about the machine (the preflight's verdict, the Pythons and .gpu-venv, the build stamp,
the import check, the files the machine cannot run) is gpu_check_machine.py; which test files a
test stage runs, gpu_check_files.py. Standard library only: it runs before anything is
installed.

    preflight  seconds: the GPU, MPS, driver and runtime, the kernel, pip, every build
               requirement, whether compute-sanitizer can open the device; fails fast (one
               line naming what is missing) when a build requirement is missing
    build      .gpu-venv + carried test wheels + `pip install -e .` with MOECOMM_WITH_CUDA=ON
               (without a device: `make build`); "reused" when its stamp says the build is current
    joinleave  tools/probe/join_leave_diag.py: a peer joining a spinning device wait, four ways
    core       the gpu test files never given a verdict, one pytest (one junit) each, each with
               its cap (gpu_check_plan.STAGE_FILES), then any gpu-marked file in no stage
    smoke      tests/gpu/test_smoke_loopback.py, CUDA_LAUNCH_BLOCKING=1
    regress    the gpu test files that passed on the last GPU run, rerun with their caps
    deepep     tests/compat/test_deep_ep_cuda.py, one pytest (each scenario reported on its own)
    bench      bench/ops/vs_deepep.py --gpu-only (the moecomm GPU row)
    sanitizer  compute-sanitizer --tool memcheck on the smoke test, deadlines scaled by 20;
               skipped for the machine when the preflight found the tool cannot open the device
    racecheck  the same with --tool racecheck (optional: in no call, by name only)
    host       tests/gpu/test_gpu_host.py tests/tools/test_cuda_build.py (no device needed)

docs/gpu-check.md describes them; their budgets per device call are in gpu_check_plan.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gpu_check_machine as machine
from gpu_check_files import discover_gpu_files, stage_files
from gpu_check_machine import (
    GPU_VENV,
    IMPORT_SCRIPT,
    REQUIREMENTS,
    WHEELS_DIR,
    build_current,
    host_python,
    json_line,
    judge_import,
    judge_preflight,
    last_line,
    stamp_path,
    write_stamp,
)
from gpu_check_plan import (
    BUILD_FULL_S,
    DEEPEP_TEST,
    SMOKE_TEST,
    STAGE_FILES,
)
from gpu_check_reports import (
    FAILED,
    NOT_RUN,
    PASSED,
    SKIPPED,
    find_sanitizer,
    parse_pytest_summary,
    parse_sanitizer,
)
from gpu_check_run import Run, Stage, StageRun, exit_text
from gpu_check_types import Context, FileResult

# tools/gpu_check.py takes these two from here, with the stages.
make_venv = machine.make_venv
test_python = machine.test_python

TOOLS = Path(__file__).resolve().parent
JOINLEAVE_SCRIPT = "tools/probe/join_leave_diag.py"
HOST_TESTS = [
    "tests/gpu/test_gpu_host.py",
    "tests/gpu/test_free_and_preload_host.py",
    "tests/gpu/test_roundtrip_reference_host.py",
    "tests/tools/test_cuda_build.py",
]
# A left-out file's row starts with this (the tag of tests/conftest.py's skip_for_machine).
MACHINE_SKIP = "[machine] "
DEVICE_TEST_ENV = {"MOECOMM_REQUIRE_GPU": "1", "PYTHONUNBUFFERED": "1"}
# Device deadlines count wall time; under compute-sanitizer kernels run 10-100x slower.
SANITIZER_DEADLINE_SCALE = "20"
# pytest-timeout per test (each also kept below its file's timeout).
SMOKE_TEST_TIMEOUT_S = 30.0
CORE_TEST_TIMEOUT_S = 60.0
HOST_TEST_TIMEOUT_S = 120.0
SANITIZER_TEST_TIMEOUT_S = 100.0
# Under the sanitizer: the loopback cases only (the single-rank DeepEP Buffer case adds the
# adapter's torch glue, not device code of its own), so memcheck fits its stage.
SANITIZER_SELECT = "loopback_step"
# The join/leave diagnostic's own limit per variant run (four variants in its 60 s stage).
JOINLEAVE_VARIANT_S = 12.0

# ---------------------------------------------------------------------------------------------
# Helpers


def step_ok(run: StageRun, r: Run | None, what: str) -> bool:
    """Whether a command of a stage's sequence succeeded; if not, the stage failed with why."""
    if r is not None and not r.timed_out and r.returncode == 0:
        return True
    res = run.res
    res.status = FAILED
    if r is None:
        res.reason = f"{what}: not run, stage budget spent"
    elif r.timed_out:
        res.reason = f"{what}: killed by the stage timeout after {r.duration_s:.0f} s"
    else:
        res.reason = f"{what}: {exit_text(r.returncode)}: {last_line(r.output) or 'no output'}"
    return False


# ---------------------------------------------------------------------------------------------
# preflight


def stage_preflight(run: StageRun) -> None:
    ctx = run.ctx
    py = ctx.base_python if ctx.device else host_python(ctx.root)
    cmd = [
        py,
        TOOLS / "gpu_check_probe.py",
        "--requirements",
        ctx.root / REQUIREMENTS,
        "--wheels",
        ctx.root / WHEELS_DIR,
        "--venv",
        ctx.root / GPU_VENV,
    ]
    r = run.command(cmd, label=f"probe with {py}")
    info = json_line(r.output, "GPU-CHECK-PREFLIGHT") if r is not None else None
    if info is None:
        step_ok(run, r, "the probe")
        if run.res.status != FAILED:
            run.res.status, run.res.reason = FAILED, "the probe printed no result"
        return
    run.res.status, run.res.reason, figures = judge_preflight(info, ctx.device)
    run.res.figures.update(figures)


# ---------------------------------------------------------------------------------------------
# build


def _import_check(run: StageRun) -> bool:
    r = run.command([run.ctx.python, "-c", IMPORT_SCRIPT], label="import check", timeout=90)
    info = json_line(r.output, "GPU-CHECK-IMPORT") if r is not None else None
    if info is None:
        step_ok(run, r, "import moecomm")
        if run.res.status != FAILED:
            run.res.status, run.res.reason = FAILED, "import moecomm printed no result"
        return False
    run.res.figures.update({k: v for k, v in info.items() if k != "moecomm"})
    ok, why = judge_import(info, run.ctx.device)
    run.res.reason = why
    if not ok:
        run.res.status = FAILED
    return ok


def stage_build(run: StageRun) -> None:
    if run.ctx.device:
        build_device(run)
    else:
        build_host(run)


def build_host(run: StageRun) -> None:
    """Without a device: `make build` (.venv; incremental), then the import check."""
    r = run.command(
        [os.environ.get("MAKE", "make"), "--no-print-directory", "build"], label="make build"
    )
    if not step_ok(run, r, "make build"):
        return
    made = last_line(r.output) or "done"
    if _import_check(run):
        run.res.status = PASSED
        run.res.reason = f"make build: {made}; {run.res.reason}"


def build_device(run: StageRun) -> None:
    """.gpu-venv over the image's Python, the carried test wheels, the CUDA build, the import
    check; reused (seconds) when the stamp says the build is current and the import check
    passes."""
    ctx, res = run.ctx, run.res
    root = ctx.root
    venv = root / GPU_VENV
    py = venv / "bin" / "python"
    current, why = build_current(root, ctx.base_python)
    if current:
        if _import_check(run):
            res.status = PASSED
            res.reason = f"reused: the build is current ({why}); {res.reason}"
            res.figures["reused"] = True
            return
        why = f"the build is current but the import check failed ({res.reason})"
        res.status = ""
    run.echo(f"building: {why}")
    res.figures["reused"] = False
    res.figures["why_built"] = why
    if res.budget_s < BUILD_FULL_S:
        run.extend(BUILD_FULL_S, f"not reused: {why}")
    stamp_path(root).unlink(missing_ok=True)
    if not py.exists():
        r = run.command(
            [ctx.base_python, TOOLS / "gpu_check.py", "--make-venv", venv],
            label=f"make {GPU_VENV}",
            timeout=120,
        )
        if not step_ok(run, r, f"make {GPU_VENV}"):
            return
        made = json_line(r.output, "GPU-CHECK-VENV") or {}
        res.figures["venv_pip"] = made.get("venv_pip")
    pip = [py, "-m", "pip", "install", "--no-index", "--disable-pip-version-check"]
    wheels = root / WHEELS_DIR
    links = ["--find-links", wheels] if wheels.is_dir() else []
    r = run.command([*pip, *links, "-r", root / REQUIREMENTS], label="test requirements")
    if not step_ok(run, r, f"test requirements (from {WHEELS_DIR} where missing)"):
        if not wheels.is_dir():
            res.reason += f"; {WHEELS_DIR} was not carried (make gpu-wheels, carry it)"
        return
    env = {"MOECOMM_WITH_CUDA": "ON", "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 8)}
    r = run.command(
        [*pip, "--no-build-isolation", "--no-deps", "-v", "-e", "."],
        label="pip install -e . (MOECOMM_WITH_CUDA=ON)",
        env=env,
    )
    if not step_ok(run, r, "pip install -e ."):
        return
    res.figures["pip_seconds"] = r.duration_s
    if _import_check(run):
        write_stamp(root, ctx.base_python)
        res.status = PASSED
        res.reason = f"built in {r.duration_s:.0f} s; {res.reason}"


# ---------------------------------------------------------------------------------------------
# The test stages


def _missing(ctx: Context, path: str) -> bool:
    return not (ctx.root / path).exists()


def _smoke_missing(ctx: Context) -> str:
    return f"{SMOKE_TEST} is also missing" if _missing(ctx, SMOKE_TEST) else ""


def stage_smoke(run: StageRun) -> None:
    if _missing(run.ctx, SMOKE_TEST):
        run.res.status, run.res.reason = FAILED, f"missing: {SMOKE_TEST} does not exist"
        return
    env = {**DEVICE_TEST_ENV, "CUDA_LAUNCH_BLOCKING": "1"}
    run.pytest_file(
        SMOKE_TEST,
        [SMOKE_TEST, "-m", "gpu"],
        env=env,
        cap=STAGE_FILES["smoke"][SMOKE_TEST],
        test_timeout=SMOKE_TEST_TIMEOUT_S,
    )


def files_stage(run: StageRun) -> None:
    """A stage of test files (core, regress): each its own pytest with its cap; a file whose
    machine lacks what it needs (UNCARRIED) is a machine skip, named."""
    files = stage_files(run.ctx.root, run.name)
    if not files:
        run.res.status, run.res.reason = FAILED, f"no gpu-marked test file of stage {run.name}"
        return
    out = (
        machine.left_out(run.ctx) if any(f in dict(files) for f, _, _ in machine.UNCARRIED) else {}
    )
    if out:
        run.res.figures["left_out"] = [f"{f}: {why}" for f, why in out.items()]
    for f, cap in files:
        if f in out:
            run.add_file(FileResult(run.name, f, SKIPPED, f"{MACHINE_SKIP}left out: {out[f]}"))
            continue
        run.pytest_file(
            f, [f, "-m", "gpu"], env=DEVICE_TEST_ENV, cap=cap, test_timeout=CORE_TEST_TIMEOUT_S
        )


def judge_joinleave(res, info: dict | None) -> None:
    """The diagnostic's verdict: every variant's peer seen by the spinning wait (status OK).
    Its per-variant lines (status, word, elapsed, read-back, connect/put times) are in the log
    and the figures."""
    if info is None:
        res.status, res.reason = FAILED, "the diagnostic printed no result"
        return
    variants = info.get("variants") or []
    res.figures["joinleave"] = [v.get("line", "") for v in variants]
    bad = [v["name"] for v in variants if v.get("status") != "OK"]
    if not variants:
        res.status, res.reason = FAILED, f"no variant ran: {info.get('error', '?')}"
    elif bad:
        res.status = FAILED
        res.reason = f"{len(bad)} of {len(variants)} variants did not see the put: " + ", ".join(
            bad
        )
    else:
        res.status, res.reason = PASSED, f"all {len(variants)} variants saw the put"


def stage_joinleave(run: StageRun) -> None:
    """tools/probe/join_leave_diag.py with the tests' Python: a peer process joins while a
    device wait spins (cold, warm, no spinning kernel, CUDA_MODULE_LOADING=EAGER)."""
    ctx = run.ctx
    if _missing(ctx, JOINLEAVE_SCRIPT):
        run.res.status, run.res.reason = FAILED, f"missing: {JOINLEAVE_SCRIPT} does not exist"
        return
    cmd = [ctx.python, JOINLEAVE_SCRIPT, "--variant-timeout", str(JOINLEAVE_VARIANT_S)]
    r = run.command(cmd, label="join/leave diagnostic", env={"PYTHONUNBUFFERED": "1"})
    info = json_line(r.output, "JOIN-LEAVE-DIAG") if r is not None else None
    if info is None:
        step_ok(run, r, "the diagnostic")
        if run.res.status != FAILED:
            run.res.status, run.res.reason = FAILED, "the diagnostic printed no result"
        return
    judge_joinleave(run.res, info)


def stage_deepep(run: StageRun) -> None:
    """One pytest over the scenario file: its fixture starts the two rank processes once (spawn,
    torch, a CUDA context: seconds a launch per scenario would pay again) and runs the scenarios
    in order, each with its own deadline and reported on its own (a hang or a dead rank names
    the scenario and a new group runs the rest); what the stage's budget leaves unrun is
    reported "not run" by name. The per-test timeout is the whole budget: the first test's
    setup runs every scenario."""
    ctx = run.ctx
    if _missing(ctx, DEEPEP_TEST):
        run.res.status, run.res.reason = FAILED, f"missing: {DEEPEP_TEST} does not exist"
        return
    cap = STAGE_FILES["deepep"][DEEPEP_TEST]
    run.pytest_file(
        DEEPEP_TEST,
        [DEEPEP_TEST, "-m", "gpu"],
        env=DEVICE_TEST_ENV,
        cap=cap,
        test_timeout=min(cap, run.left()),
    )


def judge_bench(res, row: dict | None, device: bool) -> None:
    """The bench's GPU row: its figures; on a device it must have run and be right."""
    row = row or {}
    for k in ("name", "dispatch_us", "combine_us", "dispatch_gbps", "combine_gbps", "calc_diff"):
        if k in row:
            res.figures[k] = row[k]
    if row.get("not_run"):
        res.status = FAILED if device else SKIPPED
        res.reason = f"moecomm GPU row not run: {row['not_run']}"
    elif row.get("ok") != "yes":
        res.status = FAILED
        res.reason = f"moecomm GPU row is wrong: calc_diff {row.get('calc_diff')}"
    else:
        res.status = PASSED
        res.reason = (
            f"dispatch {row['dispatch_us']:.1f} µs, combine {row['combine_us']:.1f} µs "
            f"(calc_diff {row['calc_diff']:.1e})"
        )


def stage_bench(run: StageRun) -> None:
    ctx = run.ctx
    out = ctx.path("vs_deepep.json")
    out.unlink(missing_ok=True)
    cmd = [ctx.python, "bench/ops/vs_deepep.py", "--gpu-only", "--json", out]
    r = run.command(cmd, label="bench/ops/vs_deepep.py --gpu-only", env={"PYTHONUNBUFFERED": "1"})
    if not step_ok(run, r, "bench/ops/vs_deepep.py"):
        return
    if not out.exists():
        run.res.status, run.res.reason = FAILED, "the bench wrote no JSON"
        return
    judge_bench(run.res, json.loads(out.read_text()).get("gpu_row"), ctx.device)


def sanitizer_stage(tool: str, name: str) -> Stage:
    """compute-sanitizer --tool <tool> on the smoke test: one process (no --target-processes
    all, so no server child runs under the tool), device deadlines scaled by
    MOECOMM_DEVICE_DEADLINE_SCALE, any reported error fails it."""

    def body(run: StageRun) -> None:
        if _missing(run.ctx, SMOKE_TEST):
            run.res.status, run.res.reason = FAILED, f"missing: {SMOKE_TEST} does not exist"
            return
        pre = run.ctx.results.get("preflight")
        if pre is not None and pre.figures.get("sanitizer_device") is False:
            run.res.status = SKIPPED
            run.res.reason = (
                f"{MACHINE_SKIP}compute-sanitizer cannot open the device on this machine "
                f"(kernel {pre.figures.get('uname_r')}): {pre.figures.get('sanitizer_device_why')}"
            )
            return
        san = find_sanitizer()
        if san is None:
            run.res.status = FAILED
            run.res.reason = "compute-sanitizer not found (PATH, /usr/local/cuda/bin)"
            return

        def judge(fr: FileResult, r: Run) -> None:
            figs = parse_sanitizer(r.output)
            run.res.figures.update(figs)
            if r.returncode == 86 or figs["sanitizer_errors"]:
                fr.status = FAILED
                fr.reason = f"{tool} reported {figs['sanitizer_errors']} errors; {fr.reason}"
            elif not r.timed_out and figs["processes_checked"] == 0:
                fr.status = FAILED
                fr.reason = f"no compute-sanitizer summary in the output; {fr.reason}"
            elif fr.status == PASSED:
                fr.reason += f"; {tool}: 0 errors"

        env = {**DEVICE_TEST_ENV, "MOECOMM_DEVICE_DEADLINE_SCALE": SANITIZER_DEADLINE_SCALE}
        run.pytest_file(
            SMOKE_TEST,
            [SMOKE_TEST, "-m", "gpu", "-k", SANITIZER_SELECT],
            env=env,
            prefix=(san, "--tool", tool, "--error-exitcode", "86"),
            test_timeout=SANITIZER_TEST_TIMEOUT_S,
            judge=judge,
        )

    return Stage(
        name,
        body,
        title=f"compute-sanitizer --tool {tool} on {SMOKE_TEST} (deadlines x"
        f"{SANITIZER_DEADLINE_SCALE})",
        needs_device=True,
        requires=("build",),
        require_pass=True,
        no_device_reason=_smoke_missing,
    )


def stage_host(run: StageRun) -> None:
    ctx = run.ctx
    for f in HOST_TESTS:
        run.pytest_file(f, [f], env={"PYTHONUNBUFFERED": "1"}, test_timeout=HOST_TEST_TIMEOUT_S)
    if ctx.device:
        return
    # No device: the gpu tests still import and collect (the device stages cannot tell here).
    files = discover_gpu_files(ctx.root)
    collect = [ctx.python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    r = run.command([*collect, "-m", "gpu", *files], label="collect -m gpu", timeout=120)
    name = f"collect -m gpu ({len(files)} files)"
    if r is None:
        run.add_file(FileResult(run.name, name, NOT_RUN, "not run: stage budget spent"))
        return
    n = (parse_pytest_summary(r.output) or {}).get("collected")
    fr = FileResult(run.name, name, FAILED, duration_s=r.duration_s)
    if r.timed_out:
        fr.killed, fr.reason = True, f"killed by the stage timeout after {r.duration_s:.0f} s"
    elif r.returncode != 0 or not n:
        fr.reason = f"{exit_text(r.returncode)}, {n or 0} collected: "
        fr.reason += last_line(r.output) or "no output"
    else:
        fr.status, fr.reason = PASSED, f"{n} gpu-marked tests collected"
    run.res.figures["gpu_tests_collected"] = n
    run.add_file(fr)


def all_stages() -> dict[str, Stage]:
    stages = [
        Stage(
            "preflight",
            stage_preflight,
            title="the GPU, MPS, driver/runtime, pip and every build requirement",
            tail_on_failure=False,
        ),
        Stage(
            "build",
            stage_build,
            title=f"{GPU_VENV} + pip install -e . with MOECOMM_WITH_CUDA=ON (reused when current);"
            " make build without a device",
            requires=("preflight",),
        ),
        Stage(
            "joinleave",
            stage_joinleave,
            title=f"{JOINLEAVE_SCRIPT}: a peer joining a spinning device wait, four ways",
            needs_device=True,
            requires=("build",),
        ),
        Stage(
            "core",
            files_stage,
            title="the gpu test files never given a verdict, one pytest each with its cap "
            "(MOECOMM_REQUIRE_GPU=1)",
            needs_device=True,
            requires=("build",),
            require_pass=True,
        ),
        Stage(
            "smoke",
            stage_smoke,
            title=f"{SMOKE_TEST} (CUDA_LAUNCH_BLOCKING=1)",
            needs_device=True,
            requires=("build",),
            require_pass=True,
            no_device_reason=_smoke_missing,
        ),
        Stage(
            "regress",
            files_stage,
            title="the gpu test files that passed on the last GPU run, each with its cap",
            needs_device=True,
            requires=("build",),
            require_pass=True,
        ),
        Stage(
            "deepep",
            stage_deepep,
            title=f"{DEEPEP_TEST} (each scenario reported on its own)",
            needs_device=True,
            requires=("build",),
            require_pass=True,
        ),
        Stage(
            "bench",
            stage_bench,
            title="bench/ops/vs_deepep.py --gpu-only (the moecomm GPU row)",
            needs_device=True,
            requires=("build",),
        ),
        sanitizer_stage("memcheck", "sanitizer"),
        sanitizer_stage("racecheck", "racecheck"),
        Stage(
            "host",
            stage_host,
            title="the GPU modules' host behaviour and the CUDA compile checks (no device needed)",
            requires=("build",),
            requires_without_device=("preflight",),
        ),
    ]
    return {s.name: s for s in stages}
