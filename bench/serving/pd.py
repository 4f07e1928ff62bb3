"""Prefill/decode split vs one front end: decode ITL and TTFT under a mixed load, the KV
hand-off's cost, and the prefix cache on a shared-prefix load; the conditional router beside
the always-split one.

Processes (real `moecomm` processes on 127.0.0.1, the tiny random checkpoint of `moecomm tiny
--arch ARCH`, every one with ``--threads 1``): the membership monitor and two expert servers
(experts 0-11 and 4-15), shared by the two contenders, which run one after the other:

- ``single``: one plain front end (no role);
- ``split``: a prefill front end (``--role prefill``), a decode front end (``--role decode``)
  and ``moecomm router --max-local-prefill-tokens 0`` in front of them (always split); the
  prefill front end hands each prompt's KV blocks to the decode front end over shm;
- ``conditional``: the same processes, the router with ``--max-local-prefill-tokens
  --local-tokens`` (default: the router's own default): a prompt with at most that many tokens
  the decode front end's prefix cache does not hold is prefilled on the decode front end, with
  no hand-off (the decode front end has a prefix cache of ``--cache-mib`` too).

Every front end has ``--max-batch-tokens MAX_BATCH_TOKENS`` (a long prompt is prefilled in one
engine step, a real stall for the decodes batched with it, not chunked away) and a prefix cache
of ``--cache-mib`` (the prefill side only, in the split: the decode front end never prefills).

Workload 1, "mixed" (``--duration-s``): ``--clients`` clients each send streamed greedy
completions one after the other (a ``--short-input``-token prompt, ``--short-output`` tokens),
while long prompts (``--long-input`` tokens, ``--long-output`` tokens) arrive, one in every
``--long-every-s`` seconds at a random offset within them. Prompts and arrival times come from
``--seed``: both contenders get the same load. Client-side timing is moecomm bench's
(loadgen): TTFT = request sent -> first streamed token; ITL = the gaps between a request's
streamed tokens (in the split the first gap holds the KV hand-off and the decode front end's
admission, so the table also gives it apart, and the p99 without it). For the split: KV bytes
per hand-off and hand-off seconds per token of context, from the prefill front end's /metrics
(moecomm_kv_handoff_*) over the mixed phase and the prompt tokens sent (usage.prompt_tokens).

Workload 2, "shared prefix": one request at a time (TTFT is then its own prefill), each a
``--prefix``-token system prefix plus a distinct ``--tail``-token tail, ``--prefix-output``
tokens generated. First ``--prefix-requests`` requests each with a fresh prefix (the cache
misses: TTFT without the cache), then one that fills the cache with the shared prefix, then
``--prefix-requests`` that share it (TTFT with the cache). Hit rate and the cache's own
TTFT-saved estimate are the moecomm_prefix_cache_* series over the shared requests.

Ratios are split / single (> 1: the split is slower), then conditional / single and
conditional / split. Goals: the split's decode ITL p99 under the mixed load <= 0.5x the single
front end's, TTFT p50 <= 1.2x; the conditional router's short-request TTFT p99 <= 1.1x the
single front end's and its decode ITL p99 no worse than the always-split router's. The router's
moecomm_router_prefills_total{path} says where the conditional router prefilled. Outputs are
not compared here (tests/serving test the split's greedy outputs equal the single front
end's).

Usage: python bench/serving/pd.py [--duration-s 90] [--arch mixtral] [--seed 0] [--quick]
       [--json bench/results/pd.json] [--plot bench/results/pd.png]
Exit status: 0 when every request of both contenders completed and no process was left, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
from _lib.common import format_table, percentile, write_json
from _lib.soak_report import save_figure
from moecomm.testing import MONITOR_CMD, Proc, Processes, wait_all
from moecomm_serving.cli import loadgen
from moecomm_serving.cli.demo import CLI, ONE_THREAD, SERVER_EXPERTS
from moecomm_serving.disagg.router import DEFAULT_MAX_LOCAL_PREFILL_TOKENS
from moecomm_serving.model.tiny import ARCHS
from soak_frontend import GONE_TIMEOUT_S, START_TIMEOUT_S, STOP_TIMEOUT_S, alive, descendants

MODEL = "tiny"
# Tokens per engine step of every front end: a long prompt (--long-input <= this) is prefilled
# in one step, so it stalls the decodes batched with it (the default 64 would chunk it into
# 64-token pieces and hide most of what the split removes). Also the expert client's batch
# capacity.
MAX_BATCH_TOKENS = 1024
# Each client's one request in flight: a long prefill with 8 clients, 2 expert servers and up to
# 3 front-end processes on 2 cores takes seconds; this means stuck, not slow.
REQUEST_TIMEOUT_S = 120.0
# /metrics answers from memory.
METRICS_TIMEOUT_S = 30.0
# Short client i's request j draws its prompt from seed (seed * SEED_STRIDE + i) * SEED_STRIDE
# + j: distinct for every (seed, client, request), the same for both contenders.
SEED_STRIDE = 1_000_003
# Seed offsets of the long prompts, their arrival times and the shared-prefix prompts.
LONG_SEED, ARRIVAL_SEED, PREFIX_SEED = 1, 2, 3
# Quantiles kept of each contender's ITL samples (0..100 %), for the CDF plot.
QUANTILES = tuple(range(101))
# The load's sampling: greedy, every request runs to max_tokens (a fixed amount of decoding).
SAMPLING = {"temperature": 0.0, "ignore_eos": True}
# Goals of the split (split / single).
GOAL_ITL_P99 = 0.5
GOAL_TTFT_P50 = 1.2
# Goals of the conditional router: short-request TTFT p99 / the single front end's, decode ITL
# p99 / the always-split router's.
GOAL_COND_TTFT_SHORT_P99 = 1.1
GOAL_COND_ITL_P99 = 1.0
CONTENDERS = ("single", "split", "conditional")
ROUTED = ("split", "conditional")  # the contenders behind a router
# Left edge of the ITL CDF plot (ms).
CDF_LEFT_MS = 1.0
# Set by Ctrl-C / SIGTERM: the clients send no new request (a cancellation alone can be lost in
# the HTTP client's stream handling, and a client loop would then go on).
STOP = threading.Event()


@dataclass
class PdBenchConfig:
    arch: str = "mixtral"
    duration_s: float = 90.0
    clients: int = 8
    short_input: int = 32
    short_output: int = 48
    long_input: int = 768
    long_output: int = 8
    long_every_s: float = 4.0
    prefix: int = 512
    tail: int = 16
    prefix_output: int = 4
    prefix_requests: int = 8
    cache_mib: float = 64.0
    seed: int = 0
    local_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS

    def check(self) -> None:
        if self.duration_s <= 0 or self.clients < 1 or self.long_every_s <= 0:
            raise SystemExit(
                "bench/serving/pd.py: need --duration-s > 0, --clients >= 1, --long-every-s > 0"
            )
        if min(self.short_input, self.long_input, self.prefix, self.tail) < 1:
            raise SystemExit("bench/serving/pd.py: prompt lengths must be >= 1")
        # two tokens at least: the split hands off only requests that go on past the prefill
        if min(self.short_output, self.long_output, self.prefix_output) < 2:
            raise SystemExit("bench/serving/pd.py: output lengths must be >= 2")
        if self.prefix_requests < 1:
            raise SystemExit("bench/serving/pd.py: need --prefix-requests >= 1")
        if self.local_tokens < 0:
            raise SystemExit("bench/serving/pd.py: need --local-tokens >= 0")
        if self.long_input > MAX_BATCH_TOKENS or self.prefix + self.tail > MAX_BATCH_TOKENS:
            raise SystemExit(
                f"bench/serving/pd.py: prompts must fit one engine step ({MAX_BATCH_TOKENS} tokens)"
            )


# The few-second smoke run of the test suite: the same shape, small.
QUICK = {
    "duration_s": 4.0,
    "clients": 3,
    "short_output": 12,
    "long_input": 256,
    "long_every_s": 1.5,
    "prefix": 128,
    "prefix_requests": 2,
}


# ---------------------------------------------------------------------------- processes
class Deployment:
    """The children started so far; :meth:`stop` stops them newest first (front ends before
    the servers they call, the monitor last) and says which are left."""

    def __init__(self):
        # the `moecomm` children, each in a process group of its own (output in a log file)
        self.procs = Processes(cli=CLI)
        self.children: list[Proc] = []
        self.pids: dict[str, int] = {}

    def start(self, name: str, args: list[str]) -> Proc:
        """`moecomm <args>` as `name`, not waited for (url_of / wait_all)."""
        c = self.procs.moecomm(name, args, wait=False)
        self.children.append(c)
        self.pids[name] = c.pid
        return c

    def stop(self, children: list[Proc] | None = None) -> list[str]:
        """Stops `children` (default: all), newest first; the names of processes still alive
        (children and what they started) after GONE_TIMEOUT_S. Whatever is left is then killed
        and every group's shared memory reaped."""
        todo = list(self.children if children is None else children)
        pids = {c.name: c.pid for c in todo}
        for c in todo:
            for pid in descendants(c.pid):
                pids[f"{c.name}.{pid}"] = pid
        for c in reversed(todo):
            c.stop(signal.SIGINT, STOP_TIMEOUT_S, clean=False)
            self.children.remove(c)
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
            time.sleep(0.1)
        left = [f"{n} ({p})" for n, p in pids.items() if alive(p)]
        for c in todo:
            c.stop()  # the rest of its group killed, its shared memory reaped
        return left


