"""A whole deployment as separate processes, as a user runs it: the membership monitor
(`python -m moecomm.membership.monitor`), three `moecomm expert-server` processes with every
expert on two of them, and `moecomm frontend --stages 2` (standby stages on, the CLI default)
with live re-placement (`--eplb-interval`, `--min-replicas 2`), all found through the monitor.

Every process is started through the process harness (moecomm.testing: a process group of its
own, ready once it announced its URL) and stopped with its group; every line each one prints is
kept in its log, which is how the stage pids are known."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time

import httpx
import moecomm
from deployment_plan import CLIENT_TIMEOUT_S, NUM_SERVERS, NUM_STAGES
from membership_procs import MonitorProcess
from moecomm.testing import Proc, Processes, wait_all

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


class Deployment:
    def __init__(self, checkpoint: str, threads: int = 1):
        self.checkpoint = str(checkpoint)
        self.threads = str(threads)
        self.token = "tok-" + secrets.token_hex(8)
        self.env = dict(os.environ, MOECOMM_MONITOR_TOKEN=self.token)
        self.monitor = MonitorProcess(token=self.token)
        self.monitor_pids: list[int] = []
        self.procs = Processes(env=self.env)
        self.servers: list[Proc | None] = [None] * len(HOSTED)
        self.server_generation = [0] * len(HOSTED)
        self.all_procs: list[Proc] = []  # every server and front end ever started
        self.frontend: Proc | None = None
        self.url = ""
        self._leftovers: list[str] = []

    # ------------------------------------------------------------------ start / stop
    def start(self) -> None:
        self.monitor_url = self.monitor.start()
        self.monitor_pids.append(self.monitor.proc.pid)
        for i in range(len(HOSTED)):
            self._spawn_server(i)
        wait_all(self.servers, START_S)
        args = ["frontend", "--checkpoint", self.checkpoint, "--model-name", MODEL_NAME]
        args += ["--monitor", self.monitor_url, "--stages", "2", "--port", "0"]
        args += ["--threads", self.threads, "--max-batch-tokens", str(MAX_BATCH_TOKENS)]
        args += ["--timeout", str(CLIENT_TIMEOUT_S), "--min-replicas", "2"]
        args += ["--eplb-interval", str(EPLB_INTERVAL_S)]
        args += ["--eplb-min-tokens", str(EPLB_MIN_TOKENS)]
        self.frontend = self.procs.moecomm("frontend", args, wait=False)
        self.all_procs.append(self.frontend)
        self.url = self.frontend.wait_ready(START_S)["url"]

    def _spawn_server(self, i: int) -> None:
        gen = self.server_generation[i]
        self.server_generation[i] += 1
        args = ["expert-server", "--checkpoint", self.checkpoint, "--experts", HOSTED[i]]
        args += ["--monitor", self.monitor_url, "--id", f"chaos-server-{i}-{gen}"]
        args += ["--threads", self.threads]
        p = self.procs.moecomm(f"server {i} ({gen})", args, wait=False)
        self.servers[i] = p
        self.all_procs.append(p)

    def restart_server(self, i: int) -> None:
        """Starts server `i` again (a new id: the dead one's lease may still be listed)."""
        old = self.servers[i]
        if old is not None:
            old.popen.wait(STOP_S)  # killed: reaped here
            old.stop()  # its group gone, its shared memory reaped
        self._spawn_server(i)

    def restart_monitor(self) -> None:
        """The monitor again, on its port (it keeps nothing: everyone registers again)."""
        self.monitor.proc.wait(STOP_S)
        self.monitor.start()
        self.monitor_pids.append(self.monitor.proc.pid)

    def close(self) -> dict[str, int | None]:
        """Stops everything: the front end first (its stages still call the servers), then the
        servers, then the monitor. Exit codes by process name."""
        codes = {}
        # Not cleaned up after: a process or segment left behind is a leak to report.
        if self.frontend is not None:
            codes["frontend"] = self.frontend.stop(signal.SIGINT, STOP_S, clean=False)
        for p in self.servers:
            if p is not None:
                codes[p.name] = p.stop(signal.SIGINT, STOP_S, clean=False)
        if self.monitor.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.monitor.proc.pid, signal.SIGCONT)
            self.monitor.stop()
        self._leftovers = self._find_leftovers()  # reaps what it finds
        self.procs.close(signal.SIGINT, STOP_S)  # every group gone, its shared memory reaped
        return codes

    # ------------------------------------------------------------------ state
    def stage_pids(self) -> list[int]:
        """The serving pipeline's stage pids (the front end prints them at start and after
        every replacement)."""
        last = self.frontend.wait_output("pipeline stage pids: ", 1, 0)[-1]
        return [int(p) for p in last.split(": ", 1)[1].split()]

    def every_stage_pid(self) -> set[int]:
        """Every stage process the front end ever started: serving and standby."""
        out = set()
        for ln in self.frontend.lines():
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
                p.wait_ready(max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # exited or late: said with its output
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
        """After close: no process of the deployment was left, no shared-memory segment of any
        (checked by close(), before its teardown reaped everything)."""
        return list(self._leftovers)

    def _find_leftovers(self) -> list[str]:
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
