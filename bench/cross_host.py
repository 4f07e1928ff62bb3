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
Goals for moecomm-nixl (medians): signal-only <= 1.5x raw TCP, decode <= 1.2x raw TCP.
Raw TCP (TCP_NODELAY, the same bytes sent there and back) is the floor of this link. Bytes moved
= request + response payload. Ratios are contender median / raw-TCP median. Every contender checks
one echo against what it sent (with a fresh payload and a cleared receive buffer), so a broken one
cannot look fast.

The same file is the server and the client (`--role server|client`), so one script runs in all
three places; the client writes its samples to a file under a temporary directory in /tmp, which
the mount namespace leaves shared with the parent.

Usage: python bench/cross_host.py [--iters-signal N] [--iters-decode N] [--quick] [--json PATH]
                                  [--only NAME,NAME]
(needs root: see moecomm.netns.available())
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Stats, format_table, time_calls, write_json
from moecomm.netns import Host, Lab, available

TOKENS, HIDDEN, TOPK = 128, 7168, 8
SIZES = ("signal", "decode")
DEFAULT_JSON = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "cross_host.json"
)
# Each run gets a fresh port: a listener of the previous run may still hold its port in TIME_WAIT.
# Ports are per namespace, so nothing on the machine itself can collide with these.
BASE_PORT = 29600
# How long a client keeps retrying its connect while the server in the other namespace starts
# (a cold `import torch` takes a few seconds on a loaded 2-core machine).
CONNECT_TIMEOUT_S = 60.0
# Bound on one contender's whole run (start-up, warm-up, samples): a hung contender fails the run
# instead of hanging it.
RUN_TIMEOUT_S = 600.0
# Gloo picks its interface from the hostname unless told; inside a namespace the hostname does not
# resolve to the lab address, so name the lab's interface.
GLOO_IFNAME = "eth0"
SIGNAL_BYTE, CHECK_BYTE = 0x5A, 0xA5


def payload_bytes() -> tuple[int, int]:
    req = TOKENS * HIDDEN * 2 + 2 * TOKENS * TOPK * 4
    return req, TOKENS * HIDDEN * 2


def make_request(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 256, (TOKENS, TOPK), dtype=torch.int32, generator=g)
    scores = torch.rand(TOKENS, TOPK, generator=g)
    return x, ids, scores


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


# ---------------------------------------------------------------------------- raw TCP
def _recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError("peer closed mid-message")
        got += n


def tcp_server(a: argparse.Namespace) -> None:
    req, resp = payload_bytes() if a.size == "decode" else (1, 1)
    with socket.create_server(("0.0.0.0", a.port), reuse_port=True) as ls:
        conn, _ = ls.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(req))
    for _ in range(a.iters):
        _recv_exact(conn, buf)
        conn.sendall(buf[:resp])  # the activations (or the signal byte) go back as they came
    conn.close()


def _connect(addr: str, port: int) -> socket.socket:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            s = socket.create_connection((addr, port), timeout=1.0)
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def tcp_client(a: argparse.Namespace) -> list[int]:
    sock = _connect(a.peer, a.port)
    decode = a.size == "decode"
    if decode:
        x, ids, sc = make_request(1)
        req = bytes(as_bytes(x)) + bytes(as_bytes(ids)) + bytes(as_bytes(sc))
    else:
        req = bytes([SIGNAL_BYTE])
    resp = memoryview(bytearray(payload_bytes()[1] if decode else 1))

    def once():
        sock.sendall(req)
        _recv_exact(sock, resp)

    samples = time_calls(once, a.iters, a.warmup)
    if decode:
        x, ids, sc = make_request(2)
        req = bytes(as_bytes(x)) + bytes(as_bytes(ids)) + bytes(as_bytes(sc))
    else:
        req = bytes([CHECK_BYTE])
    resp[:] = bytes(len(resp))
    once()
    assert resp == req[: len(resp)], "raw TCP echo differs from what was sent"
    sock.close()
    return samples


# ---------------------------------------------------------------------------- pyzmq
def zmq_server(a: argparse.Namespace) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.REP)
    sock.bind(f"tcp://0.0.0.0:{a.port}")
    for _ in range(a.iters):
        parts = sock.recv_multipart(copy=False)
        sock.send(parts[0], copy=False)
    sock.close(linger=1000)


