"""Processes of a prefill/decode deployment for the router tests: expert servers, front ends
with a role, the router, each a `moecomm` command started through the process harness
(moecomm.testing: a process group of its own, output in a log file, ready once it announced its
URL) and always stopped (group killed, shared memory reaped) by :meth:`Deployment.stop_all`,
even when the test failed."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
from moecomm.testing import CLI_ARGV, Proc, Processes

CLI = list(CLI_ARGV)
MODEL_NAME = "tiny"
# One HTTP call of a test: a short generation of the tiny model, with retries behind it.
HTTP_TIMEOUT_S = 120.0


class Deployment:
    """`moecomm` processes of one test by name (started into `processes`, e.g. by
    moecomm.testing.start_local_cluster), with the faults a test strikes; logs in `log_dir`."""

    def __init__(self, log_dir: Path):
        self._procs = Processes(log_dir)

    @property
    def processes(self) -> Processes:
        """The harness's Processes (start_local_cluster can start into it)."""
        return self._procs

    @property
    def procs(self) -> dict[str, Proc]:
        return self._procs.procs

    # ------------------------------------------------------------------ starting
    def restart(self, name: str) -> Proc:
        """Starts `name` again with its arguments (a fixed --port gives it its old URL back)."""
        return self._procs.restart(name)

    # ------------------------------------------------------------------ faults
    def signal(self, name: str, sig: signal.Signals) -> None:
        self._procs[name].send_signal(sig)

    def kill(self, name: str) -> None:
        self._procs[name].kill()

    # ------------------------------------------------------------------ stopping
    def stop_all(self) -> None:
        self._procs.close()


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
