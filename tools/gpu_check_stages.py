"""The stages of tools/gpu_check.py: what each runs and how its result is judged. Standard
library only: it runs before anything is installed.

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

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_plan import (
    BUILD_FULL_S,
    CONDITIONAL_FILES,
    DEEPEP_TEST,
    ENGINES_TEST,
    NIXL_TEST,
    SMOKE_TEST,
    STAGE_FILES,
    UNPLANNED_CAP_S,
    stage_of,
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

TOOLS = Path(__file__).resolve().parent
JOINLEAVE_SCRIPT = "tools/probe/join_leave_diag.py"
HOST_TESTS = [
    "tests/gpu/test_gpu_host.py",
    "tests/gpu/test_free_and_preload_host.py",
    "tests/gpu/test_roundtrip_reference_host.py",
    "tests/tools/test_cuda_build.py",
]
WHEELS_DIR = ".gpu-wheels"
REQUIREMENTS = "tools/gpu-requirements.txt"
GPU_VENV = ".gpu-venv"
# The build stamp, in .gpu-venv: a hash of the build's inputs and the Python that built it.
STAMP_NAME = ".gpu-check-build.json"
BUILD_INPUT_DIRS = ("csrc", "bindings", "cmake")
BUILD_INPUT_FILES = ("CMakeLists.txt", "pyproject.toml", REQUIREMENTS)
# gpu tests in these files need something of the machine that the GPU image lacks and the
# device tool cannot carry: when the check (a Python snippet run by the tests' Python, exit 0
# when it is there) fails, the file is left out of its stage as a machine skip, and the summary
# says so by name (under MOECOMM_REQUIRE_GPU=1 their skip would otherwise fail the run for a
# reason that is the machine's, not moecomm's). Their stage and cap: gpu_check_plan.
ENGINES_PRESENT = (
    "import sys; sys.path.insert(0, 'tests/engines'); import engine_env; "
    "why = engine_env.why_unavailable(); print(why or 'present'); sys.exit(why is not None)"
)
UNCARRIED = [
    (
        NIXL_TEST,
        "nixl",
        "NIXL is not in the GPU image and its wheel (65 MiB) is over the device tool's 64 MiB",
    ),
    (
        ENGINES_TEST,
        ENGINES_PRESENT,
        "the engine environment (tools/engines_env.sh, ~1 GB) is not carried to the device",
    ),
]
# A left-out file's row starts with this (the tag of tests/conftest.py's skip_for_machine).
MACHINE_SKIP = "[machine] "
GPU_MARK = re.compile(r"\bmark\.gpu\b")
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


def json_line(text: str, tag: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith(tag + " "):
            try:
                return json.loads(line[len(tag) + 1 :])
            except ValueError:
                return None
    return None


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("$ ")]
    return lines[-1][:160] if lines else ""


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


def uses_gpu_marker(source: str) -> bool:
    """Whether Python source applies the gpu marker in code (``@pytest.mark.gpu``,
    ``pytestmark = [pytest.mark.gpu, ...]``, ``marks=mark.gpu``), not in a string or comment."""
    if not GPU_MARK.search(source):
        return False
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True  # pytest will report it; the stage runs the file and shows the error
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "gpu"
        and (
            (isinstance(node.value, ast.Attribute) and node.value.attr == "mark")
            or (isinstance(node.value, ast.Name) and node.value.id == "mark")
        )
        for node in ast.walk(tree)
    )


def discover_gpu_files(root: Path) -> list[str]:
    """Every test file that uses the gpu marker (what `pytest -m gpu` would select from)."""
    found = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        try:
            if uses_gpu_marker(path.read_text(errors="replace")):
                found.append(path.relative_to(root).as_posix())
        except OSError:
            continue
    return found


def stage_files(root: Path, stage: str) -> list[tuple[str, float]]:
    """(file, cap) of a test stage, in the order they run: its planned files that exist, then
    its conditional ones (gpu_check_plan.CONDITIONAL_FILES); core also gets every gpu-marked
    file that is in no stage (UNPLANNED_CAP_S each), so a new file still runs."""
    found = discover_gpu_files(root)
    files = [(f, cap) for f, cap in STAGE_FILES.get(stage, {}).items() if f in found]
    files += [(f, c[1]) for f, c in CONDITIONAL_FILES.items() if c[0] == stage and f in found]
    if stage == "core":
        files += [(f, UNPLANNED_CAP_S) for f in found if stage_of(f) is None]
    return files


def core_files(root: Path) -> list[str]:
    return [f for f, _ in stage_files(root, "core")]


def left_out(ctx: Context) -> dict[str, str]:
    """{file: why} for each UNCARRIED file whose check fails with the tests' Python: a module
    name (importable?) or a Python snippet (exit 0 when what the file needs is there)."""
    out = {}
    for path, check, why in UNCARRIED:
        if check.isidentifier():
            snippet = (
                f"import importlib.util, sys; sys.exit(importlib.util.find_spec({check!r}) is None)"
            )
            what = f"{check} not importable"
        else:
            snippet, what = check, "not present"
        try:
            r = subprocess.run(
                [ctx.python, "-c", snippet],
                timeout=60,
                cwd=ctx.root,
                capture_output=True,
                text=True,
            )
            missing = r.returncode != 0
            said = last_line(r.stdout + r.stderr)
        except (OSError, subprocess.TimeoutExpired) as exc:
            missing, said = True, str(exc)
        if missing:
            if not check.isidentifier() and said:
                what = said
            out[path] = f"{what} ({why})"
    return out


def host_python(root: Path) -> str:
    venv = root / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def test_python(root: Path, device: bool) -> str:
    """The Python the tests run with: .gpu-venv's on a device, .venv's without one."""
    if device:
        return str(root / GPU_VENV / "bin" / "python")
    return host_python(root)


# ---------------------------------------------------------------------------------------------
# preflight


def _ok(value) -> bool:
    return bool(value) and not str(value).startswith("not importable")


def _version_tuple(text: str) -> tuple:
    m = re.search(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def judge_preflight(info: dict, device: bool) -> tuple[str, str, dict]:
    """(status, one-line reason, figures) from the probe's facts. With a device, a missing build
    requirement fails the stage (and with it the build: minutes saved); anything else missing
    is named in the same line."""
    build, other = [], []
    if not info.get("venv_pip"):
        build.append("pip (no ensurepip and no pip in this Python)")
    for mod in ("scikit_build_core", "pybind11", "triton"):
        if not _ok(info.get(mod)):
            build.append(mod)
    cmake = info.get("cmake") or {}
    if not cmake.get("path"):
        build.append("cmake")
    elif _version_tuple(cmake.get("version", "")) < (3, 24):
        build.append(f"cmake>=3.24 (have {cmake.get('version')})")
    if not (info.get("ninja") or {}).get("path"):
        build.append("ninja")
    if not info.get("nvshmem"):
        build.append("nvidia.nvshmem (nvidia-nvshmem-cu13) or NVSHMEM_HOME")
    torch = info.get("torch")
    if not _ok(torch):
        build.append("torch")
    elif not info.get("torch_cuda"):
        build.append(f"torch with CUDA (this torch {torch} is a CPU build)")
    elif not info.get("torch_cuda_available"):
        build.append(f"torch.cuda.is_available() ({info.get('torch_cuda_error', 'False')})")
    if not (info.get("nvcc") or {}).get("path"):
        build.append("nvcc")
    uncarried = info.get("test_requirements_uncarried") or []
    if uncarried:
        build.append(
            f"test requirements {', '.join(uncarried)} (not in this Python, no wheel in "
            f"{WHEELS_DIR}: make gpu-wheels here, carry=['{WHEELS_DIR}'])"
        )
    if not info.get("compute_sanitizer"):
        other.append("compute-sanitizer (the sanitizer stage)")
    elif device and info.get("sanitizer_device") is False:
        other.append(
            "compute-sanitizer cannot open the device (the sanitizer stage is skipped): "
            + str(info.get("sanitizer_device_why", ""))[:160]
        )
    if not info.get("nvidia_smi"):
        other.append("nvidia-smi")
    elif device and not info.get("gpu_count"):
        other.append(f"a GPU in nvidia-smi ({info.get('nvidia_smi_error', 'none listed')})")

    gpus = info.get("gpus") or []
    facts = []
    if gpus:
        facts.append(
            f"{len(gpus)}× {gpus[0]['name']}, driver {info.get('driver')} "
            f"(CUDA {info.get('driver_cuda', '?')}), compute mode {info.get('compute_mode')}"
        )
    else:
        facts.append("no GPU listed")
    facts.append(f"MPS {info.get('mps', '?')}")
    facts.append(f"kernel {info.get('uname_r', '?')} ({info.get('uname_v', '?')})")
    facts.append(
        f"python {info.get('python')}, torch {torch} (CUDA {info.get('torch_cuda')}), "
        f"nvcc {(info.get('nvcc') or {}).get('version', '-')}"
    )
    facts.append(f"pip: {info.get('venv_pip') or 'none'}")
    figures = {
        "gpu_count": info.get("gpu_count"),
        "gpu": gpus[0]["name"] if gpus else None,
        "driver": info.get("driver"),
        "driver_cuda": info.get("driver_cuda"),
        "compute_mode": info.get("compute_mode"),
        "mps": info.get("mps"),
        "python": info.get("python"),
        "torch": torch,
        "torch_cuda": info.get("torch_cuda"),
        "torch_cuda_available": info.get("torch_cuda_available"),
        "capability": info.get("capability"),
        "triton": info.get("triton"),
        "cmake": cmake.get("version"),
        "nvcc": (info.get("nvcc") or {}).get("version"),
        "nvshmem": info.get("nvshmem"),
        "compute_sanitizer": info.get("compute_sanitizer"),
        "uname_r": info.get("uname_r"),
        "uname_v": info.get("uname_v"),
        "sanitizer_device": info.get("sanitizer_device"),
        "sanitizer_device_why": info.get("sanitizer_device_why"),
        "venv_pip": info.get("venv_pip"),
        "test_requirements_missing": info.get("test_requirements_missing") or [],
        "missing": build + other,
    }
    if device and build:
        reason = f"missing: {', '.join(build + other)} — build requirements missing, not building"
        return FAILED, f"{reason}; {'; '.join(facts)}", figures
    where = "" if device else " (none needed without a device: make build installs .venv's)"
    missing = f"missing: {', '.join(build + other)}{where}" if build + other else "nothing missing"
    return PASSED, f"{missing}; {'; '.join(facts)}", figures


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

IMPORT_SCRIPT = r"""
import json
import moecomm, moecomm.wire.cuda as gpu, torch
info = {"moecomm": moecomm.__file__, "torch": torch.__version__,
        "torch_cuda_available": torch.cuda.is_available(),
        "built_cuda": gpu.built("_cuda"), "built_nvshmem": gpu.built("_nvshmem"),
        "available": gpu.available(), "device_count": gpu.device_count(),
        "why_unavailable": gpu.why_unavailable()}
