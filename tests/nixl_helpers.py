"""Shared by tests/wire/test_nixl_transport.py and tests/wire/test_nixl_faults.py: the spawned peer
processes (each with its own NIXL agent), how to start them and read their answers, and the
constants both use. The child functions live here, in a plain importable module, so a `spawn`
child unpickles them without importing a test module."""

from __future__ import annotations

import itertools
import math
import os
import random
import signal
import time

import moecomm
import moecomm.wire.nixl
import torch
from moecomm import prefork
from moecomm.errors import PeerLostError
from moecomm.testing import check_pattern
from moecomm.wire.server import ServerChannel
from moecomm.wire.transport import SignalOp, WaitOp
from moecomm.wire.views import region_bytes_view

NIXL_OK, NIXL_WHY = moecomm.wire.nixl.available()

SEED = 20240611
S = 1_000_000_000  # ns per second
START_TIMEOUT_S = 60.0
# Generous: a wait here only ends early on success; other test runs share the two cores.
WAIT_NS = 30 * S


# ---------------------------------------------------------------------------------- helpers
def start(reaper, target, *args):
    """Starts `target(conn, *args)` in a spawned process, killed at teardown whatever happens
    (the reaper fixture); returns (process, our end of the pipe)."""
    ctx = prefork.process_context()
    parent, child = ctx.Pipe()
    p = reaper.process(ctx.Process(target=target, args=(child, *args), daemon=True))
    p.start()
    child.close()
    return p, parent


def spawn(reaper, target, *args):
    """start(), then the process's first message: (process, pipe, message)."""
    p, conn = start(reaper, target, *args)
    return p, conn, recv(conn, START_TIMEOUT_S)


def recv(conn, timeout=WAIT_NS / S):
    assert conn.poll(timeout), "the peer process did not answer in time"
    return conn.recv()


def kill(p):
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert not p.is_alive()


# ------------------------------------------- put + signal + wait: the stream's receiver
# The receiver's region: two signal words, then two halves a message goes into alternately.
HALF = 6 << 20
HEADER = 64
STREAM_BYTES = HEADER + 2 * HALF
STREAM_MESSAGES = 120
# Sizes at the edges of the transport's staging (4 MiB, a 64-byte scratch, 64-byte slots).
EDGE_SIZES = [1, 2, 63, 64, 65, 4096, (4 << 20) - 64, (4 << 20) - 63, 4 << 20, HALF]


def stream_message(seed: int, i: int):
    """Message i: (offset in its half, payload bytes in 1..255, piece boundaries). A payload
    byte is never 0, the value the receiver wipes a checked message with."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    if i < len(EDGE_SIZES):
        size = EDGE_SIZES[i]
    else:  # log-uniform over 1 B .. HALF: mostly small, now and then several MiB
        size = int(2 ** (torch.rand(1, generator=g).item() * math.log2(HALF)))
        size = min(max(size, 1), HALF)
    offset = int(torch.randint(0, HALF - size + 1, (1,), generator=g))
    payload = torch.randint(1, 256, (size,), dtype=torch.uint8, generator=g)
    pieces = int(torch.randint(1, 4, (1,), generator=g))
    cuts = sorted({0, size, *torch.randint(0, size + 1, (pieces - 1,), generator=g).tolist()})
    return offset, payload, list(itertools.pairwise(cuts))


def stream_receiver(conn, seed, count):
    t = moecomm.wire.nixl.open_nixl_transport()
    r = t.create_region(STREAM_BYTES)
    conn.send(r.handle)
    sender = t.attach(conn.recv())
    view = region_bytes_view(r)
    for i in range(count):
        slot = i % 2
        offset, want, _ = stream_message(seed, i)  # ready before the word lands: checked at once
        base = HEADER + slot * HALF + offset
        t.wait(r, 8 * slot, WaitOp.EQUAL, i + 1, timeout_ns=WAIT_NS, peer=sender)
        got = view[base : base + want.numel()]
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            conn.send(("mismatch", i, want.numel(), int(bad[0]), bad.numel()))
            return
        got.zero_()  # a stale byte of the next message here reads 0, never a payload byte
        t.signal(sender, 0, i + 1)  # ack: the sender may reuse this half
    conn.send(("ok", count))


# ----------------------------------------------- the slot protocol over nixl: the server
def nixl_identity_server(conn, layout_dict, client_id, num_slots, borrow=True):
    """moecomm.testing.serve_identity over nixl (that one builds its own ShmTransport). Each
    answer is the request's own activations, from the slot they landed in (sent in place when
    `borrow`); at "stop" it reports what it served, its WRITEs and its puts sent in place."""
    layout = moecomm.SlotLayout.from_dict(layout_dict)
    t = moecomm.wire.nixl.open_nixl_transport(borrow=borrow)
    channel = ServerChannel(t, layout, client_id, num_slots)
    conn.send((channel.handle, channel.request_ring.poison))
    channel.connect(conn.recv())
    served = rejected = 0
    out_dtype = moecomm.wire.protocol.ENCODING_DTYPE[layout.out_encoding]
    while True:
        try:
            reqs = channel.wait(timeout=0.05)
        except PeerLostError:
            break
        for req in reqs:
            problem = "invalid" if not req.valid else check_pattern(req, client_id)
            if problem is not None:
                channel.reject(req, moecomm.wire.protocol.ResponseStatus.SERVER_ERROR, problem)
                rejected += 1
                continue
            y = req.activations
            channel.respond(req, y if y.dtype == out_dtype else y.to(out_dtype))
            served += 1
        if not reqs and conn.poll() and conn.recv() == "stop":
            break
    conn.send(
        {
            "served": served,
            "rejected": rejected,
            "writes": t.engine.transfers_by_op["WRITE"],
            "in_place": t.zero_copy_stats,
        }
    )


# -------------------------------------------------------------- peers for the fault tests
def ringer(conn, seed):
    """Rings the parent's word (a put, then kAdd on the word) until killed."""
    t = moecomm.wire.nixl.open_nixl_transport()
    r = t.create_region(4096)
    conn.send((r.handle, t.agent_name))
    parent = t.attach(conn.recv())
    rng = random.Random(seed)
    buf = torch.arange(256, dtype=torch.uint8)
    while True:
        t.put(parent, 64 + rng.randrange(0, 3000), buf.data_ptr(), rng.randrange(1, 256))
        t.signal(parent, 0, 1, SignalOp.ADD)
        time.sleep(rng.random() * 0.002)


