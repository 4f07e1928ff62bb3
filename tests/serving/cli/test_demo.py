"""`moecomm demo` end to end, and Ctrl-C in the middle of it: nothing is left running."""

import os
import signal
import subprocess
import sys
import time

import pytest
from moecomm.testing import forking_env

CLI = [sys.executable, "-m", "moecomm_serving.cli"]


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(300)
def test_demo_runs_and_shuts_down_cleanly():
    out = subprocess.run([*CLI, "demo"], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "demo OK" in text
    assert text.count(" -> ") == 3  # three completions
    assert "'status': 'ok'" in text  # health ran a real forward
    assert "TTFT mean" in text and "failovers 0" in text
    for name in ("frontend", "expert-server-1", "expert-server-0", "monitor"):
        assert f"stopped {name} (exit 0)" in text


@pytest.mark.timeout(300)
def test_demo_with_two_pipeline_stages():
    """`moecomm demo --stages 2`: the front end's model runs in two stage processes, each a
    client of both expert servers (token equality with the single-process model is
    tests/serving/api/test_frontend_pipeline.py's)."""
    out = subprocess.run(
        [*CLI, "demo", "--stages", "2"],
        capture_output=True,
        text=True,
        timeout=280,
        env=forking_env(),  # its processes forked: how the demo starts them is tested above
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "demo OK" in text and "pipeline stages ready: layers 0-1 | 2-3" in text
    assert "'status': 'ok'" in text
    assert text.count(" -> ") == 3  # three completions
    for ln in text.splitlines():  # both servers did expert work for the stages
        if ln.strip().startswith("expert server") and "served" in ln:
            assert int(ln.split("served ")[1].split()[0]) > 0
    for name in ("frontend", "expert-server-1", "expert-server-0", "monitor"):
        assert f"stopped {name} (exit 0)" in text


@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_process():
    p = subprocess.Popen([*CLI, "demo"], stdout=subprocess.PIPE, text=True)
    kids = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            assert line, "the demo ended before its front end started"
            if line.startswith("4. "):
                kids = children_of(p.pid)
                break
        assert len(kids) >= 3  # monitor and two expert servers at least
        p.send_signal(signal.SIGINT)
        rest = p.communicate(timeout=120)[0]
        assert "interrupted" in rest and p.returncode == 130
        deadline = time.monotonic() + 30
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(k) for k in kids)
    finally:
        if p.poll() is None:
            p.kill()
        for k in kids:
            if alive(k):
                os.kill(k, signal.SIGKILL)