def url_of(child: Proc) -> str:
    """The URL `child` announced once it serves."""
    return child.wait_ready(START_TIMEOUT_S)["url"]


def start_servers(dep: Deployment, ckpt: str) -> str:
    """The monitor and the expert servers (started together); the monitor's URL."""
    mon = dep.procs.spawn("monitor", [*MONITOR_CMD, "--port", "0"])  # light: no torch
    dep.children.append(mon)
    dep.pids["monitor"] = mon.pid
    monitor = url_of(mon)
    servers = []
    for i, experts in enumerate(SERVER_EXPERTS):
        args = ["expert-server", "--checkpoint", ckpt, "--experts", experts]
        servers.append(
            dep.start(f"s{i}", [*args, "--id", f"pd-bench-{i}", "--monitor", monitor, *ONE_THREAD])
        )
    wait_all(servers, START_TIMEOUT_S)
    return monitor


def frontend_args(ckpt: str, monitor: str, extra: list[str]) -> list[str]:
    return [
        "frontend",
        "--checkpoint",
        ckpt,
        "--model-name",
        MODEL,
        "--monitor",
        monitor,
        *ONE_THREAD,
        "--port",
        "0",
        "--max-batch-tokens",
        str(MAX_BATCH_TOKENS),
        *extra,
    ]


