"""`moecomm demo --pd`: prefill and decode front ends behind `moecomm router`, end to end, and
its shutdown (also on Ctrl-C) with nothing left running."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import moecomm
import pytest

CLI = [sys.executable, "-m", "moecomm_serving.cli"]
# monitor, two expert servers, prefill and decode front ends, router
PD_CHILDREN = 6
# Start-up of six processes and a few prompts on a busy 2-core machine: ~35 s when quiet.
DEMO_TIMEOUT_S = 240
# After the demo's exit its children (each stopped with a deadline by the demo) must be gone.
GONE_TIMEOUT_S = 30
CHILD_NAMES = (
    "router",
    "decode-frontend",
    "prefill-frontend",
    "expert-server-1",
    "expert-server-0",
    "monitor",
)


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int]) -> list[int]:
    """The pids still alive after GONE_TIMEOUT_S."""
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while any(alive(k) for k in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [k for k in pids if alive(k)]


def run_until(p: subprocess.Popen, prefix: str, lines: list[str]) -> list[int]:
    """Reads the demo's output into `lines` until a line starts with `prefix`; the demo's
    children then."""
    deadline = time.monotonic() + DEMO_TIMEOUT_S
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        assert line, f"the demo ended before {prefix!r}:\n" + "".join(lines[-40:])
        lines.append(line)
        if line.startswith(prefix):
            return children_of(p.pid)
    raise AssertionError(f"no {prefix!r} line within {DEMO_TIMEOUT_S} s")


def read_rest(p: subprocess.Popen, lines: list[str]) -> str:
    """The demo's whole output once it exits. Read through the same buffered pipe as
    run_until (communicate() would read the raw pipe and lose what readline buffered); the
    test's timeout bounds a demo that never exits."""
    lines += p.stdout.readlines()
    p.wait(GONE_TIMEOUT_S)
    return "".join(lines)


def kill_all(p: subprocess.Popen, kids: list[int]) -> None:
    """Whatever a failed test left: the demo and its children (each in its own session)."""
    if p.poll() is None:
        p.kill()
        p.wait(GONE_TIMEOUT_S)
    for k in kids:
        if alive(k):
            with contextlib.suppress(ProcessLookupError):  # gone in between
                os.killpg(k, signal.SIGKILL)


def metric(text: str, name: str, after: str = "") -> float:
    """The value of the first `name` line the demo printed after the line `after`."""
    text = text[text.index(after) :]
    for ln in text.splitlines():
        if ln.strip().startswith(name + " "):
            return float(ln.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} line in the demo's output")


@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_demo_pd_runs_through_the_router_and_shuts_down_cleanly():
    p = subprocess.Popen([*CLI, "demo", "--pd"], stdout=subprocess.PIPE, text=True)
    kids: list[int] = []
    lines: list[str] = []
    try:
        # the router is up: every child has started
        kids = run_until(p, "6. ", lines)
        assert len(kids) == PD_CHILDREN
        text = read_rest(p, lines)
        assert p.returncode == 0, text[-4000:]
        assert "demo OK" in text
        assert "completions through the router" in text
        assert text.count(" -> ") == 3  # three completions
        assert "streamed chat (sampled, seed 7)" in text
        assert "'status': 'ok'" in text
        # every request went prefill -> decode: 3 completions and the streamed chat
        assert metric(text, "moecomm_router_handoffs_total") >= 4
        assert metric(text, "moecomm_router_kv_bytes_total") > 0
        sent = 'moecomm_kv_handoff_handoffs_total{direction="sent"}'
        received = 'moecomm_kv_handoff_handoffs_total{direction="received"}'
        handoffs = metric(text, "moecomm_router_handoffs_total")
        assert metric(text, sent, after="prefill front end:") == handoffs
        assert metric(text, received, after="decode front end:") == handoffs
        assert metric(text, 'moecomm_router_retries_total{phase="decode"}') == 0
        for name in CHILD_NAMES:
            assert f"stopped {name} (exit 0)" in text
        assert not wait_gone(kids)
        leaked = [s for k in kids for s in moecomm.list_segments(k)]
        assert not leaked, f"shared-memory segments left: {leaked}"
    finally:
        kill_all(p, kids)


@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_ctrl_c_during_the_pd_start_up_stops_every_process():
    p = subprocess.Popen([*CLI, "demo", "--pd"], stdout=subprocess.PIPE, text=True)
    kids: list[int] = []
    lines: list[str] = []
    try:
        # the prefill front end printed its first line: the interrupt lands in the middle of its
        # start-up, before the decode front end and the router
        kids = run_until(p, "  [prefill-frontend]", lines)
        assert len(kids) == PD_CHILDREN - 2
        p.send_signal(signal.SIGINT)
        rest = read_rest(p, lines)
        assert "interrupted" in rest and p.returncode == 130, rest[-3000:]
        assert "stopped prefill-frontend" in rest and "stopped decode-frontend" not in rest
        assert not wait_gone(kids)
    finally:
        kill_all(p, kids)


@pytest.mark.parametrize(
    ("extra", "why"),
    [(["--stages", "2"], "--stages 1"), (["--device", "cuda"], "--device cpu")],
)
def test_demo_pd_refuses_stages_and_cuda(extra, why):
    out = subprocess.run(
        [*CLI, "demo", "--pd", *extra], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert "moecomm demo --pd" in out.stderr and why in out.stderr
    assert "1. writing" not in out.stdout  # refused before anything started
