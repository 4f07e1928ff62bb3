"""The combine of the DeepEP adapter's CUDA path (a mixin of ``_ll_device._Lane``): a handle
combined any number of times, at any time, each combine on its own sequence number.

The device kernels answer a request with the request's own sequence, from the server workspace
of its gather, into the response slot of its request slot. So the combine does not use them
as they were left: combine ``c`` of a lane uses slot ``j = c % 2`` and sequence
``COMBINE_SEQ_BASE + c + 1`` (the host path's combine sequence space, far above any dispatch
sequence):

- **respond** (server side): the handle's admitted entries (copied at its receive) are written
  into the entries of server workspace ``j`` at entry ``(client, j)``, re-stamped with that
  sequence and ``layer_id = j``, with their first step tokens and the handle's ``slot_of``;
  every other entry is idle. ``server_respond`` then answers each client in its response slot
  ``j``. Response slot ``j`` of a client is only ever written from workspace ``j``'s entry
  ``(client, j)``, so the cumulative arrival counter that entry keeps stays exact. (Its
  release of our request slot compares against this sequence and so leaves the request slot
  alone: a request slot is only ever overwritten by the next request, see ``_ll_device.py``.)
- **reduce** (client side): client workspace ``j`` gets the handle's per-server row counts and
  this sequence for every server the dispatch sent to; ``client_combine`` waits (no reduce
  launch) and the weighted sum is torch on the device (``combine_from_answers``), from the
  handle's row map.

Nothing here reads the device from the host: the statuses of a combine are checked at the next
receive of its lane, where the host synchronises anyway.
"""

from __future__ import annotations

import torch

import moecomm.cuda
from moecomm import _C
from moecomm.compat._ll_device_ops import (
    DeviceHandle,
    combine_from_answers,
    expert_rows,
    part,
)
from moecomm.compat._ll_support import COMBINE_SEQ_BASE, NUM_SLOTS
from moecomm.errors import PeerLostError, ProtocolError, TimeoutError

# EntryState (dispatch_index.h): int32 action, code, num_tokens, topk, layer_id, reserved; u64 seq.
ENTRY_WORDS = 8
ENTRY_LAYER_WORD = 4
ENTRY_SEQ_QWORD = 3  # the u64 seq as the 4th int64 of the 32-byte entry
# client_dispatch.cuh's kBusySeq (all ones: a server skipped because its slot was busy), as the
# int64 the workspace's u64 reads as.
BUSY_SEQ = -1


def combine_seq(c: int) -> tuple[int, int]:
    """(response slot, sequence) of combine `c` of a lane."""
    return c % NUM_SLOTS, COMBINE_SEQ_BASE + c + 1


class LaneCombine:
    """Needs the lane's ``path``, ``peers``, configs (``scfg``, ``ccfg``), workspaces (``s_ws``,
    ``c_ws`` and their layouts), ``expert_out``, the response ring geometry and
    ``num_combines`` / ``pending_status``."""

    def respond(self, y: torch.Tensor, handle: DeviceHandle, stream) -> tuple[int, int]:
        """Answers every client with `y`'s rows of `handle`; returns the (slot, seq) used."""
        k, nr = self.path.k, self.path.buf.num_ranks
        slot, seq = combine_seq(self.num_combines)
        self.num_combines += 1
        ws, lay = self.s_ws[slot], self.s_layout
        entries = part(ws, lay, "entries", torch.int32, nr * NUM_SLOTS * ENTRY_WORDS)
        entries = entries.view(nr, NUM_SLOTS, ENTRY_WORDS)
        entries.zero_()  # idle: respond skips them
        mine = entries[:, slot]
        mine.copy_(handle.entries)
        mine[:, ENTRY_LAYER_WORD] = slot
        mine.view(torch.int64)[:, ENTRY_SEQ_QWORD] = seq
        first = part(ws, lay, "batch_offsets", torch.int64, nr * NUM_SLOTS + 1)
        first[: nr * NUM_SLOTS].view(nr, NUM_SLOTS)[:, slot].copy_(handle.first)
        part(ws, lay, "slot_of", torch.int64, self.max_rows).copy_(handle.slot_of)
        expert_rows(y, handle.expert, handle.pos, handle.valid, self.expert_out)
        ra = k.ServerRespondArgs()
        ra.expert_out, ra.expert_out_dtype = self.expert_out.data_ptr(), int(_C.Encoding.BF16)
        ra.workspace = ws.data_ptr()
        k.server_respond(self.peers, self.scfg, ra, stream.cuda_stream)
        return slot, seq

    def reduce(
        self, handle: DeviceHandle, slot: int, seq: int, topk_idx, weights, out, use_logfmt, stream
    ) -> None:
        """Waits for the answers of combine (slot, seq) and sums them into `out`."""
        k, buf = self.path.k, self.path.buf
        nr = buf.num_ranks
        ws, lay = self.c_ws[slot], self.c_layout
        # Servers the dispatch sent nothing to (0, or the kernels' busy mark) stay so; every
        # other one is waited for with this combine's sequence.
        sent = handle.sent_seq
        was_sent = (sent != 0) & (sent != BUSY_SEQ)
        part(ws, lay, "sent_seq", torch.int64, nr).copy_(torch.where(was_sent, seq, sent))
        part(ws, lay, "count", torch.int32, nr).copy_(handle.count)
        ca = k.CombineArgs()
        ca.num_tokens, ca.layer_id, ca.slot = 0, slot, slot  # wait only: we reduce below
        ca.workspace, ca.out, ca.out_dtype = ws.data_ptr(), 0, int(_C.Encoding.BF16)
        # Scaled like every device deadline (a sanitizer or debugger slows the server down).
        ca.timeout_ns = int(buf.timeout * 1e9 * moecomm.cuda.deadline_scale())
        k.client_combine(self.peers, self.ccfg, ca, stream.cuda_stream)
        h = self.shape.hidden
        start = self.resp_base + _C.slot_offset(self.resp_slot_bytes, slot) + _C.PAYLOAD_OFFSET
        answers = torch.as_strided(
            self.region_bytes.view(torch.bfloat16),
            (nr, self.max_tokens, h),
            (self.resp_ring // 2, h, 1),
            start // 2,
        )
        combine_from_answers(
            answers, handle.rows_at, topk_idx, weights, self.num_local, out, use_logfmt
        )
        status = part(ws, lay, "status", torch.int32, nr)
        self.pending_status.append((handle.index, status.clone()))

    def check_statuses(self) -> None:
        """Raises for a combine whose wait failed (read where the host synchronised anyway)."""
        pending, self.pending_status = self.pending_status, []
        names = {v: n for n, v in self.path.k.SERVER_STATUS.items()}
        errors = {"PEER_LOST": PeerLostError, "TIMEOUT": TimeoutError}
        errors["PAYLOAD_TIMEOUT"] = TimeoutError
        for index, status in pending:
            for q, code in enumerate(status.tolist()):
                name = names.get(code, str(code))
                if name not in ("OK", "NOT_SENT"):
                    raise errors.get(name, ProtocolError)(
                        f"deep_ep.Buffer rank {self.path.buf.rank}: a combine of dispatch "
                        f"{index} got no valid answer from rank {q} ({name}); its output was "
                        "wrong"
                    )