def zmq_client(a: argparse.Namespace) -> list[int]:
    import zmq

    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.connect(f"tcp://{a.peer}:{a.port}")  # zmq retries the connect itself
    decode = a.size == "decode"

    def parts_of(seed: int):
        if not decode:
            return [bytes([SIGNAL_BYTE if seed == 1 else CHECK_BYTE])]
        x, ids, sc = make_request(seed)
        return [x.view(torch.uint8).numpy(), ids.numpy(), sc.numpy()]

    parts = parts_of(1)
    out = [b""]

    def once():
        sock.send_multipart(parts, copy=False)
        out[0] = sock.recv(copy=False)

    samples = time_calls(once, a.iters, a.warmup)
    parts = parts_of(2)
    once()
    assert bytes(out[0].buffer) == bytes(memoryview(parts[0]).cast("B")), "pyzmq echo differs"
    sock.close()
    return samples


# ---------------------------------------------------------------------------- gloo
def _gloo_init(a: argparse.Namespace, rank: int, master: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{a.port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S),
    )


def gloo_server(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    _gloo_init(a, rank=1, master=a.peer)  # rank 0 (the client, in host A) holds the store
    if a.size == "decode":
        x, ids, sc = (torch.empty_like(t) for t in make_request(0))
        for _ in range(a.iters):
            dist.recv(x, 0)
            dist.recv(ids, 0)
            dist.recv(sc, 0)
            dist.send(x, 0)
    else:
        one = torch.zeros(1, dtype=torch.uint8)
        for _ in range(a.iters):
            dist.recv(one, 0)
            dist.send(one, 0)
    dist.destroy_process_group()


def gloo_client(a: argparse.Namespace) -> list[int]:
    import torch.distributed as dist

    _gloo_init(a, rank=0, master=a.self_addr)
    decode = a.size == "decode"
    x, ids, sc = make_request(1)
    y = torch.empty_like(x)
    one = torch.full((1,), SIGNAL_BYTE, dtype=torch.uint8)
    back = torch.zeros(1, dtype=torch.uint8)

    def once():
        if decode:
            dist.send(x, 1)
            dist.send(ids, 1)
            dist.send(sc, 1)
            dist.recv(y, 1)
        else:
            dist.send(one, 1)
            dist.recv(back, 1)

    samples = time_calls(once, a.iters, a.warmup)
    x, ids, sc = make_request(2)
    one.fill_(CHECK_BYTE)
    y.zero_()
    back.zero_()
    once()
    assert torch.equal(y, x) if decode else torch.equal(back, one), "gloo echo differs"
    dist.destroy_process_group()
    return samples


# ---------------------------------------------------------------------------- moecomm
# Both ends exchange region handles through files in the run's temporary directory under /tmp
# (shared by every namespace of the lab): a file appears whole (written, then renamed).
CLIENT_ID = 1
# Signal words of the ping-pong: each at the start of its own cache line in its owner's region.
PING_OFFSET = 64
WAIT_S = 10.0
WAIT_NS = int(WAIT_S * 1e9)


def _put_handle(a: argparse.Namespace, who: str, handle: str) -> None:
    path = os.path.join(a.tmp, f"{who}.handle")
    with open(path + ".part", "w") as f:
        f.write(handle)
    os.rename(path + ".part", path)


def _get_handle(a: argparse.Namespace, who: str) -> str:
    path = os.path.join(a.tmp, f"{who}.handle")
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {who} handle within {CONNECT_TIMEOUT_S} s")
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


def _transport(a: argparse.Namespace):
    if a.contender == "nixl":
        from moecomm.nixl import NixlTransport

        return NixlTransport(host=a.self_addr)
    import moecomm

    return moecomm.ShmTransport()


def _layout():
    import moecomm

    return moecomm.SlotLayout(TOKENS, HIDDEN, TOPK)


def moecomm_server(a: argparse.Namespace) -> None:
    """The server end of both moecomm measurements, over the transport the contender names.
    Ends with a two-way handshake ("served", then the client's "done"): neither end lets its
    agent and regions go while the other may still have a transfer in flight to it."""
    from moecomm.slots import ServerChannel
    from moecomm.transport import WaitOp

    t = _transport(a)
    if a.size == "signal":
        mine = t.create_region(128)
        _put_handle(a, "server", mine.handle)
        peer = t.attach(_get_handle(a, "client"))
        for i in range(1, a.iters + 1):
            t.wait(mine, PING_OFFSET, WaitOp.EQUAL, i, timeout_ns=WAIT_NS, peer=peer)
            t.signal(peer, PING_OFFSET, i)
    else:
        ch = ServerChannel(t, _layout(), CLIENT_ID, num_slots=1)
        _put_handle(a, "server", ch.handle)
        ch.connect(_get_handle(a, "client"))
        served = 0
        while served < a.iters:  # the identity expert: each request's activations go back
            for req in ch.wait(WAIT_S):
                if not req.valid:
                    raise RuntimeError(f"invalid request in slot {req.slot}")
                ch.respond(req, req.activations)
                served += 1
    _put_handle(a, "served", "served")
    _get_handle(a, "done")


def moecomm_client(a: argparse.Namespace) -> list[int]:
    from moecomm.slots import ClientChannel
    from moecomm.transport import WaitOp

    t = _transport(a)
    if a.size == "signal":
        mine = t.create_region(128)
        peer = t.attach(_get_handle(a, "server"))
        _put_handle(a, "client", mine.handle)
        counter = [0]

        def once():
            counter[0] += 1
            t.signal(peer, PING_OFFSET, counter[0])
            return t.wait(
                mine, PING_OFFSET, WaitOp.EQUAL, counter[0], timeout_ns=WAIT_NS, peer=peer
            )

        samples = time_calls(once, a.iters, a.warmup)
        assert once() == counter[0], "moecomm signal word differs from what was sent"
    else:
        client = ClientChannel(t, _layout(), CLIENT_ID, num_slots=1)
        server = _get_handle(a, "server")
        _put_handle(a, "client", client.handle)
        client.connect(server)
        x, ids, sc = make_request(1)
        last = [None]

        def once():
            last[0] = client.wait(0, client.send(0, x, ids, sc), WAIT_S).activations

        samples = time_calls(once, a.iters, a.warmup)
        x, ids, sc = make_request(2)
        last[0].zero_()  # the response slot: the check must read freshly written bytes
        once()
        assert torch.equal(last[0], x), "moecomm decode response differs from the request"
    _get_handle(a, "served")
    _put_handle(a, "done", "done")
    return samples


def shm_client(a: argparse.Namespace) -> list[int]:
    """Same host: the server is a child process of this one, so it shares this spawn's network,
    IPC, PID and mount namespaces, and so its private /dev/shm."""
    argv = [sys.executable, os.path.abspath(__file__), "--role", "server", "--contender", "shm",
            "--size", a.size, "--iters", str(a.iters + a.warmup + 1), "--tmp", a.tmp]  # fmt: skip
    srv = subprocess.Popen(argv)
    try:
        samples = moecomm_client(a)
        if srv.wait(CONNECT_TIMEOUT_S) != 0:
            raise RuntimeError(f"shm server exited with {srv.returncode}")
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    return samples


# ---------------------------------------------------------------------------- the runs
# role name -> (server in host B, client in host A); the client returns its samples in ns.
ROLES: dict[str, tuple[Callable, Callable]] = {
    "tcp": (tcp_server, tcp_client),
    "zmq": (zmq_server, zmq_client),
    "gloo": (gloo_server, gloo_client),
    "nixl": (moecomm_server, moecomm_client),
    "shm": (moecomm_server, shm_client),
}
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
                samples = json.load(f)["samples_ns"]
        return Stats(label, samples, sum(payload_bytes()) if size == "decode" else 0)

    return run


LOGS: dict[tuple[str, str], dict[str, str]] = {}

# UCX transports that move bytes through memory shared between processes: none may carry
# moecomm-nixl's bytes, or the run would not be measuring the network.
SHM_UCX_TRANSPORTS = ("sysv", "posix", "cma", "xpmem", "knem")
_UCX_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_.:-]+)")


