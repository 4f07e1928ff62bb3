"""Where does the front end's memory go per request? RSS and tracemalloc growth sites of an
OpenAI front end over the tiny checkpoint under the soak's request mix.

This process runs the front end (the same `make_frontend_app` / `start_frontend` the CLI runs;
`--stages N > 1`: the model over N pipeline stage processes behind a `PipelinedModel`, as
`moecomm frontend --stages N`), with tracemalloc on. The requests come from a child process
(this file with --client), so no client allocation lands in the measured process: `--clients`
concurrent connections, each request drawn exactly as bench/serving/soak_frontend.py draws them
(completions and chat, streamed or not, greedy or seeded, 1..24 prompt words, 1..32 new tokens),
seeded by (--seed, request index).

Every `--every` requests the client pauses with nothing in flight; this process then collects
garbage and records VmRSS, the memory tracemalloc traces, and a snapshot. Printed per checkpoint:
the RSS and traced growth since the previous checkpoint; at the end, the allocation sites
(grouped by line and by traceback) that grew between the checkpoint at `--baseline` requests and
the last one, in bytes per request. A site that keeps growing at every checkpoint is a leak; one
that grows and then stays flat is a cache filling up (or allocator fragmentation when RSS grows
while traced memory does not).

tracemalloc's own tables grow with every traced block, so RSS per request is read from a run
with --no-tracemalloc (and ~5x more requests per second); --malloc-trim returns malloc's free
memory before each reading, so what is left is live memory. --explain N names, for the top N
sites, the containers that hold their objects.

Usage: python bench/serving/frontend_memory.py [--stages 1] [--standby] [--requests 3000]
       [--every 500]
       [--baseline 500] [--clients 8] [--no-tracemalloc] [--malloc-trim] [--explain N]
       [--json bench/results/frontend_memory.json]
Experts are in-process (--local-experts): with --stages N > 1 the front end process holds no
expert client either way, and the soak's growth was in the front end process.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import linecache
import os
import queue
import random
import select
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
from _lib.common import write_json

# Frames kept per traced allocation: enough to see which request-path caller made it.
TRACE_FRAMES = 16
# Sites printed per grouping.
TOP_SITES = 12
# Frames of a traceback printed per site (innermost first).
SHOW_FRAMES = 6
# A checkpoint (gc, snapshot, compare) takes seconds with TRACE_FRAMES frames; the client waits
# this long for the go-ahead before it gives up (the parent died or hangs).
CHECKPOINT_TIMEOUT_S = 600.0
# The client's `--every` requests on 2 busy cores: ~0.1-1 s each with 8 in flight.
CHUNK_TIMEOUT_S = 1800.0
# Start-up: imports, a tiny checkpoint, stage processes.
START_TIMEOUT_S = 240.0
# The soak's deadline of one request.
REQUEST_TIMEOUT_S = 120.0
# Request j of run seed s draws from seed s * SEED_STRIDE + j.
SEED_STRIDE = 1_000_003
BYTES_PER_KB = 1024


# glibc's malloc_trim: returns the free memory malloc holds to the system, so RSS then counts
# live memory only (growth that goes away with it is fragmentation, not a leak).
_LIBC = ctypes.CDLL(None)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * BYTES_PER_KB
    raise RuntimeError("no VmRSS in /proc/self/status")


# ---------------------------------------------------------------------------- the client
async def _client_main(a: argparse.Namespace) -> int:
    import httpx
    from soak_frontend import FrontendSoakConfig, make_request, send

    cfg = FrontendSoakConfig(seed=a.seed)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    https = [httpx.AsyncClient(base_url=a.client, timeout=timeout) for _ in range(a.clients)]
    errors = 0
    nxt = 0
    try:
        for end in range(a.every, a.requests + 1, a.every):

            async def one(http, end=end) -> None:
                nonlocal nxt, errors
                while nxt < end:
                    j, nxt = nxt, nxt + 1
                    req = make_request(random.Random(a.seed * SEED_STRIDE + j), cfg, 0, j)
                    try:
                        await asyncio.wait_for(send(http, req, req["stream"]), REQUEST_TIMEOUT_S)
                    except Exception as exc:  # counted and reported; the run goes on
                        errors += 1
                        print(f"error: request {j}: {type(exc).__name__}: {exc}", flush=True)

            await asyncio.wait_for(asyncio.gather(*(one(h) for h in https)), CHUNK_TIMEOUT_S)
            print(f"at {end} {errors}", flush=True)
            ready, _, _ = select.select([sys.stdin], [], [], CHECKPOINT_TIMEOUT_S)
            if not ready or sys.stdin.readline().strip() != "go":
                print("client: no go-ahead from the front end", flush=True)
                return 1
    finally:
        for h in https:
            await h.aclose()
    return 0


# ---------------------------------------------------------------------------- the front end
def start_frontend_here(ckpt: str, stages: int, standby: bool, max_batch_tokens: int):
    """(HttpServer, its Frontend, closer) of a front end over `ckpt` in this process."""
    import torch
    from moecomm_serving.api.app import FrontendSettings, make_frontend_app, start_frontend
    from moecomm_serving.model.config import MoEConfig
    from moecomm_serving.model.tokenizer import load_tokenizer
    from moecomm_serving.model.transformer import LOCAL, load_model

    torch.set_num_threads(1)  # as the soak's --threads 1
    config = MoEConfig.from_file(ckpt)
    tokenizer = load_tokenizer(ckpt, config)
    model = None
    if stages == 1:
        model = load_model(ckpt, experts=LOCAL, dtype=torch.float32)
    else:
        from moecomm_serving.engine.pipeline import PipelinedModel
        from moecomm_serving.engine.stages import model_pipeline

        def build(initial_k: int = 0):
            return model_pipeline(
                ckpt,
                stages,
                dtype=torch.float32,
                max_tokens=max_batch_tokens,
                return_logits=True,
                initial_k=initial_k,
            )

        model = PipelinedModel(build(), config, restart=build, standby=standby)
    app = make_frontend_app(model, tokenizer, FrontendSettings("tiny", max_batch_tokens))
    http = start_frontend(app)

    def close() -> None:
        http.stop()
        if stages > 1:
            model.close()

    return http, app.state.frontend, close


def _short(frame) -> str:
    path = frame.filename
    for marker in ("site-packages/", "/python/", "/serving/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{frame.lineno}"


def _site(stat, frames: int) -> list[str]:
    return [_short(fr) for fr in list(stat.traceback)[::-1][:frames]]  # innermost first


def growth_sites(new, old, key: str, per: int, top: int) -> list[dict]:
    stats = [s for s in new.compare_to(old, key) if s.size_diff > 0]
    stats.sort(key=lambda s: s.size_diff, reverse=True)
    rows = []
    for s in stats[:top]:
        rows.append(
            {
                "bytes": s.size_diff,
                "blocks": s.count_diff,
                "bytes_per_request": s.size_diff / per,
                "site": _site(s, SHOW_FRAMES if key == "traceback" else 1),
            }
        )
    return rows


def _innermost(obj) -> str | None:
    """The allocation site ("path:line" as _site writes it) of a traced object, or None."""
    tb = tracemalloc.get_object_traceback(obj)
    return None if tb is None else _short(tb[-1])


def explain(sites: list[str], limit: int) -> dict:
    """For live objects allocated at each of `sites` ("path:line", innermost frame): their types
    and the allocation sites and types of the containers holding them, by count. Slow (every
    object the collector tracks is visited): a diagnosis, not a measurement."""
    want = set(sites)
    held: dict[str, dict[tuple, int]] = {s: {} for s in sites}
    for container in gc.get_objects():
        for ref in gc.get_referents(container):
            site = _innermost(ref)
            if site in want:
                where = _innermost(container) or "?"
                key = (type(ref).__name__, type(container).__name__, where)
                held[site][key] = held[site].get(key, 0) + 1
    out = {}
    for site, counts in held.items():
        rows = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
        out[site] = [
            {"object": k[0], "held_by": k[1], "held_by_site": k[2], "n": n} for k, n in rows
        ]
    return out


def print_sites(title: str, rows: list[dict]) -> None:
    print(title)
    for r in rows:
        frames = r["site"]
        print(
            f"  {r['bytes_per_request']:9.1f} B/req  {r['bytes']:>10,d} B {r['blocks']:>+8d} blocks"
            f"  {frames[0]}"
        )
        for fr in frames[1:]:
            print(f"  {'':>48}  <- {fr}")


class Lines:
    """A child's stdout lines through a thread, read with a deadline."""

    def __init__(self, proc: subprocess.Popen):
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            self.q.put(line.rstrip())
        self.q.put(None)

    def get(self, timeout: float) -> str | None:
        return self.q.get(timeout=timeout)


