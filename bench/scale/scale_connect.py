"""What each attention-client / expert-server pair costs: the connect handshake and the memory,
connections and threads a pair holds, for C clients x S servers, with the library's own
`ExpertServer` processes (`spawn_expert_server`) and `AttentionClient`s (`connect_client`), each
client in its own process, every client connected to every server (each server hosts experts
every client routes to).

Measured per (C, S): the connect wall time of each client (all S handshakes) and per server;
RSS, threads, open fds and sockets of every server and client process before and after the
clients connected (and of the servers after they closed again); the bytes of the slot regions
in /dev/shm created by these processes (files `moecomm-<pid>-...`). Per pair: the growth
divided by the pairs it serves.

    python bench/scale/scale_connect.py                    # C x S = 1x4, 4x8, 8x16, 8x32
    python bench/scale/scale_connect.py --sizes 2x4        # short

writes bench/results/scale_connect.json (with the load average of every row).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

TOKEN = "scale-connect"
HIDDEN = 256
TOPK = 2
MAX_TOKENS = 64
# Experts each server hosts (every client routes to every server's experts).
EXPERTS_PER_SERVER = 2
# A client process starts (imports torch) and connects within this long, even under load.
CLIENT_DEADLINE_S = 240.0
# Server processes started at once (each imports torch: starting 32 one by one takes minutes).
SPAWN_PARALLEL = 8
# After the clients closed, the servers free their side within this long (disconnect is sync,
# dead-client sweeps are not needed).
SETTLE_S = 1.0
DEFAULT_SIZES = ["1x4", "4x8", "8x16", "8x32"]


def proc_stats(pid: int) -> dict:
    """RSS (bytes), threads, open fds and sockets of one process, from /proc."""
    status = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    fds = os.listdir(f"/proc/{pid}/fd")
    sockets = 0
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return {
        "rss": int(status["VmRSS"].split()[0]) * 1024,
        "threads": int(status["Threads"]),
        "fds": len(fds),
        "sockets": sockets,
    }


def shm_bytes(pids: set[int]) -> tuple[int, int]:
    """(files, bytes) of the slot regions in /dev/shm created by `pids`."""
    files = size = 0
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        mine = len(parts) > 2 and parts[0] == "moecomm" and parts[1].isdigit()
        if mine and int(parts[1]) in pids:
            with contextlib.suppress(FileNotFoundError):
                size += os.stat(f"/dev/shm/{name}").st_size
                files += 1
    return files, size


def run_client(urls: list[str]) -> None:
    """A client process: connects to every server, says what it cost, waits for 'close'."""
    import torch
    from moecomm.testing.clients import connect_client

    torch.set_num_threads(1)
    before = proc_stats(os.getpid())
    t0 = time.perf_counter()
    client = connect_client(urls, HIDDEN, TOPK, MAX_TOKENS, token=TOKEN, timeout=60.0)
    connect_s = time.perf_counter() - t0
    after = proc_stats(os.getpid())
    print(json.dumps({"connect_s": connect_s, "before": before, "after": after}), flush=True)
    sys.stdin.readline()  # the parent's 'close' (or its death: EOF)
    t0 = time.perf_counter()
    client.close()
    print(json.dumps({"close_s": time.perf_counter() - t0}), flush=True)


def read_line(proc: subprocess.Popen, deadline: float) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"client {proc.pid} said nothing in time: {proc.stderr.read()[-2000:]}")
    return json.loads(line)


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def measure(c: int, s: int) -> dict:
    from moecomm.runtime.launch import ModelSpec, spawn_expert_server

    spec = ModelSpec(
        num_layers=1, num_experts=EXPERTS_PER_SERVER * s, hidden=HIDDEN, intermediate=64, seed=3
    )
    hosted = [
        {0: list(range(EXPERTS_PER_SERVER * i, EXPERTS_PER_SERVER * (i + 1)))} for i in range(s)
    ]
    servers, clients = [], []
    try:
        with ThreadPoolExecutor(SPAWN_PARALLEL) as pool:
            futures = [
                pool.submit(spawn_expert_server, spec, h, f"sc{i}", TOKEN)
                for i, h in enumerate(hosted)
            ]
            for f in futures:
                servers.append(f.result())
        urls = [p.url for p in servers]
        spids = {p.process.pid for p in servers}
        s_before = {pid: proc_stats(pid) for pid in spids}
        shm_before = shm_bytes(spids)
        t0 = time.monotonic()
        for _ in range(c):
            clients.append(
                subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--client", json.dumps(urls)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        deadline = t0 + CLIENT_DEADLINE_S
        answers = [read_line(p, deadline) for p in clients]
        cpids = {p.pid for p in clients}
        s_after = {pid: proc_stats(pid) for pid in spids}
        shm_after = shm_bytes(spids | cpids)
        load = os.getloadavg()
        for p in clients:
            p.stdin.write("close\n")
            p.stdin.flush()
        closes = [read_line(p, time.monotonic() + 60) for p in clients]
        for p in clients:
            p.wait(30)
        time.sleep(SETTLE_S)
        s_closed = {pid: proc_stats(pid) for pid in spids}
        shm_closed = shm_bytes(spids | cpids)
    finally:
        for p in clients:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        with ThreadPoolExecutor(SPAWN_PARALLEL) as pool:
            list(pool.map(lambda p: p.stop(), servers))
    server_growth = [delta(s_after[pid], s_before[pid]) for pid in spids]
    server_left = [delta(s_closed[pid], s_before[pid]) for pid in spids]
    client_growth = [delta(a["after"], a["before"]) for a in answers]
    connects = sorted(a["connect_s"] for a in answers)
    pairs = c * s
    row = {
        "clients": c,
        "servers": s,
        "pairs": pairs,
        "loadavg": load,
        "connect_s_median": statistics.median(connects),
        "connect_s_max": connects[-1],
        # A client's handshakes run one after another: its connect / S is one pair's.
        "connect_per_server_s_median": statistics.median(connects) / s,
        "close_s_median": statistics.median(x["close_s"] for x in closes),
        "shm_files": shm_after[0] - shm_before[0],
        "shm_bytes": shm_after[1] - shm_before[1],
        "shm_bytes_per_pair": (shm_after[1] - shm_before[1]) / pairs,
        "shm_files_left_after_close": shm_closed[0] - shm_before[0],
        "server_rss_per_client_bytes": mean(server_growth, "rss") / c,
        "server_threads_per_client": mean(server_growth, "threads") / c,
        "server_fds_per_client": mean(server_growth, "fds") / c,
        "server_sockets_per_client": mean(server_growth, "sockets") / c,
        "server_threads_left_after_close": mean(server_left, "threads"),
        "server_fds_left_after_close": mean(server_left, "fds"),
        "client_rss_per_server_bytes": mean(client_growth, "rss") / s,
        "client_threads_per_server": mean(client_growth, "threads") / s,
        "client_fds_per_server": mean(client_growth, "fds") / s,
        "client_sockets_per_server": mean(client_growth, "sockets") / s,
        "server_baseline": {k: mean(list(s_before.values()), k) for k in ("rss", "threads", "fds")},
        "client_baseline": {k: mean([a["before"] for a in answers], k) for k in ("rss", "threads")},
    }
    return row


def write(path: str, rows: list[dict], failures: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"rows": rows, "failures": failures, "loadavg_end": os.getloadavg()}, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, help="CxS, e.g. 8x32")
    p.add_argument(
        "--json", default=os.path.join(os.path.dirname(HERE), "results", "scale_connect.json")
    )
    args = p.parse_args()
    if args.client is not None:
        run_client(json.loads(args.client))
        return
    rows, failures = [], []
    for size in args.sizes:
        c, _, s = size.partition("x")
        if not (c.isdigit() and s.isdigit() and int(c) > 0 and int(s) > 0):
            p.error(f"a size is CxS with C, S > 0, got {size!r}")
        try:
            rows.append(measure(int(c), int(s)))
        except Exception as exc:  # said in the JSON; the other sizes still run
            failures.append({"size": size, "error": repr(exc)})
            print(f"{size}: failed: {exc!r}", flush=True)
            continue
        keys = ("connect_per_server_s_median", "shm_bytes_per_pair", "server_rss_per_client_bytes")
        keys += ("server_threads_per_client", "server_sockets_per_client")
        keys += (
            "client_rss_per_server_bytes",
            "client_threads_per_server",
            "client_fds_per_server",
        )
        print(size, {k: round(rows[-1][k], 4) for k in keys}, rows[-1]["loadavg"], flush=True)
        write(args.json, rows, failures)  # after every size: a long sweep cut short keeps its rows
    write(args.json, rows, failures)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
