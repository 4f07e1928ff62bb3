"""Round-trip latency across two "hosts": network namespaces joined by a bridge (moecomm.netns).

Client in host A, server in host B, each started with Lab.spawn: private /dev/shm, IPC and PID
namespaces, so only the network (veth -> bridge -> veth) can carry data between them.

(a) signal-only: the smallest message each contender can send, there and back (raw TCP: 1 byte;
    pyzmq: a 1-byte REQ/REP message; gloo: a 1-element uint8 send/recv).
(b) decode-size: request = 128 tokens x 7168 bf16 + top-8 int32 ids + top-8 f32 scores,
    response = 128 x 7168 bf16 (the server echoes the activations back).
moecomm-nixl: the nixl transport (NIXL over UCX) between the hosts; signal-only is a signal-word
ping-pong (each end waits on its own word, then signals the other's), decode-size is the slot
protocol (ClientChannel -> an identity ServerChannel loop). UCX_PROTO_INFO=y makes UCX print the
protocols it picks; the run reports the transport that carried the bytes (and that no
shared-memory transport reached the peer). moecomm-shm (same host) is a reference row: both ends
in ONE spawned program in host A (the client starts the server as its child), over ShmTransport.
moecomm-nixl sends each message as one transfer whose NIXL notification carries the signal word
(and the doorbell as a notification of its own), and sends a payload that lies in its own
registered memory in place: the client's request tensors live in a registered buffer
(TensorRegion), as NIXL itself sends from one, and the server answers from the request slot the
bytes landed in. The row "moecomm-nixl (staged copy)" is the same transport with every put
copied into staging first (borrow=False; the client sends from plain tensors): the path before
zero copy. The row "moecomm-nixl (word per WRITE)" also sends each word as its own WRITE, waited
for (the earliest path). All in the same run.
Per-leg breakdown of the nixl rows (NIXL itself timed the same way): the client's send, its
wait, the server's answer inside that wait, the median time of one transfer (posted -> complete
at the target), and the WRITEs, notifications and in-place puts each side spent per round trip.
"NIXL itself" is NIXL's own round trip between the same namespaces, on an agent made as moecomm
makes its own (same UCX settings, same progress thread): signal-only is a notification answered
by a notification, decode-size a WRITE of the request bytes carrying a notification, answered by
a WRITE of the response bytes carrying one. It is the engine moecomm-nixl runs on, so its rows
are the floor moecomm-nixl is held to ("x NIXL").
Goals for moecomm-nixl (medians): signal-only <= 1.2x NIXL's notification round trip and <= 2x
raw TCP; decode-size <= 1.0x NIXL's own WRITE round trip and <= 2x raw TCP. The run also says
whether NIXL itself is within 2x raw TCP on this link.
Raw TCP (TCP_NODELAY, the same bytes sent there and back) is the floor of this link. Bytes moved
= request + response payload. Ratios are contender median / raw-TCP median. Every contender checks
one echo against what it sent (with a fresh payload and a cleared receive buffer), so a broken one
cannot look fast.
Idle waiter: the CPU a process spends waiting on a nixl word nobody signals (all its threads,
NIXL's progress thread included), over --idle-s seconds, with moecomm's defaults and with the
earlier ones (a sleep of 20 µs between polls for good, the progress thread every 1 ms).
`--ucx-sweep` instead times NIXL itself and moecomm-nixl under each of UCX_VARIANTS (UCX's
rendezvous threshold, transports, TCP options, NIXL's progress thread) and writes
bench/results/cross_host_ucx.json: the measurements behind moecomm.wire.nixl.UCX_DEFAULTS.

The same file is the server and the client (`--role server|client`), so one script runs in all
three places; the client writes its samples to a file under a temporary directory in /tmp, which
the mount namespace leaves shared with the parent.
The contenders' server and client ends live in bench/wire/cross_host_contenders.py.

Usage: python bench/wire/cross_host.py [--iters-signal N] [--iters-decode N] [--quick] [--json PATH]
                                  [--png PATH] [--only NAME,NAME] [--idle-s S]
       python bench/wire/cross_host.py --ucx-sweep [--ucx-variants NAME,NAME] [--json PATH]
Writes the JSON (default bench/results/cross_host.json) and a PNG next to it (median and p99 of
every contender as ratios to raw TCP).
(needs root: see moecomm.netns.available())
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
from _lib.common import Stats, format_table, percentile, write_json
from cross_host_contenders import (
    CONNECT_TIMEOUT_S,
    HIDDEN,
    ROLES,
    SHM_UCX_TRANSPORTS,
    TOKENS,
    TOPK,
    payload_bytes,
    ucx_protocols,
)
from moecomm.netns import Host, Lab, available

SIZES = ("signal", "decode")
DEFAULT_JSON = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "cross_host.json"
)
# Each run gets a fresh port: a listener of the previous run may still hold its port in TIME_WAIT.
# Ports are per namespace, so nothing on the machine itself can collide with these.
BASE_PORT = 29600
# Bound on one contender's whole run (start-up, warm-up, samples): a hung contender fails the run
# instead of hanging it.
RUN_TIMEOUT_S = 600.0
# Gloo picks its interface from the hostname unless told; inside a namespace the hostname does not
# resolve to the lab address, so name the lab's interface.
GLOO_IFNAME = "eth0"


# ---------------------------------------------------------------------------- the runs
# The contenders (cross_host_contenders.ROLES): role name -> (server in host B, client in
# host A); the client returns its samples in ns.
Contender = Callable[[Lab, Host, Host, int, int], Stats]
_next_port = [BASE_PORT]


def remote_pair(
    role: str, size: str, label: str, same_host: bool = False, env_extra: dict | None = None
) -> Contender:
    """A contender whose server runs in host b and whose client (the timer) runs in host a; with
    same_host, one program in host a whose client starts the server itself (same namespaces).
    The logs of both ends are kept in LOGS[(label, size)]."""

    def run(lab: Lab, a: Host, b: Host, iters: int, warmup: int) -> Stats:
        port = _next_port[0]
        _next_port[0] += 1
        me = [sys.executable, os.path.abspath(__file__), "--role"]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": GLOO_IFNAME, **(env_extra or {})}
        with tempfile.TemporaryDirectory(prefix="moecomm-xhost-") as tmp, ExitStack() as files:
            common = ["--contender", role, "--size", size, "--port", str(port), "--tmp", tmp]
            out = os.path.join(tmp, "samples.json")
            logs = {
                k: files.enter_context(open(os.path.join(tmp, f"{k}.log"), "w+"))
                for k in ("server", "client")
            }
            # The server answers warm-up, timed and check round trips: iters + warmup + 1.
            srv = None
            if not same_host:
                srv = lab.spawn(
                    b,
                    [*me, "server", *common, "--peer", a.addr, "--self-addr", b.addr,
                     "--iters", str(iters + warmup + 1)],
                    env=env,
                    stdout=logs["server"],
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
            cli = lab.spawn(
                a,
                [*me, "client", *common, "--peer", a.addr if same_host else b.addr,
                 "--self-addr", a.addr, "--iters", str(iters), "--warmup", str(warmup),
                 "--out", out],
                env=env,
                stdout=logs["client"],
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                rc_cli = cli.wait(RUN_TIMEOUT_S)
                rc_srv = srv.wait(CONNECT_TIMEOUT_S) if srv is not None else 0
            except subprocess.TimeoutExpired:
                rc_cli = rc_srv = "timeout"
            text = {}
            for k, f in logs.items():
                f.seek(0)
                text[k] = f.read()
            LOGS[(label, size)] = text
            if rc_cli != 0 or rc_srv != 0:
                lab.kill(cli)
                if srv is not None:
                    lab.kill(srv)
                raise RuntimeError(
                    f"{label} {size}: client rc={rc_cli}, server rc={rc_srv}\n"
                    f"--- client\n{text['client'][-4000:]}\n--- server\n{text['server'][-4000:]}"
                )
            with open(out) as f:
                got = json.load(f)
            samples = got["samples_ns"]
            if got.get("legs"):
                LEGS[(label, size)] = got["legs"]
        return Stats(label, samples, sum(payload_bytes()) if size == "decode" else 0)

    return run


LOGS: dict[tuple[str, str], dict[str, str]] = {}
# (label, size) -> the moecomm client's per-round-trip legs and both ends' engine counters.
LEGS: dict[tuple[str, str], dict] = {}


def legs_rows() -> list[dict]:
    """The nixl round trip taken apart, per size: the client's send (payload + header + signal
    word + doorbell, until its transfer is complete), the client's wait (one-way delivery, the
    server's wake-up and answer, the answer's delivery and our wake-up), and inside that wait
    the server's own answer (its send); `network + wake-ups` = wait - server answer (none where
    the legs overlap: see below). Medians.
    With the transfers and notifications each round trip cost on each side, and the mean time
    its transfers were in flight (`xfer`: posted until complete at the target; the rest of a
    send is staging copies and the calls into NIXL)."""
    out = []
    for (label, size), legs in sorted(LEGS.items()):
        if label not in LEG_ROWS:
            continue
        send = percentile(legs["client_send_ns"], 50) / 1e3
        wait = percentile(legs["client_wait_ns"], 50) / 1e3
        answer = percentile(legs["server"]["answer_ns"], 50) / 1e3
        # On the word-per-WRITE path a sender's wait for its own WRITE overlaps the peer's
        # answer (the word landed before that wait ended), so the legs overlap: no remainder.
        rest = wait - answer if wait >= answer else None
        row = {"name": label, "size": size, "client_send_us": send, "client_wait_us": wait,
               "server_answer_us": answer, "network_and_wakeups_us": rest}  # fmt: skip
        # Counters cover warm-up and the check too: per round trip over all the client made.
        trips = len(legs["server"]["answer_ns"])
        for side in ("client", "server"):
            c = legs[side]
            if c and trips:
                row[f"{side}_writes_per_rt"] = c["writes"] / trips
                row[f"{side}_notifs_per_rt"] = c["notifications_sent"] / trips
                row[f"{side}_reads_per_rt"] = c["reads"] / trips
                # Puts sent in place from registered memory (no staging copy).
                row[f"{side}_zero_copy_puts_per_rt"] = c.get("zero_copy_puts", 0) / trips
                # Mean time its transfers were in flight (posted -> complete at the target).
                row[f"{side}_xfer_us_per_rt"] = c.get("xfer_ns", 0) / trips / 1e3
                # The median transfer: what one WRITE costs, free of wire-up and stalls.
                xs = c.get("xfer_samples_ns") or []
                row[f"{side}_xfer_median_us"] = percentile(xs, 50) / 1e3 if xs else None
        out.append(row)
    return out


def write_png(path: str, r_sig: list[dict], r_dec: list[dict]) -> None:
    """Median and p99 of every contender, both sizes, as ratios to raw TCP's median."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, rows_, title in ((axes[0], r_sig, "signal-only"), (axes[1], r_dec, "decode-size")):
        ref = next(r for r in rows_ if r["name"] == REFERENCE)["median_us"]
        names = [r["name"] for r in rows_]
        med = [r["median_us"] / ref for r in rows_]
        p99 = [r["p99_us"] / ref for r in rows_]
        y = range(len(names))
        ax.barh([i + 0.2 for i in y], med, height=0.4, label="median")
        ax.barh([i - 0.2 for i in y], p99, height=0.4, label="p99", alpha=0.6)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(list(y), names, fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("x raw TCP median (log)")
        ax.set_title(f"{title} round trip (raw TCP median {ref:.0f} µs)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def nixl_ucx_report() -> dict:
    """What UCX said it used for the moecomm-nixl runs (both ends, both sizes). Bytes to the
    peer go through its inter-/intra-node endpoint; the "self" endpoint is each agent's loopback
    to itself (UCX gives it cma), which never carries a byte to the other host."""
    text = "\n".join(t for (name, _), logs in LOGS.items() if name == NIXL for t in logs.values())
    ops = ucx_protocols(text)
    peer = {k: v for k, v in ops.items() if k != "self"}
    # Puts carry the payload and the signal words (the transport only ever writes).
    carried = sorted(
        {t for v in peer.values() for op, ts in v.items() if "ucp_put" in op for t in ts}
    )
    used = sorted({t for v in peer.values() for ts in v.values() for t in ts})
    shm = [t for t in used if t.split("/")[0] in SHM_UCX_TRANSPORTS]
    return {
        "ucx_transport": ", ".join(carried) if carried else "unknown (no UCX protocol table)",
        "ucx_peer_endpoint": sorted(peer),
        "ucx_transports_to_peer": used,
        "ucx_protocols": ops,
        "shared_memory_transport_to_peer": shm,
    }


# contender name -> size -> runner. Each runner gets the lab and both hosts, so a contender can
# run across the bridge (a -> b) or inside one namespace (both ends in a).
# moecomm-nixl: client in a, server in b, UCX over the lab's eth0; UCX prints the protocol it
# picked for each transfer (UCX_PROTO_INFO), from which the run reports the transport that carried
# the bytes. moecomm-shm: a reference row, both ends in host a (same namespaces, same /dev/shm).
REFERENCE = "raw TCP"
NIXL = "moecomm-nixl"
# The same transport with each signal word its own WRITE, waited for (the path before one
# transfer per message): the difference between the two rows is what the notification saves.
NIXL_WORDS = "moecomm-nixl (word per WRITE)"
# The notification path with every put copied into staging (the path before zero copy): the
# client sends from plain tensors, the server stages its answer.
NIXL_STAGED = "moecomm-nixl (staged copy)"
# NIXL's own round trips on the same engine (bench/wire/cross_host_contenders.py, "NIXL itself").
NIXL_OWN = "NIXL itself"
SHM_SAME_HOST = "moecomm-shm (same host)"
# The rows taken apart by leg: both nixl paths, and NIXL's own round trip timed the same way.
LEG_ROWS = (NIXL_OWN, NIXL, NIXL_STAGED, NIXL_WORDS)
UCX_ENV = {"UCX_PROTO_INFO": "y"}
CONTENDERS: dict[str, dict[str, Contender]] = {
    name: {size: remote_pair(role, size, name, **kw) for size in SIZES}
    for name, role, kw in (
        (REFERENCE, "tcp", {}),
        ("pyzmq REQ/REP tcp", "zmq", {}),
        ("torch.distributed gloo", "gloo", {}),
        (NIXL_OWN, "nixl-own", {"env_extra": UCX_ENV}),
        (NIXL, "nixl", {"env_extra": UCX_ENV}),
        (NIXL_STAGED, "nixl-staged", {"env_extra": UCX_ENV}),
        (NIXL_WORDS, "nixl-words", {"env_extra": UCX_ENV}),
        (SHM_SAME_HOST, "shm", {"same_host": True}),
    )
}


# The goals for moecomm-nixl, as ratios of medians: to NIXL's own round trip of the same kind
# (moecomm adds nothing over its engine) and to raw TCP (the link's floor). NIXL itself is held
# to the raw-TCP limits too, to tell what the engine allows on this link.
GOALS_NIXL = {"signal": 1.2, "decode": 1.0}
GOALS_TCP = {"signal": 2.0, "decode": 2.0}


def goals_of(r_sig: list[dict], r_dec: list[dict]) -> dict:
    out = {}
    for size, rows_ in (("signal", r_sig), ("decode", r_dec)):
        mine = next((r for r in rows_ if r["name"] == NIXL), None)
        own = next((r for r in rows_ if r["name"] == NIXL_OWN), None)
        checks = []
        if mine is not None and own is not None:
            checks.append((f"{NIXL} {size} <= {GOALS_NIXL[size]}x NIXL", mine["x_nixl"],
                           GOALS_NIXL[size]))  # fmt: skip
        for row in (mine, own):
            if row is not None:
                checks.append((f"{row['name']} {size} <= {GOALS_TCP[size]}x raw TCP",
                               row["ratio"], GOALS_TCP[size]))  # fmt: skip
        for key, ratio, limit in checks:
            out[key] = {"ratio": ratio, "limit": limit, "met": ratio <= limit}
    return out


# ---------------------------------------------------------------------------- the idle waiter
# How long the idle waiter is measured for (its CPU time over this wall time).
DEFAULT_IDLE_S = 5.0
# The earlier defaults, measured beside the current ones: every poll 20 µs apart for good
# (max_poll_ns = poll_ns) and NIXL's progress thread at its earlier delay (100 µs, which NIXL
# rounds up to a 1 ms poll timeout).
IDLE_VARIANTS = {
    "moecomm defaults": {},
    "earlier (no back-off, progress 100 µs)": {"max_poll_ns": 20_000, "progress_us": 100},
}


def idle_main(a: argparse.Namespace) -> int:
    """One idle receiver: a nixl transport whose waiter waits a.idle_s on a word nobody
    signals; prints the CPU time of the whole process (every thread) per wall second."""
    from moecomm.errors import DeadlineExceededError
    from moecomm.wire.nixl import open_nixl_transport
    from moecomm.wire.transport import WaitOp

    kw = json.loads(a.idle_options or "{}")
    t = open_nixl_transport(**kw)
    r = t.create_region(64)
    c0, w0 = time.process_time(), time.monotonic()
    try:
        t.wait(r, 0, WaitOp.EQUAL, 1, timeout_ns=int(a.idle_s * 1e9))
        raise RuntimeError("nobody signals this word, yet the wait ended")
    except DeadlineExceededError:
        pass
    c1, w1 = time.process_time(), time.monotonic()
    print(json.dumps({"cpu_s": c1 - c0, "wall_s": w1 - w0, "core_fraction": (c1 - c0) / (w1 - w0)}))
    return 0


def idle_rows(seconds: float) -> list[dict]:
    out = []
    for label, kw in IDLE_VARIANTS.items():
        r = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--role", "idle", "--idle-s", str(seconds),
             "--idle-options", json.dumps(kw)],
            capture_output=True, text=True, timeout=seconds + RUN_TIMEOUT_S,
        )  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"idle waiter ({label}) failed:\n{r.stdout}\n{r.stderr[-4000:]}")
        got = json.loads(r.stdout.strip().splitlines()[-1])
        out.append({"name": label, "options": kw, **got, "core_pct": 100 * got["core_fraction"]})
    return out