def ucx_protocols(text: str) -> dict[str, dict[str, list[str]]]:
    """From UCX_PROTO_INFO=y output: endpoint kind ("inter-node" / "intra-node": a peer;
    "self": the agent's loopback to itself) -> operation (e.g. "remote memory write by
    ucp_put*(multi) from host memory to host") -> the UCX transports/devices its protocols use
    ("tcp/eth0")."""
    ops: dict[str, dict[str, set[str]]] = {}
    kind = op = None
    for line in text.splitlines():
        i = line.find("|")
        if i < 0:
            continue
        cells = [c.strip() for c in line[i:].strip().strip("|").split("|")]
        if len(cells) == 1:
            m = re.search(r"\s(self|inter-node|intra-node) cfg#\d+$", cells[0])
            if m:
                kind, op = m.group(1), None
            elif " by ucp_" in cells[0]:
                op = cells[0]
        elif (
            kind and op and len(cells) >= 3 and re.fullmatch(r"[0-9a-z]*(\.\.[0-9a-z]+)?", cells[0])
        ):
            found = {"/".join(m) for m in _UCX_TRANSPORT.findall(cells[-1])}
            ops.setdefault(kind, {}).setdefault(op, set()).update(found)
    return {k: {o: sorted(t) for o, t in sorted(v.items())} for k, v in sorted(ops.items())}


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
SHM_SAME_HOST = "moecomm-shm (same host)"
UCX_ENV = {"UCX_PROTO_INFO": "y"}
CONTENDERS: dict[str, dict[str, Contender]] = {
    name: {size: remote_pair(role, size, name, **kw) for size in SIZES}
    for name, role, kw in (
        (REFERENCE, "tcp", {}),
        ("pyzmq REQ/REP tcp", "zmq", {}),
        ("torch.distributed gloo", "gloo", {}),
        (NIXL, "nixl", {"env_extra": UCX_ENV}),
        (SHM_SAME_HOST, "shm", {"same_host": True}),
    )
}


