"""Every Triton kernel moecomm.ops launches, compiled (not interpreted) for a Hopper GPU on a
machine without one.

The CPU tests run the kernels under the Triton interpreter, which accepted a kernel the real
compiler refused on the H200 (a plain Python global read inside a @triton.jit function). Here
the launches the ops make are recorded under the interpreter, in every dtype they support
(float32, float16, bfloat16, float8_e4m3 and int8 activations with per-token and per-block
scales), with the signature Triton's launcher derives from the real arguments; each distinct
launch is then compiled to a cubin for sm_90 in a process without TRITON_INTERPRET. The
helper (triton_compile_helper.py) does both steps, each in its own process, since Triton reads
TRITON_INTERPRET when it is imported and this pytest may have imported it interpreted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HELPER = Path(__file__).with_name("triton_compile_helper.py")
KERNELS = Path(__file__).resolve().parents[2] / "python/moecomm/ops/_triton_moe_kernels.py"
# The kernels the ops launch, by name: a new one must be launched by the recording too.
LAUNCHED = ["down_kernel", "gate_up_kernel", "shrink_kernel", "tile_map_kernel"]
# Two compile processes: the machine running the CPU suite has two cores.
COMPILE_PROCS = 2
# Deadlines of the helper's processes: recording runs the kernels interpreted, compiling runs
# MLIR and ptxas per launch; both take seconds alone, minutes on a loaded 2-core machine.
RECORD_TIMEOUT_S = 300
COMPILE_TIMEOUT_S = 600


def _env(tmp: Path, interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    # A cache of this run's own: what is compiled here is compiled, not read from an old run.
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")
    # Triton 3.9 warns that the FP fusion default will change; the compile is the same.
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return env


def _run(cmd: list, env: dict, timeout: float) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[2:4]} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"


def compile_records(tmp: Path, kernels_file: Path, records: list) -> list[dict]:
    """The helper's compile step over records, split across COMPILE_PROCS processes."""
    chunks = [records[i::COMPILE_PROCS] for i in range(COMPILE_PROCS)]
    procs = []
    for i, chunk in enumerate(chunks):
        if not chunk:
            continue
        src, out = tmp / f"part{i}.json", tmp / f"compiled{i}.json"
        src.write_text(json.dumps({"records": chunk}))
        cmd = [sys.executable, str(HELPER), "compile", str(kernels_file), str(src), str(out)]
        proc = subprocess.Popen(
            cmd, env=_env(tmp, False), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        procs.append((i, out, proc))
    results: list = [None] * len(records)
    try:
        for i, out, proc in procs:
            text, _ = proc.communicate(timeout=COMPILE_TIMEOUT_S)
            assert proc.returncode == 0, f"compile process {i} failed:\n{text[-3000:]}"
            for j, res in enumerate(json.loads(out.read_text())):
                results[i + j * COMPILE_PROCS] = res
    finally:
        for _, _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("triton-record")
    out = tmp / "records.json"
    _run([sys.executable, str(HELPER), "record", str(out)], _env(tmp, True), RECORD_TIMEOUT_S)
    return json.loads(out.read_text())


def _name(rec: dict) -> str:
    ptrs = [t for k, t in rec["signature"].items() if k in ("x_ptr", "w13_ptr", "h_ptr")]
    flags = {k: v for k, v in rec["constexprs"].items() if k.isupper() and "BLOCK" not in k}
    return f"{rec['kernel']}({', '.join(ptrs)}; {flags})"


def test_the_recording_covers_every_kernel_and_dtype(recorded):
    assert recorded["kernels"] == LAUNCHED
    launched = {r["kernel"] for r in recorded["records"]}
    assert launched == set(LAUNCHED), f"never launched: {set(LAUNCHED) - launched}"
    gate_up = [r["signature"] for r in recorded["records"] if r["kernel"] == "gate_up_kernel"]
    pairs = {(s["x_ptr"], s["w13_ptr"]) for s in gate_up}
    for w in ("*fp32", "*fp16", "*bf16"):
        assert {(w, w), ("*fp8e4nv", w), ("*i8", w)} <= pairs, (w, sorted(pairs))
    down = {(r["signature"]["h_ptr"], r["constexprs"]["HAS_SCORES"])
            for r in recorded["records"] if r["kernel"] == "down_kernel"}  # fmt: skip
    assert down == {(t, s) for t in ("*fp32", "*fp16", "*bf16") for s in (False, True)}


def test_every_launch_compiles_for_hopper(recorded, tmp_path):
    results = compile_records(tmp_path, KERNELS, recorded["records"])
    failed = [
        f"{_name(rec)}: {res['error']}"
        for rec, res in zip(recorded["records"], results, strict=True)
        if not res["ok"]
    ]
    assert not failed, "\n\n".join(failed)
    assert all(res["cubin_bytes"] > 0 for res in results)


def test_the_compiler_refuses_what_the_interpreter_ran(recorded, tmp_path):
    """The H200's failure, on this machine: a scratch copy of the kernels whose tile-map
    sentinel is a plain int again (the interpreter runs it; the compiler must refuse it)."""
    text = KERNELS.read_text()
    fixed = "_TILE_END_SENTINEL = tl.constexpr(2**30)"
    assert fixed in text
    scratch = tmp_path / "kernels_plain_global.py"
    scratch.write_text(text.replace(fixed, "_TILE_END_SENTINEL = 2**30"))
    tile_map = [r for r in recorded["records"] if r["kernel"] == "tile_map_kernel"]
    (res,) = compile_records(tmp_path, scratch, tile_map)
    assert not res["ok"]
    assert res["error"].startswith("CompilationError") and "_TILE_END_SENTINEL" in res["error"]
