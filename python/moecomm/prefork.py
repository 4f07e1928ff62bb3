"""Cheap process start-ups for tests and benchmarks: one fork server that imported torch and
moecomm once, from which the processes of a test run are forked in milliseconds instead of each
paying ~2 s of imports (on a loaded two-core machine, that is most of a test's start-up).

It is multiprocessing's own fork server, with a module list to import first
(:func:`enable`), and two ways in:

- :func:`process_context` is a multiprocessing context for in-Python workers (ranks, peers):
  ``ctx.Process(target=...)`` as with ``mp.get_context("spawn")``, with the caller's current
  environment and stdout/stderr, as a spawned process would have them;
- :func:`popen_module` starts ``python -m <module> <args>`` (a `moecomm` command) as a
  Popen-like handle: a session of its own, its output in a log file, the environment given,
  `sys.path` as a fresh interpreter has it, atexit handlers run at exit.

A fork is only used when it cannot be told from a fresh start: when the environment differs from
the fork server's in a variable that a preloaded module reads at import time (the slot poisoning
switch, thread counts, Triton's interpreter switch, the library path...), both fall back to a
fresh process. Nothing is forked while :func:`enable` was not called: production code never
starts processes this way."""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from multiprocessing import context as mp_context
from multiprocessing import reduction

# What the processes of moecomm's tests import first: torch and the library's heavy modules.
# Imported once, in the fork server; every fork shares them.
DEFAULT_PRELOAD = (
    "numpy",
    "torch",
    "moecomm",
    "moecomm.runtime.server",
    "moecomm.runtime.client",
    "moecomm.pipeline.stage",
)
# Variables read while a module is imported (so a preloaded module holds the server's value):
# a process whose environment differs from the server's in one of these starts fresh. Others
# (NIXL's and UCX's, TorchInductor's cache folder, which modules imported later set) reach the
# fork with the rest of its environment.
IMPORT_TIME_ENV_PREFIXES = (
    "MOECOMM_POISON_SLOTS",  # moecomm.wire.channel
    "MOECOMM_EPLB_NATIVE",  # moecomm.eplb.native
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "TORCH_",
    "PYTORCH_",
    "TRITON_",
    "CUDA_",
    "PYTHON",
    "LD_",
)

# Set (to a comma-separated list of modules to preload beyond DEFAULT_PRELOAD, possibly empty)
# in the environment of a benchmark a test runs: its harness (moecomm.testing.Processes calls
# enable_from_env()) forks its processes too.
PREFORK_ENV = "MOECOMM_PREFORK"

_lock = threading.Lock()
_state: dict | None = None  # {"env": the server's environment, "sys_path": a fresh one}
_live: set[mp.process.BaseProcess] = set()
# How the processes of this run started: "forked", or why fresh ("env KEY", "argv"); a test run
# prints it, so a change that silently ends forking shows.
starts: collections.Counter = collections.Counter()


def _import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV_PREFIXES)}


