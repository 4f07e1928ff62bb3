"""What the GPU check (tools/gpu_check.py) learns about the machine and how it judges it, apart
from the stages that run things (gpu_check_stages): the preflight's verdict from the probe's
facts, the Pythons the tests run with and the .gpu-venv made for them, the build stamp that lets
a current build be reused, the import check after a build, the test files whose needs the
machine lacks (a machine skip, named), and the readers of a command's output that the stages
share. Standard library only: it runs before anything is installed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_plan import ENGINES_TEST, NIXL_TEST
from gpu_check_reports import FAILED, PASSED
from gpu_check_types import Context

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

# ---------------------------------------------------------------------------------------------
# A command's output


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


# ---------------------------------------------------------------------------------------------
# The Pythons, and the files the machine cannot run


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


# ---------------------------------------------------------------------------------------------
# build: the import check, the build stamp, the venv


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
