"""Pairs of ranks of ``moecomm.compat.nixl_ep``: the connect handshake through the
``tcp_store_group`` and the control region that carries a pair's data-channel handles at its
first live round (docs/compat-nixl-ep.md, "Connecting").

**Connect** (``connect_ranks``, the only time the store is used). Every Buffer has an
*incarnation* (pid + random id), so keys left by an earlier process of the same rank (killed, or
removed by a scale-down, in a store that outlives it) are never taken for the live one's.
Rank ``a`` connecting to ``b`` (and ``b`` to ``a``, at about the same time):

1. ``a`` sets ``{prefix}/hello/a/b`` = its incarnation and the handle of the control region it
   made for ``b``;
2. once ``{prefix}/hello/b/a`` exists, ``a`` reads it and sets ``{prefix}/ack/a/b`` =
   ``"<inc a>/<inc b it read>"``;
3. ``a`` is done when ``{prefix}/ack/b/a`` names ``a``'s incarnation: ``b`` read ``a``'s current
   hello. If that ack names another incarnation of ``b`` than the hello ``a`` read (a stale
   hello of an earlier ``b``), ``a`` re-reads ``b``'s hello (``b`` sets it before its ack) and
   acks again. An ack naming an earlier incarnation of ``a`` is ignored.
4. Done, ``a`` deletes its own hello (``b`` read it) and ``b``'s ack (consumed): a completed
   handshake leaves no key behind.

**Control region** (one per direction of a pair, 4 KiB of the owner's memory, the peer writes
it): word 0 counts the messages written (the signal word; the transport keeps its sleeper count
in the next 8 bytes), bytes 16..23 hold the length of the last one, its JSON from byte 64. A
pair's data channels are sized from the first dispatch's shape, which is unknown at connect
time, and vLLM's ``destroy()`` clears the store (``set_tcp_store_group(None)``) while the Buffer
keeps serving, so the channel handles travel here, at the pair's first live round, not through
the store.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import torch

from moecomm.errors import DeadlineExceededError, ProtocolError
from moecomm.wire.transport import SignalOp, Transport, WaitOp
from moecomm.wire.views import region_bytes_view

__all__ = ["CONTROL_BYTES", "Control", "handshake", "new_incarnation"]

CONTROL_BYTES = 4096
_LENGTH = 16  # bytes 8..15 belong to the signal word: the shm transport counts its sleepers there
_PAYLOAD = 64
_POLL_S = 0.005


def new_incarnation() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _key(prefix: str, kind: str, a: int, b: int) -> str:
    return f"{prefix}/{kind}/{a}/{b}"


def handshake(
    store, prefix: str, rank: int, hellos: dict[int, dict], timeout: float
) -> dict[int, dict]:
    """Connects `rank` with every peer of `hellos` ({peer: our hello for it, with "inc"});
    returns {peer: its hello for us}. Raises moecomm.DeadlineExceededError naming the peers that
    did not answer within `timeout` seconds (our hellos to them are withdrawn)."""
    inc = {p: h["inc"] for p, h in hellos.items()}
    for p, hello in hellos.items():
        store.set(_key(prefix, "hello", rank, p), json.dumps(hello))
    seen: dict[int, dict] = {}
    done: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(hellos):
        for p in hellos:
            if p in done:
                continue
            theirs = _key(prefix, "hello", p, rank)
            if p not in seen:
                if not store.check([theirs]):
                    continue
                seen[p] = json.loads(store.get(theirs))
                store.set(_key(prefix, "ack", rank, p), f"{inc[p]}/{seen[p]['inc']}")
            ack = _key(prefix, "ack", p, rank)
            if not store.check([ack]):
                continue
            peer_inc, our_inc = store.get(ack).decode().split("/", 1)
            if our_inc != inc[p]:
                continue  # an ack of an earlier handshake: not for this Buffer
            if peer_inc != seen[p]["inc"]:  # we acked a stale hello: take the current one
                current = json.loads(store.get(theirs))
                if current["inc"] != peer_inc:
                    continue
                seen[p] = current
                store.set(_key(prefix, "ack", rank, p), f"{inc[p]}/{peer_inc}")
            done[p] = seen[p]
            store.delete_key(_key(prefix, "hello", rank, p))
            store.delete_key(ack)
        if len(done) == len(hellos):
            break
        if time.monotonic() > deadline:
            missing = sorted(set(hellos) - set(done))
            for p in missing:
                store.delete_key(_key(prefix, "hello", rank, p))
            raise DeadlineExceededError(
                f"nixl_ep.Buffer rank {rank}: connect_ranks: ranks {missing} did not connect "
                f"(call connect_ranks with this rank) within {timeout:.1f} s"
            )
        time.sleep(_POLL_S)
    return done


class Control:
    """One direction of a pair's control channel: our region (the peer writes into it) and the
    peer's (we write into it)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.region = transport.create_region(CONTROL_BYTES)
        self.peer = None
        self._sent = 0
        self._read = 0

    @property
    def handle(self) -> str:
        return self.region.handle

    def attach(self, handle: str) -> None:
        self.peer = self.transport.attach(handle)

    def send(self, message: dict) -> None:
        data = json.dumps(message).encode()
        if _PAYLOAD + len(data) > CONTROL_BYTES:
            raise ValueError(f"control message of {len(data)} bytes does not fit")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        size = torch.tensor([len(data)], dtype=torch.int64)
        self.transport.put(self.peer, _PAYLOAD, raw.data_ptr(), len(data))
        self.transport.put(self.peer, _LENGTH, size.data_ptr(), 8)
        self._sent += 1
        self.transport.signal(self.peer, 0, self._sent, SignalOp.SET)

    def receive(self, timeout: float) -> dict:
        """The peer's newest message not yet read. Raises moecomm.DeadlineExceededError, or
        moecomm.PeerLostError when the peer process dies meanwhile."""
        ns = max(int(timeout * 1e9), 1)
        self._read = self.transport.wait(
            self.region, 0, WaitOp.NOT_EQUAL, self._read, timeout_ns=ns, peer=self.peer
        )
        view = region_bytes_view(self.region)
        n = int(view[_LENGTH : _LENGTH + 8].view(torch.int64)[0])
        raw = bytes(view[_PAYLOAD : _PAYLOAD + max(0, min(n, CONTROL_BYTES - _PAYLOAD))].tolist())
        try:
            return json.loads(raw.decode())
        except ValueError as exc:
            raise ProtocolError(f"unreadable control message ({n} bytes): {raw!r}") from exc

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        self.region.close()
