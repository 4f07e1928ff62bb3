"""Soak through the OpenAI front end: a whole deployment started from the `moecomm` CLI, as a user
would, under seeded concurrent traffic for `--duration-s`.

Processes (each a real `moecomm` process on 127.0.0.1, the tiny random checkpoint of `moecomm
tiny`): the membership monitor, two expert servers (experts 0-11 and 4-15, so 4-11 have a
replica), and `moecomm frontend --stages N` (default 2: the model over two pipeline stage
processes, with their standby set) that finds the servers through the monitor.

Load: `--clients` concurrent OpenAI-API clients (asyncio tasks in this process, each its own HTTP
connection), each sending one request after the other: /v1/completions or /v1/chat/completions,
streamed or not, greedy or seeded sampling, a prompt of 1..`--max-prompt-words` words and
max_tokens of 1..`--max-new-tokens`, all drawn per request from a generator seeded by (--seed,
client), so a failure names the client and request and the same seed replays it. Checked:

- no request failed or hung: every request has a deadline (`--request-timeout-s`), a streamed
  one must end with [DONE] and a finish reason, a non-streamed one must carry its text;
- answers: every `--check-every`-th request of each client (greedy and seeded) is sent again at
  the end, one at a time, non-streamed, to the same front end (the reference run: no batch-mates,
  no concurrency); its text must equal what the soak got (streamed text joined). The front end's
  float32 path is batch invariant, so a difference is a real corruption (a KV slot reused while
  live, a stage's traffic applied twice), not noise;
- RSS (VmRSS every `--rss-every-s`) of every process — monitor, servers, front end and every
  process below them (stages, standby stages) — flat within `--drift-limit` between the
  warm-up (the first `--warmup-frac` of the load) and the end of the load; a process that was
  there after the warm-up and is gone before the end (a crash, a stage restart) fails the run, as
  does a "pipeline restarted" line from the front end (no fault is injected here);
- at the end: the front end's /health 200, every expert server's /health 200 with its failure
  counters at 0, front-end failovers 0 (/metrics), and after shutdown no process left and no
  /dev/shm segment of any of them.

Latency is the client's whole request (sent -> last byte); TTFT is request sent -> first content
chunk of a streamed request. Both as p50/p99 per interval (`--interval-s`), printed and in the
JSON; the PNG shows latency, TTFT and RSS over time. The verdict helpers (RSS drift, its table
and plot) are soak_report.py's, shared with bench/soak/soak.py.

Usage: python bench/serving/soak_frontend.py [--duration-s 1800] [--clients 8] [--stages 2]
       [--json bench/results/soak_frontend.json] [--plot bench/results/soak_frontend.png]
Exit status: 0 when every check passed, 1 otherwise (the reasons are printed last).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
import moecomm
from _lib.common import format_table, percentile, write_json
from _lib.soak_report import (
    KB_PER_MB,
    max_abs_drift,
    plot_rss,
    print_rss,
    rss_failures,
    rss_processes,
    save_figure,
)
from moecomm.testing import MONITOR_CMD, Proc, Processes, wait_all
from moecomm_serving.cli.demo import CLI, ONE_THREAD, SERVER_EXPERTS

# Start-up of one `moecomm` child (imports torch, loads the checkpoint; a front end with stages
# starts 2N stage processes) on a busy 2-core machine.
START_TIMEOUT_S = 240.0
# A child asked to stop (SIGINT) gets this long before SIGKILL.
STOP_TIMEOUT_S = 30.0
# After shutdown, processes below the children (stages) are given this long to be gone.
GONE_TIMEOUT_S = 30.0
# /health, /metrics: a real one-token forward pass, on a machine that may be loaded.
PROBE_TIMEOUT_S = 60.0
# A client keeps its first few error reports; the counts are always complete.
MAX_SAMPLES = 10
# Client idx of run seed s draws from seed s * SEED_STRIDE + idx: distinct for every (s, idx).
SEED_STRIDE = 1_000_003
# Sampled requests use this temperature with a per-request seed (reproducible in any batch).
SAMPLED_TEMPERATURE = 0.8
# Words prompts are made of (the tiny checkpoint's tokenizer is byte level: any text works).
WORDS = tuple(
    [
        "the",
        "experts",
        "route",
        "tokens",
        "across",
        "servers",
        "while",
        "attention",
        "keeps",
        "its",
        "cache",
        "and",
        "every",
        "request",
        "carries",
        "a",
        "deadline",
        "so",
        "nothing",
        "waits",
        "forever",
        "on",
        "a",
        "slot",
        "that",
        "never",
        "answers",
    ]
)
# The front end printing this means a stage was lost and the pipeline rebuilt: a fault.
RESTART_MARK = "pipeline restarted"


@dataclass
class FrontendSoakConfig:
    duration_s: float = 1800.0
    clients: int = 8
    stages: int = 2
    interval_s: float = 60.0
    rss_every_s: float = 5.0
    warmup_frac: float = 0.2
    drift_limit: float = 0.05
    max_prompt_words: int = 24
    max_new_tokens: int = 32
    stream_share: float = 0.5
    chat_share: float = 0.5
    greedy_share: float = 0.75
    # The reference run re-sends the sample one at a time after the load (~0.5 s each alone):
    # every 20th request keeps it to a few minutes after a 30-minute soak.
    check_every: int = 20
    # A request of 24 words and 32 new tokens takes well under a second alone; 8 clients, the
    # stages and the servers on 2 cores (and other work on the machine) stretch that ~10x. 120 s
    # means stuck, not slow.
    request_timeout_s: float = 120.0
    seed: int = 0

    def __post_init__(self):
        if self.duration_s <= 0 or self.clients < 1 or self.stages < 1 or self.check_every < 1:
            raise ValueError("need duration_s > 0, clients >= 1, stages >= 1, check_every >= 1")
        if self.max_prompt_words < 1 or self.max_new_tokens < 1:
            raise ValueError("need max_prompt_words >= 1 and max_new_tokens >= 1")
        for name in ("stream_share", "chat_share", "greedy_share", "warmup_frac"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


# ---------------------------------------------------------------------------- processes
def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def alive(pid: int) -> bool:
    """Exists and is not a zombie (a zombie holds no memory and no segment)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(root: int) -> list[int]:
    """Every live process below `root` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return sorted(out)


# ---------------------------------------------------------------------------- requests
def make_request(rng: random.Random, cfg: FrontendSoakConfig, idx: int, j: int) -> dict:
    """Request j of client idx: endpoint, body, and whether it is streamed."""
    n_words = rng.randint(1, cfg.max_prompt_words)
    text = " ".join(rng.choice(WORDS) for _ in range(n_words))
    chat = rng.random() < cfg.chat_share
    stream = rng.random() < cfg.stream_share
    greedy = rng.random() < cfg.greedy_share
    body: dict = {"model": "tiny", "max_tokens": rng.randint(1, cfg.max_new_tokens)}
    if greedy:
        body["temperature"] = 0
    else:
        body["temperature"] = SAMPLED_TEMPERATURE
        body["seed"] = rng.randrange(2**31)
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return {"client": idx, "j": j, "path": path, "body": body, "stream": stream, "greedy": greedy}


def _choice_text(choice: dict, chat: bool, stream: bool) -> str | None:
    if chat:
        part = choice.get("delta" if stream else "message") or {}
        return part.get("content", "" if stream else None)
    return choice.get("text")


async def send(http: httpx.AsyncClient, req: dict, stream: bool) -> dict:
    """One request; its text, finish reason and timings. Raises on anything malformed."""
    chat = req["path"].endswith("chat/completions")
    t0 = time.monotonic()
    if not stream:
        r = await http.post(req["path"], json=req["body"])
        r.raise_for_status()
        choice = r.json()["choices"][0]
        text = _choice_text(choice, chat, False)
        if text is None or not choice.get("finish_reason"):
            raise ValueError(f"malformed answer: {r.text[:200]}")
        return {"text": text, "finish": choice["finish_reason"], "lat": time.monotonic() - t0}
    parts, ttft, finish, done = [], None, None, False
    async with http.stream("POST", req["path"], json={**req["body"], "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line[6:])["choices"][0]
            piece = _choice_text(choice, chat, True) or ""
            if piece and ttft is None:
                ttft = time.monotonic() - t0
            parts.append(piece)
            finish = choice.get("finish_reason") or finish
    if not done or not finish:
        raise ValueError(f"stream ended without [DONE] or a finish reason (done={done})")
    return {"text": "".join(parts), "finish": finish, "lat": time.monotonic() - t0, "ttft": ttft}


class Load:
    """What the clients saw, per interval (by the request's start), and the sample to re-check."""

    def __init__(self, cfg: FrontendSoakConfig):
        self.cfg = cfg
        self.t0 = 0.0
        self.buckets: dict[int, dict] = {}
        self.errors: list[str] = []
        self.sample: list[tuple[dict, str]] = []  # (request, text the soak got)
        self.stop = False

    def bucket(self, t: float) -> dict:
        b = int((t - self.t0) // self.cfg.interval_s)
        if b not in self.buckets:
            self.buckets[b] = {"lat": [], "ttft": [], "requests": 0, "streamed": 0, "errors": 0}
        return self.buckets[b]

    async def client(self, base_url: str, idx: int) -> None:
        cfg = self.cfg
        rng = random.Random(cfg.seed * SEED_STRIDE + idx)
        timeout = httpx.Timeout(cfg.request_timeout_s)
        async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as http:
            j = 0
            # No request starts after the load's end: the last interval is as wide as the others.
            while not self.stop and time.monotonic() - self.t0 < cfg.duration_s:
                req = make_request(rng, cfg, idx, j)
                t = time.monotonic()
                k = self.bucket(t)
                try:
                    got = await asyncio.wait_for(
                        send(http, req, req["stream"]), cfg.request_timeout_s
                    )
                except Exception as exc:  # a failure is counted and reported, the soak goes on
                    k["errors"] += 1
                    if len(self.errors) < MAX_SAMPLES:
                        what = "hung" if isinstance(exc, TimeoutError) else type(exc).__name__
                        self.errors.append(
                            f"client {idx} request {j} ({req['path']}, stream={req['stream']}): "
                            f"{what}: {exc}"
                        )
                else:
                    k["requests"] += 1
                    k["lat"].append(got["lat"])
                    if req["stream"]:
                        k["streamed"] += 1
                        if got["ttft"] is not None:
                            k["ttft"].append(got["ttft"])
                    if j % cfg.check_every == 0:
                        self.sample.append((req, got["text"]))
                j += 1


async def reference_run(base_url: str, load: Load, timeout_s: float) -> tuple[int, list]:
    """The sampled requests again, one at a time, non-streamed: (checked, mismatches)."""
    wrong = []
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s)) as http:
        for req, text in load.sample:
            try:
                want = (await asyncio.wait_for(send(http, req, False), timeout_s))["text"]
            except Exception as exc:
                want = f"<reference failed: {type(exc).__name__}: {exc}>"
            if want != text:
                wrong.append(
                    {
                        "client": req["client"],
                        "request": req["j"],
                        "path": req["path"],
                        "stream": req["stream"],
                        "greedy": req["greedy"],
                        "body": req["body"],
                        "soak": text,
                        "reference": want,
                    }
                )
    return len(load.sample), wrong


