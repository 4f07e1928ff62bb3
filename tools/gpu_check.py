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
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_reports import (
    GPU_TEST_TIMEOUT_S,
    judge_collect,
    judge_gpu_tests,
    judge_pytest,
    sanitizer_step,
)
from gpu_check_run import (
    DEFAULT_BUDGET_S,
    FAILED,
    PASSED,
    SKIPPED,
    Context,
    Result,
    Step,
    exit_code_of,
    pack_logs,
    print_summary,
    run_steps,
    write_summary,
)

HOST_TESTS = ["tests/gpu/test_gpu_host.py", "tests/test_cuda_build.py"]
WHEELS_DIR = ".gpu-wheels"
REQUIREMENTS = "tools/gpu-requirements.txt"
GPU_VENV = ".gpu-venv"
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
