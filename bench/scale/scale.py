"""The membership control plane at scale: the real `moecomm monitor` process (and, apart, a real
etcd) against N simulated members, each a `moecomm.membership` registration, many per member-host
process (bench/scale/scale_members.py), as a 10,000-GPU deployment would load them.

Per (backend, renewal mode, N), over a steady window: heartbeat latency p50/p99 (one batch per
process and interval with grouped leases; one request per member with the per-member renewal of
earlier versions), the backend's CPU (cores, from /proc/<pid>/stat) and RSS, the member hosts'
own CPU apart, control requests per second per member (every request the hosts send: renewals
and watchers' polls), the time for one membership change to reach every watcher, and the time
from a member's death (its renewals stop) to its removal at every watcher. With the monitor and
grouped leases, the failure drill: 10 % of the members die at once (their hosts are SIGKILLed)
and the monitor is killed and restarted on its port; every survivor must be listed again and no
watcher may hear a survivor's loss.

Usage: python bench/scale/scale.py [--quick | --full] [--json bench/results/scale.json]
       [--plot bench/results/scale.png]
--quick (~30 s, `make test` runs it through tests/membership/test_scale_bench.py): N = 200.
Default: N = 100, 1,000, 3,000 grouped; per-member renewal up to 1,000; etcd at 1,000.
--full: the grouped sweep on to 10,000 members, etcd to 3,000, per-member to 3,000.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests")]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts

import scale_placement  # noqa: E402
from _lib.common import percentile, write_json  # noqa: E402
from membership_procs import EtcdProcess, MonitorProcess, etcd_binary, stop_pid  # noqa: E402
from moecomm.membership import Member, connect_membership  # noqa: E402
from moecomm.membership.watcher import GRACE_SLACK_S, REREGISTER_GRACE_TTLS  # noqa: E402

HOST_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scale_members.py")
TOKEN = "scale-bench-token"
# The serving lease (moecomm.runtime.launch.SERVING_TTL_S): what the figures assume.
TTL_S = 2.0
# Member hosts per run (10 machines' worth of members); the first holds the drill's 10 %. The
# quick mode starts 3: each host is an interpreter to start on a loaded 2-core machine.
HOSTS = 10
QUICK_HOSTS = 3
DRILL_FRACTION = 0.1
# A host imports moecomm and registers its share; minutes mean something is broken.
HOST_START_S = 180.0
ANSWER_S = 60.0
# Membership changes timed per run (register, then deregister, of a probe member).
PROBES = 3
# The driver's HTTP deadline (its probes, listings and the drill's watcher).
DRIVER_TIMEOUT_S = 30.0
# The driver's watcher long-polls as a member's does (DEFAULT_POLL_S).
DRIVER_POLL_S = 2.0
# A probe must reach every watcher within this, or the run says so (goal: 1 s).
PROBE_DEADLINE_S = 15.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def proc_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE / 1e6


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


class Host:
    """One member-host process."""

    def __init__(
        self, url: str, token: str, host_id: str, count: int, ttl: float, per_member: bool
    ):
        cmd = [sys.executable, HOST_SCRIPT, "--url", url, "--host-id", host_id]
        cmd += ["--count", str(count), "--ttl", str(ttl), "--watchers", "1"]
        if per_member:
            cmd.append("--per-member")
        env = dict(os.environ, MOECOMM_MONITOR_TOKEN=token)
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        self.host_id = host_id
        self.count = count
        self.ready: dict = {}

    def read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            code = self.proc.poll()
            why = f"exited with {code}" if code is not None else f"silent for {timeout} s"
            raise RuntimeError(f"member host {self.host_id} {why}")
        return json.loads(line)

    def stats(self) -> dict:
        self.proc.stdin.write('{"cmd": "stats"}\n')
        self.proc.stdin.flush()
        return self.read(ANSWER_S)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop_pid(self.proc)


def wait_probe(hosts: list[Host], kind: str, member_id: str, seen_before: int) -> list[float]:
    """Arrival times of (kind, member_id) at every host's watcher (waits up to the deadline)."""
    deadline = time.monotonic() + PROBE_DEADLINE_S
    while True:
        arrivals = []
        for h in hosts:
            hits = [t for k, m, t in h.stats()["probes"] if k == kind and m == member_id]
            arrivals.append(hits[0] if hits else None)
        if all(a is not None for a in arrivals) or time.monotonic() > deadline:
            return arrivals
        time.sleep(0.1)


