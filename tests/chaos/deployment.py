"""A whole deployment as separate processes, as a user runs it: the membership monitor
(`python -m moecomm.membership.monitor`), three `moecomm expert-server` processes with every
expert on two of them, and `moecomm frontend --stages 2` (standby stages on, the CLI default)
with live re-placement (`--eplb-interval`, `--min-replicas 2`), all found through the monitor.

Every process is started and stopped by PID; every line each one prints is kept (a thread
reads each pipe, so none fills), which is how the stage pids are known."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import httpx
import moecomm
from deployment_plan import CLIENT_TIMEOUT_S, NUM_SERVERS, NUM_STAGES
from membership_procs import MonitorProcess

CLI = [sys.executable, "-m", "moecomm_serving.cli"]
MODEL_NAME = "tiny"
# Every expert of the tiny model (16 per layer) on two of the three servers: 0-4 on 0 and 2,
# 5-10 on 0 and 1, 11-15 on 1 and 2. One server down leaves every expert served.
HOSTED = ("0-10", "5-15", "0-4,11-15")
assert len(HOSTED) == NUM_SERVERS
# Starting a process that imports torch takes seconds on a loaded 2-core machine; the front end
# starts four stage processes (serving and standby) as well.
START_S = 180.0
STOP_S = 30.0
# Live re-placement pass interval: several passes per trial, so moves run while faults strike.
EPLB_INTERVAL_S = 3.0
EPLB_MIN_TOKENS = 16
# Tokens per engine step: a few requests' prefill at once.
MAX_BATCH_TOKENS = 32
# After a trial: the deployment is whole again (every server listed by the monitor, the front
# end answers /health) within this long, or the trial fails.
RESTORE_S = 60.0
POLL_S = 0.1
# A replaced pipeline's stages are reaped in the background (the driver's grace of 1 s, then
# SIGKILL; the standby builder closes retired pipelines first): gone within this long.
STRAY_STAGE_S = 30.0
HTTP_TIMEOUT_S = 10.0


class Proc:
    """A CLI process and every line it printed."""

    def __init__(self, name: str, cmd: list[str], env: dict | None = None):
        self.name = name
        self.popen = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True, name=f"read-{name}").start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self) -> None:
        for line in self.popen.stdout:
            with self.cond:
                self.lines.append(line.rstrip())
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_line(self, prefix: str, count: int, timeout: float) -> list[str]:
        """The first `count` lines starting with `prefix`; raises after `timeout` s or when the
        process exited without printing them."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = [ln for ln in self.lines if ln.startswith(prefix)]
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                if left <= 0 or self.popen.poll() is not None:
                    tail = "\n".join(self.lines[-30:])
                    raise RuntimeError(
                        f"{self.name}: no {count} lines {prefix!r} within {timeout} s "
                        f"(exit code {self.popen.poll()}); last lines:\n{tail}"
                    )
                self.cond.wait(min(left, 1.0))

    def count(self, prefix: str) -> int:
        with self.cond:
            return sum(ln.startswith(prefix) for ln in self.lines)

    def stop(self) -> int | None:
        """SIGINT (the CLIs stop cleanly on it), SIGKILL after STOP_S; the exit code."""
        p = self.popen
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGINT
                p.send_signal(signal.SIGINT)
            try:
                p.wait(STOP_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(STOP_S)
        return p.returncode


class Deployment:
    def __init__(self, checkpoint: str, threads: int = 1):
        self.checkpoint = str(checkpoint)
        self.threads = str(threads)
        self.token = "tok-" + secrets.token_hex(8)
        self.env = dict(os.environ, MOECOMM_MONITOR_TOKEN=self.token)
        self.monitor = MonitorProcess(token=self.token)
        self.monitor_pids: list[int] = []
        self.servers: list[Proc | None] = [None] * len(HOSTED)
        self.server_generation = [0] * len(HOSTED)
        self.all_procs: list[Proc] = []  # every server and front end ever started
        self.frontend: Proc | None = None
        self.url = ""

    # ------------------------------------------------------------------ start / stop
    def start(self) -> None:
        self.monitor_url = self.monitor.start()
        self.monitor_pids.append(self.monitor.proc.pid)
        for i in range(len(HOSTED)):
            self._spawn_server(i)
        for i in range(len(HOSTED)):
            self.servers[i].wait_line("expert server", 1, START_S)
        args = ["frontend", "--checkpoint", self.checkpoint, "--model-name", MODEL_NAME]
        args += ["--monitor", self.monitor_url, "--stages", "2", "--port", "0"]
        args += ["--threads", self.threads, "--max-batch-tokens", str(MAX_BATCH_TOKENS)]
        args += ["--timeout", str(CLIENT_TIMEOUT_S), "--min-replicas", "2"]
        args += ["--eplb-interval", str(EPLB_INTERVAL_S)]
        args += ["--eplb-min-tokens", str(EPLB_MIN_TOKENS)]
        self.frontend = Proc("frontend", [*CLI, *args], self.env)
        self.all_procs.append(self.frontend)
        line = self.frontend.wait_line("frontend ", 1, START_S)[0]
        self.url = line.split(" listening on ")[1]

    def _spawn_server(self, i: int) -> None:
        gen = self.server_generation[i]
        self.server_generation[i] += 1
        args = ["expert-server", "--checkpoint", self.checkpoint, "--experts", HOSTED[i]]
        args += ["--monitor", self.monitor_url, "--id", f"chaos-server-{i}-{gen}"]
        args += ["--threads", self.threads]
        p = Proc(f"server {i} ({gen})", [*CLI, *args], self.env)
        self.servers[i] = p
        self.all_procs.append(p)

    def restart_server(self, i: int) -> None:
        """Starts server `i` again (a new id: the dead one's lease may still be listed)."""
        old = self.servers[i]
        if old is not None:
            old.popen.wait(STOP_S)  # killed: reaped here
        self._spawn_server(i)

    def restart_monitor(self) -> None:
        """The monitor again, on its port (it keeps nothing: everyone registers again)."""
        self.monitor.proc.wait(STOP_S)
        self.monitor.proc.stdout.close()
        self.monitor.start()
        self.monitor_pids.append(self.monitor.proc.pid)

    def close(self) -> dict[str, int | None]:
        """Stops everything: the front end first (its stages still call the servers), then the
        servers, then the monitor. Exit codes by process name."""
        codes = {}
        if self.frontend is not None:
            codes["frontend"] = self.frontend.stop()
        for p in self.servers:
            if p is not None:
                codes[p.name] = p.stop()
        if self.monitor.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.monitor.proc.pid, signal.SIGCONT)
            self.monitor.stop()
        return codes

    # ------------------------------------------------------------------ state
    def stage_pids(self) -> list[int]:
        """The serving pipeline's stage pids (the front end prints them at start and after
        every replacement)."""
        last = self.frontend.wait_line("pipeline stage pids: ", 1, 0)[-1]
        return [int(p) for p in last.split(": ", 1)[1].split()]

    def every_stage_pid(self) -> set[int]:
        """Every stage process the front end ever started: serving and standby."""
        out = set()
        with self.frontend.cond:
            lines = list(self.frontend.lines)
        for ln in lines:
            if ln.startswith("pipeline stage pids: "):
                out |= {int(p) for p in ln.split(": ", 1)[1].split()}
            elif ln.startswith("pipeline standby stages ready: pids "):
                out |= {int(p) for p in ln.split(" pids ", 1)[1].split()}
        return out

    def every_pid(self) -> dict[int, str]:
        out = {pid: f"monitor (pid {pid})" for pid in self.monitor_pids}
        for p in self.all_procs:
            out[p.pid] = p.name
        for pid in self.every_stage_pid():
            out[pid] = f"stage (pid {pid})"
        return out

    def metrics(self) -> dict[str, float]:
        """The front end's /metrics samples by name (with labels)."""
        r = httpx.get(f"{self.url}/metrics", timeout=HTTP_TIMEOUT_S)
        r.raise_for_status()
        out = {}
        for ln in r.text.splitlines():
            if ln and not ln.startswith("#"):
                name, value = ln.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def listed_servers(self) -> int:
        """Expert servers the monitor lists (0 while it is down)."""
        from moecomm.membership import connect_membership

        ms = connect_membership(self.monitor_url, self.token)
        try:
            return len(ms.list_members("server"))
        finally:
            ms.close()

    def wait_whole(self) -> list[str]:
        """After a trial: every server process running and listed by the monitor, the front end
        healthy. Problems, if not within RESTORE_S."""
        deadline = time.monotonic() + RESTORE_S
        for i, p in enumerate(self.servers):
            try:
                p.wait_line("expert server", 1, max(0.0, deadline - time.monotonic()))
            except RuntimeError as exc:
                return [f"server {i} did not come back: {exc}"]
        last = ""
        while time.monotonic() < deadline:
            try:
                listed = self.listed_servers()
                h = httpx.get(f"{self.url}/health", timeout=HTTP_TIMEOUT_S)
                if listed >= len(HOSTED) and h.status_code == 200:
                    return []
                last = f"monitor lists {listed} servers; front end /health {h.status_code}"
            except Exception as exc:  # the monitor or the front end not answering yet
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(POLL_S)
        return [f"deployment not whole within {RESTORE_S} s: {last}"]

    def stray_stages(self) -> list[str]:
        """While serving: stage processes beyond the serving and the standby pipeline (those of
        replaced pipelines must be gone) still running after STRAY_STAGE_S."""
        deadline = time.monotonic() + STRAY_STAGE_S
        while True:
            live = {pid for pid in self.every_stage_pid() if _state(pid) not in ("Z", "")}
            if len(live) <= 2 * NUM_STAGES or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        if len(live) <= 2 * NUM_STAGES:
            return []
        return [
            f"{len(live)} stage processes running (pids {sorted(live)}), at most "
            f"{2 * NUM_STAGES} expected (serving and standby)"
        ]

    def leftovers(self) -> list[str]:
        """After close: no process of the deployment left, no shared-memory segment of any."""
        problems = []
        for pid, name in self.every_pid().items():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            alive = True
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive = False
            if alive and _state(pid) not in ("Z", ""):
                problems.append(f"{name} is still running")
            left = moecomm.list_segments(pid)
            if left:
                problems.append(f"{name} left shared-memory segments {left}")
                moecomm.reap_stale_segments(pid)
        return problems


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""
