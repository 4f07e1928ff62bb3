"""Shared fixtures: GPU/long-run markers, machine skips, nvcc-built check programs (built once
per run), and spawned processes that are always cleaned up."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

# Slot poisoning (read once, own the copy): every slot released in this process or in any process
# the suite starts is overwritten first, so a read after release fails every time. Set before
# moecomm is imported: channels read the switch at import time.
os.environ["MOECOMM_POISON_SLOTS"] = "1"

import moecomm
import moecomm.wire.cuda
import pytest
import torch
from long_run import LONG  # MOECOMM_LONG=1 also runs the tests marked slow
from membership_procs import MONITOR_TOKEN, EtcdProcess, MonitorProcess, etcd_binary
from moecomm import prefork
from moecomm.testing.procs import SERVING_PRELOAD

# Triton reads TRITON_INTERPRET when it is first imported, and modules collected before
# tests/ops (transformers, imported by the tokenizer and parity tests) import it: without a
# device the interpreter is the only way the kernels run, so choose it before anything else.
# With a CUDA torch that sees a device the kernels must be compiled: say so explicitly, so that a
# later `setdefault("TRITON_INTERPRET", "1")` (tests/ops/conftest.py, collected after this file)
# changes nothing, for this process and for the processes the tests start (GPU expert servers
# inherit the environment).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    os.environ.setdefault("TRITON_INTERPRET", "0")


def _gpu_skip_reason() -> str | None:
    """Why tests marked gpu cannot run, or None. A device counts when moecomm sees one
    (cuda-python or moecomm._cuda: the GPU checks need only nvcc and a driver) or torch does;
    torch here is usually the CPU build, so it alone would skip every check on a GPU machine."""
    if torch.cuda.is_available():
        return None
    why = moecomm.wire.cuda.why_unavailable()
    return None if why is None else f"needs a CUDA device ({why})"


# A GPU run (make gpu-check) sets this: a gpu test that would be skipped there fails instead, so a
# run in which every GPU test skipped (no device seen, module not built) cannot pass.
REQUIRE_GPU = os.environ.get("MOECOMM_REQUIRE_GPU") == "1"

# The one exception: a skip that names a property of the machine the device tool lent, which no
# build or code change can alter (one GPU without MPS for a test that needs two GPUs, ...). Such
# a test skips through `skip_for_machine(reason)` (or the fixture of that name); its reason
# starts with this tag, and MOECOMM_REQUIRE_GPU=1 leaves it a skip, reported with the reason.
# Every other skip of a gpu test (no device seen, a module not built, a missing tool) still
# fails under MOECOMM_REQUIRE_GPU=1.
MACHINE_SKIP_TAG = "[machine] "


def skip_for_machine(reason: str):
    """Skips the calling test for a reason that is the machine's (see MACHINE_SKIP_TAG)."""
    pytest.skip(MACHINE_SKIP_TAG + reason)


def is_machine_skip(why: str) -> bool:
    """Whether a skip reason (as pytest reports it: "Skipped: ...") came from skip_for_machine."""
    return why.removeprefix("Skipped: ").startswith(MACHINE_SKIP_TAG)


# The processes the tests start (the harness's commands, and workers through
# prefork.process_context()) are forked from one server that imported torch, moecomm and the
# `moecomm` commands once: ~2 s less per start-up, more on a loaded machine. Tests of how a
# command starts its own processes (the demos) run it as production does. MOECOMM_TEST_FRESH=1
# starts every process fresh; a GPU run (MOECOMM_REQUIRE_GPU=1) always does.
def pytest_sessionstart(session):
    if os.environ.get("MOECOMM_TEST_FRESH") != "1" and not REQUIRE_GPU:
        prefork.enable((*prefork.DEFAULT_PRELOAD, *SERVING_PRELOAD))


def pytest_terminal_summary(terminalreporter):
    if prefork.enabled():
        counts = ", ".join(f"{n} {how}" for how, n in prefork.starts.most_common())
        terminalreporter.write_line(f"processes started by the tests: {counts or 'none'}")


@pytest.fixture(name="skip_for_machine")
def skip_for_machine_fixture():
    """`skip_for_machine(reason)` for test modules (a fixture: test files do not import
    conftest)."""
    return skip_for_machine


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if not (REQUIRE_GPU and report.skipped and item.get_closest_marker("gpu")):
        return
    if hasattr(report, "wasxfail") or (item.get_closest_marker("slow") and not LONG):
        return  # an expected failure, or a long trial this run did not ask for
    longrepr = report.longrepr
    why = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    if is_machine_skip(why):
        return  # the machine's, not moecomm's: stays a skip, with its reason
    report.outcome = "failed"
    report.longrepr = f"MOECOMM_REQUIRE_GPU=1 and this gpu test would be skipped: {why}"


