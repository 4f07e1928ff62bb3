"""The placement controller at scale, for bench/scale.py: the real `PlacementController` reads the
tables of N simulated expert servers, as its redundancy watch does every
`REDUNDANCY_WATCH_S` (0.1 s) while it runs.

The N servers' GET /experts are answered by one process (an ASGI app serving every simulated
server under /s/<i>, tables shaped like a DeepSeek-V3 placement: 58 MoE layers, 256 experts
spread over the N servers), so the controller, in the bench's process, is what is measured:
the wall time of one full read (`snapshot(load=False)`), its CPU, and what it means against the
0.1 s watch period and each server's request rate. Run as a script it is that server process:
`python bench/scale_placement.py --servers N` prints its URL and serves until killed.
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

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
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


def measure(n: int) -> dict:
    """One N: the controller's full reads of N simulated servers."""
    from moecomm.runtime.placement import REDUNDANCY_WATCH_S, PlacementController

    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--servers", str(n)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        url = proc.stdout.readline().strip() if ready else ""
        if not url.startswith("http://"):
            raise RuntimeError(f"simulated servers did not start: {url!r}")
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
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", type=int, required=True)
    serve(p.parse_args().servers)
