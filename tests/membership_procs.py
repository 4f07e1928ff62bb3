"""Real processes for membership tests: the embedded monitor and etcd, on 127.0.0.1 only.

Each is started with a deadline on every wait and stopped by its PID (SIGTERM, then SIGKILL),
whether the test passed or not."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from moecomm.membership import Member, connect_membership
from moecomm.testing import Processes

# Starting a Python process that imports moecomm (and so torch) takes seconds on a loaded
# 2-core machine; a minute means something is broken, not slow.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
HEALTH_POLL_S = 0.05
# etcd's own timing, scaled down so 1 s leases are allowed: minimum lease TTL is 1.5 election
# timeouts rounded up to whole seconds, and a single-member cluster never loses its leader.
ETCD_HEARTBEAT_MS = 10
ETCD_ELECTION_MS = 50
ETCD_APT_PACKAGE = "etcd-server"
APT_TIMEOUT_S = 600.0
# Debian installs etcd in /usr/bin; a test runner's PATH may be trimmed.
ETCD_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/usr/local/bin"])


MONITOR_TOKEN = "tok-" + secrets.token_hex(8)
# Test leases: short so the suite is quick, long enough for a loaded 2-core machine to heartbeat.
TTL_S = 1.0
# Long-poll/stream read of test watchers: short so closing a watcher is quick.
POLL_S = 0.3
# How late after its TTL a loss may be reported. Monitor: its 50 ms expiry sweep plus
# scheduling. etcd: it checks lease expiry every 500 ms, plus scheduling.
LOSS_SLACK_S = {"embedded": 0.6, "etcd": 1.1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_pid(proc: subprocess.Popen) -> None:
    """SIGTERM, wait, SIGKILL: by PID, never by name."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(STOP_TIMEOUT_S)


class MonitorProcess:
    """`python -m moecomm.membership.monitor` on 127.0.0.1, started through the process harness
    (ready when its ready file names its URL); restartable on the same port. `proc` is the
    running monitor's Popen."""

    def __init__(self, token: str = ""):
        self.token = token
        self.port = 0
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self.handle = None  # the harness's Proc of the running monitor
        # Logs and ready files of every (re)start, removed with this object.
        self._dir = tempfile.TemporaryDirectory(prefix="moecomm-monitor-")
        self._procs = Processes(self._dir.name)

    def start(self) -> str:
        cmd = [sys.executable, "-m", "moecomm.membership.monitor", "--port", str(self.port)]
        env = {"MOECOMM_MONITOR_TOKEN": self.token}
        self.handle = self._procs.start("monitor", cmd, env=env, timeout=START_TIMEOUT_S)
        self.proc = self.handle.popen
        self.url = self.handle.url
        self.port = int(self.url.rsplit(":", 1)[1])
        return self.url

    def stop(self) -> None:
        """SIGTERM, SIGKILL after STOP_TIMEOUT_S (by process group, never by name)."""
        if self.handle is not None:
            self.handle.stop(signal.SIGTERM, STOP_TIMEOUT_S)

    def restart(self, fresh: bool = True) -> None:
        # The monitor keeps nothing: every restart is "fresh".
        self.stop()
        self.start()


def etcd_binary() -> str:
    """The etcd binary; installs Debian's etcd-server when it is missing. Raises RuntimeError
    (the tests then fail, never skip) when it cannot be had."""
    found = shutil.which("etcd", path=ETCD_SEARCH_PATH)
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise RuntimeError(f"etcd is not installed and cannot be: install {ETCD_APT_PACKAGE}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", ETCD_APT_PACKAGE]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=APT_TIMEOUT_S)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
    found = shutil.which("etcd", path=ETCD_SEARCH_PATH)
    if not found:
        raise RuntimeError(f"{ETCD_APT_PACKAGE} installed but no etcd binary on PATH")
    return found


class EtcdProcess:
    """A single-member etcd on 127.0.0.1 with free ports and a temporary data dir."""

    def __init__(self, binary: str, workdir: str):
        self.binary = binary
        self.workdir = workdir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.generation = 0
        self.data_dir = ""
        self.proc: subprocess.Popen | None = None
        self.endpoint = f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        if not self.data_dir:
            self.data_dir = os.path.join(self.workdir, f"data{self.generation}")
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self.binary,
            "--name=moecomm-test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=moecomm-test={peer}",
            f"--heartbeat-interval={ETCD_HEARTBEAT_MS}",
            f"--election-timeout={ETCD_ELECTION_MS}",
        ]
        log_path = os.path.join(self.workdir, f"etcd{self.generation}.log")
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {log_path}")
            try:
                if httpx.get(f"{client}/health", timeout=1.0).json().get("health") == "true":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(HEALTH_POLL_S)
        stop_pid(self.proc)
        raise RuntimeError(f"etcd not healthy within {START_TIMEOUT_S} s; see {log_path}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc)

    def restart(self, fresh: bool = False) -> None:
        """Same data dir (leases and keys survive), or a fresh one (everything is forgotten)."""
        self.stop()
        if fresh:
            self.generation += 1
            self.data_dir = ""
        self.start()


class Backend:
    """One backend under test; closes everything a test opened, in reverse order."""

    def __init__(self, name: str, url: str, token: str, process):
        self.name = name
        self.url = url
        self.token = token
        self.process = process
        self.loss_slack = LOSS_SLACK_S[name]
        self.uid = secrets.token_hex(4)
        self._opened = []
        self.ms = self.connect()

    def connect(self):
        return self.track(connect_membership(self.url, self.token, poll_s=POLL_S))

    def track(self, obj):
        self._opened.append(obj)
        return obj

    def member(self, role: str, n: int, **kw) -> Member:
        return Member(role, f"{role[0]}{n}-{self.uid}", **kw)

    def register(self, member: Member, ttl: float = TTL_S):
        return self.track(self.ms.register(member, ttl))

    def watch(self, **kw):
        return self.track(self.ms.watch(**kw))

    def mine(self, members) -> list[Member]:
        return [m for m in members if m.member_id.endswith(self.uid)]

    def restart(self, fresh: bool) -> None:
        self.process.restart(fresh)

    def close(self) -> None:
        for obj in reversed(self._opened):
            with contextlib.suppress(Exception):
                obj.close()


def open_backend(request, name: str) -> Backend:
    """A Backend over the session's monitor or etcd process, closed when the test ends."""
    if name == "embedded":
        mon = request.getfixturevalue("monitor_process")
        b = Backend("embedded", mon.url, MONITOR_TOKEN, mon)
    else:
        etcd = request.getfixturevalue("etcd_process")
        prefix = "/t" + secrets.token_hex(4)
        b = Backend("etcd", f"etcd://{etcd.endpoint}{prefix}", "", etcd)
    request.addfinalizer(b.close)
    return b
