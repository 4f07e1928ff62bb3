"""The other process of the KV transfer tests: a pool in its own process, driven by commands
over a pipe (JSON strings in, answers out), so that every transfer crosses a process boundary
and a test can kill either end mid-transfer. The pool is the library's shared memory, or the
engine's own tensors (`tensors`: "blocks_inner" for vLLM's ``[2, num_blocks, ...]`` per layer,
"blocks_outer" for ``[num_blocks, 2, ...]``, whose K and V blocks are strided)."""

from __future__ import annotations

import os
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


# The uid a sender drops to when a test needs the kernel to refuse its cross-memory writes.
NOBODY = 65534


def engine_tensors(layout: KvLayout, kind: str) -> list[torch.Tensor]:
    """An engine's own KV tensors for a K/V `layout`, one per part in layout order, allocated
    the way vLLM does per layer (two parts a layer, same shape)."""
    out = []
    for layer in range(layout.num_layers):
        parts = [layout.parts[i] for i in layout.layer_parts(layer)]
        shape, dtype = parts[0].block_shape, parts[0].dtype
        n = layout.num_blocks
        if kind == "blocks_inner":  # [2, num_blocks, ...]: each part's blocks contiguous
            kv = torch.zeros(len(parts), n, *shape, dtype=getattr(torch, dtype))
            out += [kv[j] for j in range(len(parts))]
        elif kind == "blocks_outer":  # [num_blocks, 2, ...]: each part's blocks strided
            kv = torch.zeros(n, len(parts), *shape, dtype=getattr(torch, dtype))
            out += [kv[:, j] for j in range(len(parts))]
        else:
            raise ValueError(f"unknown engine tensor layout {kind!r}")
    return out


def write_as(conn, pid: int, address: int, nbytes: int, drop: bool) -> None:
    """Tries one cross-memory write of `nbytes` into process `pid` at `address`, as nobody when
    `drop`; sends back (outcome, errno, message)."""
    from moecomm.errors import PeerLostError
    from moecomm.wire.kv import cma

    if drop:
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    src = torch.ones(nbytes, dtype=torch.uint8)
    try:
        cma.write(pid, [(src.data_ptr(), address, nbytes)])
        conn.send(("ok", 0, ""))
    except cma.CmaError as exc:
        conn.send(("CmaError", exc.errno, str(exc)))
    except PeerLostError as exc:
        conn.send(("PeerLostError", 0, str(exc)))


def serve(conn, layout_dict: dict, seed: int, tensors: str = "", transport: str = "shm") -> None:
    """Answers commands until "exit": info, connect, expect, send, send_layers, wait. The pool
    lives on `transport`: "shm" or "nixl" (its own NIXL agent)."""
    if transport == "nixl":
        from moecomm.wire.nixl import open_nixl_transport

        transport = open_nixl_transport()
    else:
        transport = ShmTransport()
    layout = KvLayout.from_dict(layout_dict)
    pool = KvPool(transport, layout, tensors=engine_tensors(layout, tensors) if tensors else None)
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
            elif cmd == "drop_privileges":  # keeps its mappings, loses the right to write peers
                os.setresgid(NOBODY, NOBODY, NOBODY)
                os.setresuid(NOBODY, NOBODY, NOBODY)
                conn.send(("ok", None))
            else:
                conn.send(("error", f"unknown command {cmd}"))
        except Exception as exc:  # the test reads the class and message
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    pool.close()