def start_contender(
    dep: Deployment, name: str, ckpt: str, monitor: str, cache_bytes: int, local_tokens: int = 0
) -> tuple[list[Proc], str, str]:
    """The contender's processes; (them, the URL the clients use, the URL whose /metrics has
    the prefix cache and the KV hand-offs)."""
    cache = ["--prefix-cache-bytes", str(cache_bytes)]
    if name == "single":
        fe = dep.start("frontend", frontend_args(ckpt, monitor, cache))
        url = url_of(fe)
        return [fe], url, url
    pre = dep.start("prefill", frontend_args(ckpt, monitor, ["--role", "prefill", *cache]))
    # the conditional router prefills on the decode front end too: it gets a prefix cache
    dec_cache = cache if name == "conditional" else []
    dec = dep.start("decode", frontend_args(ckpt, monitor, ["--role", "decode", *dec_cache]))
    wait_all([pre, dec], START_TIMEOUT_S)  # started together
    pre_url, dec_url = pre.url, dec.url
    args = ["router", "--checkpoint", ckpt, "--model-name", MODEL, "--port", "0"]
    local = str(local_tokens if name == "conditional" else 0)
    args += ["--max-local-prefill-tokens", local]
    router = dep.start("router", [*args, "--prefill", pre_url, "--decode", dec_url])
    return [pre, dec, router], url_of(router), pre_url


def scrape(url: str) -> dict[str, float]:
    """`url`'s /metrics samples: name{labels} -> value."""
    r = httpx.get(f"{url}/metrics", timeout=METRICS_TIMEOUT_S)
    r.raise_for_status()
    out = {}
    for ln in r.text.splitlines():
        if ln and not ln.startswith("#"):
            name, _, value = ln.rpartition(" ")
            out[name] = float(value)
    return out


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


# ---------------------------------------------------------------------------- workloads
def prompt(tokens: int, seed: int) -> str:
    """A random-word prompt of `tokens` tokens (the tiny checkpoint's tokenizer is byte level:
    one character is one token)."""
    return loadgen.synthetic_requests(1, tokens, 1, 0.0, seed, 1.0)[0].prompt


async def one(http, url: str, text: str, max_tokens: int) -> loadgen.RequestResult:
    """One streamed greedy completion, timed by moecomm bench's client."""
    req = loadgen.BenchRequest(text, max_tokens)
    call = loadgen._one(
        http, f"{url}/v1/completions", MODEL, req, False, SAMPLING, REQUEST_TIMEOUT_S
    )
    try:
        return await asyncio.wait_for(call, REQUEST_TIMEOUT_S)
    except asyncio.TimeoutError:
        return loadgen.RequestResult(error=f"no complete answer within {REQUEST_TIMEOUT_S} s")


