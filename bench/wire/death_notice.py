"""How soon an shm waiter notices that its peer died: the peer's life word (a robust futex the
kernel marks and wakes as the peer dies) against the /proc liveness poll every 20 ms that came
before it, side by side in one run.

Each trial: a peer process owns a region and sleeps; this process waits on a word of its own
region (nobody signals it) watching the peer, with a 30 s deadline; after `--live` seconds the
peer is killed with SIGKILL. Recorded per trial: kill -> the wait returning PEER_LOST, and how
often the waiter woke while the peer lived (voluntary context switches of its thread). The two
contenders alternate, so they see the same machine; the load average is recorded.

Usage: python bench/wire/death_notice.py [--trials 10] [--live 1.0]
       [--json bench/results/death_notice.json]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from moecomm import prefork

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts

from _lib.common import format_table, percentile, write_json

CONTENDERS = {"life_word": True, "poll": False}  # name -> ShmTransport(watch_death=...)
DEADLINE_S = 30.0


def _peer(conn) -> None:
    from moecomm import _C

    t = _C.ShmTransport()
    r = t.create_region(4096)
    conn.send(r.handle)
    time.sleep(600)


def _switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    return -1


def trial(ctx, watch: bool, live_s: float) -> dict:
    from moecomm import _C

    parent, child = ctx.Pipe()
    p = ctx.Process(target=_peer, args=(child,), daemon=True)
    p.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the peer did not start")
        handle = parent.recv()
        t = _C.ShmTransport(watch_death=watch)
        own = t.create_region(4096)
        peer = t.attach(handle)
        out = {}
        started = threading.Event()

        def wait() -> None:
            out["tid"] = threading.get_native_id()
            started.set()
            status, _ = _C.wait_doorbell(t, own, 0, int(DEADLINE_S * 1e9), peer)
            out["ended"] = time.monotonic()
            out["status"] = status.name

        th = threading.Thread(target=wait, daemon=True)
        th.start()
        started.wait(10)
        time.sleep(0.05)
        before = _switches(out["tid"])
        time.sleep(live_s)
        woke = _switches(out["tid"]) - before
        killed = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        th.join(DEADLINE_S + 10)
        return {
            "notice_ms": round((out["ended"] - killed) * 1e3, 3),
            "status": out["status"],
            "wakeups_per_s_alive": round(woke / live_s, 1),
        }
    finally:
        if p.is_alive():
            p.kill()  # a forked one may be reaped already
        p.join(10)
        from moecomm.wire.shm import reap_stale_segments

        reap_stale_segments(p.pid)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trials", type=int, default=10, help="kills per contender")
    ap.add_argument("--live", type=float, default=1.0, help="seconds the waiter sleeps first")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    args = argv if argv is not None else sys.argv[1:]
    ctx = prefork.process_context()
    rows, trials = [], []
    load_before = os.getloadavg()[0]
    for i in range(a.trials):
        names = list(CONTENDERS) if i % 2 == 0 else list(CONTENDERS)[::-1]
        for name in names:
            r = {
                "contender": name,
                "load": os.getloadavg()[0],
                **trial(ctx, CONTENDERS[name], a.live),
            }
            trials.append(r)
            print(r, flush=True)
    base = None
    for name in CONTENDERS:
        mine = [t for t in trials if t["contender"] == name and t["status"] == "PEER_LOST"]
        ms = [t["notice_ms"] for t in mine]
        row = {
            "contender": name,
            "n": len(ms),
            "p50_ms": percentile(ms, 50) if ms else None,
            "max_ms": max(ms) if ms else None,
            "wakeups_per_s": percentile([t["wakeups_per_s_alive"] for t in mine], 50)
            if mine
            else None,
        }
        base = base or row
        row["p50_ratio"] = (
            round(row["p50_ms"] / base["p50_ms"], 2) if row["p50_ms"] and base["p50_ms"] else None
        )
        rows.append(row)
    print(
        format_table(
            rows,
            [
                ("contender", "contender", "s"),
                ("n", "kills", "d"),
                ("p50_ms", "notice p50 ms", ".2f"),
                ("max_ms", "max ms", ".2f"),
                ("p50_ratio", "p50 / life_word", ".2f"),
                ("wakeups_per_s", "wake-ups/s alive", ".1f"),
            ],
        )
    )
    print(f"load average (1 min) before {load_before:.1f}, after {os.getloadavg()[0]:.1f}")
    write_json(
        a.json,
        {
            "command": "python bench/wire/death_notice.py " + " ".join(args),
            "load_1min_before": load_before,
            "load_1min_after": os.getloadavg()[0],
            "table": rows,
            "trials": trials,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
