"""Processes in the network-namespace lab (moecomm.netns) for tests that build "hosts": each
started with its output in a log file, and waited for by a line of that log."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest


def start_logged(lab, host, argv, log: Path):
    """argv in `host`'s namespaces, stdout and stderr into `log`."""
    f = open(log, "w")  # noqa: SIM115 - the child writes it; closed with the lab
    return lab.spawn(host, argv, env=dict(os.environ), stdout=f, stderr=f)


def wait_for_log(log: Path, text: str, proc, deadline: float) -> None:
    """Until `text` shows in `log`; fails with the log's tail if `proc` exits or time runs out."""
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[-1]!r} exited ({proc.returncode}): {log.read_text()[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"no {text!r} in {log} in time: {log.read_text()[-3000:] if log.exists() else ''}")
