"""The preflight probe of tools/gpu_check.py, run with the Python that is to build moecomm (the
GPU image's, or .venv's without a device): what the machine and that Python have, as one JSON
line ``GPU-CHECK-PREFLIGHT {...}``. It judges nothing (tools/gpu_check_machine.py does); every
outside command has a short timeout. Standard library only, plus what it probes for.

    python tools/gpu_check_probe.py [--wheels DIR] [--venv DIR] [--requirements FILE]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

TAG = "GPU-CHECK-PREFLIGHT"


def _run(cmd: list[str], timeout: float = 15.0) -> tuple[int, str]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return r.returncode, (r.stdout + r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, f"{type(exc).__name__}: {exc}"


def gpus() -> dict:
    """GPU count, models, driver and its CUDA version, compute mode, from nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {"nvidia_smi": None, "gpu_count": 0, "gpus": []}
    q = "index,name,driver_version,memory.total,compute_mode"
    rc, out = _run([smi, f"--query-gpu={q}", "--format=csv,noheader"])
    rows = []
    if rc == 0:
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 5:
                rows.append(
                    dict(
                        zip(
                            ("index", "name", "driver", "memory", "compute_mode"),
                            parts,
                            strict=True,
                        )
                    )
                )
    info = {"nvidia_smi": smi, "gpu_count": len(rows), "gpus": rows}
    if rc != 0:
        info["nvidia_smi_error"] = out.splitlines()[-1][:200] if out else f"exit {rc}"
    if rows:
        info["driver"] = rows[0]["driver"]
        info["compute_mode"] = rows[0]["compute_mode"]
        rc, out = _run([smi])
        m = re.search(r"CUDA Version:\s*([\d.]+)", out)
        if m:
            info["driver_cuda"] = m.group(1)
    return info


def kernel() -> dict:
    """The kernel the machine reports (``uname -r``, ``uname -v``): a sandbox such as gVisor
    answers with its own (4.4.0), and there compute-sanitizer has been refused the device."""
    u = platform.uname()
    return {"uname_r": u.release, "uname_v": u.version}


# Opens the device the way any CUDA program does (cuInit, a context, one allocation) through the
# driver library alone, so it needs neither torch nor moecomm: run under compute-sanitizer it
# shows whether the tool can attach to a process that uses the device.
OPEN_DEVICE = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
for step, rc in (("cuInit", lambda: cuda.cuInit(0)),
                 ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0)),
                 ("cuDevicePrimaryCtxRetain",
                  lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
                 ("cuCtxSetCurrent", lambda: cuda.cuCtxSetCurrent(ctx)),
                 ("cuMemAlloc", lambda: cuda.cuMemAlloc_v2(ctypes.byref(ptr), 64))):
    code = rc()
    if code != 0:
        print(f"DEVICE-OPEN-FAILED {step} CUresult {code}")
        sys.exit(3)