# ---------------------------------------------------------------------------- the run
class Deployment:
    """monitor, servers, front end; `pids` role -> pid of every process, including the ones below
    each child, as first seen."""

    def __init__(self):
        # the `moecomm` children, each in a process group of its own (output in a log file)
        self.procs = Processes(cli=CLI)
        self.children: list[Proc] = []
        self.server_urls: list[str] = []
        self.url = ""
        self.pids: dict[str, int] = {}

    def start(self, cfg: FrontendSoakConfig, ckpt: str) -> None:
        mon = self.procs.spawn("monitor", [*MONITOR_CMD, "--port", "0"])  # light: no torch
        self.children.append(mon)
        self.pids["monitor"] = mon.pid
        monitor = mon.wait_ready(START_TIMEOUT_S)
        for i, experts in enumerate(SERVER_EXPERTS):
            args = ["expert-server", "--checkpoint", ckpt, "--experts", experts]
            args += ["--id", f"soak-server-{i}", "--monitor", monitor["url"], *ONE_THREAD]
            self._child(f"s{i}", args)
        servers = self.children[1:]  # they start in parallel
        wait_all(servers, START_TIMEOUT_S)
        self.server_urls = [c.url for c in servers]
        fe = self._child(
            "frontend",
            [
                "frontend",
                "--checkpoint",
                ckpt,
                "--model-name",
                "tiny",
                "--monitor",
                monitor["url"],
                *ONE_THREAD,
                "--port",
                "0",
                "--stages",
                str(cfg.stages),
            ],
        )
        self.url = fe.wait_ready(START_TIMEOUT_S)["url"]
        names = {
            "pipeline stage pids: ": "stage",
            "pipeline standby stages ready: pids ": "standby",
        }
        if cfg.stages > 1:  # the load starts once the standby set is up too: its start-up
            # is no part of the steady RSS
            fe.wait_output("pipeline standby stages ready", 1, START_TIMEOUT_S)
            for prefix, role in names.items():
                pids = fe.wait_output(prefix, 1, 0)[0].removeprefix(prefix).split()
                self.pids.update({f"{role}{i}": int(p) for i, p in enumerate(pids)})

    def _child(self, name: str, args: list[str]) -> Proc:
        c = self.procs.moecomm(name, args, wait=False)
        self.children.append(c)
        self.pids[name] = c.pid
        return c

    def discover(self) -> None:
        """Adds the processes below each child seen now (stage processes appear at start-up)."""
        known = set(self.pids.values())
        for c in self.children:
            for pid in descendants(c.pid):
                if pid not in known:
                    self.pids[f"{c.name}.{pid}"] = pid

    def dead(self) -> list[str]:
        return [f"{c.name} (exit {c.poll()})" for c in self.children if c.poll() is not None]

    def stop(self) -> None:
        """The front end first (its in-flight steps still need the servers), then the servers
        together, the monitor last (the servers leave its membership as they stop)."""
        n = 1 + len(SERVER_EXPERTS)
        monitor, servers, rest = self.children[0], self.children[1:n], self.children[n:]
        # Not cleaned up after (clean=False): what a process leaves is counted, then reaped.
        for c in reversed(rest):
            c.stop(signal.SIGINT, STOP_TIMEOUT_S, clean=False)
        for c in servers:
            c.send_signal(signal.SIGINT)
        for c in [*servers, monitor]:
            c.stop(signal.SIGINT, STOP_TIMEOUT_S, clean=False)


