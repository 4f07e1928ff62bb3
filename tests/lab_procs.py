"""Processes in the network-namespace lab (moecomm.netns) for tests that build "hosts": each
started with its output in a log file; a moecomm process is waited for by its ready file
(moecomm.readiness), anything else by a line of its log."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from moecomm.readiness import READY_FILE_ENV, read_ready

# How often a wait looks again.
POLL_S = 0.05


def ready_file(log: Path) -> Path:
    """Where the process logging to `log` announces it serves."""
    return log.with_suffix(".ready.json")


def start_logged(lab, host, argv, log: Path):
    """argv in `host`'s namespaces, stdout and stderr into `log`, its ready file beside it (the
    lab's hosts share this file system)."""
    ready_file(log).unlink(missing_ok=True)
    env = {**os.environ, READY_FILE_ENV: str(ready_file(log))}
    f = open(log, "w")  # noqa: SIM115 - the child writes it; closed with the lab
    return lab.spawn(host, argv, env=env, stdout=f, stderr=f)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


def wait_ready(log: Path, proc, deadline: float) -> dict:
    """What the moecomm process logging to `log` announced once it serves; fails with the log's
    tail if `proc` exits or time runs out. (Its pid is that of its own PID namespace: not
    checked.)"""
    while time.monotonic() < deadline:
        info = read_ready(ready_file(log))
        if info is not None:
            return info
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[-1]!r} exited ({proc.returncode}): {_tail(log)}")
        time.sleep(POLL_S)
    pytest.fail(f"{log.name}: no ready file in time: {_tail(log)}")


def wait_for_log(log: Path, text: str, proc, deadline: float) -> None:
    """Until `text` shows in `log` (a process that is not moecomm's, or an event other than
    readiness); fails with the log's tail if `proc` exits or time runs out."""
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[-1]!r} exited ({proc.returncode}): {_tail(log)}")
        time.sleep(POLL_S)
    pytest.fail(f"no {text!r} in {log} in time: {_tail(log)}")