print("DEVICE-OPEN-OK")
"""
# compute-sanitizer's own start plus a CUDA context: seconds; it must leave the preflight time.
SANITIZER_OPEN_TIMEOUT_S = 10.0


def sanitizer_device(sanitizer: str | None, gpu_count: int) -> dict:
    """Whether compute-sanitizer can open the device: the OPEN_DEVICE program under
    ``compute-sanitizer --tool memcheck``. {"sanitizer_device": True/False/None (not tried),
    "sanitizer_device_why": its last lines when it could not}."""
    if sanitizer is None:
        return {"sanitizer_device": None, "sanitizer_device_why": "no compute-sanitizer"}
    if not gpu_count:
        return {"sanitizer_device": None, "sanitizer_device_why": "no GPU listed"}
    cmd = [sanitizer, "--tool", "memcheck", sys.executable, "-c", OPEN_DEVICE]
    rc, out = _run(cmd, timeout=SANITIZER_OPEN_TIMEOUT_S)
    if rc == 0 and "DEVICE-OPEN-OK" in out:
        return {"sanitizer_device": True}
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    why = " | ".join(lines[-3:])[:300] or f"exit {rc}, no output"
    return {"sanitizer_device": False, "sanitizer_device_why": f"exit {rc}: {why}"}


def mps() -> dict:
    """Whether an MPS control daemon or server runs (their processes, the pipe folder)."""
    procs = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if os.path.basename(cmd).startswith("nvidia-cuda-mps"):
            procs.append(f"{os.path.basename(cmd)} (pid {p.name})")
    pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    pipe = os.path.exists(os.path.join(pipe_dir, "control"))
    control = shutil.which("nvidia-cuda-mps-control")
    running = bool(procs) or pipe
    what = "running: " + ", ".join(procs or [f"pipe {pipe_dir}/control"]) if running else "off"
    return {"mps": what, "mps_running": running, "mps_control": control}


def version_of(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # anything an import can raise: report it, judge elsewhere
        return f"not importable: {type(exc).__name__}: {str(exc)[:120]}"
    return str(getattr(mod, "__version__", "present"))


def tool_version(name: str, args: tuple = ("--version",)) -> dict:
    path = shutil.which(name)
    if path is None:
        return {"path": None}
    _, out = _run([path, *args])
    # "cmake version 3.25.1", "1.11.1" (ninja), "Cuda compilation tools, release 13.0, V13.0.48"
    m = re.search(r"release ([\d.]+), V([\d.]+)", out) or re.search(r"(\d+\.\d+(?:\.\d+)?)", out)
    return {"path": path, "version": m.group(m.lastindex) if m else out[:80]}


def nvshmem() -> dict:
    home = os.environ.get("NVSHMEM_HOME")
    if home and Path(home, "include", "nvshmem.h").exists():
        return {"nvshmem": f"NVSHMEM_HOME={home}"}
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        base = Path(next(iter(spec.submodule_search_locations)))
        if (base / "include" / "nvshmem.h").exists():
            return {"nvshmem": f"wheel {base}"}
        return {"nvshmem": None, "nvshmem_error": f"{base} has no include/nvshmem.h"}
    return {"nvshmem": None}


def torch_info() -> dict:
    try:
        import torch
    except Exception as exc:
        return {"torch": f"not importable: {type(exc).__name__}: {str(exc)[:120]}"}
    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    try:
        info["torch_cuda_available"] = bool(torch.cuda.is_available())
        if info["torch_cuda_available"]:
            info["torch_device_count"] = torch.cuda.device_count()
            info["torch_gpu"] = torch.cuda.get_device_name(0)
            info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except Exception as exc:
        info["torch_cuda_available"] = False
        info["torch_cuda_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return info


def pip_info() -> dict:
    """How a venv made over this Python gets pip: ensurepip's bundled wheel (offline), else this
    Python's own pip seen through the venv's .pth; which one the check will use."""
    info: dict = {}
    try:
        import ensurepip

        info["ensurepip"] = ensurepip.version()
    except Exception as exc:
        info["ensurepip"] = None
        info["ensurepip_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    pip = version_of("pip")
    info["pip"] = pip if pip and not pip.startswith("not importable") else None
    if info["ensurepip"]:
        info["venv_pip"] = f"ensurepip (bundled pip {info['ensurepip']})"
    elif info["pip"]:
        info["venv_pip"] = f"this Python's pip {info['pip']} (through the venv's .pth)"
    else:
        info["venv_pip"] = None
    return info


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(path: Path) -> list[str]:
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0])
    return names


def test_requirements(req: Path, wheels: Path | None, venv: Path | None) -> dict:
    """The test requirements this Python lacks, and of those, which have no carried wheel."""
    extra = [str(p) for p in venv.glob("lib/python*/site-packages")] if venv else []
    have_wheel = set()
    if wheels and wheels.is_dir():
        have_wheel = {_canon(w.name.split("-")[0]) for w in wheels.glob("*.whl")}
    missing, uncarried = [], []
    for name in requirement_names(req):
        found = any(True for _ in importlib.metadata.distributions(name=name, path=sys.path))
        found = found or any(True for _ in importlib.metadata.distributions(name=name, path=extra))
        if not found:
            missing.append(name)
            if _canon(name) not in have_wheel:
                uncarried.append(name)
    return {
        "test_requirements_missing": missing,
        "test_requirements_uncarried": uncarried,
        "wheels_dir": str(wheels) if wheels and wheels.is_dir() else None,
    }


def probe(req: Path | None = None, wheels: Path | None = None, venv: Path | None = None) -> dict:
    info = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "machine": platform.machine(),
    }
    info.update(kernel())
    info.update(gpus())
    info.update(mps())
    info.update(pip_info())
    info["scikit_build_core"] = version_of("scikit_build_core")
    info["pybind11"] = version_of("pybind11")
    for tool in ("cmake", "ninja"):
        got = tool_version(tool)
        if got["path"] is None:  # the PyPI wheel puts its binary next to the module
            v = version_of(tool)
            got = {"path": f"python module {tool}", "version": v} if "not" not in v else got
        info[tool] = got
    info.update(nvshmem())
    info["triton"] = version_of("triton")
    info.update(torch_info())
    info["nvcc"] = tool_version("nvcc")
    sanitizer = None
    here = Path(__file__).resolve().parent
    if str(here) not in sys.path:
        sys.path.insert(0, str(here))
    try:
        from gpu_check_reports import find_sanitizer

        sanitizer = find_sanitizer()
    except ImportError:
        sanitizer = shutil.which("compute-sanitizer")
    info["compute_sanitizer"] = sanitizer
    info.update(sanitizer_device(sanitizer, info.get("gpu_count", 0)))
    if req is not None and req.exists():
        info.update(test_requirements(req, wheels, venv))
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requirements", type=Path, default=None)
    ap.add_argument("--wheels", type=Path, default=None)
    ap.add_argument("--venv", type=Path, default=None)
    a = ap.parse_args(argv)
    info = probe(a.requirements, a.wheels, a.venv)
    for k, v in info.items():
        print(f"{k}: {v}")
    print(f"{TAG} {json.dumps(info)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