def measure(a: argparse.Namespace) -> dict:
    from moecomm_serving.model.tiny import write_tiny

    filters = [
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, linecache.__file__),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
        tracemalloc.Filter(False, "<unknown>"),
    ]
    points: list[dict] = []
    base_snap = prev_snap = None
    base_point = None
    result: dict = {"config": {k: v for k, v in vars(a).items() if k != "json"}}
    with tempfile.TemporaryDirectory(prefix="moecomm-fe-mem-") as tmp:
        ckpt = os.path.join(tmp, "tiny")
        write_tiny(ckpt)
        if a.tracemalloc:
            tracemalloc.start(TRACE_FRAMES)
        http, fe, close = start_frontend_here(ckpt, a.stages, a.standby, a.max_batch_tokens)
        child = None
        try:
            cmd = [sys.executable, os.path.abspath(__file__), "--client", http.url]
            cmd += ["--requests", str(a.requests), "--every", str(a.every)]
            cmd += ["--clients", str(a.clients), "--seed", str(a.seed)]
            child = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
            )
            lines = Lines(child)
            t0 = time.monotonic()
            print(f"front end ({a.stages} stage(s)) on {http.url}; {a.requests} requests")
            while True:
                line = lines.get(START_TIMEOUT_S + CHUNK_TIMEOUT_S)
                if line is None:
                    break
                if not line.startswith("at "):
                    print(f"  client: {line}")
                    continue
                _, n, errors = line.split()
                n, errors = int(n), int(errors)
                gc.collect()
                if a.malloc_trim:
                    _LIBC.malloc_trim(0)
                point = {"requests": n, "errors": errors, "t_s": time.monotonic() - t0}
                point["rss"] = rss_bytes()
                point["generated_tokens"] = fe.metrics.generation_tokens
                if a.tracemalloc:
                    point["traced"] = tracemalloc.get_traced_memory()[0]
                    point["tracemalloc_overhead"] = tracemalloc.get_tracemalloc_memory()
                    snap = tracemalloc.take_snapshot().filter_traces(filters)
                prev = points[-1] if points else None
                msg = f"[{point['t_s']:6.0f} s] {n:6d} requests ({errors} errors): RSS "
                msg += f"{point['rss'] / 2**20:.1f} MB"
                if prev:
                    dn = n - prev["requests"]
                    msg += f" ({(point['rss'] - prev['rss']) / dn:+.0f} B/req)"
                if a.tracemalloc:
                    msg += f", traced {point['traced'] / 2**20:.2f} MB"
                    if prev:
                        msg += f" ({(point['traced'] - prev['traced']) / dn:+.0f} B/req)"
                print(msg, flush=True)
                if a.tracemalloc and prev_snap is not None:
                    rows = growth_sites(snap, prev_snap, "lineno", n - prev["requests"], 3)
                    point["top_since_previous"] = rows
                    for r in rows:
                        print(f"    {r['bytes_per_request']:8.1f} B/req  {r['site'][0]}")
                points.append(point)
                if a.tracemalloc:
                    prev_snap = snap
                    if base_snap is None and n >= a.baseline:
                        base_snap, base_point = snap, point
                    del snap
                child.stdin.write("go\n")
                child.stdin.flush()
            child.wait(START_TIMEOUT_S)
            result["client_exit"] = child.returncode
            result["checkpoints"] = points
            last = points[-1] if points else None
            if base_point is None and points:
                base_point = next((p for p in points if p["requests"] >= a.baseline), None)
            if base_point is not None and last is not None and last is not base_point:
                dn = last["requests"] - base_point["requests"]
                growth = {
                    "from_requests": base_point["requests"],
                    "to_requests": last["requests"],
                    "rss_bytes_per_request": (last["rss"] - base_point["rss"]) / dn,
                    "generated_tokens_per_request": (
                        last["generated_tokens"] - base_point["generated_tokens"]
                    )
                    / dn,
                }
                if a.tracemalloc:
                    growth["traced_bytes_per_request"] = (
                        last["traced"] - base_point["traced"]
                    ) / dn
                    growth["by_line"] = growth_sites(prev_snap, base_snap, "lineno", dn, TOP_SITES)
                    growth["by_traceback"] = growth_sites(
                        prev_snap, base_snap, "traceback", dn, TOP_SITES
                    )
                result["growth"] = growth
                if a.explain:
                    sites = [r["site"][0] for r in growth["by_line"][: a.explain]]
                    growth["holders"] = explain(sites, SHOW_FRAMES)
        finally:
            if child is not None and child.poll() is None:
                child.kill()
                child.wait(START_TIMEOUT_S)
            close()
    return result


