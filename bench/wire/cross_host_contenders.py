"""The contenders of bench/wire/cross_host.py: each one's server and client end, run by that script
as `--role server|client` inside a lab host (see its docstring for what is measured).

raw TCP, pyzmq REQ/REP, torch.distributed gloo, NIXL's own round trips (notifications, WRITEs
with notifications), and moecomm over nixl (across the bridge) or over ShmTransport (same host:
the client starts the server as its own child). A client returns its
samples in ns, after checking one echo against what it sent. Also here: the parser of UCX's
protocol tables (UCX_PROTO_INFO=y), which says what carried moecomm-nixl's bytes.
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
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
from _lib.common import gloo_round_trip, time_calls

# The entry point: shm_client starts the server end through it (`--role server`).
ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cross_host.py")
TOKENS, HIDDEN, TOPK = 128, 7168, 8
# How long a client keeps retrying its connect while the server in the other namespace starts
# (a cold `import torch` takes a few seconds on a loaded 2-core machine).
CONNECT_TIMEOUT_S = 60.0
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

    once = gloo_round_trip(decode, (x, ids, sc), y, one, back)

    samples = time_calls(once, a.iters, a.warmup)
    for t, fresh in zip((x, ids, sc), make_request(2), strict=True):
        t.copy_(fresh)  # in place: `once` holds these tensors
    one.fill_(CHECK_BYTE)
    y.zero_()
    back.zero_()
    once()
    assert torch.equal(y, x) if decode else torch.equal(back, one), "gloo echo differs"
    dist.destroy_process_group()
    return samples


# ---------------------------------------------------------------------------- moecomm
# The roles that run moecomm over nixl (see _transport).
NIXL_ROLES = ("nixl", "nixl-staged", "nixl-words")
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
    if a.contender in NIXL_ROLES:
        from moecomm.wire.nixl import open_nixl_transport

        # "nixl": the signal word rides on the payload's notification (one transfer per
        # message), and a payload in our own registered memory is sent in place (the client's
        # request buffer, the server's request slot it answers from); "nixl-staged": the same,
        # every put copied into staging first (the path before zero copy); "nixl-words": each
        # word its own WRITE, waited for, every put staged (the earliest path).
        return open_nixl_transport(
            host=a.self_addr, notify=a.contender != "nixl-words", borrow=a.contender == "nixl"
        )
    import moecomm

    return moecomm.ShmTransport()


def _layout():
    import moecomm

    return moecomm.SlotLayout(TOKENS, HIDDEN, TOPK)


def _registered_request(t, x, ids, sc):
    """The request's tensors moved into one host buffer registered with nixl transport `t`
    (TensorRegion), as NIXL itself sends from a registered buffer: ClientChannel.send then
    reads them in place. Returns views of x, ids and scores in it, and the region (kept alive
    by the caller)."""
    from moecomm.wire.nixl import TensorRegion

    parts = [p.contiguous().view(torch.uint8).flatten() for p in (x, ids, sc)]
    buf = torch.cat(parts)
    reg = TensorRegion(t, buf)
    views, at = [], 0
    for p, src in zip(parts, (x, ids, sc), strict=True):
        views.append(buf[at : at + p.numel()].view(src.dtype).view(src.shape))
        at += p.numel()
    return (*views, reg)


def moecomm_server(a: argparse.Namespace) -> None:
    """The server end of both moecomm measurements, over the transport the contender names.
    Ends with a two-way handshake ("served", then the client's "done"): neither end lets its
    agent and regions go while the other may still have a transfer in flight to it."""
    from moecomm.wire.server import ServerChannel
    from moecomm.wire.transport import WaitOp

    t = _transport(a)
    clock = time.perf_counter_ns
    answer_ns = []  # the server's own leg: its answer (signal, or respond), per round trip
    if a.size == "signal":
        mine = t.create_region(128)
        _put_handle(a, "server", mine.handle)
        peer = t.attach(_get_handle(a, "client"))
        for i in range(1, a.iters + 1):
            t.wait(mine, PING_OFFSET, WaitOp.EQUAL, i, timeout_ns=WAIT_NS, peer=peer)
            t0 = clock()
            t.signal(peer, PING_OFFSET, i)
            answer_ns.append(clock() - t0)
    else:
        ch = ServerChannel(t, _layout(), CLIENT_ID, num_slots=1)
        _put_handle(a, "server", ch.handle)
        ch.connect(_get_handle(a, "client"))
        served = 0
        while served < a.iters:  # the identity expert: each request's activations go back
            for req in ch.wait(WAIT_S):
                if not req.valid:
                    raise RuntimeError(f"invalid request in slot {req.slot}")
                t0 = clock()
                ch.respond(req, req.activations)
                answer_ns.append(clock() - t0)
                served += 1
    _put_handle(a, "server_legs", json.dumps({"answer_ns": answer_ns, **_engine_counters(t)}))
    _put_handle(a, "served", "served")
    _get_handle(a, "done")


def moecomm_client(a: argparse.Namespace) -> list[int]:
    from moecomm.wire.client import ClientChannel
    from moecomm.wire.transport import WaitOp

    t = _transport(a)
    clock = time.perf_counter_ns
    legs: list[tuple[int, int]] = []  # per round trip: (send, wait) in ns
    if a.size == "signal":
        mine = t.create_region(128)
        peer = t.attach(_get_handle(a, "server"))
        _put_handle(a, "client", mine.handle)
        counter = [0]

        def once():
            counter[0] += 1
            t0 = clock()
            t.signal(peer, PING_OFFSET, counter[0])
            t1 = clock()
            v = t.wait(mine, PING_OFFSET, WaitOp.EQUAL, counter[0], timeout_ns=WAIT_NS, peer=peer)
            legs.append((t1 - t0, clock() - t1))
            return v

        samples = time_calls(once, a.iters, a.warmup)
        assert once() == counter[0], "moecomm signal word differs from what was sent"
    else:
        client = ClientChannel(t, _layout(), CLIENT_ID, num_slots=1)
        server = _get_handle(a, "server")
        _put_handle(a, "client", client.handle)
        client.connect(server)
        x, ids, sc = make_request(1)
        registered = a.contender == "nixl"  # sends from registered memory, as NIXL itself does
        if registered:
            x, ids, sc, _reg = _registered_request(t, x, ids, sc)
        last = [None]

        def once():
            t0 = clock()
            seq = client.send(0, x, ids, sc)
            t1 = clock()
            last[0] = client.wait(0, seq, WAIT_S).activations
            legs.append((t1 - t0, clock() - t1))

        samples = time_calls(once, a.iters, a.warmup)
        if registered:  # the check's fresh request goes through the registered buffer too
            for dst, fresh in zip((x, ids, sc), make_request(2), strict=True):
                dst.copy_(fresh)
        else:
            x, ids, sc = make_request(2)
        last[0].zero_()  # the response slot: the check must read freshly written bytes
        once()
        assert torch.equal(last[0], x), "moecomm decode response differs from the request"
    _get_handle(a, "served")
    timed = legs[a.warmup : a.warmup + a.iters]  # the timed round trips only
    a.legs = {
        "client_send_ns": [s for s, _ in timed],
        "client_wait_ns": [w for _, w in timed],
        "client": _engine_counters(t),
        "server": json.loads(_get_handle(a, "server_legs")),
    }
    _put_handle(a, "done", "done")
    return samples


def _engine_counters(t) -> dict:
    """The nixl engine's counters (transfers by kind, notifications, reposted transfers), or
    nothing for another transport."""
    e = getattr(t, "engine", None)
    if e is None:
        return {}
    zc_puts, zc_bytes = t.zero_copy_stats
    return {
        "zero_copy_puts": zc_puts,
        "zero_copy_bytes": zc_bytes,
        "writes": e.transfers_by_op["WRITE"],
        "reads": e.transfers_by_op["READ"],
        "notifications_sent": e.notifications_sent,
        "notifications_received": e.notifications_received,
        "prepared_reposts": e.prepared_hits,
        "xfer_ns": e.xfer_ns,
        # Each transfer's own time (the latest ones): the legs table shows their median.
        "xfer_samples_ns": list(e.xfer_samples_ns),
    }


def shm_client(a: argparse.Namespace) -> list[int]:
    """Same host: the server is a child process of this one, so it shares this spawn's network,
    IPC, PID and mount namespaces, and so its private /dev/shm."""
    argv = [sys.executable, ENTRY, "--role", "server", "--contender", "shm",
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


# ---------------------------------------------------------------------------- NIXL itself
# NIXL's own round trips, on an agent made as moecomm makes its own (moecomm.wire.nixl.new_agent:
# same UCX settings, same progress thread): the floor the moecomm-nixl rows are held to.
# signal: a notification answered by a notification. decode: a WRITE of the request bytes from a
# registered buffer into the server's, carrying a notification; the server answers with a WRITE
# of the response bytes (its request buffer's activations) carrying one. Each side waits for
# NIXL's notifications by polling get_new_notifs() (NIXL's API has nothing to block on), and an
# initiator polls its transfer's state, which is what lets NIXL send the attached notification.
# Both polls follow moecomm's waiting policy (spin, then sleep between polls), so the rows
# differ by protocol only: a busy poll takes the core NIXL's progress thread needs to move the
# bytes (on a 2-core machine it made NIXL's decode round trip 3-4x slower).
NIXL_REQ, NIXL_RESP = b"q", b"r"
# moecomm's nixl waiter: spin this long, then sleep this long between polls
# (csrc/transport/nixl/nixl_transport.h, kDefaultSpinNs and kDefaultPollNs).
NIXL_SPIN_S, NIXL_POLL_S = 50e-6, 20e-6


def _nixl_poll(ready, what: str, timeout_s: float = WAIT_S):
    """Calls ready() until it returns something true: spins, then sleeps between calls."""
    start = time.monotonic()
    while not (got := ready()):
        now = time.monotonic()
        if now - start > timeout_s:
            raise TimeoutError(f"{what} after {timeout_s} s")
        if now - start > NIXL_SPIN_S:
            time.sleep(NIXL_POLL_S)
    return got


def _nixl_agent(a: argparse.Namespace):
    from moecomm.wire.nixl import new_agent

    agent, name = new_agent(host=a.self_addr)
    return agent, name


def _nixl_buffer(agent, nbytes: int):
    """A registered host buffer of `nbytes` (a tensor: kept alive by the caller)."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    agent.register_memory([(buf.data_ptr(), nbytes, 0, "")], "DRAM")
    return buf


def _nixl_peer(a: argparse.Namespace, agent, me: str, other: str, buf) -> tuple[str, int]:
    """Swaps agent metadata and one buffer's address with the other end (files under a.tmp);
    returns the peer's agent name and its buffer's address."""
    import base64

    blob = base64.b64encode(agent.get_agent_metadata()).decode()
    _put_handle(a, me, json.dumps({"md": blob, "addr": buf.data_ptr() if buf is not None else 0}))
    got = json.loads(_get_handle(a, other))
    name = agent.add_remote_agent(base64.b64decode(got["md"]))
    return (name.decode() if isinstance(name, bytes) else name), got["addr"]


def _nixl_wait_notif(agent, peer: str, want: bytes) -> None:
    got = _nixl_poll(lambda: agent.get_new_notifs().get(peer), f"no notification {want!r}")
    if list(map(bytes, got)) != [want]:
        raise RuntimeError(f"NIXL notifications {got!r}, expected [{want!r}]")


class _OwnCounters:
    """NIXL itself's WRITEs and notifications, counted and timed as moecomm's engine counts its
    own (moecomm.wire.nixl.NixlEngine): the legs table sets both side by side."""

    def __init__(self) -> None:
        self.writes = self.notifs = 0
        self.xfer_ns: list[int] = []  # each WRITE: posted -> complete at the target

    def as_dict(self) -> dict:
        return {"writes": self.writes, "reads": 0, "notifications_sent": self.notifs,
                "notifications_received": 0, "prepared_reposts": self.writes,
                "xfer_ns": sum(self.xfer_ns), "xfer_samples_ns": self.xfer_ns}  # fmt: skip


def _nixl_write(agent, h, notif: bytes, counters: _OwnCounters | None = None) -> None:
    t0 = time.perf_counter_ns()
    state = [agent.transfer(h, notif)]

    def done() -> bool:
        if state[0] == "PROC":
            state[0] = agent.check_xfer_state(h)
        return state[0] != "PROC"

    _nixl_poll(done, "a NIXL WRITE still in flight")
    if state[0] != "DONE":
        raise RuntimeError(f"a NIXL WRITE ended {state[0]}")
    if counters is not None:
        counters.xfer_ns.append(time.perf_counter_ns() - t0)
        counters.writes += 1
        counters.notifs += 1


def _nixl_handle(agent, peer: str, local: int, remote: int, nbytes: int):
    lo = agent.get_xfer_descs([(local, nbytes, 0)], "DRAM")
    ro = agent.get_xfer_descs([(remote, nbytes, 0)], "DRAM")
    return agent.initialize_xfer("WRITE", lo, ro, peer)


def nixl_own_server(a: argparse.Namespace) -> None:
    agent, _ = _nixl_agent(a)
    req, resp = payload_bytes()
    buf = _nixl_buffer(agent, req) if a.size == "decode" else None
    peer, remote = _nixl_peer(a, agent, "server", "client", buf)
    h = _nixl_handle(agent, peer, buf.data_ptr(), remote, resp) if buf is not None else None
    counters = _OwnCounters()
    answer_ns = []  # the server's own leg, as moecomm_server times its answer
    for _ in range(a.iters):
        _nixl_wait_notif(agent, peer, NIXL_REQ)
        t0 = time.perf_counter_ns()
        if h is None:
            agent.send_notif(peer, NIXL_RESP)
            counters.notifs += 1
        else:  # the activations go back as they came, from where they landed
            _nixl_write(agent, h, NIXL_RESP, counters)
        answer_ns.append(time.perf_counter_ns() - t0)
    _put_handle(a, "server_legs", json.dumps({"answer_ns": answer_ns, **counters.as_dict()}))
    _put_handle(a, "served", "served")
    _get_handle(a, "done")


def nixl_own_client(a: argparse.Namespace) -> list[int]:
    agent, _ = _nixl_agent(a)
    req, resp = payload_bytes()
    decode = a.size == "decode"
    src = _nixl_buffer(agent, req) if decode else None
    back = _nixl_buffer(agent, resp) if decode else None
    peer, remote = _nixl_peer(a, agent, "client", "server", back)

    def fill(seed: int) -> None:
        x, ids, sc = make_request(seed)
        whole = torch.cat([t.contiguous().view(torch.uint8).flatten() for t in (x, ids, sc)])
        src.copy_(whole)

    counters = _OwnCounters()
    clock = time.perf_counter_ns
    legs: list[tuple[int, int]] = []  # per round trip: (send, wait) in ns, as moecomm_client
    if decode:
        fill(1)
        h = _nixl_handle(agent, peer, src.data_ptr(), remote, req)

        def send():
            _nixl_write(agent, h, NIXL_REQ, counters)
    else:

        def send():
            agent.send_notif(peer, NIXL_REQ)
            counters.notifs += 1

    def once():
        t0 = clock()
        send()
        t1 = clock()
        _nixl_wait_notif(agent, peer, NIXL_RESP)
        legs.append((t1 - t0, clock() - t1))

    samples = time_calls(once, a.iters, a.warmup)
    if decode:
        fill(2)
        back.zero_()
        once()
        assert torch.equal(back, src[:resp]), "NIXL's WRITE echo differs from the request"
    else:
        once()  # the answer is a notification of its own: checked to be exactly NIXL_RESP
    _get_handle(a, "served")
    timed = legs[a.warmup : a.warmup + a.iters]
    a.legs = {
        "client_send_ns": [s for s, _ in timed],
        "client_wait_ns": [w for _, w in timed],
        "client": counters.as_dict(),
        "server": json.loads(_get_handle(a, "server_legs")),
    }
    _put_handle(a, "done", "done")
    return samples


# ---------------------------------------------------------------------------- the roles
# role name -> (server in host B, client in host A); the client returns its samples in ns.
ROLES: dict[str, tuple[Callable, Callable]] = {
    "tcp": (tcp_server, tcp_client),
    "zmq": (zmq_server, zmq_client),
    "gloo": (gloo_server, gloo_client),
    "nixl": (moecomm_server, moecomm_client),
    "nixl-staged": (moecomm_server, moecomm_client),
    "nixl-words": (moecomm_server, moecomm_client),
    "nixl-own": (nixl_own_server, nixl_own_client),
    "shm": (moecomm_server, shm_client),
}


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
