"""What the KV transfer tests share: the layouts they use, a pool in another process
(:class:`Peer`, driving kv_peer_proc.serve over a pipe), the sender's KV rebuilt locally, and
the bit-exact comparison."""

from __future__ import annotations

import contextlib

import torch
from kv_peer_proc import fill, serve
from moecomm import prefork
from moecomm.wire.kv import KvLayout, KvPool
from moecomm.wire.shm import ShmTransport

# Two layers of K and V, 1.5 KiB per part and block; a prefill pool smaller than the decode pool
# (the layouts agree on everything but the block count).
LAYERS = 2
PARTS = {"k": (2, 4, 96), "v": (2, 4, 96)}
SENDER_BLOCKS = 24
RECEIVER_BLOCKS = 40
SEED = 1234
# Generous for a loaded 2-core machine; a dead peer must end a wait far sooner (checked).
START_TIMEOUT_S = 120.0
WAIT_S = 20.0
# A killed peer is noticed through its life word at once; this bounds "at once" on a busy host.
DEATH_NOTICE_S = 5.0


def layout(num_blocks: int) -> KvLayout:
    return KvLayout.paged(LAYERS, num_blocks, torch.bfloat16, PARTS)


class Peer:
    """A pool in a spawned process (kv_peer_proc.serve), killed at teardown if still there.
    `tensors`: "" (the library allocates the pool) or an engine tensor layout of
    kv_peer_proc.engine_tensors; `transport`: "shm" or "nixl"."""

    def __init__(self, num_blocks: int, seed: int, tensors: str = "", transport: str = "shm"):
        ctx = prefork.process_context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=serve, args=(child, layout(num_blocks).to_dict(), seed, tensors, transport)
        )
        self.proc.start()
        if not self.conn.poll(START_TIMEOUT_S):
            raise AssertionError("the peer process did not start in time")
        tag, self.info = self.conn.recv()
        assert tag == "ready"

    def call(self, *cmd, timeout: float = WAIT_S):
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise AssertionError(f"the peer did not answer {cmd[0]} within {timeout} s")
        tag, value = self.conn.recv()
        if tag != "ok":
            raise RuntimeError(value)
        return value

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()  # a forked one may be reaped already
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit",))
            self.proc.join(10)
        self.kill()


def reference(seed: int, num_blocks: int) -> KvPool:
    """The sender's KV rebuilt locally (same seed), to compare against."""
    p = KvPool(ShmTransport(), layout(num_blocks))
    fill(p, seed)
    return p


def assert_blocks_equal(dst_pool, dst, src_pool, src, layers=range(LAYERS)) -> None:
    for layer in layers:
        for part in PARTS:
            got = dst_pool.view(layer, part)[dst].view(torch.int16)
            want = src_pool.view(layer, part)[src].view(torch.int16)
            assert torch.equal(got, want), f"layer {layer} part {part} differs"
