"""DeepEP V2's ``deep_ep.ElasticBuffer`` / ``EPHandle`` (``deep_ep/buffers/elastic.py`` of
github.com/deepseek-ai/DeepEP, v2.1.0), the expert-parallel part, over moecomm: CPU tensors on
the host transport, on top of :class:`moecomm.compat.normal.mode.NormalMode`.

Answered: ``dispatch`` (plain and expanded layouts, fp8 ``(x, sf)`` input, cached ``EPHandle``,
``cumulative_local_expert_recv_stats``), ``combine`` (bias 0/1/2, top-k weights), ``barrier``,
``destroy``, ``capture``, ``get_buffer_size_hint``, the domain-size getters and the SM/QP
getters (numbers only). Refused with ``NotImplementedError`` naming the method: Engram
(``engram_write``/``engram_fetch``/``get_engram_storage_size_hint``), pipeline-parallel
send/recv (``pp_set_config``/``pp_send``/``pp_recv``/``get_pp_buffer_size_hint``) and
all-gather/reduce-scatter sessions (``create_agrs_session``, ``destroy_agrs_session``,
``agrs_new_session``, ``agrs_set_config``, ``agrs_get_inplace_tensor``, ``all_gather``,
``get_agrs_num_max_session_bytes``, ``get_agrs_buffer_size_hint``), and ``get_comm_stream``.

Semantics (DeepEP's ``tests/elastic/test_ep.py`` and ``deep_ep/utils/refs.py``):

- Source token ``t`` of rank ``s`` has the global index ``s * num_max_tokens_per_rank + t``.
  Received tokens are ordered by it (DeepEP's ``deterministic=True`` order; this adapter is
  always deterministic). ``handle.recv_src_metadata`` is int32 ``[num_recv_tokens, 2 + K]``:
  column 0 the global index, column 1 the row in ``recv_x`` (non-expanded), columns ``2:`` the
  expanded row of each (token, k), ``-1`` where expert ``k`` is not local (always ``-1`` in the
  plain layout).
- Plain layout: ``recv_x [num_recv_tokens, hidden]``, ``recv_topk_idx`` local expert indices or
  ``-1``, ``recv_topk_weights`` the weights (``0`` where the index is ``-1``).
- Expanded layout (``do_expand=True``): one row per (token, local expert), experts in order,
  each expert's block starting at the previous block's end aligned up to ``expert_alignment``,
  tokens by global index inside a block; padding rows are zero. ``recv_topk_idx`` is ``None``,
  ``recv_topk_weights`` is 1-D, one weight per row. ``psum_num_recv_tokens_per_expert[e]`` =
  start of block ``e`` + its real count (DeepEP's definition);
  ``num_recv_tokens_per_expert_list`` holds the aligned counts in both layouts.
- ``combine`` (``allow_multiple_reduction=True``, DeepEP's default): in the expanded layout a
  rank first sums, per received token, its expert rows (f32, k ascending, one bf16 rounding);
  each rank then sends one row per received token back; the source adds
  ``f32(bias_0) + f32(bias_1)`` then the rows of the ranks in the order of each rank's last
  top-k position, in f32, one final bf16 rounding — bit-equal to DeepEP's
  ``refs.combine(..., reduce_in_local=True, reduce_in_scaleup=False)``. With
  ``allow_multiple_reduction=False`` and the expanded layout, every (token, k) row travels back
  and the source adds them k ascending (``refs.combine(..., False, False)``).
  ``combined_topk_weights[t, k]`` is the weight the rank hosting ``topk_idx[t, k]`` sent back
  (``0`` where ``topk_idx`` is ``-1``): a combine of the dispatched weights returns them.
- ``do_cpu_sync`` is accepted; tensors are always sized exactly (DeepEP without a CPU sync
  sizes them for the worst case; slicing to ``psum_num_recv_tokens_per_scaleup_rank[-1]`` works
  on both). ``use_tma_aligned_col_major_sf`` returns the scales column-major (same values).
- Events, streams, SM/QP counts, hybrid mode, ``sl_idx``, buffer byte sizes: accepted and
  ignored; ``event`` is a completed event.
- Rendezvous as ``moecomm.compat.deep_ep.Buffer``: a ``ProcessGroup`` (one
  ``all_gather_object``), or keyword-only ``rank``, ``num_ranks``, ``store``.
"""

from __future__ import annotations

import torch

from moecomm.compat.api import CompletedEvent, EventHandle, EventOverlap, refused
from moecomm.compat.normal.mode import NormalMode, check_bias, check_cpu
from moecomm.compat.rendezvous import exchange, group_rank_and_size
from moecomm.wire.shm import ShmTransport

