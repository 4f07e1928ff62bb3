"""Soak: many attention clients with variable batches through replicated expert servers.

`--clients` client processes (spawned), each an AttentionClient with two micro-batches in flight,
send batches of 0..max_tokens tokens (a new size every step, layers in turn) to `--servers`
expert-server processes that host every expert `--replicas` times. It runs until `--round-trips`
round trips are done (or `--duration-s` passes) and shows:

- no hang: every request has a deadline (`--timeout-s`), a client that reports no progress for
  `--stall-s` is a hang (it dumps its Python stack to stderr first), and a watchdog bounds the run;
- no error, no failover, no reconnect (no fault is injected: a failover means a deadline missed
  or an error answered), every server's /health 200 at the end with no batch failure, rejected
  request or client dropped as dead in its counters, no shared-memory segment left behind;
- every result correct (`--check-every`): bit-exact float32 against an in-process reference
  that sums in the runtime's order (per server its experts, then the servers in order), and the
  (token, k) pairs of a batch reach exactly one server each that hosts the expert;
- RSS of every server and client (VmRSS, sampled every `--rss-every-s`) flat within
  `--drift-limit` between the warm-up (the first `--warmup-frac`) and the first client's end;
- p50/p99 latency per interval (`--interval-s`, a minute by default), printed and in the JSON,
  and a PNG of latency and RSS over time.

Latency is one round trip, dispatch() called -> combine() returned, with the client's other
micro-batch in flight; 0-token batches reach no server, so they count as round trips but not in
the percentiles. Inputs come from a generator seeded by (--seed, client): a failure names the
client and step, and the same seed replays it. The clients' side is in soak_client.py, the
verdict, tables and plot in soak_report.py.

Usage: python bench/soak/soak.py [--clients 8] [--servers 3] [--replicas 2] [--round-trips 100000]
       [--duration-s S] [--interval-s 60] [--json PATH] [--plot PATH]
Exit status: 0 when every check passed, 1 otherwise (the reasons are printed last).
"""

from __future__ import annotations

import argparse
import os
import queue as queue_mod
import signal
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx
import torch
from moecomm import prefork

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
import moecomm
from _lib.soak_report import KB_PER_MB, analyse, plot, print_report, write_report
from moecomm.runtime.client import MAX_ATTEMPTS
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.wire.channel import POISON_ENV, POISON_SLOTS
from soak_client import FLUSH_S, MAX_SAMPLES, POLL_S, START_TIMEOUT_S, client_main

# Waiting for clients to exit when the run ends (they close their connections first).
JOIN_TIMEOUT_S = 30.0


@dataclass
class SoakConfig:
    clients: int = 8
    servers: int = 3
    replicas: int = 2
    round_trips: int = 100_000
    duration_s: float | None = None  # stop earlier when this passes (not a failure)
    interval_s: float = 60.0
    rss_every_s: float = 5.0
    warmup_frac: float = 0.2
    drift_limit: float = 0.05
    max_tokens: int = 64
    topk: int = 2
    num_layers: int = 2
    num_experts: int = 8
    hidden: int = 256
    intermediate: int = 128
    timeout_s: float = 10.0
    # No progress from a client for this long is a hang: by then even a request that failed over
    # MAX_ATTEMPTS times to replicas, each with the full deadline, would have completed.
    stall_s: float | None = None
    # The 10^5 run takes about 25 minutes on the 2-core CI machine: 3 h means stuck, not slow.
    watchdog_s: float = 3 * 3600.0
    check_every: int = 1
    order: str = "fifo"  # or "random": which of the two micro-batches is combined first
    # Every process poisons the slots it releases (MOECOMM_POISON_SLOTS), so a read after
    # release fails loudly. Off by default: the long run measures the production setting.
    poison_slots: bool = False
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.replicas <= self.servers:
            raise ValueError(f"replicas must be in 1..servers={self.servers}, got {self.replicas}")
        if not 1 <= self.topk <= self.num_experts or self.clients < 1 or self.check_every < 1:
            raise ValueError("need 1 <= topk <= num_experts, clients >= 1, check_every >= 1")

    def spec(self) -> ModelSpec:
        return ModelSpec(
            self.num_layers, self.num_experts, self.hidden, self.intermediate, self.seed
        )

    def stall_limit_s(self) -> float:
        return self.stall_s or (MAX_ATTEMPTS + 1) * self.timeout_s + 2 * FLUSH_S

    def placement(self) -> list[dict[int, list[int]]]:
        """Server s hosts expert e when s is one of e, e+1, ..., e+replicas-1 (mod servers)."""
        return [
            {
                layer: [
                    e
                    for e in range(self.num_experts)
                    if any((e + j) % self.servers == s for j in range(self.replicas))
                ]
                for layer in range(self.num_layers)
            }
            for s in range(self.servers)
        ]


