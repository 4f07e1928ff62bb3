"""The host path of ``deep_ep.Buffer`` (CPU tensors over the shm transport): writing a round's
requests, laying the received copies out per local expert, and reducing the answers. A mixin of
:class:`moecomm.compat.deep_ep.Buffer`, whose state it uses; see deep_ep.py for the contract.
"""

from __future__ import annotations

import time

import torch

from moecomm._C import Encoding
from moecomm.compat._ll_cast import UE8M0_PACK, deepep_cast, logfmt_roundtrip, pack_ue8m0
from moecomm.compat._ll_layout import (
    receive_layout,
    reduce_answers,
)
from moecomm.compat._ll_replicas import drop_masked
from moecomm.compat._ll_support import (
    NUM_SLOTS,
    PEER_FAILURES,
    LowLatencyHandle,
    naming_peer,
)
from moecomm.errors import ProtocolError
from moecomm.ops.dispatch import pack_dispatch


def _widen(t: torch.Tensor, k: int, fill: float) -> torch.Tensor:
    """[n, w] -> [n, k] (k >= w), the new columns `fill`."""
    w = t.shape[1]
    return t if w == k else torch.nn.functional.pad(t, (0, k - w), value=fill)


class HostPath:
    """Buffer's host-transport halves of dispatch and combine."""

    def _send_requests(self, x, topk_idx, rnd: int, use_fp8: bool, round_scale: bool):
        shape = self.shape
        t, k = topk_idx.shape
        num_local = self._num_local
        rows_total = self.num_ranks * shape.num_max_dispatch_tokens_per_rank
        enc = Encoding.FP8_E4M3_B128 if use_fp8 else Encoding.BF16
        batches = {}
        # Each expert's primary, else its first live replica (_ll_replicas); dest [T, K] rank.
        pick, dest, dropped = self._plan.route(topk_idx, self._mask.bool())
        self.dropped_copies += dropped
        if t:
            carried = torch.arange(t, dtype=torch.float32).unsqueeze(1).expand(t, k)
            # Packed in bf16 and cast per packed row: the cast is per row, so this is DeepEP's
            # cast of each token (once per destination rank, as its per-copy cast).
            for b in pack_dispatch(x, topk_idx, carried, self._plan.map, Encoding.BF16, pick):
                batches[b.server] = b
        handle = LowLatencyHandle(
            torch.full((num_local, rows_total), -1, dtype=torch.int32),
            torch.zeros(num_local, self.num_ranks, dtype=torch.int64),
            shape.num_max_dispatch_tokens_per_rank,
            shape.hidden,
            shape.num_experts,
        )
        handle.owner, handle.round, handle.topk_idx = id(self), rnd, topk_idx.clone()
        handle.dest = dest
        handle.sent_rows = []
        slot, seq = rnd % NUM_SLOTS, rnd + 1
        sent_to = []
        for q, client in enumerate(self._clients):
            b = batches.get(q)
            if not self._live(q):  # masked: DeepEP sends nothing to it
                handle.sent_rows.append(torch.empty(0, dtype=torch.int64))
                continue
            if b is None:  # nothing for rank q: one row whose experts are all elsewhere
                act = torch.zeros(1, shape.hidden, dtype=torch.bfloat16)
                ids = torch.full((1, k), -1, dtype=torch.int32)
                scores, rows = torch.zeros(1, k), torch.empty(0, dtype=torch.int64)
            else:
                act, ids, scores = b.activations, b.expert_ids, b.scores
                flat = b.token_index.unsqueeze(1) * k + torch.arange(k)
                rows = flat[b.expert_ids >= 0]
            scales = None
            if use_fp8:
                act, scales = deepep_cast(act, round_scale)
            # The request's seq is the round, the same on every rank whoever was skipped.
            client._next_seq = seq
            client.send(slot, act, ids, scores, scales=scales, encoding=enc, wake=False)
            handle.sent_rows.append(rows)
            sent_to.append(client)
        for client in sent_to:
            client.ring()
        return handle

    def _recv_tensors(self, slot: int, use_fp8: bool, use_ue8m0: bool = False):
        """The slot's reusable receive buffers (DeepEP's two low-latency buffers)."""
        key = (slot, use_fp8, use_ue8m0)
        if key not in self._recv_buffers:
            s = self.shape
            num_local = self._num_local
            rows = self.num_ranks * s.num_max_dispatch_tokens_per_rank
            if use_fp8:
                data = torch.empty(num_local, rows, s.hidden, dtype=torch.float8_e4m3fn)
                # Column-major in the last two dims, as DeepEP lays its scales out for TMA.
                if use_ue8m0:
                    n = s.hidden // (128 * UE8M0_PACK)
                    scales = torch.empty(num_local, n, rows, dtype=torch.int32).transpose(1, 2)
                else:
                    scales = torch.empty(num_local, s.hidden // 128, rows).transpose(1, 2)
                self._recv_buffers[key] = (data, scales)
            else:
                self._recv_buffers[key] = torch.empty(
                    num_local, rows, s.hidden, dtype=torch.bfloat16
                )
        return self._recv_buffers[key]

    def _receive(self, handle, recv_x, recv_count, stats, cost, use_fp8, use_ue8m0) -> None:
        if handle.requests is not None:
            return
        self._check_open()
        want = Encoding.FP8_E4M3_B128 if use_fp8 else Encoding.BF16
        reqs = self._wait_round(handle.round, "dispatch request", cost)
        for p, req in enumerate(reqs):
            if req is not None and req.encoding != want:
                raise ProtocolError(
                    f"deep_ep.Buffer rank {self.rank}: rank {p} dispatched {req.encoding.name}, "
                    f"this rank {want.name}: use_fp8 must agree on every rank"
                )
        live = [r for r in reqs if r is not None]
        # Each sender's request is as wide as its call's top-k (at most the slots'); laid out
        # together, narrower ones are padded with -1 ids, which keeps each row's (row, k)
        # order of copies, the order its answers go back in.
        k = max((r.expert_ids.shape[1] for r in live), default=1)
        num_local = self._num_local
        rows_per_expert = self.num_ranks * self.shape.num_max_dispatch_tokens_per_rank
        empty_ids, empty_sc = torch.empty(0, k, dtype=torch.int32), torch.empty(0, k)
        ids = [_widen(r.expert_ids, k, -1) if r is not None else empty_ids for r in reqs]
        carried = [_widen(r.scores, k, 0.0) if r is not None else empty_sc for r in reqs]
        lay = receive_layout(ids, carried, num_local, rows_per_expert)
        data = recv_x[0].view(torch.uint8) if use_fp8 else recv_x
        acts = torch.cat([r.activations.view(data.dtype) for r in live])
        # One gather per expert straight into its rows: the rows of an expert are contiguous
        # in the layout (index_copy_ / index_put_ measured 3x slower than index_select here).
        for e, (a, b) in enumerate(zip(lay.offsets[:-1], lay.offsets[1:], strict=True)):
            if b > a:
                torch.index_select(acts, 0, lay.src_token[a:b], out=data[e, : b - a])
        if use_fp8:
            scales = torch.cat([r.scales for r in live]).index_select(0, lay.src_token)
            if use_ue8m0:
                scales = pack_ue8m0(scales)
            recv_x[1][lay.expert, lay.pos] = scales
        src_info, layout_range = handle[0], handle[1]
        src_info[lay.expert, lay.pos] = lay.token_index.to(torch.int32)
        layout_range.copy_(lay.layout_range)
        recv_count.copy_(lay.counts)
        if stats is not None:
            stats += lay.counts
        for r in live:  # consumed into the receive buffers; only the copied metadata is kept
            r.activations = None
        handle.layout, handle.requests = lay, reqs

    # ------------------------------------------------------------------ combine
    def _reduce(self, handle, slot, seq, idx, weights, combined, cost, use_logfmt) -> None:
        self._check_open()
        s = self.shape
        parts, sent, got = [], [], []
        deadline = time.monotonic() + self.timeout
        for q, client in enumerate(self._clients):
            rows = handle.sent_rows[q]
            if not self._live(q):
                continue
            t0 = time.monotonic_ns()
            try:
                with naming_peer(self.rank, q, "combine answer"):
                    resp = client.wait(slot, seq, max(deadline - time.monotonic(), 0.0))
            except PEER_FAILURES as exc:
                self._peer_failed(q, exc)
                continue
            if cost is not None:
                cost[q] += time.monotonic_ns() - t0
            got.append(client)
            if rows.numel():
                if resp.num_tokens != rows.numel():
                    raise ProtocolError(
                        f"deep_ep.Buffer rank {self.rank}: rank {q} answered {resp.num_tokens} "
                        f"rows for {rows.numel()} copies"
                    )
                # LogFMT: the answer as DeepEP's receiver decodes it (the wire stays bf16).
                parts.append(logfmt_roundtrip(resp.activations) if use_logfmt else resp.activations)
                sent.append(rows)
        if self.enable_shrink and bool(self._mask.any()):  # copies on masked ranks count as -1
            idx = drop_masked(idx, handle.dest, self._mask.bool())
        # Copies the combine's topk_idx no longer selects (-1 now) are left out of the sum.
        keep = list(zip(parts, sent, strict=True))
        parts, sent = [], []
        flat_idx = idx.reshape(-1)
        for p, r in keep:
            ok = flat_idx[r] >= 0
            if bool(ok.all()):
                parts.append(p)
                sent.append(r)
            elif bool(ok.any()):
                parts.append(p[ok])
                sent.append(r[ok])
        combined.copy_(reduce_answers(parts, sent, idx, weights, s.hidden, self._scratch))
        for client in got:  # summed out of the response slots: released
            client.release(slot)

    # ------------------------------------------------------------------ lifetime, errors
