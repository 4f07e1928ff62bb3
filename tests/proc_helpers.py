"""Process control for fault tests (starting and stopping processes is moecomm.testing's)."""

import os
import signal
import time


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP, then wait until the kernel reports the process stopped: kill() returns before
    the signal is delivered, and a spinning server could still answer in between."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop within {timeout} s")