def echo(conn):
    """Answers every value written into its word 0 by writing it into the parent's word 0."""
    t = moecomm.wire.nixl.open_nixl_transport()
    r = t.create_region(4096)
    conn.send(r.handle)
    parent = t.attach(conn.recv())
    last = 0
    while True:
        last = t.wait(r, 0, WaitOp.NOT_EQUAL, last, timeout_ns=600 * S, peer=parent)
        t.signal(parent, 0, last)


def regions(conn, count):
    t = moecomm.wire.nixl.open_nixl_transport()
    regions = [t.create_region(4096 * (i + 1)) for i in range(count)]
    for i, r in enumerate(regions):
        region_bytes_view(r)[:8] = i + 1
    conn.send((t.agent_name, [r.handle for r in regions]))
    conn.recv()  # until told (or killed)


# ------------------------------------------------------------ remote read: a filled region
READ_BYTES = (10 << 20) + 13  # more than the staging buffer: read in chunks; an odd size


def filled(conn, seed):
    t = moecomm.wire.nixl.open_nixl_transport()
    r = t.create_region(READ_BYTES)
    g = torch.Generator().manual_seed(seed)
    region_bytes_view(r).copy_(torch.randint(0, 256, (READ_BYTES,), dtype=torch.uint8, generator=g))
    conn.send(r.handle)
    conn.recv()


# ------------------------------------------------------------------ kAdd: a doorbell ringer
def doorbell_writer(conn, seed):
    """Rings the parent's word 0 with kAdd on command: ("ring", n, max_sleep_s)."""
    t = moecomm.wire.nixl.open_nixl_transport()
    conn.send(t.agent_name)
    peer = t.attach(conn.recv())
    rng = random.Random(seed)
    while (cmd := conn.recv())[0] == "ring":
        _, n, max_sleep = cmd
        for _ in range(n):
            t.signal(peer, 0, 1, SignalOp.ADD)
            if max_sleep:
                time.sleep(rng.random() * max_sleep)
        conn.send("rung")


# ------------------------------------------------------------------------ the idle waiter
def idle_waiter(conn, seconds, options):
    """Waits `seconds` on a word nobody signals, over a transport opened with `options`; sends
    the CPU time the whole process (NIXL's threads included) spent per wall second."""
    t = moecomm.wire.nixl.open_nixl_transport(**options)
    r = t.create_region(64)
    c0, w0 = time.process_time(), time.monotonic()
    try:
        t.wait(r, 0, WaitOp.EQUAL, 1, timeout_ns=int(seconds * S))
        conn.send(("woken", None))
        return
    except moecomm.DeadlineExceededError:
        pass
    conn.send(("idle", (time.process_time() - c0) / (time.monotonic() - w0)))


def ucx_env_child(conn, user_envs):
    """For each of `user_envs`: clears the variables of moecomm.wire.nixl.UCX_DEFAULTS, sets the
    user's as a user would, makes a NIXL agent as moecomm does, and notes those variables as the
    process holds them afterwards. Sends the list of what it noted."""
    names = moecomm.wire.nixl.UCX_DEFAULTS
    out = []
    for user_env in user_envs:
        for k in (*names, moecomm.wire.nixl.UCX_DEFAULTS_ENV):
            os.environ.pop(k, None)
        os.environ.update(user_env)
        moecomm.wire.nixl.new_agent()
        out.append({k: os.environ.get(k) for k in names})
    conn.send(out)
