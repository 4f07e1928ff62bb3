"""Processes of a prefill/decode deployment for the router tests: expert servers, front ends
with a role, the router, each started from the command line in a session of its own, its output
in a log file, and always stopped (process group killed, shared memory reaped) by
:meth:`Deployment.stop_all` even when the test failed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import moecomm
import pytest

CLI = [sys.executable, "-m", "moecomm_serving.cli"]
MODEL_NAME = "tiny"
# Start-up of one `moecomm` process (imports torch, loads the tiny checkpoint) on a busy
# two-core machine, several starting at once.
START_TIMEOUT_S = 120.0
# SIGTERM, then this long for a clean exit before SIGKILL.
STOP_TIMEOUT_S = 10.0
# One HTTP call of a test: a short generation of the tiny model, with retries behind it.
HTTP_TIMEOUT_S = 120.0
# Each process gets one torch thread: several share two cores.
ONE_THREAD = ("--threads", "1")
# How often a wait for a log line or a condition re-checks.
POLL_S = 0.05


class Deployment:
    """Processes started for one test."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.args: dict[str, list[str]] = {}

    # ------------------------------------------------------------------ starting
    def spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - the child owns it
        p = subprocess.Popen(
            [*CLI, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.procs[name], self.args[name] = p, args
        return p

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_line(self, name: str, prefix: str, deadline: float) -> str:
        """The first log line of `name` starting with `prefix`; fails with the log's tail if the
        process exits or the deadline passes."""
        p = self.procs[name]
        while time.monotonic() < deadline:
            for line in self.log(name).splitlines():
                if line.startswith(prefix):
                    return line
            if p.poll() is not None:
                pytest.fail(f"{name} exited ({p.returncode}):\n{self.log(name)[-3000:]}")
            time.sleep(POLL_S)
        pytest.fail(f"{name}: no line starting {prefix!r} in time:\n{self.log(name)[-3000:]}")

    def start(self, name: str, args: list[str], prefix: str) -> str:
        self.spawn(name, args)
        return self.wait_line(name, prefix, time.monotonic() + START_TIMEOUT_S)

    def restart(self, name: str, prefix: str) -> str:
        """Starts `name` again with its arguments (a fixed --port gives it its old URL back)."""
        old = self.procs[name]
        if old.poll() is None:
            raise AssertionError(f"{name} still runs")
        moecomm.reap_stale_segments(old.pid)
        return self.start(name, self.args[name], prefix)

    def start_many(self, specs: list[tuple[str, list[str], str]]) -> list[str]:
        """Starts every (name, args, ready prefix) at once; their ready lines, in order."""
        for name, args, _ in specs:
            self.spawn(name, args)
        deadline = time.monotonic() + START_TIMEOUT_S
        return [self.wait_line(name, prefix, deadline) for name, _, prefix in specs]

    # ------------------------------------------------------------------ faults
    def signal(self, name: str, sig: signal.Signals) -> None:
        os.kill(self.procs[name].pid, sig)

    def kill(self, name: str) -> None:
        p = self.procs[name]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(STOP_TIMEOUT_S)

    # ------------------------------------------------------------------ stopping
    def stop_all(self) -> None:
        for p in reversed(self.procs.values()):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)  # a stopped one cannot act on SIGTERM
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(STOP_TIMEOUT_S)
                except ProcessLookupError:
                    pass
            # the group may hold children (none expected): kill whatever is left of it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            moecomm.reap_stale_segments(p.pid)


def url_of(line: str) -> str:
    """The URL a `moecomm` service prints at the end of its ready line."""
    return line.split(" listening on ")[1].split(":  ")[0].split(": layers")[0].strip()


def expert_server_args(ckpt: Path, index: int) -> list[str]:
    return [
        "expert-server",
        "--checkpoint",
        str(ckpt),
        "--experts",
        "all",
        "--id",
        f"pd-test-server-{index}",
        *ONE_THREAD,
    ]


def frontend_args(ckpt: Path, role: str | None, experts: list[str], extra=()) -> list[str]:
    """A front end of `role` (None: no role) over `experts`: ["--local-experts"] or
    ["--servers", URLs]."""
    role_args = [] if role is None else ["--role", role]
    return [
        "frontend",
        "--checkpoint",
        str(ckpt),
        "--model-name",
        MODEL_NAME,
        "--port",
        "0",
        *experts,
        *role_args,
        *ONE_THREAD,
        *extra,
    ]


def router_args(ckpt: Path, prefill: list[str], decode: list[str], extra=()) -> list[str]:
    return [
        "router",
        "--checkpoint",
        str(ckpt),
        "--model-name",
        MODEL_NAME,
        "--port",
        "0",
        "--prefill",
        ",".join(prefill),
        "--decode",
        ",".join(decode),
        *extra,
    ]


# ---------------------------------------------------------------------------------------------
# requests


def completion(url: str, prompt, max_tokens: int, **params) -> list[int]:
    """The token ids of a non-streaming completion."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **params,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


class Stream:
    """A streaming completion read in a thread: its token ids as they arrive, then whether it
    ended with [DONE] (or the error it got)."""

    def __init__(self, url: str, prompt, max_tokens: int, **params):
        self.tokens: list[int] = []
        self.done = False
        self.error: str | None = None
        self.finished = threading.Event()
        self._cond = threading.Condition()
        self._body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            "stream": True,
            **params,
        }
        self._url = url
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            with httpx.stream(
                "POST", f"{self._url}/v1/completions", json=self._body, timeout=HTTP_TIMEOUT_S
            ) as r:
                if r.status_code != 200:
                    r.read()
                    self.error = f"{r.status_code}: {r.text}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        self.done = True
                        return
                    msg = json.loads(data)
                    if "error" in msg:
                        self.error = json.dumps(msg["error"])
                        return
                    with self._cond:
                        for choice in msg["choices"]:
                            self.tokens.extend(choice.get("token_ids") or [])
                        self._cond.notify_all()
        except Exception as exc:  # the test reads it
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.finished.set()
            with self._cond:
                self._cond.notify_all()

    def wait_tokens(self, n: int, deadline: float) -> None:
        """Until at least `n` tokens arrived (fails if the stream ends first or time runs out)."""
        with self._cond:
            while len(self.tokens) < n:
                if self.finished.is_set():
                    raise AssertionError(f"stream ended after {len(self.tokens)} tokens")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"only {len(self.tokens)} of {n} tokens in time")
                self._cond.wait(left)

    def result(self, deadline: float) -> list[int]:
        if not self.finished.wait(max(0.0, deadline - time.monotonic())):
            raise AssertionError("stream did not end in time")
        assert self.error is None and self.done, self.error
        return self.tokens


def metric(url: str, series: str) -> float:
    """One series' value from a /metrics page (`series` with its labels, as rendered)."""
    text = httpx.get(f"{url}/metrics", timeout=HTTP_TIMEOUT_S).text
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no series {series} in /metrics")
