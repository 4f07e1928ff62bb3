"""The host path of ``deep_ep.Buffer`` (CPU tensors over the shm transport), a mixin of
:class:`~moecomm.compat.low_latency.buffer.Buffer` whose state it uses (see
``moecomm.compat.deep_ep`` for the contract): the request rounds (waiting for every live rank's
request of a round, masking a rank that does not arrive with ``enable_shrink``: DeepEP's
semantics), DeepEP's ``clean_low_latency_buffer`` (a barrier round) and mask-buffer API, writing
a round's requests, laying the received copies out per local expert, and reducing the answers.

A round is a dispatch or a clean: round ``n`` uses request slot ``n % 2`` with sequence
``n + 1`` on every rank (set per round, so it stays agreed whoever was masked).
"""

from __future__ import annotations

import contextlib
import time

import torch

from moecomm import _C
from moecomm._C import Encoding
from moecomm.compat.low_latency.cast import UE8M0_PACK, deepep_cast, logfmt_roundtrip, pack_ue8m0
from moecomm.compat.low_latency.layout import (
    NUM_SLOTS,
    LowLatencyHandle,
    check_mask_tensor,
    receive_layout,
    reduce_answers,
)
from moecomm.compat.low_latency.replicas import drop_masked
from moecomm.errors import DeadlineExceededError, PeerLostError, PeerOfflineError, ProtocolError
from moecomm.ops.dispatch import pack_dispatch
from moecomm.wire.shm import reap_stale_segments
from moecomm.wire.transport import WaitStatus

__all__ = ["PEER_FAILURES", "HostPath", "naming_peer", "wait_request"]

PEER_FAILURES = (DeadlineExceededError, PeerLostError, PeerOfflineError)


@contextlib.contextmanager
def naming_peer(rank: int, peer: int, what: str):
    """Re-raises a wait's DeadlineExceededError / PeerLostError naming both ranks and what was
    awaited."""
    try:
        yield
    except (DeadlineExceededError, PeerLostError) as exc:
        raise type(exc)(
            f"deep_ep.Buffer rank {rank}: waiting for the {what} of rank {peer}: {exc}"
        ) from exc


def wait_request(server, slot: int, seq: int, deadline: float):
    """The request of round `seq` in `slot` of `server`. An older round's request still sitting
    there (a dispatch that was never combined: its slot is reused two rounds later, as DeepEP's
    buffers are) is skipped, whatever its header holds, until the peer overwrites it."""
    while True:
        for req in server.poll():
            if req.slot == slot and req.seq >= seq:
                return req
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceededError(f"{server.name}: no request of round {seq} in slot {slot}")
        status, _ = _C.wait_doorbell(
            server.transport, server.region, server._doorbell, int(remaining * 1e9), server.client
        )
        if status == WaitStatus.PEER_LOST:
            reap_stale_segments()
            raise PeerLostError(f"{server.name}: the process died ({server.client.describe()})")


def _widen(t: torch.Tensor, k: int, fill: float) -> torch.Tensor:
    """[n, w] -> [n, k] (k >= w), the new columns `fill`."""
    w = t.shape[1]
    return t if w == k else torch.nn.functional.pad(t, (0, k - w), value=fill)


class HostPath:
    """Buffer's host-transport rounds, dispatch and combine. Needs ``rank``, ``num_ranks``,
    ``timeout``, ``enable_shrink``, ``shape``, ``_mask``, ``_num_rounds``, ``_mode``,
    ``_servers``, ``_clients``, ``_check_ll``, ``_check_open``."""

    def _live(self, p: int) -> bool:
        return not (self.enable_shrink and int(self._mask[p]))

    def _peer_failed(self, p: int, exc: BaseException) -> None:
        """Shrink mode masks a rank that timed out or died (DeepEP's semantics); else raise."""
        if not self.enable_shrink:
            raise exc
        self._mask[p] = 1

    def _wait_round(self, rnd: int, what: str, cost=None) -> list:
        """Every live rank's request of round `rnd` (None for a masked or failed rank)."""
        slot, seq = rnd % NUM_SLOTS, rnd + 1
        deadline = time.monotonic() + self.timeout
        reqs: list = []
        for p, server in enumerate(self._servers):
            if not self._live(p):
                reqs.append(None)
                continue
            t0 = time.monotonic_ns()
            try:
                with naming_peer(self.rank, p, what):
                    req = wait_request(server, slot, seq, deadline)
            except PEER_FAILURES as exc:
                self._peer_failed(p, exc)
                reqs.append(None)
                continue
            if cost is not None:
                cost[p] += time.monotonic_ns() - t0
            if not req.valid or req.seq != seq:
                raise ProtocolError(
                    f"deep_ep.Buffer rank {self.rank}: request of rank {p} in slot {slot} is "
                    f"invalid or out of sequence (code {req.code}, seq {req.seq}, expected {seq})"
                )
            reqs.append(req)
        return reqs

    # ------------------------------------------------------------------ clean, shrink masks
    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """DeepEP's clean: a barrier of the live ranks (a request round carrying nothing). There
        is nothing to zero here; like DeepEP's, it masks a rank that does not arrive (shrink)."""
        self._check_ll()
        if self._mode == "cuda" or self.shape is None:
            return  # nothing set up yet (or the device lanes, which hold nothing to reset)
        s = self.shape
        if (num_max_dispatch_tokens_per_rank, hidden, num_experts) != (
            s.num_max_dispatch_tokens_per_rank,
            s.hidden,
            s.num_experts,
        ):
            raise ValueError(f"this buffer was set up for {s.describe()}")
        rnd = self._num_rounds
        self._num_rounds += 1
        slot, seq = rnd % NUM_SLOTS, rnd + 1
        act = torch.zeros(1, s.hidden, dtype=torch.bfloat16)
        ids, scores = torch.full((1, 1), -1, dtype=torch.int32), torch.zeros(1, 1)
        sent_to = []
        for q, client in enumerate(self._clients):
            if self._live(q):
                client._next_seq = seq
                client.send(slot, act, ids, scores, encoding=Encoding.BF16, wake=False)
                sent_to.append(client)
        for client in sent_to:
            client.ring()
        self._wait_round(rnd, "clean barrier")

    def _check_shrink(self) -> None:
        self._check_open()
        if not self.enable_shrink:
            raise RuntimeError("Shrink mode must be enabled (Buffer(..., enable_shrink=True))")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (``mask=True``) or unmasks a rank: no data to or from it."""
        self._check_shrink()
        if not 0 <= rank_to_mask < self.num_ranks:
            raise ValueError(f"rank_to_mask must be in [0, {self.num_ranks}), got {rank_to_mask}")
        self._mask[rank_to_mask] = int(bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes the mask of every rank into ``mask_status`` (int32 ``[num_ranks]``, 1 =
        masked)."""
        self._check_shrink()
        check_mask_tensor(mask_status, self.num_ranks)
        mask_status.copy_(self._mask.to(mask_status.device))

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank."""
        self._check_shrink()
        self._mask.zero_()

    # ------------------------------------------------------------------ dispatch

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