def sample_rss(dep: Deployment, rss: dict, t: float) -> None:
    dep.discover()
    for role, pid in dep.pids.items():
        kb = rss_kb(pid) if alive(pid) else None
        if kb is not None:
            rss.setdefault(role, []).append((t, kb))


async def drive(cfg: FrontendSoakConfig, dep: Deployment, rss: dict, failures: list) -> Load:
    """The load for cfg.duration_s with RSS sampled and the children watched; returns when every
    client's last request ended (each has its deadline)."""
    load = Load(cfg)
    load.t0 = time.monotonic()
    tasks = [asyncio.create_task(load.client(dep.url, i)) for i in range(cfg.clients)]
    next_rss = next_progress = load.t0
    while time.monotonic() - load.t0 < cfg.duration_s:
        now = time.monotonic()
        if now >= next_rss:
            sample_rss(dep, rss, now - load.t0)
            next_rss = now + cfg.rss_every_s
        if now >= next_progress:
            n = sum(b["requests"] for b in load.buckets.values())
            e = sum(b["errors"] for b in load.buckets.values())
            mb = sum(ss[-1][1] for ss in rss.values() if ss) / KB_PER_MB
            print(f"[{now - load.t0:6.0f} s] {n} requests, {e} errors, RSS {mb:.0f} MB", flush=True)
            next_progress = now + cfg.interval_s
        if dep.dead():
            failures.append(f"died during the soak: {dep.dead()}")
            break
        await asyncio.sleep(min(0.5, max(0.0, next_rss - time.monotonic())))
    sample_rss(dep, rss, time.monotonic() - load.t0)
    load.stop = True
    # Each client finishes its request in flight, which has its own deadline.
    done, pending = await asyncio.wait(tasks, timeout=cfg.request_timeout_s + PROBE_TIMEOUT_S)
    for t in pending:
        t.cancel()
    if pending:
        failures.append(f"{len(pending)} clients did not finish past every request deadline")
    for t in done:
        if t.exception() is not None:
            failures.append(f"a client crashed: {t.exception()!r}")
    return load


