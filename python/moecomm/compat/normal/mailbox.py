"""Byte packages between the ranks of DeepEP's normal mode (``mode.py``) and of its
``ElasticBuffer`` (``compat/elastic.py``): a list of tensors packed into one byte tensor, and a
:class:`Mailbox` that runs an all-to-all of such packages over moecomm's stage channels (one
sender/receiver pair per ordered pair of ranks, receivers sharing one doorbell), interleaving
sends with receives so that no two ranks block each other on full rings. Every wait has a
deadline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch

from moecomm.errors import DeadlineExceededError, PeerLostError, ProtocolError
from moecomm.wire.channel import DEFAULT_TIMEOUT_S
from moecomm.wire.stage import INBOX_SLICE_S, StageInbox, StageReceiver, StageSender, stage_layout
from moecomm.wire.transport import Transport

__all__ = ["DEFAULT_TIMEOUT_S", "Mailbox", "pack", "unpack"]

# One chunk = 256 rows of 2048 bf16 = 1 MiB; 4 chunks in flight per ordered pair of ranks.
CHUNK_ROWS, CHUNK_HIDDEN, NUM_SLOTS = 256, 2048, 4
_ALIGN = 16
# While sends wait for acks (acks do not ring our doorbell), sleep at most this long.
_ACK_POLL_S = 0.0005


# ------------------------------------------------------------------------ byte packages
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack(tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """One uint8 tensor holding `tensors` (``None`` kept as ``None``): an 8-byte length, a JSON
    list of (dtype, shape), then each tensor's bytes, every part 16-byte aligned."""
    meta = [None if t is None else [_dtype_name(t.dtype), list(t.shape)] for t in tensors]
    head = json.dumps(meta).encode()
    parts, size = [], 8 + len(head)
    size += -size % _ALIGN
    offsets = []
    for t in tensors:
        if t is None:
            offsets.append(None)
            continue
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        offsets.append(size)
        parts.append((size, raw))
        size += raw.numel()
        size += -size % _ALIGN
    out = torch.zeros(max(size, _ALIGN), dtype=torch.uint8)
    out[:8] = torch.tensor([len(head)], dtype=torch.int64).view(torch.uint8)
    out[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    for off, raw in parts:
        out[off : off + raw.numel()] = raw
    return out


def unpack(data: torch.Tensor) -> list[torch.Tensor | None]:
    """The tensors of :func:`pack` (views into `data`, which the caller owns)."""
    n = int(data[:8].view(torch.int64)[0])
    meta = json.loads(bytes(data[8 : 8 + n].tolist()).decode())
    off = 8 + n
    off += -off % _ALIGN
    out: list[torch.Tensor | None] = []
    for m in meta:
        if m is None:
            out.append(None)
            continue
        dtype, shape = getattr(torch, m[0]), m[1]
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        if nbytes == 0:
            out.append(torch.empty(shape, dtype=dtype))
        else:
            out.append(data[off : off + nbytes].view(dtype).view(shape))
        off += nbytes
        off += -off % _ALIGN
    return out


# ------------------------------------------------------------------------ transport
class Mailbox:
    """All-to-all of byte packages between `num_ranks` processes over the slot protocol."""

    def __init__(
        self,
        rank: int,
        num_ranks: int,
        exchange: Callable[[dict], list],
        transport: Transport,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        num_slots: int = NUM_SLOTS,
        name: str = "deep_ep normal mode",
    ) -> None:
        self.rank, self.num_ranks, self.timeout, self.name = rank, num_ranks, timeout, name
        self.transport = transport
        layout = stage_layout(CHUNK_ROWS, CHUNK_HIDDEN, "bf16")
        self.senders: dict[int, StageSender] = {}
        self.receivers: dict[int, StageReceiver] = {}
        self.inbox = StageInbox(transport)
        self._tag = 0
        try:
            for p in range(num_ranks):
                if p == rank:
                    continue
                self.senders[p] = StageSender(
                    transport, layout, rank, num_slots, f"{name} {rank}->{p}"
                )
                self.receivers[p] = StageReceiver(
                    transport, layout, p, num_slots, f"{name} {p}->{rank}"
                )
                self.inbox.add(p, self.receivers[p])
            self.capacity = layout.request_slot_bytes  # upper bound, refined below
            if self.senders:
                self.capacity = next(iter(self.senders.values())).capacity
            mine = {
                "send": {str(p): s.handle for p, s in self.senders.items()},
                "recv": {str(p): r.handle for p, r in self.receivers.items()},
                "doorbell": self.inbox.doorbell_handle,
            }
            infos = exchange(mine)
            if len(infos) != num_ranks:
                raise ProtocolError(f"{name}: the exchange returned {len(infos)} entries")
            me = str(rank)
            for p in self.senders:
                self.senders[p].connect(infos[p]["recv"][me], infos[p]["doorbell"])
                self.receivers[p].connect(infos[p]["send"][me])
        except BaseException:
            self.close()
            raise

    def all_to_all(self, packages: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sends ``packages[p]`` (uint8) to rank ``p`` and returns the package of every rank,
        by rank (our own is returned as given). Every rank must call it, in the same order."""
        tag = self._tag
        self._tag = (self._tag + 1) & 0xFFFFFFFF
        deadline = time.monotonic() + self.timeout
        out: dict[int, torch.Tensor] = {self.rank: packages[self.rank]}
        todo = {}  # peer -> [package, next chunk, chunk count]
        for p in self.senders:
            raw = packages[p].contiguous().view(torch.uint8).reshape(-1)
            if raw.numel() == 0:
                raw = torch.zeros(_ALIGN, dtype=torch.uint8)
            todo[p] = [raw, 0, -(-raw.numel() // self.capacity)]
        waiting = set(self.receivers)
        while todo or waiting:
            progress = False
            for p in list(todo):
                raw, i, count = todo[p]
                s = self.senders[p]
                while i < count and s.next_slot_free(deadline):
                    piece = raw[i * self.capacity : (i + 1) * self.capacity]
                    s.send_chunk(tag, i, count, piece)
                    i += 1
                    progress = True
                if i == count:
                    del todo[p]
                else:
                    todo[p][1] = i
            if self.inbox.take_arrived():
                progress = True
            for p in list(waiting):
                got = self.inbox.ready.pop((p, tag), None)
                if got is not None:
                    out[p] = got[1]
                    waiting.discard(p)
            if progress or not (todo or waiting):
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceededError(
                    f"{self.name} rank {self.rank}, call {tag}: no package from ranks "
                    f"{sorted(waiting)} and unacknowledged chunks to ranks {sorted(todo)} "
                    f"within {self.timeout:.1f} s"
                )
            slice_s = _ACK_POLL_S if todo else INBOX_SLICE_S
            try:
                self.inbox.pump(min(remaining, slice_s))
            except PeerLostError as exc:
                raise PeerLostError(f"{self.name} rank {self.rank}, call {tag}: {exc}") from exc
            for p in todo:
                if not self.transport.peer_alive(self.senders[p].receiver):
                    raise PeerLostError(f"{self.name} rank {self.rank}, call {tag}: rank {p} died")
        # Chunks not yet acknowledged stay pending: their slots are checked before reuse.
        return [out[p] for p in range(self.num_ranks)]

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
        self.inbox.close()