def pytest_collection_modifyitems(config, items):
    gpu_skip = _gpu_skip_reason()
    for item in items:
        # The marker, not item.keywords: keywords also hold directory names (tests/gpu/).
        if item.get_closest_marker("gpu") and gpu_skip is not None:
            item.add_marker(pytest.mark.skip(reason=gpu_skip))
        if item.get_closest_marker("slow") and not LONG:
            item.add_marker(pytest.mark.skip(reason="long trial: set MOECOMM_LONG=1"))


@pytest.fixture
def transport():
    return moecomm.ShmTransport()


@pytest.fixture
def reaper():
    """Collects spawned servers/processes; at teardown stops or kills them and removes any
    segment they left behind, whether the test passed or not."""
    servers, procs = [], []

    class Reaper:
        def server(self, s):
            servers.append(s)
            return s

        def process(self, p):
            procs.append(p)
            return p

    yield Reaper()
    pids = []
    for s in servers:
        pids.append(s.process.pid)
        s.stop(timeout=5.0)
    for p in procs:
        pids.append(p.pid)
        if p.is_alive():
            p.kill()  # a forked one may be reaped already
        p.join(5.0)
    for pid in pids:
        moecomm.reap_stale_segments(pid)


# One monitor process and one etcd process per session, for every test that needs a membership.
@pytest.fixture(scope="session")
def monitor_process():
    mon = MonitorProcess(token=MONITOR_TOKEN)
    mon.start()
    yield mon
    mon.stop()


@pytest.fixture(scope="session")
def etcd_process(tmp_path_factory):
    try:
        binary = etcd_binary()
    except (RuntimeError, OSError) as exc:
        pytest.fail(f"the etcd backend tests need etcd (make etcd): {exc}")
    proc = EtcdProcess(binary, str(tmp_path_factory.mktemp("etcd")))
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """One intra-op thread: test tensors are far too small to split, and on the shared two-core
    machines a second spinning thread makes small steps several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory):
    """The tiny random Mixtral-layout checkpoint (seed 0), written once per session."""
    from moecomm_serving.model.tiny import write_tiny

    path = tmp_path_factory.mktemp("tiny-mixtral")
    write_tiny(str(path), "mixtral", seed=0)
    return path


# ---------------------------------------------------------------------------------------------
# nvcc-built check programs (tests/ops/cuda/*.cu): built once per test run, not once per test.
# Keyed by the content of every file the build can read (the sources given and every header and
# source under csrc/) and the command line, so an edit between runs rebuilds, and two tests
# asking for the same program with the same flags share one binary (and one failure).

ROOT = Path(__file__).resolve().parents[1]
NVCC_BUILD_TIMEOUT_S = 900


def _nvcc_inputs_digest(sources: list[Path], cmd: list[str]) -> str:
    h = hashlib.sha256("\0".join(cmd).encode())
    csrc = sorted(p for p in (ROOT / "csrc").rglob("*") if p.is_file())
    for path in [*sources, *csrc]:
        h.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def nvcc_program(tmp_path_factory):
    """`build(name, sources, flags=()) -> Path`: the executable nvcc makes from `sources` (with
    -I csrc and `flags`), built at the first request of this run and reused afterwards. Skips
    without nvcc; a failed build fails every test that asks for it, with nvcc's output."""
    nvcc = shutil.which("nvcc")
    root_dir = tmp_path_factory.mktemp("nvcc")
    built: dict[str, Path | str] = {}

    def build(name: str, sources, flags=()) -> Path:
        if nvcc is None:
            pytest.skip("needs nvcc to build the CUDA check")
        srcs = [Path(s).resolve() for s in sources]
        cmd = [nvcc, "-std=c++17", *flags, f"-I{ROOT / 'csrc'}", *map(str, srcs)]
        key = f"{name}-{_nvcc_inputs_digest(srcs, cmd)}"
        got = built.get(key)
        if got is None:
            exe = root_dir / key / name
            exe.parent.mkdir(parents=True, exist_ok=True)
            run = subprocess.run(
                [*cmd, "-o", str(exe)],
                capture_output=True,
                text=True,
                timeout=NVCC_BUILD_TIMEOUT_S,
                check=False,
            )
            got = (
                exe
                if run.returncode == 0
                else f"nvcc failed ({run.returncode}):\n" + (run.stdout + run.stderr)[-6000:]
            )
            built[key] = got
        if isinstance(got, str):
            pytest.fail(f"{name}: {got}")
        return got

    return build
