"""moecomm processes for tests, benchmarks and `moecomm demo`: each started in a process group of
its own with its output in a log file, known to serve once it wrote its ready file
(:mod:`moecomm.readiness`), and stopped (group killed, the shared memory of every process of
the group reaped) whatever happened, through :class:`Processes`.

Stdout is for people: readiness is the ready file, never a parsed line. What a process prints is
kept (`Proc.output`, `Proc.wait_output`) for diagnostics and for the events a test watches that
are not readiness (a front end's stage pids)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from moecomm import prefork
from moecomm.errors import DeadlineExceededError, MoecommError
from moecomm.readiness import READY_FILE_ENV, read_ready

# The `moecomm` command run by this interpreter. A module name, not an import: the library never
# imports the serving layer.
CLI_ARGV = (sys.executable, "-m", "moecomm_serving.cli")
# The membership monitor from its own module: what `moecomm monitor` runs, without the import of
# every command (torch included) that the `moecomm` entry point pays: ~3 s to ready instead of
# ~13 s on a loaded two-core machine (median of 3, load average 22).
MONITOR_CMD = (sys.executable, "-m", "moecomm.membership.monitor")
# The modules of the `moecomm` commands, named (not imported): a test run's fork server imports
# them once for all its processes (moecomm.prefork; PREFORK_ENV passes them to a benchmark).
SERVING_PRELOAD = (
    "moecomm.membership.monitor",
    "moecomm_serving.cli.main",
    "moecomm_serving.cli.frontend",
    "moecomm_serving.cli.expert_server",
    "moecomm_serving.cli.router",
)
# A process that imports torch and loads a checkpoint, several starting at once on a loaded
# two-core machine, serves within this long; longer means it is broken, not slow.
START_TIMEOUT_S = 120.0
# After the stop signal, this long for a clean exit before SIGKILL: a front end with pipeline
# stages stops them (and any standby set still starting) first, tens of seconds on a loaded
# two-core machine.
STOP_TIMEOUT_S = 30.0
# How often a wait for a ready file (or an output line) looks again: a fraction of the start-up
# time of the lightest process (the monitor, ~0.5 s).
POLL_S = 0.02
# How much of a process's output an error carries.
TAIL_CHARS = 3000


def forking_env(env: dict | None = None) -> dict:
    """`env` (default: this process's) for a benchmark or tool a test runs: where this process
    forks its own processes (moecomm.prefork enabled), the child's harness does too."""
    env = dict(os.environ if env is None else env)
    if prefork.enabled():
        env[prefork.PREFORK_ENV] = ",".join(SERVING_PRELOAD)
    return env


class ProcessStartError(MoecommError):
    """A process exited before it announced it serves; the message carries its output's tail."""


def group_pids(pgid: int) -> set[int]:
    """Every live process whose process group is `pgid` (from /proc)."""
    out = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        # fields: state, ppid, pgrp, ... (after the command name)
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.add(int(entry.name))
    return out


class Proc:
    """One process started by :class:`Processes`: its Popen, its log, what it announced."""

    def __init__(self, name: str, argv: Sequence[str], env: dict, log_dir: Path, generation: int):
        self.name = name
        self.argv = list(argv)
        self.env = env
        tag = f"{name}.{generation}" if generation else name
        self.log_path = log_dir / f"{tag}.log"
        self.ready_path = log_dir / f"{tag}.ready.json"
        self.ready: dict | None = None
        self.seen_pids: set[int] = set()  # every process ever seen in the group (shm reaping)
        self._lines: list[str] = []
        self._offset = 0
        self._partial = b""
        full_env = {**env, READY_FILE_ENV: str(self.ready_path)}
        self.log_path.write_bytes(b"")
        # Forked from the preloaded server where tests enabled it (same process, no imports to
        # pay), else started fresh. Either way a group of its own: a Ctrl-C of the test reaches
        # the test only, and teardown can kill the process with everything it started.
        self.popen = prefork.popen_module(self.argv, full_env, self.log_path)
        if self.popen is None:
            with open(self.log_path, "wb") as log:
                self.popen = subprocess.Popen(
                    self.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=full_env,
                    start_new_session=True,
                    preexec_fn=_sigint_default if _sigint_ignored() else None,
                )
        self.seen_pids.add(self.popen.pid)

    # ------------------------------------------------------------------ state
    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        """The URL it announced (wait_ready first)."""
        if self.ready is None or "url" not in self.ready:
            raise RuntimeError(f"{self.name} has announced no URL (ready: {self.ready})")
        return self.ready["url"]

    def poll(self) -> int | None:
        return self.popen.poll()

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    # ------------------------------------------------------------------ output
    def output(self) -> str:
        """Everything it printed so far (stdout and stderr)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, chars: int = TAIL_CHARS) -> str:
        return self.output()[-chars:]

    def lines(self) -> list[str]:
        """Its complete output lines so far (read incrementally: cheap to call often)."""
        with open(self.log_path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        data = self._partial + data
        *done, self._partial = data.split(b"\n")
        self._lines += [ln.decode(errors="replace").rstrip("\r") for ln in done]
        return self._lines

    def count(self, prefix: str) -> int:
        """How many of its lines start with `prefix`."""
        return sum(ln.startswith(prefix) for ln in self.lines())

    def wait_output(self, prefix: str, count: int = 1, timeout: float = START_TIMEOUT_S) -> list:
        """The first `count` lines starting with `prefix`, for events other than readiness;
        raises DeadlineExceededError after `timeout`, ProcessStartError if it exits first."""
        deadline = time.monotonic() + timeout
        while True:
            found = [ln for ln in self.lines() if ln.startswith(prefix)]
            if len(found) >= count:
                return found
            if self.poll() is not None:
                found = [ln for ln in self.lines() if ln.startswith(prefix)]
                if len(found) >= count:
                    return found
                raise ProcessStartError(
                    f"{self.name} exited ({self.poll()}) before {count} lines {prefix!r}:\n"
                    f"{self.tail()}"
                )
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(
                    f"{self.name}: no {count} lines {prefix!r} within {timeout} s:\n{self.tail()}"
                )
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ readiness
    def check_ready(self) -> dict | None:
        """What it announced, or None while it has not; raises ProcessStartError if it exited
        without announcing. Only this process's own announcement counts (a child it started
        inherits the variable: its pid differs)."""
        if self.ready is not None:
            return self.ready
        info = read_ready(self.ready_path)
        if info is not None and info.get("pid") == self.pid:
            self.ready = info
            self.seen_pids |= group_pids(self.pid)
            return info
        if self.poll() is not None:
            raise ProcessStartError(
                f"{self.name} exited ({self.poll()}) before it served: {' '.join(self.argv)}\n"
                f"{self.tail()}"
            )
        return None

    def wait_ready(self, timeout: float = START_TIMEOUT_S, on_output=None) -> dict:
        """Waits up to `timeout` s for its ready file; returns what it announced. `on_output`:
        see wait_all."""
        wait_all([self], timeout, on_output)
        assert self.ready is not None
        return self.ready

    # ------------------------------------------------------------------ signals
    def send_signal(self, sig: int) -> None:
        """`sig` to the process itself (not its group)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def kill(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGKILL to the whole group; returns once the process is reaped (its shared memory
        stays until stop() or Processes.close(): a test may look at it first)."""
        self.seen_pids |= group_pids(self.pid)
        self.signal_group(signal.SIGKILL)
        self.popen.wait(timeout)

    def stop(
        self, sig: int = signal.SIGINT, timeout: float = STOP_TIMEOUT_S, clean: bool = True
    ) -> int | None:
        """`sig` to the process (the moecomm commands stop cleanly on SIGINT), SIGKILL after
        `timeout`; then SIGKILL to whatever is left of its group and the shared memory of every
        process seen in the group reaped. `clean=False` leaves both (the process alone is
        stopped) for a test that checks what a clean stop leaves behind; Processes.close()
        cleans up after it. Returns the exit code (None if it could not be reaped). Safe to
        call twice."""
        self.seen_pids |= group_pids(self.pid)
        if self.poll() is None:
            self.signal_group(signal.SIGCONT)  # a stopped process cannot act on `sig`
            self.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                if clean:
                    self.signal_group(signal.SIGKILL)
                else:
                    self.send_signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(timeout)
        if not clean:
            return self.popen.poll()
        # Children it left (stage processes, ...): gone before their segments can be reaped.
        deadline = time.monotonic() + timeout
        while (left := group_pids(self.pid)) and time.monotonic() < deadline:
            self.seen_pids |= left
            self.signal_group(signal.SIGKILL)
            time.sleep(POLL_S)
        reap_segments(self.seen_pids)
        return self.popen.poll()


def _sigint_ignored() -> bool:
    """Whether this process ignores SIGINT (it was started in a script's background): its
    children inherit that, and a Python child then never installs its handler, so stop()'s SIGINT
    would do nothing and every stop would end in SIGKILL."""
    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def _sigint_default() -> None:
    """In the child before exec: SIGINT back to its default, as an interactive start has it.
    Only used when the parent ignores SIGINT (preexec_fn is best avoided in threaded parents)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def reap_segments(pids: Iterable[int]) -> None:
    """Unlinks the shm segments of `pids` whose processes are gone."""
    from moecomm.wire.shm import reap_stale_segments  # the compiled extension: only when needed

    for pid in pids:
        reap_stale_segments(pid)


def wait_all(procs: Sequence[Proc], timeout: float = START_TIMEOUT_S, on_output=None) -> list[dict]:
    """Waits for every one of `procs` to announce it serves, all against one deadline (they
    start concurrently); returns what each announced, in order. Raises ProcessStartError as soon
    as one exits, DeadlineExceededError (with the laggards' output) after `timeout`.
    `on_output(proc, line)`, if given, sees each line a process prints while it is waited for
    (`moecomm demo` shows them)."""
    deadline = time.monotonic() + timeout
    shown = {id(p): 0 for p in procs}
    while True:
        # Readiness first, then the output: a process prints before it announces, so every
        # line up to its announcement is shown before this returns.
        try:
            pending = [p for p in procs if p.check_ready() is None]
        finally:
            if on_output is not None:
                for p in procs:
                    lines = p.lines()
                    for line in lines[shown[id(p)] :]:
                        on_output(p, line)
                    shown[id(p)] = len(lines)
        if not pending:
            return [p.ready for p in procs]
        if time.monotonic() >= deadline:
            tails = "\n".join(f"--- {p.name}: {' '.join(p.argv)}\n{p.tail()}" for p in pending)
            raise DeadlineExceededError(
                f"{', '.join(p.name for p in pending)} did not announce readiness within "
                f"{timeout} s:\n{tails}"
            )
        time.sleep(POLL_S)


class Processes:
    """The processes of one test, benchmark or demo: started by name, stopped together (the last
    started first) by close() — at the end of a ``with`` block even when it raised.

    `log_dir`: where logs and ready files go (default: a temporary folder removed at close);
    `env`: the environment of every process (default: this one's); `cli`: the `moecomm`
    command's argv prefix for :meth:`moecomm`."""

    def __init__(
        self,
        log_dir: str | os.PathLike | None = None,
        env: dict | None = None,
        cli: Sequence[str] = CLI_ARGV,
    ):
        prefork.enable_from_env()  # a benchmark or demo run by a test forks its processes
        self._own_dir = log_dir is None
        if log_dir is None:
            log_dir = tempfile.mkdtemp(prefix="moecomm-procs-")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ if env is None else env)
        self.cli = list(cli)
        self.procs: dict[str, Proc] = {}
        self._generation: dict[str, int] = {}
        self._retired: list[Proc] = []  # replaced by restart(): stopped, reaped at close too

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, name: str) -> Proc:
        return self.procs[name]

    def __contains__(self, name: str) -> bool:
        return name in self.procs

    # ------------------------------------------------------------------ starting
    def spawn(self, name: str, argv: Sequence[str], env: dict | None = None) -> Proc:
        """Starts `argv` as `name` without waiting (see wait / start)."""
        if name in self.procs and self.procs[name].poll() is None:
            raise ValueError(f"a process named {name!r} is already running")
        if name in self.procs:
            self._retired.append(self.procs[name])
        gen = self._generation.get(name, -1) + 1
        self._generation[name] = gen
        full_env = self.env if env is None else {**self.env, **env}
        p = Proc(name, argv, full_env, self.log_dir, gen)
        self.procs[name] = p
        return p

    def start(
        self, name: str, argv: Sequence[str], env: dict | None = None, timeout=START_TIMEOUT_S
    ) -> Proc:
        """Starts `argv` as `name` and waits until it announced it serves."""
        p = self.spawn(name, argv, env)
        p.wait_ready(timeout)
        return p

    def moecomm(self, name: str, args: Sequence[str], env: dict | None = None, wait=True):
        """`moecomm <args>` as `name`: started and (unless wait=False) waited for."""
        p = self.spawn(name, [*self.cli, *args], env)
        if wait:
            p.wait_ready()
        return p

    def start_many(
        self, specs: Iterable[tuple[str, Sequence[str]]], timeout: float = START_TIMEOUT_S
    ) -> list[Proc]:
        """Starts every (name, argv) at once and waits for all: start-ups overlap."""
        procs = [self.spawn(name, argv) for name, argv in specs]
        wait_all(procs, timeout)
        return procs

    def restart(self, name: str, timeout: float = START_TIMEOUT_S, wait: bool = True) -> Proc:
        """`name` again with its argv and environment (it must have exited, or been killed);
        a fixed --port gives it its old URL back."""
        old = self.procs[name]
        if old.poll() is None:
            raise ValueError(f"{name} still runs")
        old.stop()  # reaps its group's shared memory
        p = self.spawn(name, old.argv, old.env)
        if wait:
            p.wait_ready(timeout)
        return p

    # ------------------------------------------------------------------ stopping
    def close(self, sig: int = signal.SIGINT, timeout: float = STOP_TIMEOUT_S) -> dict:
        """Stops every process, the last started first (a front end before the servers it
        calls); returns the exit codes by name. Every group is killed and its shared memory
        reaped even if a stop fails; the log folder goes if this object made it."""
        codes, errors = {}, []
        for name, p in reversed(list(self.procs.items())):
            try:
                codes[name] = p.stop(sig, timeout)
            except Exception as exc:  # keep stopping the others
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
                p.signal_group(signal.SIGKILL)
        for p in self._retired:
            with contextlib.suppress(Exception):
                p.stop(sig, timeout)
        if self._own_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        if errors:
            raise RuntimeError("stopping processes failed: " + "; ".join(errors))
        return codes
