"""A member host for bench/scale/scale.py: one process holding many simulated members, through the
members' own protocol code (`moecomm.membership`: registrations renewed by the library, watchers
fed by the library), as a host agent would for the GPUs of one machine.

Started by the bench with the backend URL; registers `--count` members of role "server", opens
`--watchers` watchers of role "probe" (the bench registers probes and times their arrival),
prints one JSON line when ready, then answers JSON commands on stdin, one per line:
{"cmd": "stats"} (counters since the last stats, and the probe events seen) and {"cmd": "quit"}.
The bench kills some hosts with SIGKILL in its failure drill: nothing here needs a clean exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from moecomm.membership import Member, connect_membership, monitor_token

# Members per register_many call: one request of ~300 KB to the monitor, one etcd lease.
REGISTER_CHUNK = 1024
# Layers and experts a simulated server advertises: a realistic record size (~250 bytes).
SIM_LAYERS = 2
SIM_EXPERTS_PER_LAYER = 2


def sim_member(host: str, i: int) -> Member:
    return Member(
        "server",
        f"{host}-{i}",
        endpoints={"control": f"http://10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:8000"},
        experts={layer: [i % 256, (i + 1) % 256] for layer in range(SIM_LAYERS)},
        metadata={"host": host},
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--host-id", required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--ttl", type=float, required=True)
    p.add_argument("--watchers", type=int, default=1)
    p.add_argument("--poll-s", type=float, default=2.0)
    p.add_argument("--per-member", action="store_true", help="renewal of earlier versions")
    args = p.parse_args()

    token = monitor_token() if args.url.startswith("http") else ""
    ms = connect_membership(args.url, token, poll_s=args.poll_s, group_leases=not args.per_member)
    sent = [0]
    lock = threading.Lock()

    def count(_request) -> None:
        with lock:
            sent[0] += 1

    ms._http.event_hooks["request"].append(count)  # requests this host sends, all kinds
    members = [sim_member(args.host_id, i) for i in range(args.count)]
    started = time.monotonic()
    if args.per_member:
        regs = [ms.register(m, args.ttl) for m in members]
    else:
        regs = []
        for i in range(0, len(members), REGISTER_CHUNK):
            regs += ms.register_many(members[i : i + REGISTER_CHUNK], args.ttl)
    register_s = time.monotonic() - started
    probes: list[tuple[str, str, float]] = []

    def seen(ev) -> None:
        probes.append((ev.kind, ev.member.member_id, time.monotonic()))

    watchers = [ms.watch(role="probe", callback=seen, initial=False) for _ in range(args.watchers)]
    print(json.dumps({"ready": True, "pid": os.getpid(), "register_s": register_s}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)["cmd"]
        if cmd == "quit":
            break
        lat = list(ms.leases.latencies)
        ms.leases.latencies.clear()
        with lock:
            requests, sent[0] = sent[0], 0
        out = {
            "latencies": lat,
            "requests": requests,
            "heartbeats": sum(r.heartbeats for r in regs),
            "reregistrations": sum(r.reregistrations for r in regs),
            "superseded": sum(r.superseded for r in regs),
            "errored": sum(r.last_error is not None for r in regs),
            "probes": probes[:],
            "threads": threading.active_count(),
        }
        print(json.dumps(out), flush=True)
    for w in watchers:
        w.close()
    os._exit(0)  # no deregistration: the bench tears the backend down


if __name__ == "__main__":
    sys.exit(main())