# ---------------------------------------------------------------------------- parent side
def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def server_health(url: str, timeout: float) -> dict:
    """GET /health (a real forward pass, and the server's own counters): its status code and
    body; 503 comes with the reason in "detail"."""
    try:
        r = httpx.get(f"{url}/health", timeout=timeout)
        return {"status": r.status_code, **r.json()}
    except (httpx.HTTPError, ValueError) as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}"}


def _start_servers(cfg: SoakConfig, started: list) -> None:
    """Starts the servers in parallel (each start is a process importing torch); every one that
    started is appended to `started`, so the caller stops it whatever else failed."""

    def one(i_h):
        i, h = i_h
        s = spawn_expert_server(cfg.spec(), h, f"soak-s{i}")
        started.append(s)
        return s

    with ThreadPoolExecutor(cfg.servers) as pool:
        list(pool.map(one, enumerate(cfg.placement())))
    started.sort(key=lambda s: int(s.server_id.removeprefix("soak-s")))


class Run:
    """The parent's view: merged buckets, RSS samples, failures; filled while the run goes."""

    def __init__(self, cfg: SoakConfig):
        self.cfg = cfg
        self.buckets: dict[int, dict] = {}
        self.errors: list[str] = []
        self.wrong: list[dict] = []
        self.failures: list[str] = []
        self.hang: str | None = None
        self.procs: dict[str, int] = {}  # role -> pid
        self.rss: dict[str, list] = {}  # role -> [(t_s, kB)]
        self.t0_ns = 0
        self.steady_end_s: float | None = None  # the first client ended: RSS stops counting

    def merge(self, buckets: dict, errors: list, wrong: list) -> None:
        for b, k in buckets.items():
            into = self.buckets.setdefault(b, {key: [] if key == "lat_ns" else 0 for key in k})
            for key, v in k.items():
                into[key] += v
        self.errors += errors[: MAX_SAMPLES - len(self.errors)]
        self.wrong += wrong[: MAX_SAMPLES - len(self.wrong)]

    def progress(self, now_s: float) -> str:
        k = {key: sum(b[key] for b in self.buckets.values()) for key in ("rt", "errors", "wrong")}
        mb = sum(ss[-1][1] for ss in self.rss.values() if ss) / KB_PER_MB
        return (
            f"[{now_s:6.0f} s] {k['rt']} round trips, {k['errors']} errors, {k['wrong']} wrong, "
            f"RSS of all processes {mb:.0f} MB"
        )

    def sample_rss(self) -> None:
        t = (time.monotonic_ns() - self.t0_ns) / 1e9
        for role, pid in self.procs.items():
            kb = rss_kb(pid)
            if kb is not None:
                self.rss.setdefault(role, []).append((t, kb))


def _drain(q) -> list:
    """The messages queued now, waiting up to POLL_S for the first one."""
    out = []
    try:
        out.append(q.get(timeout=POLL_S))
        while True:
            out.append(q.get_nowait())
    except queue_mod.Empty:
        return out


def _supervise(run: Run, clients, servers, go, stop, q, t0) -> None:
    cfg = run.cfg
    ready, done = set(), set()
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(ready) < cfg.clients:  # start-up: every client connected
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(ready)} of {cfg.clients} clients connected in time")
        try:
            kind, idx, payload = q.get(timeout=POLL_S)[:3]
        except queue_mod.Empty:
            dead = [i for i, p in enumerate(clients) if i not in ready and not p.is_alive()]
            if dead:
                run.failures.append(f"clients {dead} exited during start-up")
                return
            continue
        if kind == "ready":
            ready.add(idx)
        elif kind == "fatal":
            run.failures.append(f"client {idx} failed to start:\n{payload}")
            return
    t0.value = run.t0_ns = time.monotonic_ns()
    go.set()
    start = time.monotonic()
    next_rss = next_progress = start
    seen = dict.fromkeys(range(cfg.clients), start)
    while len(done) < cfg.clients:
        # Everything queued is read before any clock check: a parent that was itself delayed
        # (stopped, swapped out) must not take its own delay for the clients' stall.
        for kind, idx, *payload in _drain(q):
            seen[idx] = time.monotonic()
            if kind == "stats":
                run.merge(*payload)
            elif kind == "fatal":
                run.failures.append(f"client {idx}:\n{payload[0]}")
            elif kind == "end" and run.steady_end_s is None:
                run.steady_end_s = (time.monotonic_ns() - run.t0_ns) / 1e9
            elif kind == "done":
                done.add(idx)
        for i, p in enumerate(clients):
            if i not in done and not p.is_alive() and p.exitcode:
                run.failures.append(f"client {i} died (exit {p.exitcode})")
                done.add(i)
        for s in servers:
            if not s.process.is_alive():
                run.failures.append(f"server {s.server_id} died (exit {s.process.exitcode})")
                return
        now = time.monotonic()
        if now >= next_rss:
            run.sample_rss()
            next_rss = now + cfg.rss_every_s
        if now >= next_progress:  # a long run shows it is alive
            print(run.progress(now - start), flush=True)
            next_progress = now + cfg.interval_s
        if cfg.duration_s is not None and now - start >= cfg.duration_s:
            stop.set()
        if now - start > cfg.watchdog_s:
            run.hang = f"watchdog: the run exceeded {cfg.watchdog_s:.0f} s"
            return
        stall = cfg.stall_limit_s()
        stalled = [i for i in range(cfg.clients) if i not in done and now - seen[i] > stall]
        if stalled:
            run.hang = f"clients {stalled} made no progress for {stall:.0f} s"
            return
    run.sample_rss()