def long_arrivals(cfg: PdBenchConfig) -> list[float]:
    """Seconds after the start at which the long prompts arrive: one in every --long-every-s
    interval, at a seeded uniform offset within it (as many for both contenders and for every
    seed; a Poisson process of a few arrivals would vary the load's weight with the seed)."""
    rng = random.Random(cfg.seed * SEED_STRIDE + ARRIVAL_SEED)
    n = int(cfg.duration_s // cfg.long_every_s)
    return [(k + rng.random()) * cfg.long_every_s for k in range(n)]


async def mixed(url: str, cfg: PdBenchConfig) -> dict:
    """Workload 1; the results of the short and the long requests."""
    short: list[loadgen.RequestResult] = []
    long: list[loadgen.RequestResult] = []
    limits = httpx.Limits(max_connections=cfg.clients + 16)
    async with httpx.AsyncClient(limits=limits) as http:
        t0 = time.monotonic()

        async def client(i: int) -> None:
            j = 0
            while time.monotonic() - t0 < cfg.duration_s and not STOP.is_set():
                seed = (cfg.seed * SEED_STRIDE + i) * SEED_STRIDE + j
                short.append(await one(http, url, prompt(cfg.short_input, seed), cfg.short_output))
                j += 1

        async def long_one(at: float, k: int) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            seed = (cfg.seed * SEED_STRIDE + LONG_SEED) * SEED_STRIDE + k
            long.append(await one(http, url, prompt(cfg.long_input, seed), cfg.long_output))

        tasks = [client(i) for i in range(cfg.clients)]
        tasks += [long_one(at, k) for k, at in enumerate(long_arrivals(cfg))]
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
    return {"short": short, "long": long, "wall_s": wall}


async def shared_prefix(url: str, cfg: PdBenchConfig, cache_url: str) -> dict:
    """Workload 2, one request at a time; the miss and hit results and the cache's series over
    the shared requests."""
    base = cfg.seed * SEED_STRIDE + PREFIX_SEED
    n = cfg.prefix_requests
    tails = [prompt(cfg.tail, base * SEED_STRIDE + 2 * n + k) for k in range(2 * n + 1)]
    shared = prompt(cfg.prefix, base * SEED_STRIDE + 4 * n)
    out: dict = {"miss": [], "hit": []}
    async with httpx.AsyncClient() as http:
        for k in range(n):  # a fresh prefix each: the cache cannot help
            fresh = prompt(cfg.prefix, base * SEED_STRIDE + k)
            out["miss"].append(await one(http, url, fresh + tails[k], cfg.prefix_output))
        # fills the cache with the shared prefix
        out["fill"] = await one(http, url, shared + tails[n], cfg.prefix_output)
        before = scrape(cache_url)
        for k in range(n):
            out["hit"].append(await one(http, url, shared + tails[n + 1 + k], cfg.prefix_output))
        after = scrape(cache_url)
    p = "moecomm_prefix_cache_"
    query = delta(after, before, f"{p}query_tokens_total")
    hit = delta(after, before, f"{p}hit_tokens_total")
    out["cache"] = {
        "lookups": delta(after, before, f"{p}lookups_total"),
        "hits": delta(after, before, f"{p}hits_total"),
        "query_tokens": query,
        "hit_tokens": hit,
        "hit_rate": hit / query if query else None,
        "estimated_saved_s": delta(after, before, f"{p}saved_prefill_seconds_total"),
        "bytes": after.get(f"{p}bytes"),
    }
    return out


# ---------------------------------------------------------------------------- analysis
def ms(xs: list[float], q: float) -> float | None:
    return percentile(xs, q) * 1e3 if xs else None


def mixed_row(name: str, run: dict, before: dict, after: dict, rbefore: dict, rafter: dict) -> dict:
    short = [r for r in run["short"] if r.ok]
    long = [r for r in run["long"] if r.ok]
    gaps = [x for r in short for x in r.itls_s]
    first_gaps = [r.itls_s[0] for r in short if r.itls_s]
    later_gaps = [x for r in short for x in r.itls_s[1:]]
    ttft_short, ttft_long = [r.ttft_s for r in short], [r.ttft_s for r in long]
    row = {
        "contender": name,
        "short_requests": len(short),
        "long_requests": len(long),
        "failed": len(run["short"]) + len(run["long"]) - len(short) - len(long),
        "errors": sorted({r.error for r in run["short"] + run["long"] if not r.ok})[:5],
        "wall_s": run["wall_s"],
        "output_tokens_per_s": sum(r.output_tokens for r in short + long) / run["wall_s"],
        "itl_p50_ms": ms(gaps, 50),
        "itl_p99_ms": ms(gaps, 99),
        "itl_quantiles_ms": [ms(gaps, q) for q in QUANTILES] if gaps else [],
        "first_gap_p50_ms": ms(first_gaps, 50),
        "first_gap_p99_ms": ms(first_gaps, 99),
        "decode_itl_p99_ms": ms(later_gaps, 99),
        "ttft_p50_ms": ms(ttft_short + ttft_long, 50),
        "ttft_p99_ms": ms(ttft_short + ttft_long, 99),
        "ttft_short_p50_ms": ms(ttft_short, 50),
        "ttft_short_p99_ms": ms(ttft_short, 99),
        "ttft_long_p50_ms": ms(ttft_long, 50),
        "ttft_long_p99_ms": ms(ttft_long, 99),
    }
    if name in ROUTED:
        row["prefills"] = {
            path: delta(rafter, rbefore, f'moecomm_router_prefills_total{{path="{path}"}}')
            for path in ("local_short", "local_cached", "split")
        }
        row["cached_questions"] = delta(rafter, rbefore, "moecomm_router_cached_questions_total")
        k = "moecomm_kv_handoff_"
        sent = '{direction="sent"}'
        handoffs = delta(after, before, f"{k}handoffs_total{sent}")
        kv_bytes = delta(after, before, f"{k}bytes_total{sent}")
        seconds = delta(after, before, f"{k}send_seconds_total")
        context = sum(r.prompt_tokens for r in short + long)
        row["kv"] = {
            "handoffs": handoffs,
            "requests": len(short) + len(long),
            "bytes": kv_bytes,
            "seconds": seconds,
            "context_tokens": context,
            "bytes_per_request": kv_bytes / handoffs if handoffs else None,
            "bytes_per_token": kv_bytes / context if context else None,
            "transfer_s_per_token": seconds / context if context else None,
            "transfer_ms_per_request": seconds / handoffs * 1e3 if handoffs else None,
            "gbps": kv_bytes / seconds / 1e9 if seconds else None,
            "failures": delta(after, before, f"{k}failures_total{sent}"),
        }
    return row


def prefix_row(name: str, run: dict) -> dict:
    miss = [r.ttft_s for r in run["miss"] if r.ok]
    hit = [r.ttft_s for r in run["hit"] if r.ok]
    failed = sum(not r.ok for r in [*run["miss"], *run["hit"], run["fill"]])
    m50, h50 = ms(miss, 50), ms(hit, 50)
    return {
        "contender": name,
        "failed": failed,
        "ttft_miss_p50_ms": m50,
        "ttft_miss_p99_ms": ms(miss, 99),
        "ttft_hit_p50_ms": h50,
        "ttft_hit_p99_ms": ms(hit, 99),
        "ttft_saved_p50_ms": m50 - h50 if m50 is not None and h50 is not None else None,
        "hit_over_miss": h50 / m50 if m50 and h50 is not None else None,
        **{f"cache_{k}": v for k, v in run["cache"].items()},
    }


def ratios(rows: list[dict], keys: list[str], num: str = "split", den: str = "single") -> dict:
    """`num` / `den` (contender names) for every key both have."""
    by = {r["contender"]: r for r in rows}
    if num not in by or den not in by:
        return {}
    a, b = by[den], by[num]
    return {k: b[k] / a[k] for k in keys if a.get(k) and b.get(k) is not None}


# ---------------------------------------------------------------------------- the run
def run_bench(cfg: PdBenchConfig) -> dict:
    """Both contenders; every process is stopped when it returns, whatever happened."""
    dep = Deployment()
    mixed_rows, prefix_rows, failures, leftover = [], [], [], []
    interrupted = False
    began = time.monotonic()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="moecomm-pd-bench-") as tmp:
        try:
            ckpt = os.path.join(tmp, "tiny")
            tiny = [*CLI, "tiny", "--out", ckpt, "--arch", cfg.arch]
            subprocess.run(tiny, check=True, timeout=REQUEST_TIMEOUT_S, stdout=subprocess.DEVNULL)
            monitor = start_servers(dep, ckpt)
            cache_bytes = int(cfg.cache_mib * 2**20)
            for name in CONTENDERS:
                t = time.monotonic()
                procs, url, cache_url = start_contender(
                    dep, name, ckpt, monitor, cache_bytes, cfg.local_tokens
                )
                print(f"{name}: up in {time.monotonic() - t:.1f} s at {url}", flush=True)
                try:
                    before, rbefore = scrape(cache_url), scrape(url)
                    run = asyncio.run(mixed(url, cfg))
                    after, rafter = scrape(cache_url), scrape(url)
                    mixed_rows.append(mixed_row(name, run, before, after, rbefore, rafter))
                    print(f"{name}: mixed load done", flush=True)
                    run = asyncio.run(shared_prefix(url, cfg, cache_url))
                    prefix_rows.append(prefix_row(name, run))
                finally:
                    leftover += dep.stop(procs)
        except KeyboardInterrupt:
            interrupted = True
            failures.append("interrupted")
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            leftover += dep.stop()
    for r in mixed_rows + prefix_rows:
        if r["failed"]:
            failures.append(f"{r['contender']}: {r['failed']} requests failed: {r.get('errors')}")
    if leftover:
        failures.append(f"processes left after stopping: {leftover}")
    result = {
        "config": asdict(cfg),
        "max_batch_tokens": MAX_BATCH_TOKENS,
        "server_experts": list(SERVER_EXPERTS),
        "processes": {"single": 4, "split": 6, "conditional": 6},
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": time.monotonic() - began,
        "mixed": mixed_rows,
        "shared_prefix": prefix_rows,
        "failures": failures,
        "interrupted": interrupted,
        "ok": not failures,
    }
    if len(mixed_rows) >= 2:
        keys = [
            "itl_p50_ms",
            "itl_p99_ms",
            "decode_itl_p99_ms",
            "first_gap_p50_ms",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "ttft_short_p50_ms",
            "ttft_short_p99_ms",
            "ttft_long_p50_ms",
            "ttft_long_p99_ms",
            "output_tokens_per_s",
        ]
        r = ratios(mixed_rows, keys)
        result["mixed_ratios"] = r
        result["goals"] = {
            "itl_p99_ratio": r.get("itl_p99_ms"),
            "itl_p99_goal": GOAL_ITL_P99,
            "itl_p99_met": r.get("itl_p99_ms", math.inf) <= GOAL_ITL_P99,
            "ttft_p50_ratio": r.get("ttft_p50_ms"),
            "ttft_p50_goal": GOAL_TTFT_P50,
            "ttft_p50_met": r.get("ttft_p50_ms", math.inf) <= GOAL_TTFT_P50,
        }
        over_single = ratios(mixed_rows, keys, "conditional", "single")
        over_split = ratios(mixed_rows, keys, "conditional", "split")
        if over_single and over_split:
            result["conditional_ratios"] = {"over_single": over_single, "over_split": over_split}
            ttft = over_single.get("ttft_short_p99_ms", math.inf)
            itl = over_split.get("decode_itl_p99_ms", math.inf)
            result["goals"] |= {
                "conditional_ttft_short_p99_ratio": ttft,
                "conditional_ttft_short_p99_goal": GOAL_COND_TTFT_SHORT_P99,
                "conditional_ttft_short_p99_met": ttft <= GOAL_COND_TTFT_SHORT_P99,
                "conditional_decode_itl_p99_over_split": itl,
                "conditional_decode_itl_p99_goal": GOAL_COND_ITL_P99,
                "conditional_decode_itl_p99_met": itl <= GOAL_COND_ITL_P99,
            }
    if len(prefix_rows) >= 2:
        result["shared_prefix_ratios"] = ratios(
            prefix_rows, ["ttft_miss_p50_ms", "ttft_hit_p50_ms"]
        )
    return result


