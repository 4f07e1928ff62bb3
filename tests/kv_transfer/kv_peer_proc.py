"""The other process of the KV transfer tests: a pool in its own process, driven by commands
over a pipe (JSON strings in, answers out), so that every transfer crosses a process boundary
and a test can kill either end mid-transfer."""

from __future__ import annotations

import traceback

import torch
from moecomm.wire.kv import KvLayout, KvPool
from moecomm.wire.shm import ShmTransport


def fill(pool: KvPool, seed: int) -> None:
    """Random KV in every part of every layer (seeded: both processes can rebuild it)."""
    g = torch.Generator().manual_seed(seed)
    for p in pool.layout.parts:
        v = pool.view(p.layer, p.name)
        v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))


def serve(conn, layout_dict: dict, seed: int) -> None:
    """Answers commands until "exit": info, connect, expect, send, send_layers, wait."""
    transport = ShmTransport()
    pool = KvPool(transport, KvLayout.from_dict(layout_dict))
    fill(pool, seed)
    peer = None
    recvs = {}
    sends = {}
    conn.send(("ready", pool.info().to_json()))
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "exit":
                break
            if cmd == "connect":
                peer = pool.connect(args[0])
                conn.send(("ok", None))
            elif cmd == "expect":
                r = peer.expect(args[0])
                recvs[r.seq] = r
                conn.send(("ok", r.request.to_json()))
            elif cmd == "wait":
                recvs[args[0]].wait(args[1])
                conn.send(("ok", None))
            elif cmd == "send":  # request json, src blocks
                peer.send(args[0], args[1])
                conn.send(("ok", None))
            elif cmd == "start":  # request json, src blocks -> id
                s = peer.start(args[0], args[1])
                sends[s.req.seq] = s
                conn.send(("ok", s.req.seq))
            elif cmd == "layer":  # seq, layer
                sends[args[0]].layer(args[1])
                conn.send(("ok", None))
            elif cmd == "finish":
                sends[args[0]].finish()
                conn.send(("ok", None))
            else:
                conn.send(("error", f"unknown command {cmd}"))
        except Exception as exc:  # the test reads the class and message
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    pool.close()