# ---------------------------------------------------------------------------- the UCX sweep
# UCX's settings tried on this link, each on top of moecomm's defaults (a variable set here wins
# over moecomm.wire.nixl.UCX_DEFAULTS, which only fills unset ones). "UCX stock" leaves UCX's own
# defaults (MOECOMM_NIXL_UCX_DEFAULTS=0: moecomm sets none), so it measures UCX untouched.
# MOECOMM_NIXL_PROGRESS_US is the NIXL progress thread's delay (NIXL rounds it up to a poll
# timeout in whole ms; 0: no wait).
UCX_VARIANTS: dict[str, dict[str, str]] = {
    "moecomm defaults": {},
    "UCX stock": {"MOECOMM_NIXL_UCX_DEFAULTS": "0"},
    "UCX_TLS=tcp": {"UCX_TLS": "tcp"},
    "UCX_RNDV_THRESH=16kb": {"UCX_RNDV_THRESH": "16kb"},
    "UCX_RNDV_THRESH=inf": {"UCX_RNDV_THRESH": "inf"},
    "UCX_TCP_TX/RX_SEG_SIZE=256kb": {
        "UCX_TCP_TX_SEG_SIZE": "256kb",
        "UCX_TCP_RX_SEG_SIZE": "256kb",
    },
    "UCX_TCP_SNDBUF/RCVBUF=4mb": {"UCX_TCP_SNDBUF": "4mb", "UCX_TCP_RCVBUF": "4mb"},
    "UCX_TCP_PUT_ENABLE=n": {"UCX_TCP_PUT_ENABLE": "n"},
    "UCX_TCP_NODELAY=n": {"UCX_TCP_NODELAY": "n"},
    "progress thread busy (0 µs)": {"MOECOMM_NIXL_PROGRESS_US": "0"},
    "progress thread 100 µs (1 ms)": {"MOECOMM_NIXL_PROGRESS_US": "100"},
    "progress thread 10 ms": {"MOECOMM_NIXL_PROGRESS_US": "10000"},
}
DEFAULT_UCX_JSON = os.path.join(os.path.dirname(DEFAULT_JSON), "cross_host_ucx.json")


