"""Round-trip latency, 1 client / 1 server on one host, every contender in one run.

(a) signal-only: one signal to the server and one back (moecomm: a signal word each way, with the
    loops in Python and, for the floor, in C++; --signal-runs fresh process pairs; pyzmq:
    a 1-byte REQ/REP message; gloo: a 1-element send/recv).
(b) decode-size: request = 128 tokens x 7168 bf16 + top-8 int32 ids + top-8 f32 scores,
    response = 128 x 7168 bf16, answered by an identity expert.
The memcpy bound of (b) is (request + response payload bytes) / memcpy bandwidth measured in this
same run (torch copy_ of a buffer of the request's size, one core, data hot in its cache). Bytes
moved = request + response payload. Ratios are contender median / moecomm median.
(c) the decode round trip taken apart (bench/wire/rtt_legs.py): the copy floor (the same two copies
    between two processes with no protocol), moecomm's send and wait legs, and AttentionClient's
    pack + send staged against packed in place (zero copy).

Usage: python bench/wire/rtt.py [--iters-signal N] [--iters-decode N] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
from moecomm import prefork

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
import moecomm
from _lib.common import Stats, format_table, gloo_round_trip, time_calls, write_json
from moecomm.testing import spawn_identity_server
from moecomm.wire.client import ClientChannel
from moecomm.wire.transport import WaitOp
from rtt_legs import copy_floor, moecomm_legs, native_signal, pack_legs

TOKENS, HIDDEN, TOPK = 128, 7168, 8
CLIENT_ID = 1
WAIT_S = 10.0
# Signal words for the ping-pong: each at the start of its own cache line in the owner's region.
PING_OFFSET = 64


def payload_bytes() -> tuple[int, int]:
    req = TOKENS * HIDDEN * 2 + 2 * TOKENS * TOPK * 4
    return req, TOKENS * HIDDEN * 2


# ---------------------------------------------------------------------------- moecomm
def _pong(conn, iters: int) -> None:
    t = moecomm.ShmTransport()
    mine = t.create_region(128)
    conn.send(mine.handle)
    peer = t.attach(conn.recv())
    for i in range(1, iters + 1):
        t.wait(mine, PING_OFFSET, WaitOp.EQUAL, i, timeout_ns=int(WAIT_S * 1e9))
        t.signal(peer, PING_OFFSET, i)
    conn.send("done")


def moecomm_signal(iters: int, warmup: int) -> Stats:
    ctx = prefork.process_context()
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_pong, args=(child, iters + warmup), daemon=True)
    p.start()
    t = moecomm.ShmTransport()
    mine = t.create_region(128)
    peer = t.attach(parent.recv())
    parent.send(mine.handle)
    counter = [0]
    ns = int(WAIT_S * 1e9)

    def once():
        counter[0] += 1
        t.signal(peer, PING_OFFSET, counter[0])
        t.wait(mine, PING_OFFSET, WaitOp.EQUAL, counter[0], timeout_ns=ns)

    samples = time_calls(once, iters, warmup)
    parent.recv()
    p.join(10)
    return Stats("moecomm shm", samples)


def moecomm_decode(iters: int, warmup: int) -> Stats:
    layout = moecomm.SlotLayout(TOKENS, HIDDEN, TOPK)
    server = spawn_identity_server(layout, CLIENT_ID, num_slots=1, check=False)
    client = ClientChannel(moecomm.ShmTransport(), layout, CLIENT_ID, num_slots=1)
    client.connect(server.handle)
    server.connect(client.handle)
    x = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)
    ids = torch.randint(0, 32, (TOKENS, TOPK), dtype=torch.int32)
    scores = torch.rand(TOKENS, TOPK)

    def once():
        seq = client.send(0, x, ids, scores)
        client.wait(0, seq, WAIT_S)

    samples = time_calls(once, iters, warmup)
    check = client.wait(0, client.send(0, x, ids, scores), WAIT_S).activations
    assert torch.equal(check, x), "moecomm decode round trip is not bit-exact"
    server.stop()
    client.close()
    return Stats("moecomm shm", samples, sum(payload_bytes()))


# ---------------------------------------------------------------------------- pyzmq
def _zmq_server(addr: str, iters: int, decode: bool) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.REP)
    sock.bind(addr)
    for _ in range(iters):
        parts = sock.recv_multipart(copy=False)
        sock.send(parts[0] if decode else b"k", copy=False)
    sock.close()


def zmq_bench(iters: int, warmup: int, decode: bool) -> Stats:
    import zmq

    addr = f"ipc:///tmp/moecomm-rtt-{os.getpid()}.ipc"
    ctx = prefork.process_context()
    p = ctx.Process(target=_zmq_server, args=(addr, iters + warmup + 1, decode), daemon=True)
    p.start()
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.connect(addr)
    x = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)
    ids = torch.randint(0, 32, (TOKENS, TOPK), dtype=torch.int32)
    scores = torch.rand(TOKENS, TOPK)
    parts = [x.view(torch.uint8).numpy(), ids.numpy(), scores.numpy()]

    def once_decode():
        sock.send_multipart(parts, copy=False)
        y = sock.recv(copy=False)
        return torch.frombuffer(y.buffer, dtype=torch.bfloat16)

    def once_signal():
        sock.send(b"p")
        sock.recv()

    samples = time_calls(once_decode if decode else once_signal, iters, warmup)
    if decode:
        assert torch.equal(once_decode().view(TOKENS, HIDDEN), x), "zmq result differs"
    else:
        once_signal()
    p.join(10)
    sock.close()
    return Stats("pyzmq REQ/REP ipc", samples, sum(payload_bytes()) if decode else 0)


# ---------------------------------------------------------------------------- gloo
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_server(port: int, iters: int, decode: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    if decode:
        x = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16)
        ids = torch.empty(TOKENS, TOPK, dtype=torch.int32)
        sc = torch.empty(TOKENS, TOPK)
        for _ in range(iters):
            dist.recv(x, 0)
            dist.recv(ids, 0)
            dist.recv(sc, 0)
            dist.send(x, 0)
    else:
        one = torch.zeros(1)
        for _ in range(iters):
            dist.recv(one, 0)
            dist.send(one, 0)
    dist.destroy_process_group()


def gloo_bench(iters: int, warmup: int, decode: bool) -> Stats:
    import torch.distributed as dist

    port = _free_port()
    ctx = prefork.process_context()
    p = ctx.Process(target=_gloo_server, args=(port, iters + warmup + 1, decode), daemon=True)
    p.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    x = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)
    ids = torch.randint(0, 32, (TOKENS, TOPK), dtype=torch.int32)
    sc = torch.rand(TOKENS, TOPK)
    y = torch.empty_like(x)
    one = torch.ones(1)

    once = gloo_round_trip(decode, (x, ids, sc), y, one, one)

    samples = time_calls(once, iters, warmup)
    once()
    if decode:
        assert torch.equal(y, x), "gloo result differs"
    p.join(30)
    dist.destroy_process_group()
    return Stats("torch.distributed gloo", samples, sum(payload_bytes()) if decode else 0)


# ---------------------------------------------------------------------------- memcpy bound
def memcpy_bound(iters: int) -> tuple[Stats, float]:
    req, resp = payload_bytes()
    src = torch.randint(0, 255, (req,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    samples = time_calls(lambda: dst.copy_(src), iters, 20)
    st = Stats("memcpy", samples, req)
    bw = st.gbps  # bytes per ns == GB/s
    bound_ns = (req + resp) / bw
    return st, bound_ns


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--iters-signal", type=int, default=20000)
    ap.add_argument("--iters-decode", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument(
        "--signal-runs",
        type=int,
        default=3,
        help="fresh process pairs for the signal-only round trip (run-to-run spread)",
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)

    # Signal-only, Python and C++ loops alternating over fresh process pairs: a round trip this
    # short shows where the two processes landed, so one run says little about the next.
    runs = [
        (moecomm_signal(a.iters_signal, a.warmup), native_signal(PING_OFFSET, a.iters_signal, 0))
        for _ in range(max(1, a.signal_runs))
    ]
    print("\nsignal-only, run by run (fresh processes each): median µs, Python loop / C++ loop")
    for i, (py, cc) in enumerate(runs):
        print(f"  run {i}: {py.median_ns / 1e3:6.2f} / {cc.median_ns / 1e3:6.2f}")
    per_run = [{"python_us": py.median_ns / 1e3, "cxx_us": cc.median_ns / 1e3} for py, cc in runs]
    worst = max(runs, key=lambda r: r[0].median_ns)
    sig = [
        *worst,
        zmq_bench(a.iters_signal, a.warmup, decode=False),
        gloo_bench(a.iters_signal // 4, a.warmup, decode=False),
    ]
    dec = [
        moecomm_decode(a.iters_decode, a.warmup),
        zmq_bench(a.iters_decode, a.warmup, decode=True),
        gloo_bench(a.iters_decode, a.warmup, decode=True),
    ]
    mc, bound_ns = memcpy_bound(a.iters_decode)
    req_bytes, resp_bytes = payload_bytes()
    floor = copy_floor(req_bytes, a.iters_decode, a.warmup)
    legs = moecomm_legs(TOKENS, HIDDEN, TOPK, a.iters_decode, a.warmup)
    packs = pack_legs(TOKENS, HIDDEN, TOPK, a.iters_decode, a.warmup)

    def rows(stats, extra=None):
        ref = stats[0].median_ns
        out = []
        for s in stats:
            out.append({**s.summary(), "ratio": s.median_ns / ref})
        if extra:
            out.append(extra)
        return out

    cols = [
        ("name", "contender", "s"),
        ("median_us", "median µs", ".2f"),
        ("p99_us", "p99 µs", ".2f"),
        ("ratio", "x moecomm", ".2f"),
    ]
    r_sig = rows(sig)
    bound_row = {
        "name": "memcpy bound",
        "median_us": bound_ns / 1e3,
        "p99_us": None,
        "ratio": bound_ns / dec[0].median_ns,
        "gbps": mc.gbps,
    }
    r_dec = rows(dec, bound_row)
    print("\n(a) signal-only round trip (moecomm: the slowest of the runs above)")
    print(format_table(r_sig, cols))
    print(
        f"\n(b) decode-size round trip: {sum(payload_bytes())} payload bytes "
        f"(memcpy {mc.gbps:.1f} GB/s)"
    )
    print(format_table(r_dec, [*cols, ("gbps", "GB/s", ".2f")]))
    m_sig, m_dec = sig[0].median_ns / 1e3, dec[0].median_ns
    targets = {
        "signal_median_us<=2_every_run": (m_sig, m_sig <= 2.0),
        "decode<=0.25x_pyzmq": (m_dec / dec[1].median_ns, m_dec <= 0.25 * dec[1].median_ns),
        "decode<=0.25x_gloo": (m_dec / dec[2].median_ns, m_dec <= 0.25 * dec[2].median_ns),
        "decode<=1.3x_memcpy_bound": (m_dec / bound_ns, m_dec <= 1.3 * bound_ns),
        "zero_copy_client<=1.3x_memcpy_bound": (
            packs[1].median_ns / bound_ns,
            packs[1].median_ns <= 1.3 * bound_ns,
        ),
    }
    leg_cols = [
        ("name", "part", "s"),
        ("median_us", "median µs", ".2f"),
        ("p99_us", "p99 µs", ".2f"),
        ("vs_memcpy", "x hot memcpy of its bytes", ".2f"),
    ]
    one_copy_ns = req_bytes / mc.gbps
    r_legs = [
        {**floor.summary(), "vs_memcpy": floor.median_ns / bound_ns},
        {**legs["send"].summary(), "vs_memcpy": legs["send"].median_ns / one_copy_ns},
        {**legs["wait"].summary(), "vs_memcpy": legs["wait"].median_ns / (resp_bytes / mc.gbps)},
        *({**p.summary(), "vs_memcpy": p.median_ns / bound_ns} for p in packs),
    ]
    print("\n(c) the decode round trip taken apart (bench/wire/rtt_legs.py)")
    print(format_table(r_legs, leg_cols))
    print(
        f"  moecomm / copy floor: {dec[0].median_ns / floor.median_ns:.2f}x; "
        f"in place / staged: {packs[1].median_ns / packs[0].median_ns:.2f}x"
    )
    print("\ntargets:")
    for k, (v, ok) in targets.items():
        print(f"  {k:28s} measured {v:8.3f}  {'met' if ok else 'MISSED'}")
    write_json(
        a.json,
        {
            "signal_only": r_sig,
            "signal_only_runs": per_run,
            "decode": r_dec,
            "decode_parts": r_legs,
            "targets": {k: {"value": v, "met": ok} for k, (v, ok) in targets.items()},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