# The goals for moecomm-nixl, as ratios of medians to raw TCP's.
GOALS = {"signal": 1.5, "decode": 1.2}


def goals_of(r_sig: list[dict], r_dec: list[dict]) -> dict:
    out = {}
    for size, rows_ in (("signal", r_sig), ("decode", r_dec)):
        row = next((r for r in rows_ if r["name"] == NIXL), None)
        if row is not None:
            limit = GOALS[size]
            out[f"{NIXL} {size} <= {limit}x raw TCP"] = {
                "ratio": row["ratio"],
                "limit": limit,
                "met": row["ratio"] <= limit,
            }
    return out


def library_state() -> dict:
    """The commit the library was built from, and its files that differ from it (numbers of a
    dirty tree belong to that tree, not to the commit)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    dirty = git("status", "--porcelain", "--", "python", "csrc", "bindings").splitlines()
    return {"head": git("rev-parse", "HEAD"), "modified": [ln.split(None, 1)[1] for ln in dirty]}


def _fmt_load(load: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def role_main(a: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    server, client = ROLES[a.contender]
    if a.role == "server":
        server(a)
        return 0
    samples = client(a)
    with open(a.out, "w") as f:
        json.dump({"samples_ns": samples, "checked": True}, f)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--iters-signal", type=int, default=2000)
    ap.add_argument("--iters-decode", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="a short run: 100 signal, 50 decode")
    ap.add_argument("--json", default=DEFAULT_JSON)
    ap.add_argument("--only", help="comma-separated contender names to run (raw TCP always runs)")
    # Internal: how this script runs itself inside a host.
    ap.add_argument("--role", choices=("parent", "server", "client"), default="parent")
    ap.add_argument("--contender", choices=sorted(ROLES), help=argparse.SUPPRESS)
    ap.add_argument("--size", choices=SIZES, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--self-addr", help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role != "parent":
        return role_main(a)
    if a.quick:
        a.iters_signal, a.iters_decode, a.warmup = 100, 50, 10
    ok, why = available()
    if not ok:
        print(f"cross_host: cannot build the namespace lab: {why}", file=sys.stderr)
        return 2

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

    def rows(stats: list[Stats]) -> list[dict]:
        ref = next(s for s in stats if s.name == REFERENCE).median_ns
        return [{**s.summary(), "ratio": s.median_ns / ref} for s in stats]

    cols = [
        ("name", "contender", "s"),
        ("median_us", "median µs", ".2f"),
        ("p99_us", "p99 µs", ".2f"),
        ("ratio", "x raw TCP", ".2f"),
    ]
    load_end = os.getloadavg()
    r_sig, r_dec = rows(results["signal"]), rows(results["decode"])
    ucx = (
        nixl_ucx_report()
        if any(s.name == NIXL for s in results["signal"] + results["decode"])
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
    goals = goals_of(r_sig, r_dec)
    if goals:
        print("\ngoals (medians):")
        for k, g in goals.items():
            print(
                f"  {k:34s} measured {g['ratio']:8.2f}x  limit {g['limit']:.1f}x  "
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
            "goals": goals,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
