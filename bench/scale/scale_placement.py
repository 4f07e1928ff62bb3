"""The placement controller at scale, for bench/scale/scale.py: the real `PlacementController`
reads the tables of N simulated expert servers, as its redundancy watch does every
`REDUNDANCY_WATCH_S` (0.1 s) while it runs.

The N servers' GET /experts are answered by one process (an ASGI app serving every simulated
server under /s/<i>, tables shaped like a DeepSeek-V3 placement: 58 MoE layers, 256 experts
spread over the N servers), so the controller, in the bench's process, is what is measured:
the wall time of one full read (`snapshot(load=False)`), its CPU, and what it means against the
0.1 s watch period and each server's request rate.

`watch(n, notified)` runs the controller's redundancy watch itself (start()) over the N servers
for WATCH_RUN_S after its first pass and counts the table reads the servers answered and the
controller's CPU: the old watch (notified=False: every table every 0.1 s) against the notified
one (tables re-read only on a loss, a join or the safety poll), side by side in one run:

    python bench/scale/scale_placement.py --compare                 # N = 10, 100, 300
    python bench/scale/scale_placement.py --compare --sizes 10 30   # short

writes bench/results/scale_placement.json. `python bench/scale/scale_placement.py --servers N` is
the simulated servers' process: it prints its URL and serves until killed.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

# A DeepSeek-V3-shaped placement: 58 MoE layers of 256 experts.
LAYERS = 58
EXPERTS = 256
# Full reads timed per N (the median and the worst are reported).
READS = 5
START_TIMEOUT_S = 60.0


def table(i: int, n: int) -> bytes:
    """Server i's GET /experts answer: its share of every layer's experts, no load table."""
    per = max(1, -(-EXPERTS // n))
    ids = [(i * per + k) % EXPERTS for k in range(per)]
    body = {
        "server_id": f"s{i}",
        "hidden": 7168,
        "epoch": 1,
        "layers": {str(layer): ids for layer in range(LAYERS)},
        "leaving": {},
        "load": [],
    }
    return json.dumps(body).encode()


def serve(n: int) -> None:
    import uvicorn

    bodies = [table(i, n) for i in range(n)]
    reads = [0]

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/count":  # the table reads answered so far (not one itself)
            body = json.dumps({"reads": reads[0]}).encode()
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        reads[0] += 1
        parts = scope["path"].strip("/").split("/")
        ok = len(parts) == 3 and parts[0] == "s" and parts[1].isdigit() and int(parts[1]) < n
        body = bodies[int(parts[1])] if ok else b'{"detail": "not found"}'
        headers = [(b"content-type", b"application/json")]
        await send(
            {"type": "http.response.start", "status": 200 if ok else 404, "headers": headers}
        )
        await send({"type": "http.response.body", "body": body})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(app, log_level="warning", lifespan="off", backlog=4096)
    uvicorn.Server(config).run(sockets=[sock])


def _start(n: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--servers", str(n)],
        stdout=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    url = proc.stdout.readline().strip() if ready else ""
    if not url.startswith("http://"):
        _stop(proc)
        raise RuntimeError(f"simulated servers did not start: {url!r}")
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


# How long each watch runs idle per N and contender, after its first pass: two safety polls
# of the notified watch (SAFETY_POLL_S = 10 s).
WATCH_RUN_S = 20.0


def _count(url: str) -> int:
    """The table reads the simulated servers answered; retried while their process is not yet
    listening (it prints its URL before uvicorn listens: a refused connect)."""
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return httpx.get(f"{url}/count", timeout=30).json()["reads"]
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def watch(n: int, notified: bool, seconds: float = WATCH_RUN_S) -> dict:
    """The running controller's watch over N idle simulated servers for `seconds`: table reads
    the servers answered, per server per second, and the controller process's CPU."""
    from moecomm.runtime.placement import REDUNDANCY_WATCH_S, SAFETY_POLL_S, PlacementController

    proc, url = _start(n)
    ctl = None
    try:
        urls = [f"{url}/s/{i}" for i in range(n)]
        ctl = PlacementController(urls, min_tokens=10**12, notified=notified)
        ctl.start(3600.0)  # no load-driven pass: only the watch runs
        # Steady state only: both watches read every table once at their start.
        warm = time.monotonic() + START_TIMEOUT_S
        while _count(url) < n:
            if time.monotonic() > warm:
                raise RuntimeError("the watch's first pass did not end")
            time.sleep(0.05)
        r0 = _count(url)
        c0, t0 = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        reads = _count(url) - r0
    finally:
        if ctl is not None:
            ctl.stop()
        _stop(proc)
    return {
        "servers": n,
        "watch": "notified" if notified else "polling",
        "watch_s": REDUNDANCY_WATCH_S,
        "safety_poll_s": SAFETY_POLL_S if notified else None,
        "seconds": round(wall, 3),
        "table_reads": reads,
        "reads_per_s_per_server": reads / n / wall,
        "reads_per_s_total": reads / wall,
        "controller_cpu_cores": cpu / wall,
        "loadavg": os.getloadavg(),
    }


