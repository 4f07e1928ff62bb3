"""What NIXL-EP's C++ runtime (``nixl_ep_cpp.Buffer``) is to its Python ``Buffer``, over
moecomm: rank capacity and mask, connections added and removed at run time, and the low-latency
dispatch / combine on CPU tensors through :class:`~moecomm.compat.nixl_ep_impl.engine.Engine`
(``deep_ep.Buffer``'s host path). ``moecomm.compat.nixl_ep.Buffer`` owns one; see
docs/compat-nixl-ep.md for the semantics.

NIXL-EP's rank bound: a call's ``num_experts`` (default: the active bound, the highest unmasked
rank + 1, times ``num_experts_per_rank``) sets ``rank_bound``; the receive tensors are
``[L, rank_bound * M, H]``. The engine always works at the full capacity ``R``; rows of one
dispatch never pass ``rank_bound * M`` (only live ranks, all below the bound, send), so a bound
below ``R`` is served by copying the first ``rank_bound * M`` rows into tensors of NIXL-EP's
shape (and the combine's input back into the engine's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time

import torch

from moecomm.compat.api import NUM_MAX_NVL_PEERS
from moecomm.compat.low_latency.host import PEER_FAILURES
from moecomm.compat.low_latency.layout import (
    LLShape,
    check_cost_stats,
    check_dispatch_inputs,
    check_host,
    check_peer_agrees,
)
from moecomm.compat.low_latency.replicas import ReplicaPlan, check_replicas_arg
from moecomm.compat.nixl_ep_impl.engine import Engine
from moecomm.compat.nixl_ep_impl.pairs import CONTROL_BYTES, Control, handshake, new_incarnation
from moecomm.wire.shm import ShmTransport

__all__ = ["Handle", "Runtime", "refuse_cuda", "size_hint"]

# The slots are sized at the first dispatch for top-k up to this (or the first dispatch's, if
# larger): the largest top-k the low-latency kernels of the DeepEP family accept (their
# kNumMaxTopK is 9 to 11 across forks). vLLM keeps one NIXL-EP buffer for every MoE layer, so
# a later layer may route to more experts than the first; re-sizing would need a rendezvous of
# every rank, which a changing rank set has none of. Ids and scores cost 8 bytes per top-k per
# token in a slot, nothing beside the activations.
SLOT_TOPK = 11


def size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int):
    """Bytes of shared memory one rank maps at this shape (top-8) with every rank connected:
    deep_ep.Buffer's rings, and the control regions of every pair."""
    rings = Engine.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts
    )
    return rings + 2 * CONTROL_BYTES * (num_ranks - 1)


def _receive_hook(inner_hook, then, return_recv_hook: bool):
    """A call's receive hook: the engine's hook (if any), then `then`, once. Without
    ``return_recv_hook`` it runs now and there is no hook (None)."""
    done: list[bool] = []

    def finish() -> None:
        if done:
            return
        if inner_hook is not None:
            inner_hook()
        then()
        done.append(True)

    if not return_recv_hook:
        finish()
        return None
    return finish


def refuse_cuda(method: str, **tensors) -> None:
    cuda = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_cuda]
    if cuda:
        raise NotImplementedError(
            f"nixl_ep.Buffer.{method} on CUDA tensors ({', '.join(cuda)}) is not implemented by "
            "moecomm: NIXL-EP's kernels skip masked ranks and add ranks at run time on the "
            "device; moecomm's device path (moecomm.compat.deep_ep on CUDA) has neither masks nor "
            "a changing rank set. Give CPU tensors (the host transport)"
        )


class Handle(tuple):
    """NIXL-EP's dispatch handle ``(src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden)``, plus (as attributes) the engine's handle and the call's rank bound."""

    def __new__(cls, src_info, layout_range, num_max, hidden):
        return super().__new__(cls, (src_info, layout_range, num_max, hidden))

    owner: object
    inner: tuple
    rank_bound: int


class _Pair:
    def __init__(self, peer: int, incarnation: str, control: Control) -> None:
        self.peer, self.incarnation, self.control = peer, incarnation, control
        self.ready = False  # data channels connected (at the pair's first live round)


