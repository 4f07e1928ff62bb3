"""OpenAI-API traffic of a whole-deployment chaos trial: a few worker threads, each sending one
request after another (streamed or not, a prompt from a fixed pool, greedy) until told to stop,
and recording what came back. Every request is drawn from the trial's seed and the worker's
count, so a replay sends the same ones."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field

import httpx
from deployment_plan import rng_seed

# Prompts of the trial traffic with their max_tokens: greedy answers of the in-process model
# are the reference, computed once per prompt.
PROMPTS = (
    ("the expert server died", 6),
    ("a stage was killed mid-stream and replaced", 10),
    ("the monitor came back", 4),
    ("every request still completes " * 3, 8),
    ("x", 12),
    ("serving that never stops", 7),
)
# Requests in flight at once: more than one micro-batch per step, less than the engine's
# max_num_seqs, so the engine batches several sequences while faults strike.
WORKERS = 3
# A request's deadline: covers a stage replacement without standby (a new pipeline's start-up,
# ~10-20 s on a 2-core machine) plus a failover, on a machine running other suites besides
# (load 15-20: one request took 56 s, a replacement 45 s); far above a healthy request (~0.1 s).
REQUEST_TIMEOUT_S = 120.0
# Error texts are cut to this length in a report.
MAX_REASON = 300


@dataclass
class Answer:
    worker: int
    n: int  # the worker's n-th request
    prompt: int  # index into PROMPTS
    stream: bool
    started: float
    ended: float
    tokens: list[int] | None  # None: the request failed
    error: str = ""


@dataclass
class Traffic:
    url: str
    model: str
    seed: int
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        for w in range(WORKERS):
            t = threading.Thread(target=self._worker, args=(w,), name=f"chaos-traffic-{w}")
            t.daemon = True
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float) -> list[str]:
        """Lets every request in flight finish (each has its own deadline); the workers still
        running after `timeout_s` are reported."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        stuck = []
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                stuck.append(f"traffic worker {t.name} still running after {timeout_s} s")
        return stuck

    def _worker(self, w: int) -> None:
        n = 0
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as c:
            while not self._stop.is_set():
                rng = random.Random(rng_seed("request", self.seed, w, n))
                prompt, stream = rng.randrange(len(PROMPTS)), rng.random() < 0.5
                started = time.monotonic()
                try:
                    tokens, error = _send(c, self.url, self.model, prompt, stream), ""
                except Exception as exc:  # every failure is a finding: recorded, never raised
                    tokens, error = None, f"{type(exc).__name__}: {exc}"[:MAX_REASON]
                a = Answer(w, n, prompt, stream, started, time.monotonic(), tokens, error)
                with self._lock:
                    self.answers.append(a)
                n += 1


def body(model: str, prompt: int, stream: bool) -> dict:
    text, max_tokens = PROMPTS[prompt]
    return {
        "model": model,
        "prompt": text,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }


def _send(c: httpx.Client, url: str, model: str, prompt: int, stream: bool) -> list[int]:
    """The request's token ids; raises on anything but a complete answer."""
    b = body(model, prompt, stream)
    if not stream:
        r = c.post(f"{url}/v1/completions", json=b)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:MAX_REASON]}")
        choice = r.json()["choices"][0]
        if choice.get("finish_reason") != "length":
            raise RuntimeError(f"finish_reason {choice.get('finish_reason')!r}")
        return list(choice["token_ids"])
    ids, finish, done = [], None, False
    with c.stream("POST", f"{url}/v1/completions", json=b) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:MAX_REASON]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"error chunk: {chunk['error']}")
            choice = chunk["choices"][0]
            ids += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
    if not done or finish != "length":
        raise RuntimeError(f"stream ended without [DONE] or finish_reason length ({finish!r})")
    return ids