def print_result(r: dict) -> None:
    g = r.get("growth")
    if not g:
        print("no growth figure (too few checkpoints past --baseline)")
        return
    msg = f"\nrequests {g['from_requests']} -> {g['to_requests']}: RSS "
    msg += f"{g['rss_bytes_per_request']:+.0f} B/request"
    msg += f" ({g['generated_tokens_per_request']:.1f} tokens generated/request)"
    if "traced_bytes_per_request" in g:
        msg += f", traced {g['traced_bytes_per_request']:+.0f} B/request"
    print(msg)
    if "by_line" in g:
        print_sites("growth by line:", g["by_line"])
        print_sites("growth by traceback (innermost frame first):", g["by_traceback"])
    for site, rows in g.get("holders", {}).items():
        print(f"live objects allocated at {site}, by holder:")
        for h in rows:
            print(f"  {h['n']:6d} {h['object']} in a {h['held_by']} from {h['held_by_site']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--stages", type=int, default=1, help="moecomm frontend --stages")
    ap.add_argument("--standby", action="store_true", help="with --stages > 1: standby stages")
    ap.add_argument("--requests", type=int, default=3000, help="requests in all")
    ap.add_argument("--every", type=int, default=500, help="requests between checkpoints")
    ap.add_argument("--baseline", type=int, default=500, help="growth is measured from here")
    ap.add_argument("--clients", type=int, default=8, help="concurrent connections")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batch-tokens", type=int, default=64, help="as moecomm frontend")
    ap.add_argument(
        "--no-tracemalloc",
        dest="tracemalloc",
        action="store_false",
        help="RSS only (tracemalloc slows allocation and holds memory of its own)",
    )
    ap.add_argument(
        "--malloc-trim",
        action="store_true",
        help="call glibc malloc_trim(0) before each RSS reading (live memory, not free arenas)",
    )
    ap.add_argument(
        "--explain",
        type=int,
        default=0,
        help="for the top N growth sites, which containers hold their objects (slow)",
    )
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the child's mode
    a = ap.parse_args(argv)
    if a.every < 1 or a.requests < a.every or a.clients < 1 or a.stages < 1:
        raise SystemExit("need every >= 1, requests >= every, clients >= 1, stages >= 1")
    if a.client:
        return asyncio.run(_client_main(a))
    r = measure(a)
    print_result(r)
    write_json(a.json, {"frontend_memory": r})
    return 0 if r.get("client_exit") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