def run_soak(cfg: SoakConfig) -> dict:
    """The whole soak; every process and segment is gone when it returns, whatever happened."""
    ctx = prefork.process_context()
    run = Run(cfg)
    servers: list = []
    clients: list = []
    stop, go, q, t0 = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Value("q", 0)
    health: dict[str, dict] = {}
    leaked: list[str] = []
    began = time.monotonic()
    env_before = os.environ.get(POISON_ENV)
    if cfg.poison_slots:  # read by every process we spawn, at its import of moecomm.wire.channel
        os.environ[POISON_ENV] = "1"
    # This process read the switch when it imported moecomm: the environment may have set it.
    poisoned = cfg.poison_slots or POISON_SLOTS
    try:
        _start_servers(cfg, servers)
        urls = [s.url for s in servers]
        for i in range(cfg.clients):
            p = ctx.Process(target=client_main, args=(i, cfg, urls, t0, go, stop, q), daemon=True)
            p.start()
            clients.append(p)
        run.procs = {s.server_id.removeprefix("soak-"): s.process.pid for s in servers}
        run.procs.update({f"c{i}": p.pid for i, p in enumerate(clients)})
        _supervise(run, clients, servers, go, stop, q, t0)
        if run.hang is None and not run.failures:
            health = {s.server_id: server_health(s.url, cfg.timeout_s) for s in servers}
    except Exception:
        run.failures.append(traceback.format_exc())
    finally:
        duration = (time.monotonic_ns() - run.t0_ns) / 1e9 if run.t0_ns else 0.0
        stop.set()
        for p in clients:
            p.join(JOIN_TIMEOUT_S if run.hang is None else 1.0)
            if p.is_alive():
                p.kill()
                p.join(JOIN_TIMEOUT_S)
        for s in servers:
            s.stop()
        pids = [s.process.pid for s in servers] + [p.pid for p in clients]
        for pid in pids:
            leaked += moecomm.list_segments(pid)
            moecomm.reap_stale_segments(pid)
        q.close()
        if env_before is None:
            os.environ.pop(POISON_ENV, None)
        else:
            os.environ[POISON_ENV] = env_before
    effective = {**asdict(cfg), "poison_slots": poisoned}  # the environment may have set it
    return analyse(
        run, effective, cfg.placement(), duration, time.monotonic() - began, health, leaked
    )


HELP = {
    "clients": "client processes, each with two micro-batches in flight",
    "servers": "expert-server processes",
    "replicas": "servers hosting each expert (<= servers)",
    "round_trips": "round trips in all, shared among the clients",
    "duration_s": "stop after this many seconds even if round trips are left",
    "interval_s": "width of a latency row (p50/p99 per interval)",
    "rss_every_s": "VmRSS sampling period of every process",
    "warmup_frac": "leading share of the run left out of the RSS drift",
    "drift_limit": "largest |RSS drift| of any process that passes",
    "max_tokens": "batch sizes are drawn from 0..max_tokens at every step",
    "timeout_s": "deadline of every request (AttentionClient timeout)",
    "stall_s": "no progress from a client for this long is a hang (default: from timeout)",
    "watchdog_s": "the whole run (after start-up) longer than this is a hang",
    "check_every": "compare every n-th result with the reference (1: all)",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for f, default in asdict(SoakConfig()).items():
        flag = "--" + f.replace("_", "-")
        if isinstance(default, bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
            continue
        kind = float if f in ("duration_s", "stall_s") else type(default)
        choices = ("fifo", "random") if f == "order" else None
        ap.add_argument(flag, type=kind, default=default, choices=choices, help=HELP.get(f))
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, help="write a PNG of latency and RSS here")
    a = vars(ap.parse_args(argv))
    json_path, png_path = a.pop("json"), a.pop("plot")
    cfg = SoakConfig(**a)
    torch.set_num_threads(1)
    # SIGTERM (a CI timeout, kill) unwinds like Ctrl-C, so the finally blocks clean up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run_soak(cfg)
    print_report(result)
    write_report(json_path, result)
    if png_path:
        plot(result, png_path)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
