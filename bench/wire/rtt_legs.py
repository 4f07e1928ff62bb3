"""The decode-size round trip of bench/wire/rtt.py taken apart: its two copies and what each costs.

- floor:  the same two copies with no protocol at all — process A copies the request into B's
          shared memory and raises a word, B copies it into A's shared memory and raises one
          back (torch copies through region views; moecomm's signal/wait for the words). Any
          message that must cross address spaces pays at least this on this machine.
- legs:   moecomm's round trip split at the client: the send (the client's copy into the
          server's slot + header + signal) and the wait (the server's wake-up, its copy into the
          client's slot, our wake-up).
- pack:   what zero copy removes on the client: AttentionClient's path packs the routed batch
          (gather by server) and sends it. Staged = pack into new tensors, then copy into the
          slot (`send`); in place = pack straight into the server's slot (`request_views`),
          then `commit`. Both round trips against the identity server, answers checked.
"""

from __future__ import annotations

import time

import moecomm
import torch
from _lib.common import Stats, time_calls
from moecomm import prefork
from moecomm.ops.dispatch import ExpertMap, pack_dispatch
from moecomm.testing import spawn_identity_server
from moecomm.wire.client import ClientChannel
from moecomm.wire.transport import WaitOp
from moecomm.wire.views import RegionViews

WAIT_S = 10.0
# The signal word of each side: the first cache line of its region; the payload starts a line
# later so the word's line is never written by the copy.
FLAG_OFFSET, DATA_OFFSET = 0, 64
CLIENT_ID = 1
# Experts the decode batch is routed over, all hosted by the one server.
NUM_EXPERTS = 32


def _floor_peer(conn, nbytes: int, iters: int) -> None:
    t = moecomm.ShmTransport()
    mine = t.create_region(DATA_OFFSET + nbytes)
    conn.send(mine.handle)
    peer = t.attach(conn.recv())
    src = RegionViews(mine).get(DATA_OFFSET, (nbytes,), torch.uint8)
    dst = RegionViews(peer).get(DATA_OFFSET, (nbytes,), torch.uint8)
    for i in range(1, iters + 1):
        t.wait(mine, FLAG_OFFSET, WaitOp.EQUAL, i, timeout_ns=int(WAIT_S * 1e9))
        dst.copy_(src)
        t.signal(peer, FLAG_OFFSET, i)
    conn.send("done")


def copy_floor(req_bytes: int, iters: int, warmup: int) -> Stats:
    """Two cross-process copies of `req_bytes` (request out, same bytes back), no protocol."""
    ctx = prefork.process_context()
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_floor_peer, args=(child, req_bytes, iters + warmup), daemon=True)
    p.start()
    t = moecomm.ShmTransport()
    mine = t.create_region(DATA_OFFSET + req_bytes)
    peer = t.attach(parent.recv())
    parent.send(mine.handle)
    src = torch.randint(0, 255, (req_bytes,), dtype=torch.uint8)
    dst = RegionViews(peer).get(DATA_OFFSET, (req_bytes,), torch.uint8)
    back = RegionViews(mine).get(DATA_OFFSET, (req_bytes,), torch.uint8)
    counter = [0]
    ns = int(WAIT_S * 1e9)

    def once():
        counter[0] += 1
        dst.copy_(src)
        t.signal(peer, FLAG_OFFSET, counter[0])
        t.wait(mine, FLAG_OFFSET, WaitOp.EQUAL, counter[0], timeout_ns=ns)

    samples = time_calls(once, iters, warmup)
    assert torch.equal(back, src), "the copy floor's bytes came back wrong"
    parent.recv()
    p.join(10)
    return Stats("copy floor (2 cross-process copies, no protocol)", samples, 2 * req_bytes)


def _connected(tokens: int, hidden: int, topk: int):
    layout = moecomm.SlotLayout(tokens, hidden, topk)
    server = spawn_identity_server(layout, CLIENT_ID, num_slots=1, check=False)
    client = ClientChannel(moecomm.ShmTransport(), layout, CLIENT_ID, num_slots=1)
    client.connect(server.handle)
    server.connect(client.handle)
    return server, client


def moecomm_legs(tokens: int, hidden: int, topk: int, iters: int, warmup: int) -> dict:
    """Median send and wait of moecomm's decode round trip, timed separately in one loop."""
    server, client = _connected(tokens, hidden, topk)
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    ids = torch.randint(0, NUM_EXPERTS, (tokens, topk), dtype=torch.int32)
    scores = torch.rand(tokens, topk)
    send_ns, wait_ns = [], []
    for i in range(iters + warmup):
        t0 = time.perf_counter_ns()
        seq = client.send(0, x, ids, scores)
        t1 = time.perf_counter_ns()
        client.wait(0, seq, WAIT_S)
        t2 = time.perf_counter_ns()
        if i >= warmup:
            send_ns.append(t1 - t0)
            wait_ns.append(t2 - t1)
    server.stop()
    client.close()
    return {
        "send": Stats("send leg (client copy + header + signal)", send_ns),
        "wait": Stats("wait leg (server wake-up + copy + signal)", wait_ns),
    }


def pack_legs(tokens: int, hidden: int, topk: int, iters: int, warmup: int) -> list[Stats]:
    """AttentionClient's pack + send + wait, staged against in place."""
    server, client = _connected(tokens, hidden, topk)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, NUM_EXPERTS, (tokens, topk), generator=g)
    w = torch.rand(tokens, topk, generator=g)
    emap = ExpertMap([[(0, e)] for e in range(NUM_EXPERTS)])

    def staged():
        (b,) = pack_dispatch(x, ids, w, emap)
        seq = client.send(0, b.activations, b.expert_ids, b.scores)
        return client.wait(0, seq, WAIT_S).activations

    def in_place():
        def into(_server: int, n: int, k: int):
            return client.request_views(0, n, k)

        (b,) = pack_dispatch(x, ids, w, emap, into=into)
        assert b.in_place
        seq = client.commit(0, b.num_tokens, topk)
        return client.wait(0, seq, WAIT_S).activations

    out = []
    for name, fn in (("staged: pack, then send", staged), ("in place: pack into slot", in_place)):
        assert torch.equal(fn(), x), f"{name}: the answer differs from the request"
        out.append(Stats(f"AttentionClient {name}", time_calls(fn, iters, warmup)))
    server.stop()
    client.close()
    return out


def _native_pong(conn, offset: int, iters: int) -> None:
    t = moecomm.ShmTransport()
    mine = t.create_region(2 * offset)
    conn.send(mine.handle)
    peer = t.attach(conn.recv())
    t.ping_pong(mine, peer, offset, iters, False, int(WAIT_S * 1e9))
    conn.send("done")


def native_signal(offset: int, iters: int, warmup: int) -> Stats:
    """The signal-only round trip with both loops in C++ (Transport.ping_pong): what is left
    when Python, pybind and the GIL are taken out — the cache-line exchange between the cores."""
    ctx = prefork.process_context()
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_native_pong, args=(child, offset, iters + warmup), daemon=True)
    p.start()
    t = moecomm.ShmTransport()
    mine = t.create_region(2 * offset)
    peer = t.attach(parent.recv())
    parent.send(mine.handle)
    samples = t.ping_pong(mine, peer, offset, iters + warmup, True, int(WAIT_S * 1e9))[warmup:]
    parent.recv()
    p.join(10)
    return Stats("moecomm shm, C++ loops (no Python)", samples)