def ucx_sweep(a: argparse.Namespace) -> int:
    """NIXL itself and moecomm-nixl, both sizes, under each UCX variant (raw TCP once per
    variant, for the link's drift); medians and ratios per variant."""
    from moecomm.wire.nixl import UCX_DEFAULTS

    names = a.ucx_variants.split(",") if a.ucx_variants else list(UCX_VARIANTS)
    unknown = [n for n in names if n not in UCX_VARIANTS]
    if unknown:
        print(f"cross_host: unknown UCX variants {unknown}; known: {list(UCX_VARIANTS)}")
        return 2
    iters = {"signal": a.iters_signal, "decode": a.iters_decode}
    load_start = os.getloadavg()
    rows_out: list[dict] = []

    def save(done: bool) -> None:
        """The JSON, rewritten after every variant: a run cut short keeps what it measured."""
        write_json(
            a.json or DEFAULT_UCX_JSON,
            {
                "command": "python bench/wire/cross_host.py " + " ".join(a.argv_rest),
                "complete": done,
                "parameters": {"iters_signal": a.iters_signal, "iters_decode": a.iters_decode,
                               "warmup": a.warmup,
                               "variants": {n: UCX_VARIANTS[n] for n in names}},
                "moecomm_ucx_defaults": UCX_DEFAULTS,
                "library": library_state(),
                "load_average_start": load_start,
                "load_average_now": os.getloadavg(),
                "rows": rows_out,
            },
        )  # fmt: skip

    with Lab() as lab:
        ha, hb = lab.add_host("a"), lab.add_host("b")
        for variant in names:
            env = UCX_VARIANTS[variant]
            for size in SIZES:
                got = {}
                for label, role in ((REFERENCE, "tcp"), (NIXL_OWN, "nixl-own"), (NIXL, "nixl")):
                    print(f"  {variant}: {size} {label} ...", flush=True)
                    run = remote_pair(role, size, label, env_extra=env)
                    got[label] = run(lab, ha, hb, iters[size], a.warmup).median_ns / 1e3
                rows_out.append({
                    "variant": variant, "size": size, "env": env,
                    "raw_tcp_us": got[REFERENCE], "nixl_us": got[NIXL_OWN],
                    "moecomm_us": got[NIXL], "nixl_x_tcp": got[NIXL_OWN] / got[REFERENCE],
                    "moecomm_x_tcp": got[NIXL] / got[REFERENCE],
                    "moecomm_x_nixl": got[NIXL] / got[NIXL_OWN],
                })  # fmt: skip
            save(done=False)
    load_end = os.getloadavg()
    print(
        f"\nload average (1, 5, 15 min): start {_fmt_load(load_start)}, end {_fmt_load(load_end)}"
    )
    print(f"moecomm's UCX defaults: {UCX_DEFAULTS or 'none'}")
    for size in SIZES:
        print(f"\n{size} round trip, medians (µs) by UCX setting ({iters[size]} round trips):")
        print(format_table([r for r in rows_out if r["size"] == size], [
            ("variant", "setting", "s"), ("raw_tcp_us", "raw TCP", ".1f"),
            ("nixl_us", "NIXL", ".1f"), ("moecomm_us", "moecomm", ".1f"),
            ("nixl_x_tcp", "NIXL/TCP", ".2f"), ("moecomm_x_tcp", "moecomm/TCP", ".2f"),
            ("moecomm_x_nixl", "moecomm/NIXL", ".2f"),
        ]))  # fmt: skip
    save(done=True)
    return 0