def host_sizes(n: int, hosts: int) -> list[int]:
    """Members per host: the first holds DRILL_FRACTION of N (the drill kills it), the others
    share the rest."""
    first = max(1, round(n * DRILL_FRACTION))
    rest = n - first
    k = hosts - 1
    return [first] + [rest // k + (1 if i < rest % k else 0) for i in range(k)]


def run_one(
    backend: str, mode: str, n: int, window_s: float, drill: bool, workdir: str, hosts_n: int
) -> dict:
    """One row: start the backend and the hosts, measure, tear down."""
    per_member = mode == "per-member"
    row: dict = {"backend": backend, "mode": mode, "n": n, "ttl_s": TTL_S, "hosts": hosts_n}
    if backend == "monitor":
        server = MonitorProcess(token=TOKEN)
        url = server.start()
        token = TOKEN
    else:
        server = EtcdProcess(etcd_binary(), workdir)
        server.start()
        url, token = f"etcd://{server.endpoint}/scale", ""
    hosts: list[Host] = []
    ms = None
    try:
        pid = server.proc.pid
        started = time.monotonic()
        hosts = [
            Host(url, token, f"h{i}", c, TTL_S, per_member)
            for i, c in enumerate(host_sizes(n, hosts_n))
            if c > 0
        ]
        for h in hosts:
            h.ready = h.read(HOST_START_S)
        row["register_s"] = time.monotonic() - started
        # A long deadline: on an overloaded machine a slow answer is a figure, not a failure.
        ms = connect_membership(url, token, poll_s=DRIVER_POLL_S, timeout=DRIVER_TIMEOUT_S)
        listed = len(ms.list_members("server"))
        row["listed_after_register"] = listed
        # Steady window: renewals and idle watchers only.
        for h in hosts:
            h.stats()  # resets the hosts' counters
        cpu0, host_cpu0, t0 = (
            proc_cpu_s(pid),
            [proc_cpu_s(h.proc.pid) for h in hosts],
            time.monotonic(),
        )
        time.sleep(window_s)
        stats = [h.stats() for h in hosts]
        elapsed = time.monotonic() - t0
        cpu1, host_cpu1 = proc_cpu_s(pid), [proc_cpu_s(h.proc.pid) for h in hosts]
        lat = [x for s in stats for x in s["latencies"]]
        requests = sum(s["requests"] for s in stats)
        row.update(
            window_s=elapsed,
            backend_cpu_cores=(cpu1 - cpu0) / elapsed,
            backend_rss_mb=proc_rss_mb(pid),
            hosts_cpu_cores=sum(b - a for a, b in zip(host_cpu0, host_cpu1, strict=True)) / elapsed,
            host_threads_max=max(s["threads"] for s in stats),
            heartbeat_samples=len(lat),
            heartbeat_p50_ms=percentile(lat, 50) * 1e3 if lat else None,
            heartbeat_p99_ms=percentile(lat, 99) * 1e3 if lat else None,
            requests_per_s=requests / elapsed,
            requests_per_s_per_member=requests / elapsed / n,
            reregistrations_in_window=sum(s["reregistrations"] for s in stats),
            listed_after_window=len(ms.list_members("server")),
        )
        row["evicted_in_window"] = n - row["listed_after_window"]
        # One membership change, to every watcher (one per host).
        prop = []
        for k in range(PROBES):
            seen = [len(h.stats()["probes"]) for h in hosts]
            t = time.monotonic()
            reg = ms.register(Member("probe", f"p{k}"), TTL_S)
            arrivals = wait_probe(hosts, "join", f"p{k}", 0)
            reg.close()
            del seen
            got = [a - t for a in arrivals if a is not None]
            prop.append(max(got) if len(got) == len(arrivals) else math.inf)
        row["change_to_all_watchers_s"] = prop
        row["change_to_all_watchers_max_s"] = max(prop)
        # A member's death: its renewals stop, nothing is said.
        victim = ms.register(Member("probe", "victim"), TTL_S)
        wait_probe(hosts, "join", "victim", 0)
        victim.close(deregister=False)
        dead_at = time.monotonic()
        arrivals = wait_probe(hosts, "loss", "victim", 0)
        got = [a - dead_at for a in arrivals if a is not None]
        row["death_to_removal_s"] = max(got) if len(got) == len(arrivals) else math.inf
        row["death_to_removal_leases"] = row["death_to_removal_s"] / TTL_S
        if drill:
            row["drill"] = run_drill(server, ms, hosts, n)
    finally:
        for h in hosts:
            h.stop()
        if ms is not None:
            ms.close()
        server.stop()
    return row


def run_drill(server, ms, hosts: list[Host], n: int) -> dict:
    """10 % of the members die at once, then the monitor is killed and restarted on its port."""
    losses: list = []
    loss_times: list[float] = []  # seconds after the monitor was back, of each loss heard
    t_back = math.inf

    def heard(ev) -> None:
        losses.append(ev)
        if ev.kind == "loss":
            loss_times.append(time.monotonic() - t_back)

    watcher = ms.watch(role="server", callback=heard, initial=False)
    try:
        killed_hosts = hosts[:1]  # holds DRILL_FRACTION of the members (host_sizes)
        killed = {f"{h.host_id}-{i}" for h in killed_hosts for i in range(h.count)}
        survivors = n - len(killed)
        for h in killed_hosts:
            h.kill()
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        t_kill = time.monotonic()
        server.start()  # same port: the members' URL still holds
        t_back = time.monotonic()
        listed, all_back_s = set(), None
        deadline = t_back + 3 * TTL_S + 10.0
        while time.monotonic() < deadline:
            try:
                listed = {m.member_id for m in ms.list_members("server")}
            except ConnectionError:
                listed = set()
            if len(listed - killed) == survivors and all_back_s is None:
                all_back_s = time.monotonic() - t_back
                break
            time.sleep(0.1)
        # Listen past the watchers' re-registration grace (from the latest re-registration they
        # saw), and the long-poll after it that brings the evidence.
        time.sleep(REREGISTER_GRACE_TTLS * TTL_S + GRACE_SLACK_S + DRIVER_POLL_S + 1.0)
        lost = [e for e in losses if e.kind == "loss"]
        lost_live = [e.member.member_id for e in lost if e.member.member_id not in killed]
        why: dict[str, int] = {}
        for e in lost:
            if e.member.member_id not in killed:
                why[e.reason] = why.get(e.reason, 0) + 1
        lost_dead = {e.member.member_id for e in lost if e.member.member_id in killed}
        listed_end = {m.member_id for m in ms.list_members("server")}
        reregs = sum(h.stats()["reregistrations"] for h in hosts[len(killed_hosts) :])
        return {
            "members": n,
            "killed": len(killed),
            "survivors": survivors,
            "monitor_restart_s": t_back - t_kill,
            "survivors_listed": len(listed_end - killed),
            "all_survivors_listed_after_s": all_back_s,
            "dead_listed": len(listed_end & killed),
            "live_members_evicted": len(set(lost_live)),
            "live_losses_by_reason": why,
            "watcher_losses_at_s": sorted(round(e_t, 2) for e_t in loss_times)[:1]
            + sorted(round(e_t, 2) for e_t in loss_times)[-1:],
            "dead_reported_lost": len(lost_dead),
            "survivor_reregistrations": reregs,
        }
    finally:
        watcher.close()


def fit_linear(rows: list[dict], key: str) -> dict:
    """Least-squares a + b*N of `key` over rows (the per-member cost b, the fixed cost a)."""
    xs = [r["n"] for r in rows]
    ys = [r[key] for r in rows]
    if len(xs) < 2:
        return {"per_member": ys[0] / xs[0] if xs else None, "fixed": 0.0}
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return {"per_member": b, "fixed": my - b * mx}


def model(rows: list[dict]) -> dict:
    """Per (backend, mode): CPU per member, extrapolated to 10,000 members, and the N at which
    the backend would need one whole core (a Python monitor is one event loop)."""
    out = {}
    for key in sorted({(r["backend"], r["mode"]) for r in rows}):
        sel = [r for r in rows if (r["backend"], r["mode"]) == key]
        cpu = fit_linear(sel, "backend_cpu_cores")
        req = fit_linear(sel, "requests_per_s")
        per = cpu["per_member"] or 0.0
        out["/".join(key)] = {
            "sizes": [r["n"] for r in sel],
            "backend_cpu_cores_per_member": per,
            "backend_cpu_cores_fixed": cpu["fixed"],
            "backend_cpu_cores_at_10000": cpu["fixed"] + per * 10_000,
            "members_per_core": (1.0 - cpu["fixed"]) / per if per > 0 else None,
            "requests_per_s_per_member": req["per_member"],
            "requests_per_s_at_10000": req["fixed"] + (req["per_member"] or 0) * 10_000,
        }
    return out


def plot(rows: list[dict], placement: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [
        ("backend_cpu_cores", "backend CPU (cores)"),
        ("requests_per_s_per_member", "control requests/s per member"),
        ("heartbeat_p99_ms", "heartbeat p99 (ms)"),
        ("change_to_all_watchers_max_s", "change at every watcher (s)"),
        ("death_to_removal_leases", "death to removal (leases)"),
    ]
    if placement:
        ax = axes.flat[5]
        ax.plot([r["servers"] for r in placement], [r["read_s_median"] for r in placement], "o-")
        ax.axhline(placement[0]["watch_period_s"], color="r", ls="--", label="watch period")
        ax.set_xscale("log")
        ax.set_xlabel("expert servers")
        ax.set_ylabel("placement controller: one read of every table (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax, (key, label) in zip(list(axes.flat)[:5], panels, strict=True):
        for name in sorted({(r["backend"], r["mode"]) for r in rows}):
            sel = sorted(
                (r for r in rows if (r["backend"], r["mode"]) == name), key=lambda r: r["n"]
            )
            ys = [r.get(key) for r in sel]
            ax.plot([r["n"] for r in sel], ys, marker="o", label="/".join(name))
        ax.set_xscale("log")
        ax.set_xlabel("members N")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"membership control plane vs N (TTL {TTL_S} s; load avg {loadavg()})")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


def plan(args) -> list[tuple[str, str, int, bool]]:
    """(backend, mode, N, drill) rows to run."""
    if args.sizes:
        return [
            (b, mode, n, b == "monitor" and mode == "grouped")
            for b in args.backends.split(",")
            for mode in args.modes.split(",")
            for n in args.sizes
        ]
    if args.quick:
        return [("monitor", "grouped", 200, True), ("etcd", "grouped", 200, False)]
    grouped = [100, 1000, 3000] + ([10_000] if args.full else [])
    rows = [("monitor", "grouped", n, True) for n in grouped]
    rows += [
        ("monitor", "per-member", n, False) for n in [100, 1000] + ([3000] if args.full else [])
    ]
    rows += [("etcd", "grouped", n, False) for n in [1000] + ([3000] if args.full else [])]
    rows += [("etcd", "per-member", 1000, False)] if args.full else []
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="one size (200): well under a minute")
    g.add_argument("--full", action="store_true", help="on to 10,000 members")
    p.add_argument("--window-s", type=float, default=None, help="steady window per row")
    p.add_argument("--sizes", type=int, nargs="*", help="these N instead of the sweep's")
    p.add_argument("--backends", default="monitor", help="with --sizes: monitor,etcd")
    p.add_argument("--modes", default="grouped", help="with --sizes: grouped,per-member")
    p.add_argument("--no-placement", action="store_true", help="membership rows only")
    p.add_argument("--hosts", type=int, default=None, help=f"member hosts (default {HOSTS})")
    p.add_argument("--json", default=os.path.join(ROOT, "bench/results/scale.json"))
    p.add_argument("--plot", default=os.path.join(ROOT, "bench/results/scale.png"))
    args = p.parse_args()
    # A SIGTERM unwinds like Ctrl-C: every row's finally stops its monitor, etcd and hosts.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    window = args.window_s or (TTL_S if args.quick else 3 * TTL_S)
    hosts_n = args.hosts or (QUICK_HOSTS if args.quick else HOSTS)
    rows, failures = [], []
    load_before = loadavg()
    with tempfile.TemporaryDirectory(prefix="moecomm-scale-") as workdir:
        for backend, mode, n, drill in plan(args):
            t = time.monotonic()
            try:
                row = run_one(backend, mode, n, window, drill, workdir, hosts_n)
            except Exception as exc:  # a size that does not hold is a result, said as such
                failures.append({"backend": backend, "mode": mode, "n": n, "error": repr(exc)})
                print(f"{backend}/{mode} N={n}: FAILED {exc!r}", flush=True)
                continue
            row["run_s"] = time.monotonic() - t
            rows.append(row)
            print(
                f"{backend:7s} {mode:10s} N={n:6d}  cpu {row['backend_cpu_cores']:.3f} cores  "
                f"rss {row['backend_rss_mb']:.0f} MB  req/s/member "
                f"{row['requests_per_s_per_member']:.3f}  hb p50/p99 "
                f"{row['heartbeat_p50_ms'] or 0:.1f}/{row['heartbeat_p99_ms'] or 0:.1f} ms  "
                f"change {row['change_to_all_watchers_max_s']:.3f} s  death "
                f"{row['death_to_removal_s']:.2f} s  evicted {row['evicted_in_window']}"
                + (f"  drill {row['drill']}" if "drill" in row else ""),
                flush=True,
            )
    placement = []
    if not args.no_placement:
        for n in [10] if args.quick else [10, 100, 300] + ([1000] if args.full else []):
            try:
                placement.append(scale_placement.measure(n))
            except Exception as exc:
                failures.append({"backend": "placement", "n": n, "error": repr(exc)})
                continue
            print(f"placement {placement[-1]}", flush=True)
    payload = {
        "bench": "scale",
        "placement": placement,
        "quick": args.quick,
        "full": args.full,
        "ttl_s": TTL_S,
        "window_s": window,
        "hosts": hosts_n,
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "rows": rows,
        "failures": failures,
        "model": model(rows),
    }
    write_json(args.json, payload)
    if args.plot and rows:
        plot(rows, payload["placement"], args.plot)
    return 0 if rows and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
