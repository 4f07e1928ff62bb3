"""moecomm.prefork, the fork server the suite's processes start from: a forked command cannot be
told from a fresh `python -m` (argv, sys.path, working directory, environment, session, exit
codes, atexit handlers, SIGINT, its own random state), a worker gets its parent's environment
and output streams, and an environment that a preloaded module would have read differently
starts the process fresh instead."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time

import pytest
from moecomm import prefork
from moecomm.testing import Processes

# A command that reports how it was started, registers an atexit handler, then (with "wait")
# serves until SIGINT, or exits with the code it was given.
PROBE = textwrap.dedent(
    """
    import atexit, json, os, sys, time
    import numpy as np
    from moecomm.readiness import announce_ready

    atexit.register(lambda: print("atexit ran", flush=True))
    facts = {
        "name": __name__,
        "argv": sys.argv,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "probe_var": os.environ.get("PREFORK_PROBE"),
        "session_leader": os.getsid(0) == os.getpid(),
        "group_leader": os.getpgid(0) == os.getpid(),
        "draw": float(np.random.rand()),
        "stdin": os.read(0, 10).decode(),
    }
    print("facts " + json.dumps(facts), flush=True)
    if sys.argv[1] == "wait":
        announce_ready("probe")
        try:
            while True:
                time.sleep(0.05)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise SystemExit(0)
    raise SystemExit(int(sys.argv[1]))
    """
)
WAIT_S = 60.0


@pytest.fixture
def probe_dir(tmp_path, monkeypatch):
    (tmp_path / "prefork_probe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def facts_of(proc) -> dict:
    line = proc.wait_output("facts ", timeout=WAIT_S)[0]
    return json.loads(line.removeprefix("facts "))


def run_probe(procs, name, args, env=None):
    return procs.spawn(name, [sys.executable, "-m", "prefork_probe", *args], env)


@pytest.mark.timeout(120)
def test_a_forked_command_starts_as_a_fresh_one_would(probe_dir):
    assert prefork.enabled(), "the suite forks its processes (tests/conftest.py)"
    env = {"PREFORK_PROBE": "seen"}
    with Processes() as procs:
        forked = run_probe(procs, "forked", ["3"], env)
        fresh = run_probe(procs, "fresh", ["3"], {**env, "OMP_NUM_THREADS": "1"})
        assert type(forked.popen).__name__ == "ForkedPopen"
        assert type(fresh.popen).__name__ == "Popen"  # a thread count differs: started fresh
        twin = run_probe(procs, "twin", ["3"], env)
        codes = {p.name: p.popen.wait(WAIT_S) for p in (forked, fresh, twin)}
        assert codes == {"forked": 3, "fresh": 3, "twin": 3}
        seen = {p.name: facts_of(p) for p in (forked, fresh, twin)}
        for p in (forked, fresh, twin):
            assert p.output().rstrip().endswith("atexit ran"), p.output()
    draws = {name: f.pop("draw") for name, f in seen.items()}
    assert seen["forked"] == seen["fresh"] == seen["twin"]
    assert seen["forked"] == {
        "name": "__main__",
        "argv": [str(probe_dir / "prefork_probe.py"), "3"],
        "path0": str(probe_dir),
        "cwd": str(probe_dir),
        "probe_var": "seen",
        "session_leader": True,
        "group_leader": True,
        "stdin": "",
    }
    assert len(set(draws.values())) == 3, draws  # each its own random state


@pytest.mark.timeout(120)
def test_a_forked_command_stops_on_sigint_and_dies_by_kill(probe_dir):
    with Processes() as procs:
        a = run_probe(procs, "a", ["wait"])
        b = run_probe(procs, "b", ["wait"])
        a.wait_ready(WAIT_S)
        b.wait_ready(WAIT_S)
        assert type(a.popen).__name__ == "ForkedPopen"
        assert a.stop(signal.SIGINT) == 0
        assert "interrupted" in a.output() and "atexit ran" in a.output()
        b.kill()
        assert b.poll() == -signal.SIGKILL
        assert "atexit ran" not in b.output()
        with pytest.raises(ProcessLookupError):
            os.kill(b.pid, 0)


def _report(conn, key):
    print(f"worker output {key}", flush=True)
    conn.send((os.environ.get(key), os.getpid()))


@pytest.mark.timeout(120)
def test_a_worker_has_its_parents_environment_and_output(monkeypatch, capfd):
    ctx = prefork.process_context()
    assert isinstance(ctx, prefork._Context)
    monkeypatch.setenv("PREFORK_PROBE_WORKER", "set after the server started")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_report, args=(child, "PREFORK_PROBE_WORKER"))
    p.start()
    assert parent.poll(WAIT_S)
    value, pid = parent.recv()
    p.join(WAIT_S)
    assert p.exitcode == 0 and pid == p.pid
    assert value == "set after the server started"
    deadline = time.monotonic() + 5
    out = ""
    while "worker output" not in out and time.monotonic() < deadline:
        out += capfd.readouterr().out
        time.sleep(0.05)
    assert "worker output PREFORK_PROBE_WORKER" in out


def test_an_environment_read_at_import_starts_fresh(monkeypatch):
    assert prefork.forkable(os.environ)
    monkeypatch.setenv("MOECOMM_POISON_SLOTS", "0")  # read by moecomm.wire.channel at import
    assert not prefork.forkable(os.environ)
    assert prefork.process_context().get_start_method() == "spawn"
    log = os.devnull
    argv = [sys.executable, "-m", "prefork_probe", "0"]
    assert prefork.popen_module(argv, dict(os.environ), log) is None
    assert prefork.popen_module(["python3", "-m", "x"], {}, log) is None  # not this interpreter