class Runtime:
    """Rank ``rank``'s state; ``update_memory_buffers`` makes the engine."""

    def __init__(
        self,
        rank: int,
        timeout: float,
        connect_timeout: float,
        store_prefix: str,
        replicas: dict[int, list[int]] | None,
    ) -> None:
        self.rank, self.timeout, self.connect_timeout = rank, timeout, connect_timeout
        self.store_prefix, self.replicas = store_prefix, replicas
        self.incarnation = new_incarnation()
        self.engine: Engine | None = None
        self.num_ranks = 0  # rank capacity (update_memory_buffers' num_ranks)
        self.num_experts_per_rank = 0
        self.pairs: dict[int, _Pair] = {}
        self._transport = None
        self._bounded: dict = {}
        self._padded: torch.Tensor | None = None

    # ------------------------------------------------------------------ memory, membership
    def update_memory_buffers(self, num_ranks: int, num_experts_per_rank: int) -> None:
        if self.engine is not None:
            raise RuntimeError("Multiple calls to update_memory_buffers are not supported")
        for name, v in (("num_ranks", num_ranks), ("num_experts_per_rank", num_experts_per_rank)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not 0 <= self.rank < num_ranks:
            raise ValueError(f"rank {self.rank} is not below num_ranks={num_ranks}")
        spec = check_replicas_arg(self.replicas, False, True, num_ranks)
        ReplicaPlan(spec, num_ranks * num_experts_per_rank, num_ranks)  # checked now, not later
        self._transport = ShmTransport()
        engine = Engine(self.rank, num_ranks, self.timeout, spec, self._transport)
        self.engine, self.num_ranks = engine, num_ranks
        self.num_experts_per_rank = num_experts_per_rank

    def need(self, method: str) -> Engine:
        if self.engine is None:
            raise RuntimeError(f"nixl_ep.Buffer.{method}: call update_memory_buffers first")
        if self.engine.destroyed:
            raise RuntimeError(f"nixl_ep.Buffer.{method}: this Buffer was destroyed")
        return self.engine

    def _check_rank(self, method: str, p) -> int:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.num_ranks:
            raise ValueError(f"nixl_ep.Buffer.{method}: rank {p!r} not in [0, {self.num_ranks})")
        return p

    def connect(self, store, remote_ranks, activate: bool) -> None:
        eng = self.need("connect_ranks")
        ranks = [self._check_rank("connect_ranks", p) for p in remote_ranks]
        if not ranks:
            raise ValueError("nixl_ep.Buffer.connect_ranks: remote_ranks is empty")
        new = sorted({p for p in ranks if p != self.rank and p not in self.pairs})
        if new:
            if store is None:
                raise NotImplementedError(
                    "nixl_ep.Buffer.connect_ranks without a tcp_store_group is not implemented "
                    "by moecomm: NIXL-EP then fetches metadata from etcd; moecomm exchanges its "
                    "handles through a torch.distributed Store (Buffer(tcp_store_group=...) or "
                    "set_tcp_store_group)"
                )
            controls = {p: Control(self._transport) for p in new}
            try:
                hellos = {
                    p: {"inc": self.incarnation, "ctrl": c.handle} for p, c in controls.items()
                }
                got = handshake(store, self.store_prefix, self.rank, hellos, self.connect_timeout)
                for p in new:
                    controls[p].attach(got[p]["ctrl"])
            except BaseException:
                for c in controls.values():
                    c.close()
                raise
            for p in new:
                self.pairs[p] = _Pair(p, got[p]["inc"], controls[p])
        if activate:
            for p in ranks:
                if p != self.rank:
                    eng.set_masked(p, False)

    def disconnect(self, remote_ranks) -> None:
        eng = self.need("disconnect_ranks")
        ranks = [self._check_rank("disconnect_ranks", p) for p in remote_ranks]
        for p in ranks:
            if p == self.rank:
                raise ValueError("nixl_ep.Buffer.disconnect_ranks: cannot disconnect this rank")
            if p not in self.pairs:
                raise ValueError(f"nixl_ep.Buffer.disconnect_ranks: rank {p} is not connected")
        for p in ranks:
            eng.set_masked(p, True)
            eng.close_pair(p)
            self.pairs.pop(p).control.close()

    def connected(self, p: int) -> bool:
        return p == self.rank or p in self.pairs

    # ------------------------------------------------------------------ mask
    def update_mask(self, rank: int, mask: bool) -> None:
        eng = self.need("update_mask_buffer")
        self._check_rank("update_mask_buffer", rank)
        if mask and rank == self.rank:
            raise ValueError("nixl_ep.Buffer.update_mask_buffer: cannot mask the local rank")
        if not mask and not self.connected(rank):
            raise ValueError(
                f"nixl_ep.Buffer.update_mask_buffer: cannot unmask rank {rank}: not connected"
            )
        eng.set_masked(rank, mask)

    def query_mask(self, mask_status: torch.Tensor) -> None:
        eng = self.need("query_mask_buffer")
        if not isinstance(mask_status, torch.Tensor) or mask_status.dtype != torch.int32:
            raise TypeError("mask_status must be a torch.int32 tensor, as in NIXL-EP")
        if mask_status.numel() != self.num_ranks:
            raise ValueError(
                f"mask_status must hold num_ranks={self.num_ranks} entries, got "
                f"{mask_status.numel()}"
            )
        mask_status.copy_(eng.mask_state().view(mask_status.shape).to(mask_status.device))

    def clean_mask(self) -> None:
        eng = self.need("clean_mask_buffer")
        for p in range(self.num_ranks):
            eng.set_masked(p, not self.connected(p))

    def active_rank_bound(self) -> int:
        live = (self.engine.mask_state() == 0).nonzero().flatten()
        return int(live.max()) + 1

    def rank_bound(self, num_experts) -> int:
        """NIXL-EP's: ``num_experts`` / L, between the active bound and the capacity."""
        active = self.active_rank_bound()
        if num_experts is None:
            return active
        per = self.num_experts_per_rank
        lo, hi = active * per, self.num_ranks * per
        if isinstance(num_experts, bool) or not isinstance(num_experts, int):
            raise TypeError(f"num_experts must be an int or None, got {num_experts!r}")
        if num_experts % per or not lo <= num_experts <= hi:
            raise ValueError(
                f"num_experts={num_experts} must be a multiple of num_experts_per_rank={per} "
                f"in [{lo}, {hi}] (the active ranks' experts up to the capacity)"
            )
        return num_experts // per

    # ------------------------------------------------------------------ rounds
    def _live_peers(self) -> list[int]:
        return [p for p in sorted(self.pairs) if not self.engine.is_masked(p)]

    @contextlib.contextmanager
    def _round(self, combine: bool = False):
        """An engine call: pairs meeting for the first time are set up first (dispatch, barrier);
        the call is numbered solo when no peer is live."""
        eng = self.engine
        if not combine:
            new = [p for p in self._live_peers() if not self.pairs[p].ready]
            if new:
                self._meet(new)
        with eng.numbered(combine, solo=not self._live_peers()):
            yield

    def _meet(self, new: list[int]) -> None:
        """The first live round of these pairs: our channel handles and counters to each peer
        over its control region, theirs back; a peer that does not answer in time is masked."""
        eng = self.engine
        shape = eng.shape
        rounds, combines = eng.counters()
        common = {
            "shape": list(dataclasses.astuple(shape)),
            "replicas": hashlib.sha256(json.dumps(eng.plan.wire()).encode()).hexdigest(),
            "rounds": rounds,
            "combines": combines,
        }
        for p in new:
            self.pairs[p].control.send({**eng.open_pair(p), **common})
        deadline = time.monotonic() + self.timeout
        for p in new:
            try:
                got = self.pairs[p].control.receive(max(deadline - time.monotonic(), 0.0))
            except PEER_FAILURES as exc:
                eng.fail(p, exc)
                continue
            same_replicas = got["replicas"] == common["replicas"]
            check_peer_agrees(
                "nixl_ep.Buffer", self.rank, p, shape, LLShape(*got["shape"]), same_replicas
            )
            eng.connect_pair(p, got)
            self.pairs[p].ready = True
            rounds, combines = max(rounds, got["rounds"]), max(combines, got["combines"])
        eng.adopt(rounds, combines)

    # ------------------------------------------------------------------ dispatch
    def _start(self, call: str, async_finish: bool, return_recv_hook: bool, **tensors) -> Engine:
        """The engine of a data call after its common checks: set up, host `tensors` (CUDA
        ones refused by name), not both ``async_finish`` and ``return_recv_hook``."""
        eng = self.need(call)
        refuse_cuda(call, **tensors)
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set (NIXL-EP)")
        return eng

    def dispatch(
        self,
        x,
        topk_idx,
        num_max: int,
        num_experts,
        stats,
        cost,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        async_finish: bool,
        return_recv_hook: bool,
    ):
        eng = self._start(
            "dispatch",
            async_finish,
            return_recv_hook,
            x=x,
            topk_idx=topk_idx,
            cumulative_local_expert_recv_stats=stats,
            dispatch_wait_recv_cost_stats=cost,
        )
        rb = self.rank_bound(num_experts)
        capacity = self.num_ranks * self.num_experts_per_rank
        x, topk_idx = check_dispatch_inputs(
            x, topk_idx, num_max, rb * self.num_experts_per_rank, use_fp8
        )
        shape = LLShape(num_max, x.shape[1], capacity, topk_idx.shape[1])
        if eng.shape is None:
            slot_topk = max(shape.num_topk, min(SLOT_TOPK, capacity))
            eng.set_up(dataclasses.replace(shape, num_topk=slot_topk))
        elif shape.num_topk > eng.shape.num_topk:
            raise NotImplementedError(
                f"nixl_ep.Buffer.dispatch with top-{shape.num_topk}: the slots hold top-k up to "
                f"{eng.shape.num_topk} (sized at the first dispatch for up to {SLOT_TOPK}, the "
                "DeepEP-family kernels' limit); a larger top-k would re-size them in a "
                "rendezvous of every rank, which a changing rank set has none of"
            )
        check_cost_stats("dispatch_wait_recv_cost_stats", cost, rb)
        full_cost = None if cost is None else torch.zeros(self.num_ranks, dtype=torch.int64)
        with self._round():
            recv_x, count, inner, _, inner_hook = eng.low_latency_dispatch(
                x, topk_idx, num_max, capacity, stats, full_cost,
                use_fp8, round_scale, use_ue8m0, False, return_recv_hook,
            )  # fmt: skip
        full = rb == self.num_ranks
        m, h = num_max, x.shape[1]
        if full:
            out_x, src_info, layout_range = recv_x, inner[0], inner[1]
        else:
            out_x = self._bounded_recv(recv_x, rb * m, inner.round % 2, use_fp8, use_ue8m0)
            src_info = torch.empty(eng.num_local, rb * m, dtype=torch.int32)
            layout_range = torch.empty(eng.num_local, rb, dtype=torch.int64)
        handle = Handle(src_info, layout_range, m, h)
        handle.owner, handle.inner, handle.rank_bound = self, inner, rb

        def then() -> None:
            if not full:
                rows = rb * m
                if use_fp8:
                    out_x[0].copy_(recv_x[0][:, :rows])
                    out_x[1].copy_(recv_x[1][:, :rows])
                else:
                    out_x.copy_(recv_x[:, :rows])
                src_info.copy_(inner[0][:, :rows])
                layout_range.copy_(inner[1][:, :rb])
            if cost is not None:
                cost.add_(full_cost[:rb])

        return out_x, count, handle, _receive_hook(inner_hook, then, return_recv_hook)

    def _bounded_recv(self, recv_x, rows: int, parity: int, use_fp8: bool, use_ue8m0: bool):
        """Reusable receive tensors of NIXL-EP's shape ``[L, rank_bound * M, ...]`` (two sets,
        as the engine's: a dispatch's are reused two dispatches later)."""
        key = (parity, use_fp8, use_ue8m0, rows)
        if key not in self._bounded:
            if use_fp8:
                data, scales = recv_x
                n, s = data.shape[0], scales.shape[2]
                self._bounded[key] = (
                    torch.empty(n, rows, data.shape[2], dtype=data.dtype),
                    torch.empty(n, s, rows, dtype=scales.dtype).transpose(1, 2),
                )
            else:
                n, _, h = recv_x.shape
                self._bounded[key] = torch.empty(n, rows, h, dtype=recv_x.dtype)
        return self._bounded[key]

    # ------------------------------------------------------------------ combine
    def _check_handle(self, method: str, handle) -> Handle:
        if not isinstance(handle, Handle) or handle.owner is not self:
            raise ValueError(
                f"nixl_ep.Buffer.{method}: handle must come from dispatch of this buffer"
            )
        return handle

    def next_combine_buffer(self, handle) -> torch.Tensor:
        eng = self.need("get_next_combine_buffer")
        handle = self._check_handle("get_next_combine_buffer", handle)
        with eng.numbered(True, solo=not self._live_peers()):
            buf = eng.get_next_low_latency_combine_buffer(handle.inner)
        rb, m = handle.rank_bound, handle[2]
        return buf if rb == self.num_ranks else buf[:, : rb * m]

    def combine(
        self,
        x,
        topk_idx,
        topk_weights,
        handle,
        use_logfmt: bool,
        zero_copy: bool,
        async_finish: bool,
        return_recv_hook: bool,
        out,
        cost,
    ):
        eng = self._start(
            "combine",
            async_finish,
            return_recv_hook,
            x=x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            out=out,
            combine_wait_recv_cost_stats=cost,
        )
        handle = self._check_handle("combine", handle)
        rb, m, h = handle.rank_bound, handle[2], handle[3]
        want = (eng.num_local, rb * m, h)
        check_host("x", x)
        if x.dtype != torch.bfloat16 or tuple(x.shape) != want:
            raise ValueError(f"x must be bf16 {list(want)}, got {x.dtype} {list(x.shape)}")
        check_cost_stats("combine_wait_recv_cost_stats", cost, rb)
        full_cost = None if cost is None else torch.zeros(self.num_ranks, dtype=torch.int64)
        full = rb == self.num_ranks
        with self._round(combine=True):
            if full:
                x_full = x
            elif zero_copy:  # only checked: the engine reads its own combine buffer
                x_full = eng.get_next_low_latency_combine_buffer(handle.inner)
            else:
                x_full = self._pad(x, eng.num_local, m, h)
            combined, _, inner_hook = eng.low_latency_combine(
                x_full, topk_idx, topk_weights, handle.inner,
                use_logfmt, zero_copy, False, return_recv_hook, out, full_cost,
            )  # fmt: skip

        def then() -> None:
            if cost is not None:
                cost.add_(full_cost[:rb])

        return combined, _receive_hook(inner_hook, then, return_recv_hook)

    def _pad(self, x: torch.Tensor, num_local: int, m: int, h: int) -> torch.Tensor:
        """x [L, rank_bound * M, H] in the engine's [L, R * M, H] (rows past x never read)."""
        want = (num_local, self.num_ranks * m, h)
        if self._padded is None or tuple(self._padded.shape) != want:
            self._padded = torch.zeros(want, dtype=torch.bfloat16)
        self._padded[:, : x.shape[1]].copy_(x)
        return self._padded

    # ------------------------------------------------------------------ the rest
    def barrier(self) -> None:
        eng = self.need("barrier")
        s = eng.shape
        if s is None:
            raise RuntimeError(
                "nixl_ep.Buffer.barrier before the first dispatch: moecomm sizes a pair's "
                "channels from the first dispatch's shape, so there is nothing to meet over yet"
            )
        with self._round():
            eng.clean_low_latency_buffer(
                s.num_max_dispatch_tokens_per_rank, s.hidden, s.num_experts
            )

    def dispatch_layout(self, topk_idx, num_experts: int):
        """NIXL-EP's get_dispatch_layout over the rank capacity (a local computation)."""
        self.need("get_dispatch_layout")
        r = self.num_ranks
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            raise ValueError("topk_idx must be a 2-D tensor [num_tokens, num_topk]")
        if topk_idx.dtype != torch.int64:
            raise TypeError(f"topk_idx must be torch.int64, got {topk_idx.dtype}")
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if num_experts % r:
            raise ValueError(f"num_experts={num_experts} must be a multiple of num_ranks={r}")
        if topk_idx.numel() and (int(topk_idx.min()) < -1 or int(topk_idx.max()) >= num_experts):
            raise ValueError(f"topk_idx entries must be in [-1, {num_experts})")
        per, n = num_experts // r, topk_idx.shape[0]
        valid = topk_idx >= 0
        owner = torch.where(valid, topk_idx // per, torch.full_like(topk_idx, r))
        in_rank = torch.zeros(n, r + 1, dtype=torch.bool, device=topk_idx.device)
        in_rank.scatter_(1, owner, True)
        is_token_in_rank = in_rank[:, :r].contiguous()
        per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        per_rdma = None
        if r > NUM_MAX_NVL_PEERS:  # NIXL-EP's is_ht_available(): one count per RDMA rank
            if r % NUM_MAX_NVL_PEERS:
                raise ValueError(
                    f"num_ranks={r} above {NUM_MAX_NVL_PEERS} must be a multiple of it"
                )
            by_node = is_token_in_rank.view(n, r // NUM_MAX_NVL_PEERS, NUM_MAX_NVL_PEERS)
            per_rdma = by_node.any(dim=2).sum(0, dtype=torch.int32)
        return per_rank, per_rdma, per_expert, is_token_in_rank

    def destroy(self) -> None:
        if self.engine is not None:
            self.engine.destroy()
        for pair in self.pairs.values():
            with contextlib.suppress(Exception):
                pair.control.close()
        self.pairs.clear()
        self._bounded.clear()
        self._padded = None
