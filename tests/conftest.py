"""Shared fixtures: GPU/long-run markers, and spawned processes that are always cleaned up."""

from __future__ import annotations

import os
import signal

# Slot poisoning (read once, own the copy): every slot released in this process or in any process
# the suite starts is overwritten first, so a read after release fails every time. Set before
# moecomm is imported: channels read the switch at import time.
os.environ["MOECOMM_POISON_SLOTS"] = "1"

import moecomm
import moecomm.cuda
import pytest
import torch
from membership_procs import MONITOR_TOKEN, EtcdProcess, MonitorProcess, etcd_binary

# Triton reads TRITON_INTERPRET when it is first imported, and modules collected before
# tests/ops (transformers, imported by the tokenizer and parity tests) import it: without a
# device the interpreter is the only way the kernels run, so choose it before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Fuzz and round-trip counts: CI defaults, raised for long runs with MOECOMM_LONG=1.
LONG = os.environ.get("MOECOMM_LONG") == "1"


def _gpu_skip_reason() -> str | None:
    """Why tests marked gpu cannot run, or None. A device counts when moecomm sees one
    (cuda-python or moecomm._cuda: the GPU checks need only nvcc and a driver) or torch does;
    torch here is usually the CPU build, so it alone would skip every check on a GPU machine."""
    if torch.cuda.is_available():
        return None
    why = moecomm.cuda.why_unavailable()
    return None if why is None else f"needs a CUDA device ({why})"


# A GPU run (make gpu-check) sets this: a gpu test that would be skipped there fails instead, so a
# run in which every GPU test skipped (no device seen, module not built) cannot pass.
REQUIRE_GPU = os.environ.get("MOECOMM_REQUIRE_GPU") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if not (REQUIRE_GPU and report.skipped and item.get_closest_marker("gpu")):
        return
    if hasattr(report, "wasxfail") or (item.get_closest_marker("slow") and not LONG):
        return  # an expected failure, or a long trial this run did not ask for
    longrepr = report.longrepr
    why = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
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
            os.kill(p.pid, signal.SIGKILL)
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
    from moecomm_serving.tiny import write_tiny

    path = tmp_path_factory.mktemp("tiny-mixtral")
    write_tiny(str(path), "mixtral", seed=0)
    return path