print("GPU-CHECK-IMPORT " + json.dumps(info))
"""


def judge_import(info: dict, device: bool) -> tuple[bool, str]:
    """(ok, reason) of the import check: with a device both GPU modules must be built and see
    it; without, nvcc here means _cuda must have been built."""
    reason = (
        f"_cuda built: {info['built_cuda']}, _nvshmem built: {info['built_nvshmem']}, "
        f"devices: {info['device_count']}"
    )
    problems = []
    if device:
        if not info["built_cuda"]:
            problems.append("moecomm._cuda was not built")
        if not info["built_nvshmem"]:
            problems.append("moecomm._nvshmem was not built")
        if not info["available"]:
            problems.append(f"moecomm sees no device ({info['why_unavailable']})")
    elif not info["built_cuda"] and shutil.which("nvcc"):
        problems.append("nvcc is here but moecomm._cuda was not built")
    return (not problems), ("; ".join(problems) if problems else reason)


def build_key(root: Path, python: str) -> str:
    """A hash of what the build depends on: csrc/, bindings/, cmake/, CMakeLists.txt,
    pyproject.toml, the test requirements, and the Python that builds it."""
    h = hashlib.sha256()
    files = []
    for d in BUILD_INPUT_DIRS:
        files += sorted(p for p in (root / d).rglob("*") if p.is_file())
    files += [root / f for f in BUILD_INPUT_FILES]
    for p in files:
        if p.exists():
            h.update(p.relative_to(root).as_posix().encode() + b"\0")
            h.update(p.read_bytes() + b"\0")
    h.update(f"python={os.path.realpath(python)}\0MOECOMM_WITH_CUDA=ON".encode())
    return h.hexdigest()


def stamp_path(root: Path) -> Path:
    return root / GPU_VENV / STAMP_NAME


def build_current(root: Path, python: str) -> tuple[bool, str]:
    """(current, why): whether .gpu-venv holds a build of exactly these inputs."""
    if not (root / GPU_VENV / "bin" / "python").exists():
        return False, f"no {GPU_VENV} (a fresh machine)"
    stamp = stamp_path(root)
    if not stamp.exists():
        return False, "no build stamp (the last build did not finish)"
    try:
        got = json.loads(stamp.read_text())
    except ValueError:
        return False, "unreadable build stamp"
    if got.get("key") != build_key(root, python):
        return False, "the build's inputs or its Python changed"
    return True, f"stamp {got['key'][:12]} of {got.get('built_utc', '?')}"


def write_stamp(root: Path, python: str) -> None:
    data = {
        "key": build_key(root, python),
        "python": os.path.realpath(python),
        "built_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    stamp_path(root).write_text(json.dumps(data) + "\n")


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


def make_venv(path: Path) -> dict:
    """A venv that sees the running Python's packages, also when that Python is itself a venv
    (--system-site-packages alone would show the base interpreter's, not the image's torch).
    Its pip: its own from ensurepip (bundled with CPython, offline), else the running Python's
    pip seen through the .pth."""
    import site
    import venv

    info: dict = {}
    if not (path / "bin" / "python").exists():
        try:
            venv.EnvBuilder(system_site_packages=False, with_pip=True, symlinks=True).create(path)
            info["venv_pip"] = "its own, from ensurepip"
        except Exception as exc:  # a distribution's Python without ensurepip
            shutil.rmtree(path, ignore_errors=True)
            venv.EnvBuilder(system_site_packages=False, with_pip=False, symlinks=True).create(path)
            info["venv_pip"] = f"this Python's, through the .pth (ensurepip failed: {exc})"
    parents = [p for p in site.getsitepackages() if os.path.isdir(p)]
    user = site.getusersitepackages()
    if isinstance(user, str) and os.path.isdir(user):
        parents.append(user)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    own = path / "lib" / ver / "site-packages"
    own.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in parents)
    (own / "_gpu_check_parent.pth").write_text(lines)
    r = subprocess.run(
        [str(path / "bin" / "python"), "-m", "pip", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    info["pip"] = (r.stdout or r.stderr).strip()
    info["pip_ok"] = r.returncode == 0
    return info


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
    out = left_out(run.ctx) if any(f in dict(files) for f, _, _ in UNCARRIED) else {}
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