def measure(n: int) -> dict:
    """One N: the controller's full reads of N simulated servers."""
    from moecomm.runtime.placement import REDUNDANCY_WATCH_S, PlacementController

    proc, url = _start(n)
    try:
        urls = [f"{url}/s/{i}" for i in range(n)]
        ctl = PlacementController(urls, watch_s=REDUNDANCY_WATCH_S)
        walls, cpus, answered = [], [], []
        for _ in range(READS):
            c0, t0 = time.process_time(), time.perf_counter()
            views = ctl.snapshot(load=False)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            answered.append(len(views))
        walls.sort()
        cpus.sort()
        median = walls[len(walls) // 2]
        return {
            "servers": n,
            "answered_min": min(answered),
            "read_s_median": median,
            "read_s_max": walls[-1],
            "controller_cpu_s_median": cpus[len(cpus) // 2],
            "watch_period_s": REDUNDANCY_WATCH_S,
            # The watch reads again REDUNDANCY_WATCH_S after a read ends: its real period.
            "watch_reads_per_s": 1.0 / (REDUNDANCY_WATCH_S + median),
            "requests_per_s_per_server": 1.0 / (REDUNDANCY_WATCH_S + median),
            "requests_per_s_total": n / (REDUNDANCY_WATCH_S + median),
            "keeps_watch_period": median <= REDUNDANCY_WATCH_S,
        }
    finally:
        _stop(proc)


def compare(sizes: list[int], seconds: float) -> dict:
    """Old polling watch against the notified one, per N, in one run."""
    rows = []
    for n in sizes:
        pair = {}
        for notified in (False, True):
            row = watch(n, notified, seconds)
            rows.append(row)
            pair[notified] = row
            print(json.dumps(row), flush=True)
        old, new = pair[False], pair[True]
        print(
            f"N={n}: reads/s {old['reads_per_s_total']:.1f} -> {new['reads_per_s_total']:.2f} "
            f"({old['reads_per_s_total'] / max(new['reads_per_s_total'], 1e-9):.0f}x fewer), "
            f"controller CPU {old['controller_cpu_cores']:.3f} -> "
            f"{new['controller_cpu_cores']:.4f} cores",
            flush=True,
        )
    return {"rows": rows, "loadavg_end": os.getloadavg()}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", type=int, help="be the simulated servers' process")
    p.add_argument("--compare", action="store_true", help="polling vs notified watch")
    p.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 300])
    p.add_argument("--seconds", type=float, default=WATCH_RUN_S)
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument(
        "--json", default=os.path.join(os.path.dirname(here), "results", "scale_placement.json")
    )
    args = p.parse_args()
    if args.servers is not None:
        serve(args.servers)
    elif args.compare:
        sys.path.insert(0, os.path.join(os.path.dirname(here), "python"))
        payload = compare(args.sizes, args.seconds)
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {args.json}")
    else:
        p.error("--servers N or --compare")