def probe(url: str, path: str) -> httpx.Response | str:
    try:
        return httpx.get(f"{url}{path}", timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"


def end_checks(dep: Deployment) -> tuple[dict, list[str]]:
    """The deployment's own view at the end: health of everyone, counters that must be 0."""
    health, failures = {}, []
    r = probe(dep.url, "/health")
    health["frontend"] = r.status_code if isinstance(r, httpx.Response) else r
    if health["frontend"] != 200:
        failures.append(f"front end /health at the end: {health['frontend']}")
    m = probe(dep.url, "/metrics")
    failovers = None
    if isinstance(m, httpx.Response):
        for ln in m.text.splitlines():
            if ln.startswith("moecomm_failovers_total"):
                failovers = float(ln.rpartition(" ")[2])
    health["frontend_failovers"] = failovers
    if failovers != 0:
        failures.append(f"front end failovers: {failovers}")
    for i, u in enumerate(dep.server_urls):
        r = probe(u, "/health")
        body = r.json() if isinstance(r, httpx.Response) else {"error": r}
        status = r.status_code if isinstance(r, httpx.Response) else None
        health[f"s{i}"] = {"status": status, **body}
        bad = {k: body.get(k) for k in ("batch_failures", "rejected", "dead_clients_dropped")}
        if status != 200 or any(bad.values()):
            failures.append(f"server s{i} /health at the end: {health[f's{i}']}")
    restarts = sum(c.count(RESTART_MARK) for c in dep.children)
    if restarts:
        failures.append(f"{restarts} '{RESTART_MARK}' lines from the front end")
    return health, failures


def run_soak(cfg: FrontendSoakConfig) -> dict:
    """The whole soak; every process and segment is gone when it returns, whatever happened."""
    began = time.monotonic()
    dep = Deployment()
    rss: dict[str, list] = {}
    failures: list[str] = []
    load: Load | None = None
    checked, wrong, health = 0, [], {}
    leftover, leaked = [], []
    phases: dict[str, float] = {}  # seconds: start-up, reference run, shutdown
    with tempfile.TemporaryDirectory(prefix="moecomm-soak-fe-") as tmp:
        try:
            ckpt = os.path.join(tmp, "tiny")
            subprocess.run([*CLI, "tiny", "--out", ckpt], check=True, timeout=START_TIMEOUT_S)
            dep.start(cfg, ckpt)
            dep.discover()
            phases["start_s"] = time.monotonic() - began
            print(f"deployment up: {dep.pids}; front end {dep.url}", flush=True)
            load = asyncio.run(drive(cfg, dep, rss, failures))
            if not dep.dead():
                t = time.monotonic()
                checked, wrong = asyncio.run(reference_run(dep.url, load, cfg.request_timeout_s))
                phases["reference_s"] = time.monotonic() - t
                health, more = end_checks(dep)
                failures += more
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            t = time.monotonic()
            dep.discover()
            dep.stop()
            deadline = time.monotonic() + GONE_TIMEOUT_S
            while time.monotonic() < deadline and any(alive(p) for p in dep.pids.values()):
                time.sleep(0.2)
            leftover = [f"{r} ({p})" for r, p in dep.pids.items() if alive(p)]
            for pid in dep.pids.values():
                leaked += moecomm.list_segments(pid)
                moecomm.reap_stale_segments(pid)
            dep.procs.close()  # whatever is left of each group
            phases["stop_s"] = time.monotonic() - t
    result = analyse(cfg, dep, load, rss, failures, checked, wrong, health, leftover, leaked, began)
    return {**result, "phases_s": phases}


def _pct(xs: list, q: float) -> float | None:
    return percentile(xs, q) * 1e3 if xs else None


def analyse(cfg, dep, load, rss, failures, checked, wrong, health, leftover, leaked, began):
    rows, all_lat, all_ttft = [], [], []
    totals = {"requests": 0, "streamed": 0, "errors": 0}
    duration = cfg.duration_s
    for b in sorted(load.buckets) if load else []:
        k = load.buckets[b]
        all_lat += k["lat"]
        all_ttft += k["ttft"]
        for key in totals:
            totals[key] += k[key]
        rows.append(
            {
                "interval": b,
                "t_start_s": b * cfg.interval_s,
                "t_end_s": min((b + 1) * cfg.interval_s, duration),
                "requests": k["requests"],
                "streamed": k["streamed"],
                "errors": k["errors"],
                "p50_ms": _pct(k["lat"], 50),
                "p99_ms": _pct(k["lat"], 99),
                "ttft_p50_ms": _pct(k["ttft"], 50),
                "ttft_p99_ms": _pct(k["ttft"], 99),
            }
        )
    warm, steady = cfg.warmup_frac * duration, duration
    # The processes there at the end of the warm-up are judged; later ones are listed.
    judged = {r: p for r, p in dep.pids.items() if any(t <= warm for t, _ in rss.get(r, []))}
    procs = rss_processes(judged, rss, warm, steady)
    failures = list(failures)
    if totals["errors"]:
        failures.append(f"{totals['errors']} requests failed or hung")
    if not totals["requests"]:
        failures.append("no request completed")
    if not checked:
        failures.append("no answer was checked against the reference run")
    if wrong:
        failures.append(f"{len(wrong)} of {checked} answers differ from the reference run")
    failures += rss_failures(procs, cfg.drift_limit)
    gone = [r for r, ss in rss.items() if r in judged and ss[-1][0] < steady - cfg.rss_every_s]
    if gone:
        failures.append(f"processes gone before the end of the load: {gone}")
    if leftover:
        failures.append(f"processes left after shutdown: {leftover}")
    if leaked:
        failures.append(f"shared-memory segments left behind: {leaked}")
    return {
        "config": asdict(cfg),
        "server_experts": list(SERVER_EXPERTS),
        "duration_s": duration,
        "wall_s": time.monotonic() - began,
        "totals": {**totals, "checked": checked, "wrong": len(wrong)},
        "requests_per_s": totals["requests"] / duration,
        "latency_ms": {"p50": _pct(all_lat, 50), "p99": _pct(all_lat, 99)},
        "ttft_ms": {"p50": _pct(all_ttft, 50), "p99": _pct(all_ttft, 99)},
        "intervals": rows,
        "warmup_end_s": warm,
        "steady_end_s": steady,
        "rss": {"processes": procs, "samples": rss},
        "processes": dep.pids,
        "started_after_warmup": sorted(set(dep.pids) - set(judged)),
        "max_abs_drift": max_abs_drift(procs),
        "health": health,
        "leftover_processes": leftover,
        "leaked_segments": leaked,
        "error_samples": load.errors if load else [],
        "wrong_samples": wrong[:MAX_SAMPLES],
        "failures": failures,
        "ok": not failures,
    }


def print_report(r: dict) -> None:
    c = r["config"]
    print(
        f"\nsoak through the front end: {c['clients']} clients, front end with {c['stages']} "
        f"stage(s), expert servers {', '.join(r['server_experts'])}; prompts 1.."
        f"{c['max_prompt_words']} words, max_tokens 1..{c['max_new_tokens']}, seed {c['seed']}"
    )
    print(f"per {c['interval_s']:g} s (latency = whole request; TTFT of streamed requests):")
    print(
        "(no request completed)"
        if not r["intervals"]
        else format_table(
            r["intervals"],
            [
                ("interval", "#", "d"),
                ("t_end_s", "t s", ".0f"),
                ("requests", "requests", "d"),
                ("streamed", "streamed", "d"),
                ("errors", "#err", "d"),
                ("p50_ms", "p50 ms", ".0f"),
                ("p99_ms", "p99 ms", ".0f"),
                ("ttft_p50_ms", "TTFT p50 ms", ".0f"),
                ("ttft_p99_ms", "TTFT p99 ms", ".0f"),
            ],
        )
    )
    print_rss(r, "the load ended")
    t, lat, ttft = r["totals"], r["latency_ms"], r["ttft_ms"]
    nan = float("nan")
    print(
        f"\n{t['requests']} requests ({t['streamed']} streamed) in {r['duration_s']:.0f} s "
        f"({r['requests_per_s']:.2f}/s; {r['wall_s']:.0f} s with start, reference run and stop); "
        f"latency p50 {lat['p50'] or nan:.0f} ms p99 {lat['p99'] or nan:.0f} ms; TTFT p50 "
        f"{ttft['p50'] or nan:.0f} ms p99 {ttft['p99'] or nan:.0f} ms; errors {t['errors']}; "
        f"checked {t['checked']}, wrong {t['wrong']}; max |RSS drift| "
        f"{r['max_abs_drift'] if r['max_abs_drift'] is not None else nan:.2%}"
    )
    for e in r["error_samples"]:
        print(f"  error: {e}")
    for w in r["wrong_samples"]:
        print(f"  wrong: {w}")
    print("PASS" if r["ok"] else "FAIL:\n  " + "\n  ".join(r["failures"]))


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    rows = [x for x in r["intervals"] if x["p50_ms"] is not None]
    mid = [(x["t_start_s"] + x["t_end_s"]) / 2 for x in rows]
    ax1.plot(mid, [x["p50_ms"] for x in rows], "o-", label="request p50")
    ax1.plot(mid, [x["p99_ms"] for x in rows], "s-", label="request p99")
    tt = [(m, x) for m, x in zip(mid, rows, strict=True) if x["ttft_p50_ms"] is not None]
    ax1.plot([m for m, _ in tt], [x["ttft_p50_ms"] for _, x in tt], "^--", label="TTFT p50")
    ax1.plot([m for m, _ in tt], [x["ttft_p99_ms"] for _, x in tt], "v--", label="TTFT p99")
    ax1.set_ylabel("ms")
    ax1.set_ylim(bottom=0)
    ax1.legend(loc="upper left", fontsize=8)
    c = r["config"]
    ax1.set_title(
        f"soak through the front end: {c['clients']} clients, {c['stages']} stage(s), "
        f"{r['totals']['requests']} requests, per {c['interval_s']:g} s"
    )
    plot_rss(ax2, r, (ax1, ax2))
    save_figure(fig, path)


HELP = {
    "duration_s": "seconds of load",
    "clients": "concurrent OpenAI-API clients, one request in flight each",
    "stages": "moecomm frontend --stages",
    "interval_s": "width of a latency row (p50/p99 per interval)",
    "rss_every_s": "VmRSS sampling period of every process",
    "warmup_frac": "leading share of the load left out of the RSS drift",
    "drift_limit": "largest |RSS drift| of any process that passes",
    "check_every": "re-check every n-th request of each client in the reference run",
    "request_timeout_s": "deadline of every request",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for f, default in asdict(FrontendSoakConfig()).items():
        ap.add_argument(
            "--" + f.replace("_", "-"), type=type(default), default=default, help=HELP.get(f)
        )
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, help="write a PNG of latency, TTFT and RSS here")
    a = vars(ap.parse_args(argv))
    json_path, png_path = a.pop("json"), a.pop("plot")
    cfg = FrontendSoakConfig(**a)
    # SIGTERM (a CI timeout, kill) unwinds like Ctrl-C, so the finally blocks stop the children.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run_soak(cfg)
    print_report(result)
    write_json(json_path, {"soak_frontend": result})
    if png_path:
        plot(result, png_path)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
