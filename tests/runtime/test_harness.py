"""The process harness (moecomm.testing.procs) and the readiness signal (moecomm.readiness), with
real processes and real shared memory: a ready file is what a process announced, an early exit
is reported with the process's output, a start-up deadline holds, and teardown leaves no process
of the group and no shared-memory segment behind, even when the body raised."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time

import httpx
import moecomm
import pytest
from moecomm.errors import DeadlineExceededError
from moecomm.readiness import READY_FILE_ENV, announce_ready, read_ready
from moecomm.testing import Processes, ProcessStartError, wait_all

PY = sys.executable
# Generous for a Python start on a loaded two-core machine; the deadline test measures against
# its own short deadline, not this.
START_S = 60.0
# How late a deadline may fire (one poll interval plus scheduling on a loaded machine).
DEADLINE_SLACK_S = 5.0

# A leader that makes a shm segment, starts a child (same process group) that makes one too and
# ignores SIGINT and SIGTERM (only a group SIGKILL ends it), announces both pids, then sleeps.
LEADER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    import moecomm
    from moecomm.readiness import announce_ready
    t = moecomm.ShmTransport()
    region = t.create_region(4096)
    child = subprocess.Popen([sys.executable, "-c", '''
    import signal, sys, time
    import moecomm
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    t = moecomm.ShmTransport()
    r = t.create_region(4096)
    print("child ready", flush=True)
    time.sleep(600)
    '''], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "child ready"
    announce_ready("test-leader", child=child.pid, region=region.handle)
    print("leader serving", flush=True)
    time.sleep(600)
    """
)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_announce_writes_the_file_atomically_and_only_when_asked(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    monkeypatch.delenv(READY_FILE_ENV, raising=False)
    assert announce_ready("x", url="http://a") is None
    assert not path.exists()
    monkeypatch.setenv(READY_FILE_ENV, str(path))
    info = announce_ready("x", url="http://a", layers=[0, 1])
    assert info == {"role": "x", "pid": os.getpid(), "url": "http://a", "layers": [0, 1]}
    assert json.loads(path.read_text()) == info
    assert read_ready(path) == info
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left
    assert read_ready(tmp_path / "absent.json") is None
    (tmp_path / "bad.json").write_text("{half")
    with pytest.raises(ValueError, match=r"bad\.json"):
        read_ready(tmp_path / "bad.json")


def test_the_monitor_announces_its_url(tmp_path):
    with Processes(tmp_path) as procs:
        mon = procs.start("monitor", [PY, "-m", "moecomm.membership.monitor", "--port", "0"])
        assert mon.ready["role"] == "monitor" and mon.ready["pid"] == mon.pid
        assert mon.url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{mon.url}/health", timeout=10).status_code == 200
        # for people: the URL is still printed
        assert mon.wait_output("http://", timeout=10) == [mon.url]
    assert mon.poll() is not None


def test_an_early_exit_is_reported_with_its_output(tmp_path):
    script = "import sys; print('cannot serve: no such checkpoint', flush=True); sys.exit(3)"
    t0 = time.monotonic()
    with Processes(tmp_path) as procs, pytest.raises(ProcessStartError) as err:
        procs.start("doomed", [PY, "-c", script], timeout=START_S)
    assert "no such checkpoint" in str(err.value) and "(3)" in str(err.value)
    assert time.monotonic() - t0 < START_S / 2  # reported as it happened, not at the deadline


def test_the_start_deadline_holds_and_names_the_laggard(tmp_path):
    script = "import time; print('still loading', flush=True); time.sleep(600)"
    with Processes(tmp_path) as procs:
        slow = procs.spawn("slow", [PY, "-c", script])
        slow.wait_output("still loading", timeout=START_S)  # started: only the wait is timed
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="slow did not announce") as err:
            slow.wait_ready(timeout=1.0)
        took = time.monotonic() - t0
        assert 1.0 <= took < 1.0 + DEADLINE_SLACK_S
        assert "still loading" in str(err.value)
    assert slow.poll() is not None


def test_a_child_announcement_is_not_the_process_s_own(tmp_path):
    """A process's children inherit the variable; only the started process's pid counts."""
    script = textwrap.dedent(
        """
        import subprocess, sys, time
        from moecomm.readiness import announce_ready
        subprocess.run([sys.executable, "-c",
            "from moecomm.readiness import announce_ready; announce_ready('child')"], check=True)
        time.sleep(1.0)
        announce_ready("parent", url="http://parent")
        time.sleep(600)
        """
    )
    with Processes(tmp_path) as procs:
        p = procs.start("parent", [PY, "-c", script], timeout=START_S)
        assert p.ready["role"] == "parent" and p.url == "http://parent"


def test_teardown_kills_the_group_and_reaps_its_shm_even_when_the_body_raises(tmp_path):
    with (
        pytest.raises(RuntimeError, match="the test body failed"),
        Processes(tmp_path) as procs,
    ):
        leader = procs.start("leader", [PY, "-c", LEADER], timeout=START_S)
        child = leader.ready["child"]
        pids = (leader.pid, child)
        held = {pid: moecomm.list_segments(pid) for pid in pids}
        assert all(held.values()), held  # each made a segment: the check below can fail
        raise RuntimeError("the test body failed")
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(leader.pid) and _gone(child), "a process of the group survived teardown"
    assert moecomm.list_segments(leader.pid) == [] and moecomm.list_segments(child) == []


def test_processes_start_together_and_fail_together(tmp_path):
    """start_many waits for all against one deadline; one that exits fails the start at once,
    and close() still stops the one that was fine."""
    ok = "from moecomm.readiness import announce_ready; import time; "
    ok += "announce_ready('ok', url='http://ok'); time.sleep(600)"
    with Processes(tmp_path) as procs:
        a, b = procs.start_many([("a", [PY, "-c", ok]), ("b", [PY, "-c", ok])], timeout=START_S)
        assert a.url == b.url == "http://ok" and a.pid != b.pid
        c = procs.spawn("c", [PY, "-c", ok])
        d = procs.spawn("d", [PY, "-c", "raise SystemExit('d refuses')"])
        with pytest.raises(ProcessStartError, match="d refuses"):
            wait_all([c, d], START_S)
        codes = procs.close()
    assert codes["a"] is not None and codes["c"] is not None and codes["d"] == 1


def test_restart_gives_a_fresh_ready_file(tmp_path):
    ok = "from moecomm.readiness import announce_ready; import time, os; "
    ok += "announce_ready('ok', url=f'http://{os.getpid()}'); time.sleep(600)"
    with Processes(tmp_path) as procs:
        first = procs.start("s", [PY, "-c", ok], timeout=START_S)
        with pytest.raises(ValueError, match="still runs"):
            procs.restart("s")
        first.kill()
        second = procs.restart("s", timeout=START_S)
        assert second.pid != first.pid and second.url == f"http://{second.pid}"
        assert procs["s"] is second
    assert first.poll() is not None and second.poll() is not None


def test_stop_reports_a_stopped_process_s_exit(tmp_path):
    """A SIGSTOPped process cannot act on SIGINT: stop() continues it first."""
    ok = "from moecomm.readiness import announce_ready; import time; "
    ok += "announce_ready('ok'); time.sleep(600)"
    with Processes(tmp_path) as procs:
        p = procs.start("p", [PY, "-c", ok], timeout=START_S)
        os.kill(p.pid, signal.SIGSTOP)
        code = p.stop(timeout=START_S)
    # Python ends on an unhandled SIGINT by that signal: acted on, not SIGKILLed (-9)
    assert code == -signal.SIGINT