def print_report(r: dict) -> None:
    c = r["config"]
    print(
        f"\n{c['arch']}, max batch tokens {r['max_batch_tokens']}, one torch thread per process; "
        f"expert servers {', '.join(r['server_experts'])}; load average "
        f"{r['loadavg_before'][0]:.2f} before, {r['loadavg_after'][0]:.2f} after"
    )
    print(
        f"mixed: {c['clients']} clients x ({c['short_input']} prompt + {c['short_output']} "
        f"generated tokens, streamed) for {c['duration_s']:g} s, long prompts of "
        f"{c['long_input']} tokens (+{c['long_output']}) every {c['long_every_s']:g} s "
        f"(seed {c['seed']}); ITL over the short requests; ratio = split / single"
    )
    rows = list(r["mixed"])
    if "mixed_ratios" in r:
        rows.append({"contender": "split/single", **r["mixed_ratios"]})
    if "conditional_ratios" in r:
        rows.append({"contender": "cond/single", **r["conditional_ratios"]["over_single"]})
        rows.append({"contender": "cond/split", **r["conditional_ratios"]["over_split"]})
    cols = [
        ("contender", "contender", ""),
        ("itl_p50_ms", "ITL p50", ".2f"),
        ("itl_p99_ms", "ITL p99", ".2f"),
        ("decode_itl_p99_ms", "ITL p99 w/o 1st", ".2f"),
        ("first_gap_p50_ms", "1st gap p50", ".2f"),
        ("ttft_p50_ms", "TTFT p50", ".2f"),
        ("ttft_p99_ms", "TTFT p99", ".2f"),
        ("ttft_short_p50_ms", "short p50", ".2f"),
        ("ttft_short_p99_ms", "short p99", ".2f"),
        ("ttft_long_p50_ms", "long p50", ".2f"),
        ("ttft_long_p99_ms", "long p99", ".2f"),
        ("output_tokens_per_s", "tok/s", ".2f"),
    ]
    print("(ms; TTFT = short and long requests together, then apart)")
    if rows:  # none when no contender started (the failures below say why)
        print(format_table(rows, cols))
    for row in r["mixed"]:
        print(
            f"  {row['contender']}: {row['short_requests']} short + {row['long_requests']} long "
            f"requests in {row['wall_s']:.1f} s, {row['failed']} failed"
        )
        if "prefills" in row:
            print(
                f"  {row['contender']} prefills by path: "
                + ", ".join(f"{k} {v:.0f}" for k, v in row["prefills"].items())
                + f"; {row['cached_questions']:.0f} prefix-cache questions"
            )
        kv = row.get("kv")
        if kv and kv["handoffs"]:
            print(
                f"  {row['contender']} KV hand-off: {kv['handoffs']:.0f} hand-offs for "
                f"{kv['requests']} requests, {kv['bytes_per_request'] / 1024:.1f} KiB per request "
                f"({kv['bytes_per_token']:.0f} B per token of context), "
                f"{kv['transfer_ms_per_request']:.2f} ms per request, "
                f"{kv['transfer_s_per_token'] * 1e6:.2f} us per token of context, "
                f"{kv['gbps']:.2f} GB/s; {kv['failures']:.0f} failures"
            )
    g = r.get("goals")
    if g:
        nan = float("nan")
        print(
            f"goals: ITL p99 ratio {g['itl_p99_ratio'] or nan:.2f} (goal <= {GOAL_ITL_P99}: "
            f"{'met' if g['itl_p99_met'] else 'not met'}), TTFT p50 ratio "
            f"{g['ttft_p50_ratio'] or nan:.2f} (goal <= {GOAL_TTFT_P50}: "
            f"{'met' if g['ttft_p50_met'] else 'not met'})"
        )
        if "conditional_ttft_short_p99_ratio" in g:
            print(
                f"conditional (--max-local-prefill-tokens {c['local_tokens']}): short TTFT p99 / "
                f"single {g['conditional_ttft_short_p99_ratio']:.2f} (goal <= "
                f"{GOAL_COND_TTFT_SHORT_P99}: "
                f"{'met' if g['conditional_ttft_short_p99_met'] else 'not met'}), decode ITL "
                f"p99 / split {g['conditional_decode_itl_p99_over_split']:.2f} (goal <= "
                f"{GOAL_COND_ITL_P99}: "
                f"{'met' if g['conditional_decode_itl_p99_met'] else 'not met'})"
            )
    print(
        f"\nshared prefix: {c['prefix']}-token prefix + {c['tail']}-token tail, "
        f"{c['prefix_output']} generated, one request at a time; {c['prefix_requests']} with a "
        f"fresh prefix (miss) then {c['prefix_requests']} sharing one (hit); cache "
        f"{c['cache_mib']:g} MiB"
    )
    cols = [
        ("contender", "contender", ""),
        ("ttft_miss_p50_ms", "TTFT miss p50", ".1f"),
        ("ttft_hit_p50_ms", "TTFT hit p50", ".1f"),
        ("ttft_saved_p50_ms", "saved p50", ".1f"),
        ("hit_over_miss", "hit/miss", ".2f"),
        ("cache_hit_rate", "hit rate", ".2f"),
        ("cache_estimated_saved_s", "est. saved s", ".3f"),
    ]
    if r["shared_prefix"]:
        print(format_table(r["shared_prefix"], cols))
    print("PASS" if r["ok"] else "FAIL:\n  " + "\n  ".join(r["failures"]))


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    for row in r["mixed"]:
        q = row["itl_quantiles_ms"]
        if q:
            ax1.plot(q, [x / 100 for x in QUANTILES], label=row["contender"])
    ax1.set_xscale("log")
    # tokens that reach the client in one read show gaps of microseconds: not decode steps
    ax1.set_xlim(left=CDF_LEFT_MS)
    ax1.set_xlabel("inter-token gap of the short requests (ms, log)")
    ax1.set_ylabel("fraction of gaps")
    ax1.set_title("mixed load: ITL CDF")
    ax1.legend()
    keys = [
        ("itl_p99_ms", "ITL p99"),
        ("ttft_short_p50_ms", "TTFT short p50"),
        ("ttft_short_p99_ms", "TTFT short p99"),
        ("ttft_long_p50_ms", "TTFT long p50"),
        ("ttft_long_p99_ms", "TTFT long p99"),
    ]
    width = 0.8 / max(1, len(r["mixed"]))
    for i, row in enumerate(r["mixed"]):
        xs = [k + i * width for k in range(len(keys))]
        ax2.bar(xs, [row[k] or 0 for k, _ in keys], width, label=row["contender"])
    ax2.set_xticks([k + width / 2 for k in range(len(keys))], [lbl for _, lbl in keys])
    ax2.tick_params(axis="x", labelsize=7)
    ax2.set_ylabel("ms")
    ax2.set_title("mixed load: latency")
    ax2.legend()
    for i, row in enumerate(r["shared_prefix"]):
        xs = [0 + i * width, 1 + i * width]
        vals = [row["ttft_miss_p50_ms"] or 0, row["ttft_hit_p50_ms"] or 0]
        ax3.bar(xs, vals, width, label=row["contender"])
    ax3.set_xticks([width / 2, 1 + width / 2], ["TTFT p50, miss", "TTFT p50, prefix hit"])
    ax3.set_ylabel("ms")
    ax3.set_title("shared prefix: prefix cache")
    ax3.legend()
    save_figure(fig, path)