def enable(preload: Sequence[str] = DEFAULT_PRELOAD) -> None:
    """Starts the fork server now, with this process's environment, importing `preload` (module
    names; a missing one is skipped). Later calls do nothing. Tests and benchmarks call it once,
    after setting the environment their processes share."""
    global _state
    with _lock:
        if _state is not None:
            return
        # sys.path as `python -m` has it in a fresh interpreter of this environment (the fork
        # server's is this process's, with a test runner's additions).
        fresh = subprocess.run(
            [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
            capture_output=True,
            text=True,
            check=True,
            env=dict(os.environ),
        )
        mp.set_forkserver_preload(list(preload))
        from multiprocessing import forkserver

        forkserver.ensure_running()
        _state = {"env": dict(os.environ), "sys_path": json.loads(fresh.stdout)}
        atexit.register(_kill_left)


def enable_from_env() -> None:
    """enable() with DEFAULT_PRELOAD and the modules PREFORK_ENV names, if it is set."""
    names = os.environ.get(PREFORK_ENV)
    if names is not None and _state is None:
        enable((*DEFAULT_PRELOAD, *(n for n in names.split(",") if n)))


def enabled() -> bool:
    return _state is not None


def forkable(env: Mapping[str, str]) -> bool:
    """Whether a process with environment `env` can be forked from the server (see the module
    docstring)."""
    return _state is not None and not _env_differs(env)


def _env_differs(env: Mapping[str, str]) -> list[str]:
    """The import-time variables whose value in `env` is not the server's."""
    assert _state is not None
    ours, server = _import_time_env(env), _import_time_env(_state["env"])
    return sorted(k for k in ours.keys() | server.keys() if ours.get(k) != server.get(k))


def _decide(env: Mapping[str, str]) -> bool:
    """forkable(env), counted in `starts` when enabled."""
    if _state is None:
        return False
    differs = _env_differs(env)
    starts["forked" if not differs else "fresh: environment differs in " + ", ".join(differs)] += 1
    return not differs


def _kill_left() -> None:
    """At exit: forked commands a test left running (multiprocessing would wait for them)."""
    for p in list(_live):
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        p.join(5)


# ---------------------------------------------------------------------------------------------
# In-Python workers
class _Process(mp_context.ForkServerProcess):
    """A forked worker with its parent's environment and stdout/stderr at start(), as a spawned
    one has them."""

    def start(self):
        self._parent_env = dict(os.environ)
        super().start()

    def __getstate__(self):
        state = self.__dict__.copy()
        # Pickled while the parent launches it: the fds travel to the child with it.
        state["_stdio"] = [(fd, reduction.DupFd(fd)) for fd in (1, 2) if _is_open(fd)]
        return state

    def run(self):
        for fd, dup in self.__dict__.pop("_stdio", ()):
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            new = dup.detach()
            os.dup2(new, fd)
            os.close(new)
        os.environ.clear()
        os.environ.update(self._parent_env)
        _reseed()
        super().run()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


class _Context(mp_context.ForkServerContext):
    Process = _Process


_CONTEXT = _Context()


def process_context():
    """A multiprocessing context for workers: the fork server's when enabled and this process's
    environment allows it, else "spawn". A benchmark a test runs (PREFORK_ENV set) enables it
    here."""
    enable_from_env()
    if _decide(os.environ):
        return _CONTEXT
    return mp.get_context("spawn")


def _reseed() -> None:
    """A fork shares its server's random state; a fresh process draws its own."""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


# ---------------------------------------------------------------------------------------------
# Commands
class ForkedPopen:
    """The part of subprocess.Popen the process harness uses, for a command forked from the
    server."""

    def __init__(self, process: mp.process.BaseProcess, argv: Sequence[str]):
        self._process = process
        self.args = list(argv)
        self.pid = process.pid

    def poll(self) -> int | None:
        code = self._process.exitcode
        if code is not None:
            _live.discard(self._process)
        return code

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code


class _CommandProcess(mp_context.ForkServerProcess):
    """A forked command: `_run_module` sets up its environment, streams and session."""


def popen_module(
    argv: Sequence[str], env: Mapping[str, str], log_path: str | os.PathLike
) -> ForkedPopen | None:
    """Starts `argv` (``[sys.executable, "-m", module, *args]``) forked from the server, its
    stdout and stderr into `log_path`, in a session of its own; None when it cannot be forked
    (not enabled, another form of argv, an environment that differs at import time): the caller
    starts it fresh."""
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
        if _state is not None:
            starts["fresh: not `python -m`"] += 1
        return None
    if not _decide(env):
        return None
    assert _state is not None
    p = _CommandProcess(
        target=_run_module,
        args=(
            argv[2],
            list(argv[3:]),
            dict(env),
            os.getcwd(),
            os.fspath(log_path),
            _state["sys_path"],
        ),
        name=f"moecomm:{argv[2]}",
    )
    p.start()
    _live.add(p)
    return ForkedPopen(p, argv)


def _run_module(
    module: str, args: list[str], env: dict, cwd: str, log_path: str, sys_path: list[str]
) -> None:
    """In the fork: what `python -m module args` does in a fresh interpreter (`sys_path`: its
    path after the working directory)."""
    import importlib.util
    import runpy

    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = [cwd, *sys_path]
    sys.argv = [module, *args]
    # A preloaded module run as __main__ is run anew, as in a fresh interpreter (runpy would warn
    # that it is imported already); a package runs its __main__.
    spec = importlib.util.find_spec(module)
    main = (
        module if spec is None or spec.submodule_search_locations is None else f"{module}.__main__"
    )
    sys.modules.pop(main, None)
    interrupted = False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        interrupted = True
    finally:
        # multiprocessing ends its children with os._exit: what an interpreter's exit does is
        # done here, in its order (non-daemon threads joined, then the atexit handlers).
        threading._shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    if interrupted:
        # As Python exits on an uncaught KeyboardInterrupt: killed by SIGINT.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
