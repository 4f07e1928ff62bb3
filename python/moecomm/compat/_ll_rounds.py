"""Request rounds and shrink mode of the DeepEP-shaped adapter's host path (a mixin of
``deep_ep.Buffer``): waiting for every live rank's request of a round, masking a rank that does
not arrive (``enable_shrink``, DeepEP's semantics), DeepEP's ``clean_low_latency_buffer`` (a
barrier round) and its mask-buffer API.

A round is a dispatch or a clean: round ``n`` uses request slot ``n % 2`` with sequence
``n + 1`` on every rank (set per round, so it stays agreed whoever was masked)."""

from __future__ import annotations

import time

import torch

from moecomm._C import Encoding
from moecomm.compat._ll_support import (
    NUM_SLOTS,
    PEER_FAILURES,
    check_mask_tensor,
    naming_peer,
    wait_request,
)
from moecomm.errors import ProtocolError


class RoundsMixin:
    """Needs ``rank``, ``num_ranks``, ``timeout``, ``enable_shrink``, ``shape``, ``_mask``,
    ``_num_rounds``, ``_mode``, ``_servers``, ``_clients``, ``_check_ll``, ``_check_open``."""

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