def library_state() -> dict:
    """The commit the library was built from, and its files that differ from it (numbers of a
    dirty tree belong to that tree, not to the commit)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    dirty = git("status", "--porcelain", "--", "python", "csrc", "bindings").splitlines()
    return {"head": git("rev-parse", "HEAD"), "modified": [ln.split(None, 1)[1] for ln in dirty]}


def _fmt_load(load: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def role_main(a: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    if a.role == "idle":
        return idle_main(a)
    server, client = ROLES[a.contender]
    if a.role == "server":
        server(a)
        return 0
    samples = client(a)
    with open(a.out, "w") as f:
        json.dump({"samples_ns": samples, "checked": True, "legs": getattr(a, "legs", None)}, f)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--iters-signal", type=int, default=2000)
    ap.add_argument("--iters-decode", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="a short run: 100 signal, 50 decode")
    ap.add_argument("--json", help=f"default {DEFAULT_JSON} ({DEFAULT_UCX_JSON} with --ucx-sweep)")
    ap.add_argument("--png", help="the figure (default: the JSON path with .png)")
    ap.add_argument("--only", help="comma-separated contender names to run (raw TCP always runs)")
    ap.add_argument("--idle-s", type=float, default=DEFAULT_IDLE_S,
                    help="seconds the idle waiter is measured for (0: not measured)")  # fmt: skip
    ap.add_argument("--ucx-sweep", action="store_true", help="time UCX's settings (UCX_VARIANTS)")
    ap.add_argument("--ucx-variants", help="comma-separated UCX_VARIANTS names for --ucx-sweep")
    # Internal: how this script runs itself inside a host.
    ap.add_argument("--role", choices=("parent", "server", "client", "idle"), default="parent")
    ap.add_argument("--idle-options", help=argparse.SUPPRESS)
    ap.add_argument("--contender", choices=sorted(ROLES), help=argparse.SUPPRESS)
    ap.add_argument("--size", choices=SIZES, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--self-addr", help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.argv_rest = list(sys.argv[1:] if argv is None else argv)
    if a.role != "parent":
        return role_main(a)
    if a.quick:
        a.iters_signal, a.iters_decode, a.warmup = 100, 50, 10
    ok, why = available()
    if not ok:
        print(f"cross_host: cannot build the namespace lab: {why}", file=sys.stderr)
        return 2
    if a.ucx_sweep:
        return ucx_sweep(a)
    a.json = a.json or DEFAULT_JSON

    iters = {"signal": a.iters_signal, "decode": a.iters_decode}
    only = set(a.only.split(",")) if a.only else set()
    results: dict[str, list[Stats]] = {size: [] for size in SIZES}
    load_start = os.getloadavg()
    with Lab() as lab:
        ha, hb = lab.add_host("a"), lab.add_host("b")
        for size in SIZES:
            for name, runners in CONTENDERS.items():
                if only and name not in only and name != REFERENCE:
                    continue
                if size in runners:
                    print(f"  {size:6s} {name} ...", flush=True)
                    results[size].append(runners[size](lab, ha, hb, iters[size], a.warmup))

    idle = idle_rows(a.idle_s) if a.idle_s > 0 else []

    def rows(stats: list[Stats]) -> list[dict]:
        ref = next(s for s in stats if s.name == REFERENCE).median_ns
        own = next((s.median_ns for s in stats if s.name == NIXL_OWN), None)
        return [
            {**s.summary(), "ratio": s.median_ns / ref,
             "x_nixl": s.median_ns / own if own else None}
            for s in stats
        ]  # fmt: skip

    cols = [
        ("name", "contender", "s"),
        ("median_us", "median µs", ".2f"),
        ("p99_us", "p99 µs", ".2f"),
        ("ratio", "x raw TCP", ".2f"),
        ("x_nixl", "x NIXL", ".2f"),
    ]
    load_end = os.getloadavg()
    r_sig, r_dec = rows(results["signal"]), rows(results["decode"])
    ucx = (
        nixl_ucx_report()
        if any(s.name in LEG_ROWS[1:] for s in results["signal"] + results["decode"])
        else {}
    )
    where = (
        f"; {NIXL}: UCX carried the bytes over {ucx['ucx_transport']}"
        f" ({'/'.join(ucx['ucx_peer_endpoint']) or '?'} endpoint)"
        if ucx
        else ""
    )
    print(
        f"\nload average (1, 5, 15 min): start {_fmt_load(load_start)}, end {_fmt_load(load_end)}"
    )
    print(f"\n(a) signal-only round trip, host A -> host B ({a.iters_signal} round trips){where}")
    print(format_table(r_sig, cols))
    print(
        f"\n(b) decode-size round trip: {sum(payload_bytes())} payload bytes "
        f"({a.iters_decode} round trips){where}"
    )
    print(format_table(r_dec, [*cols, ("gbps", "GB/s", ".2f")]))
    if ucx.get("shared_memory_transport_to_peer"):
        shm = ucx["shared_memory_transport_to_peer"]
        print(f"WARNING: UCX reached the peer through shared-memory transports: {shm}")
    legs = legs_rows()
    if legs:
        print(
            "\nnixl round trip by leg (medians, µs; xfer: one transfer, posted -> complete at"
            " the target; xfer/rt: the client's transfer time per round trip, mean; transfers"
            " per round trip by side):"
        )
        print(
            format_table(
                legs,
                [
                    ("name", "contender", "s"),
                    ("size", "size", "s"),
                    ("client_send_us", "client send", ".1f"),
                    ("client_wait_us", "client wait", ".1f"),
                    ("server_answer_us", "server answer", ".1f"),
                    ("network_and_wakeups_us", "net+wake", ".1f"),
                    ("client_xfer_median_us", "cli xfer", ".1f"),
                    ("server_xfer_median_us", "srv xfer", ".1f"),
                    ("client_xfer_us_per_rt", "cli xfer/rt", ".1f"),
                    ("client_writes_per_rt", "cli WRITEs", ".2f"),
                    ("client_notifs_per_rt", "cli notifs", ".2f"),
                    ("server_writes_per_rt", "srv WRITEs", ".2f"),
                    ("server_notifs_per_rt", "srv notifs", ".2f"),
                    ("client_zero_copy_puts_per_rt", "cli in place", ".2f"),
                    ("server_zero_copy_puts_per_rt", "srv in place", ".2f"),
                ],
            )
        )
    png = a.png or os.path.splitext(a.json)[0] + ".png"
    write_png(png, r_sig, r_dec)
    print(f"wrote {png}")
    if idle:
        print(f"\nidle nixl waiter: CPU of the whole process over {a.idle_s:.0f} s (goal <= 5 %):")
        print(format_table(idle, [("name", "setting", "s"), ("core_pct", "% of a core", ".1f")]))
    goals = goals_of(r_sig, r_dec)
    if idle:
        pct = idle[0]["core_pct"]
        goals["idle nixl waiter <= 5 % of a core"] = {"ratio": pct, "limit": 5.0, "met": pct <= 5}
    if goals:
        print("\ngoals (medians):")
        for k, g in goals.items():
            print(
                f"  {k:44s} measured {g['ratio']:8.2f}  limit {g['limit']:.1f}  "
                f"{'met' if g['met'] else 'MISSED'}"
            )
    write_json(
        a.json,
        {
            "parameters": {
                "tokens": TOKENS,
                "hidden": HIDDEN,
                "topk": TOPK,
                "request_bytes": payload_bytes()[0],
                "response_bytes": payload_bytes()[1],
                "iters_signal": a.iters_signal,
                "iters_decode": a.iters_decode,
                "warmup": a.warmup,
                "link": "veth pair -> Linux bridge -> veth pair, between network namespaces",
                "reference": REFERENCE,
                "same_host_rows": [SHM_SAME_HOST],
            },
            "library": library_state(),
            "load_average_start": load_start,
            "load_average_end": load_end,
            **ucx,
            "signal_only": r_sig,
            "decode": r_dec,
            "nixl_legs": legs,
            "idle_waiter": idle,
            "command": "python bench/wire/cross_host.py " + " ".join(a.argv_rest),
            "png": os.path.relpath(png, os.path.dirname(os.path.abspath(a.json))),
            "goals": goals,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