HELP = {
    "arch": "model family of the tiny checkpoint",
    "duration_s": "seconds of the mixed load, per contender",
    "clients": "concurrent short-request clients of the mixed load",
    "short_input": "prompt tokens of a short request",
    "short_output": "tokens generated per short request",
    "long_input": f"prompt tokens of a long request (<= {MAX_BATCH_TOKENS})",
    "long_output": "tokens generated per long request",
    "long_every_s": "one long prompt arrives in every interval of this many seconds",
    "prefix": "shared-prefix workload: tokens of the shared prefix",
    "tail": "shared-prefix workload: distinct tokens after the prefix",
    "prefix_output": "shared-prefix workload: tokens generated per request",
    "prefix_requests": "shared-prefix workload: requests that miss, and as many that hit",
    "cache_mib": "prefix cache budget of the (prefill) front end, MiB",
    "seed": "seed of every prompt and arrival time",
    "local_tokens": "the conditional router's --max-local-prefill-tokens",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for f, default in asdict(PdBenchConfig()).items():
        kwargs = {"choices": ARCHS} if f == "arch" else {}
        ap.add_argument(
            "--" + f.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"{HELP[f]} (default {default})",
            **kwargs,
        )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"a few seconds of load for a CI smoke test: sets {', '.join(QUICK)}",
    )
    ap.add_argument("--json", default="bench/results/pd.json", help="write the results here")
    ap.add_argument("--plot", default="bench/results/pd.png", help="write a PNG here")
    a = vars(ap.parse_args(argv))
    json_path, png_path, quick = a.pop("json"), a.pop("plot"), a.pop("quick")
    if quick:
        a.update(QUICK)
    cfg = PdBenchConfig(**a)
    cfg.check()

    # Ctrl-C and SIGTERM (a CI timeout, kill) raise KeyboardInterrupt wherever the bench is, so
    # the finally blocks stop the children. Installed by hand for SIGINT too: asyncio.run's own
    # handler only cancels the load's task, and a cancellation swallowed on the way (seen in
    # the HTTP client's stream handling) would let the run go on as if nothing happened.
    def on_signal(*_):
        STOP.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    result = run_bench(cfg)
    print_report(result)
    if result["interrupted"]:  # a partial run does not replace the results file
        return 130
    write_json(json_path, {"pd": result})
    if png_path and result["mixed"]:
        plot(result, png_path)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