__all__ = ["EPHandle", "ElasticBuffer"]

DEFAULT_STORE_PREFIX = "moecomm.compat.elastic"
_ALIGNMENT_2MB = 2 << 20


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _store_exchange(rank: int, num_ranks: int, group, store, prefix: str, timeout: float):
    """The rendezvous of deep_ep.Buffer (rendezvous.exchange), bound to this buffer."""

    def gather(mine: dict) -> list:
        return exchange(mine, rank, num_ranks, group, store, prefix, timeout)

    return gather


class EPHandle:
    """DeepEP's ``EPHandle``: the routing of one dispatch, reused by a cached dispatch and
    consumed by ``combine``. Same attribute names and meanings (see the module docstring);
    ``token_metadata_at_forward`` and ``channel_linked_list`` (hybrid mode) are ``None``."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: torch.Tensor
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: list
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor
    psum_num_recv_tokens_per_expert: torch.Tensor
    num_unaligned_recv_tokens_per_expert: torch.Tensor | None
    recv_src_metadata: torch.Tensor
    dst_buffer_slot_idx: torch.Tensor
    token_metadata_at_forward: None = None
    channel_linked_list: None = None


def refuse(method: str, why: str):
    """An ``ElasticBuffer`` method moecomm does not answer: it raises NotImplementedError saying
    why (as :func:`moecomm.compat.api.refused` words it)."""

    def refuse_call(self, *args, **kwargs):
        raise refused("ElasticBuffer", method, why)

    refuse_call.__name__ = method
    return refuse_call


ENGRAM = "Engram (remote KV-cache fetch over RDMA into CPU storage) has no moecomm equivalent"
PP = "pipeline-parallel send/recv belongs to moecomm.wire.stage / moecomm.pipeline"
AGRS = "all-gather/reduce-scatter sessions are not an expert-parallel operation moecomm serves"


class ElasticBuffer:
    """``deep_ep.ElasticBuffer``'s dispatch/combine on moecomm; see the module docstring."""

    def __init__(
        self,
        group=None,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        rank: int | None = None,
        num_ranks: int | None = None,
        store=None,
        store_prefix: str = DEFAULT_STORE_PREFIX,
        timeout: float | None = None,
    ) -> None:
        if num_cpu_bytes:
            raise NotImplementedError(
                f"ElasticBuffer(num_cpu_bytes={num_cpu_bytes}): CPU segments serve Engram "
                "storage, which moecomm does not implement"
            )
        if group is not None:
            rank_size = group_rank_and_size(group)
            if rank is not None or num_ranks is not None or store is not None:
                raise ValueError("pass either a process group or rank/num_ranks/store, not both")
            rank, num_ranks = rank_size
        elif rank is None or num_ranks is None or store is None:
            raise ValueError("without a process group, rank=, num_ranks= and store= are required")
        timeout = float(num_cpu_timeout_secs if timeout is None else timeout)
        self.group, self.rank_idx, self.num_ranks = group, rank, num_ranks
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = True  # our order is always the deterministic one
        self.explicitly_destroy = explicitly_destroy
        self.num_bytes = num_bytes if num_bytes is not None else _ALIGNMENT_2MB
        self.num_allocated_qps = num_allocated_qps or 17
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, rank
        self.num_rdma_ranks, self.num_nvlink_ranks = 1, num_ranks
        exchange = _store_exchange(rank, num_ranks, group, store, store_prefix, timeout)
        self._normal = NormalMode(
            rank, num_ranks, exchange, ShmTransport(), timeout=timeout, name="ElasticBuffer"
        )
        self._normal.setup()  # DeepEP's constructor is collective (it ends with a barrier)
        self.runtime = self._normal

    # ---------------------------------------------------------------- life cycle, misc
    def destroy(self) -> None:
        if self.runtime is not None:
            self._normal.destroy()
            self.runtime = None

    def __enter__(self) -> ElasticBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _live(self) -> NormalMode:
        if self.runtime is None:
            raise RuntimeError("ElasticBuffer used after destroy()")
        return self._normal

    def barrier(
        self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True
    ) -> None:
        self._live().barrier()

    @staticmethod
    def capture() -> EventOverlap:
        """DeepEP's: an event on the current CUDA stream (nothing to wait for without CUDA)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_buffer_size_hint(
        group,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """Shared memory this adapter maps per rank is fixed by its chunked channels; the hint
        is the size of one rank's tokens (bf16 rows), 2 MB aligned, for callers that pass it."""
        return _align(max(1, num_max_tokens_per_rank * hidden * 2), _ALIGNMENT_2MB)

    def get_physical_domain_size(self) -> tuple[int, int]:
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, *args, **kwargs) -> int:
        return 1

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        return min(num_sms, self.num_allocated_qps)

    get_comm_stream = refuse(
        "get_comm_stream", "host calls run on the caller's thread; there is no comm stream"
    )
    get_engram_storage_size_hint = staticmethod(refuse("get_engram_storage_size_hint", ENGRAM))
    engram_write = refuse("engram_write", ENGRAM)
    engram_fetch = refuse("engram_fetch", ENGRAM)
    get_pp_buffer_size_hint = staticmethod(refuse("get_pp_buffer_size_hint", PP))
    pp_set_config = refuse("pp_set_config", PP)
    pp_send = refuse("pp_send", PP)
    pp_recv = refuse("pp_recv", PP)
    get_agrs_num_max_session_bytes = staticmethod(refuse("get_agrs_num_max_session_bytes", AGRS))
    get_agrs_buffer_size_hint = staticmethod(refuse("get_agrs_buffer_size_hint", AGRS))
    create_agrs_session = refuse("create_agrs_session", AGRS)
    destroy_agrs_session = refuse("destroy_agrs_session", AGRS)
    agrs_new_session = refuse("agrs_new_session", AGRS)
    agrs_set_config = refuse("agrs_set_config", AGRS)
    agrs_get_inplace_tensor = refuse("agrs_get_inplace_tensor", AGRS)
    all_gather = refuse("all_gather", AGRS)

    # ---------------------------------------------------------------- dispatch
    def dispatch(
        self,
        x,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ):
        nm = self._live()
        x, sf = x if isinstance(x, tuple) else (x, None)
        check_cpu("x", x)
        r = self.num_ranks
        if handle is not None:
            if not isinstance(handle, EPHandle) or handle.owner != id(self):
                raise ValueError("handle must be an EPHandle from a dispatch of this buffer")
            if topk_idx is not None:
                raise ValueError("a cached dispatch (handle=...) takes no topk_idx")
            if do_cpu_sync:
                raise ValueError("Cannot do CPU sync with cached handle")
            given = (num_experts, expert_alignment, num_max_tokens_per_rank)
            want = (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
            if any(g is not None and g != w for g, w in zip(given, want, strict=True)):
                raise ValueError(
                    f"the handle was made with (num_experts, expert_alignment, "
                    f"num_max_tokens_per_rank) = {want}, got {given}"
                )
            topk_idx = handle.topk_idx
            num_experts, expert_alignment, m = want
            if do_expand != handle.do_expand:
                raise ValueError(f"the handle was made with do_expand={handle.do_expand}")
        else:
            if topk_idx is None or num_experts is None:
                raise ValueError("dispatch needs topk_idx and num_experts (or a handle)")
            m = num_max_tokens_per_rank or self.num_max_tokens_per_rank
            expert_alignment = 1 if expert_alignment is None else expert_alignment
            if not (isinstance(m, int) and m > 0):
                raise ValueError("num_max_tokens_per_rank must be given (here or at construction)")
        n = x.shape[0]
        if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape[0] != n:
            raise ValueError(f"x must be [num_tokens, hidden] and topk_idx [{n}, num_topk]")
        if n > m:
            raise ValueError(f"{n} tokens exceed num_max_tokens_per_rank={m}")
        if topk_weights is not None:
            check_cpu("topk_weights", topk_weights)
            if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_idx.shape:
                raise ValueError(f"topk_weights must be float32 {list(topk_idx.shape)}")
        num_topk = topk_idx.shape[1]
        per = num_experts // r
        if handle is None:
            ntr, _, nte, itr, _ = nm.get_dispatch_layout(topk_idx, num_experts)
            w = topk_weights if topk_weights is not None else torch.zeros(topk_idx.shape)
            recv, ridx, rw, _, nh, _ = nm.dispatch(
                (x, sf) if sf is not None else x,
                num_tokens_per_rank=ntr,
                is_token_in_rank=itr,
                num_tokens_per_expert=nte,
                topk_idx=topk_idx,
                topk_weights=w,
            )
            if topk_weights is None:
                rw = None
        else:
            nh = handle._normal
            ridx = handle._recv_topk_idx
            # one collective: the rows of x, sf and the new weights side by side, as bytes
            parts = [x] + [t for t in (sf, topk_weights) if t is not None]
            widths = [t.shape[1] * t.element_size() for t in parts]
            blob = torch.zeros((n, _align(sum(widths), 16)), dtype=torch.uint8)
            col = 0
            for t, wd in zip(parts, widths, strict=True):
                blob[:, col : col + wd] = t.contiguous().view(torch.uint8).view(n, wd)
                col += wd
            got, *_ = nm.dispatch(blob, handle=nh)
            outs, col = [], 0
            for t, wd in zip(parts, widths, strict=True):
                piece = got[:, col : col + wd].contiguous().view(t.dtype)
                outs.append(piece.view(got.shape[0], t.shape[1]))
                col += wd
            recv = outs[0] if sf is None else (outs[0], outs[1])
            rw = None
            if topk_weights is not None:
                rw = torch.where(ridx >= 0, outs[-1], torch.zeros(()))
        recv_x, recv_sf = recv if isinstance(recv, tuple) else (recv, None)
        num_recv = nh.num_recv_tokens
        src_rank = torch.repeat_interleave(
            torch.arange(r, dtype=torch.int64), torch.tensor(nh.recv_counts, dtype=torch.int64)
        )
        gidx = (src_rank * m + nh[3][:num_recv].to(torch.int64)).to(torch.int32)
        counts = torch.stack([(ridx == e).sum() for e in range(per)]) if per else torch.zeros(0)
        counts = counts.to(torch.int32)
        aligned = [_align(int(c), expert_alignment) for c in counts.tolist()]
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += counts.to(
                cumulative_local_expert_recv_stats.dtype
            )
        if handle is None:
            meta = torch.full((num_recv, 2 + num_topk), -1, dtype=torch.int32)
            meta[:, 0] = gidx
            meta[:, 1] = torch.arange(num_recv, dtype=torch.int32)
            starts = [0] * per
            psum_expert = torch.tensor(aligned, dtype=torch.int64).cumsum(0).to(torch.int32)
            unaligned, num_expanded = None, num_recv
            if do_expand:
                acc = 0
                for e in range(per):
                    starts[e] = acc
                    acc += aligned[e]
                num_expanded = acc
                psum_expert = (torch.tensor(starts, dtype=torch.int64) + counts).to(torch.int32)
                unaligned = counts.clone()
                for e in range(per):
                    tok, k = (ridx == e).nonzero(as_tuple=True)  # tokens ascending
                    meta[tok, 2 + k] = starts[e] + torch.arange(tok.numel(), dtype=torch.int32)
            handle = EPHandle(
                do_expand=do_expand,
                num_experts=num_experts,
                expert_alignment=expert_alignment,
                num_max_tokens_per_rank=m,
                num_sms=num_sms or 1,
                topk_idx=topk_idx.clone() if do_handle_copy else topk_idx,
                num_recv_tokens=num_recv,
                num_expanded_tokens=num_expanded,
                num_recv_tokens_per_expert_list=aligned,
                psum_num_recv_tokens_per_scaleup_rank=torch.tensor(
                    nh.recv_counts, dtype=torch.int64
                )
                .cumsum(0)
                .to(torch.int32),
                psum_num_recv_tokens_per_expert=psum_expert,
                num_unaligned_recv_tokens_per_expert=unaligned,
                recv_src_metadata=meta,
                dst_buffer_slot_idx=nh[5].clone(),
                token_metadata_at_forward=None,
                channel_linked_list=None,
            )
            handle.owner, handle._normal, handle._recv_topk_idx = id(self), nh, ridx
        if not do_expand:
            if recv_sf is not None and use_tma_aligned_col_major_sf:
                recv_sf = recv_sf.T.contiguous().T
            out_x = recv_x if recv_sf is None else (recv_x, recv_sf)
            return out_x, ridx, rw, handle, CompletedEvent()
        # Expanded layout: one row per (token, local expert).
        slots = handle.recv_src_metadata[:, 2:].to(torch.int64)
        valid = slots >= 0
        tok = valid.nonzero(as_tuple=True)[0]
        dst = slots[valid]
        rows = handle.num_expanded_tokens
        ex = torch.zeros((rows, recv_x.shape[1]), dtype=recv_x.dtype)
        ex[dst] = recv_x[tok]
        ex_sf = None
        if recv_sf is not None:
            ex_sf = torch.zeros((rows, recv_sf.shape[1]), dtype=recv_sf.dtype)
            ex_sf[dst] = recv_sf[tok]
            if use_tma_aligned_col_major_sf:
                ex_sf = ex_sf.T.contiguous().T
        ex_w = None
        if rw is not None:
            ex_w = torch.zeros((rows,), dtype=torch.float32)
            ex_w[dst] = rw[valid]
        out_x = ex if ex_sf is None else (ex, ex_sf)
        return out_x, None, ex_w, handle, CompletedEvent()

    # ---------------------------------------------------------------- combine
    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        bias=None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        nm = self._live()
        if not isinstance(handle, EPHandle) or handle.owner != id(self):
            raise ValueError("handle must be an EPHandle from a dispatch of this buffer")
        check_cpu("x", x)
        if x.dtype != torch.bfloat16 or x.dim() != 2:
            raise ValueError(f"x must be bf16 [num_tokens, hidden], got {x.dtype} {list(x.shape)}")
        nh, num_recv, hidden = handle._normal, handle.num_recv_tokens, x.shape[1]
        topk_idx = handle.topk_idx
        n, k = topk_idx.shape
        r, per = self.num_ranks, handle.num_experts // self.num_ranks
        want_rows = handle.num_expanded_tokens if handle.do_expand else num_recv
        if x.shape[0] < want_rows:
            raise ValueError(f"x must have at least {want_rows} rows, got {x.shape[0]}")
        slots = handle.recv_src_metadata[:, 2:].to(torch.int64)
        valid = slots >= 0
        # Per received token: the rows to send back, and the weights [num_recv, K].
        w_back = None
        if topk_weights is not None:
            check_cpu("topk_weights", topk_weights)
            if handle.do_expand:
                if topk_weights.dim() != 1 or topk_weights.dtype != torch.float32:
                    raise ValueError("topk_weights must be float32 [num_expanded_tokens]")
                w_back = torch.zeros((num_recv, k), dtype=torch.float32)
                w_back[valid] = topk_weights[slots[valid]]
            else:
                if topk_weights.dtype != torch.float32 or topk_weights.shape[1:] != (k,):
                    raise ValueError(f"topk_weights must be float32 [num_recv_tokens, {k}]")
                w_back = topk_weights[:num_recv]
        per_k = handle.do_expand and not self.allow_multiple_reduction
        if not handle.do_expand:
            y = x[:num_recv]
        elif per_k:  # every (token, k) row travels back: [num_recv, K * hidden]
            yk = torch.zeros((num_recv, k, hidden), dtype=torch.bfloat16)
            yk[valid] = x[slots[valid]]
            y = yk.view(num_recv, k * hidden)
        else:  # local reduction first: f32, k ascending, one bf16 rounding
            acc = torch.zeros((num_recv, hidden), dtype=torch.float32)
            for j in range(k):
                sel = valid[:, j].nonzero().flatten()
                acc[sel] += x[slots[sel, j]].float()
            y = acc.to(torch.bfloat16)
        extra = [] if w_back is None else [w_back]
        back = nm.send_back(y, nh, extra)
        bias0, bias1 = check_bias(bias, n, hidden)
        out = torch.zeros((n, hidden), dtype=torch.float32)
        if bias0 is not None and bias1 is not None:
            out = bias0.float() + bias1.float()
        elif bias0 is not None:
            out = bias0.float().clone()
        owner = torch.where(topk_idx >= 0, topk_idx // per, torch.full_like(topk_idx, -1))
        ar = torch.arange(n)
        if per_k:
            full = torch.zeros((r, n, k, hidden), dtype=torch.float32)
            for p, (rows, g) in enumerate(back):
                full[p, rows] = g[0].view(-1, k, hidden).float()
            for j in range(k):
                sel = owner[:, j] >= 0
                out[sel] += full[owner[sel, j], ar[sel], j]
        else:
            full = torch.zeros((r, n, hidden), dtype=torch.float32)
            for p, (rows, g) in enumerate(back):
                full[p, rows] = g[0].float()
            # rank p's row is added at the last k whose expert lives on p
            for j in range(k):
                o = owner[:, j]
                later = (
                    (owner[:, j + 1 :] == o[:, None]).any(1)
                    if j + 1 < k
                    else torch.zeros(n, dtype=torch.bool)
                )
                sel = (o >= 0) & ~later
                out[sel] += full[o[sel], ar[sel]]
        combined_w = None
        if w_back is not None:
            wfull = torch.zeros((r, n, k), dtype=torch.float32)
            for p, (rows, g) in enumerate(back):
                wfull[p, rows] = g[1]
            combined_w = torch.zeros((n, k), dtype=torch.float32)
            sel = owner >= 0
            tok, j = sel.nonzero(as_tuple=True)
            combined_w[tok, j] = wfull[owner[tok, j], tok, j]
        return out.to(torch.bfloat16), combined_w, CompletedEvent()
