"""DeepEP's normal (high-throughput) mode — ``Buffer.get_dispatch_layout`` / ``dispatch`` /
``combine`` — over moecomm's slot protocol: CPU tensors on the host transport.

Semantics follow DeepEP's intranode kernels (``deep_ep/buffers/legacy.py`` and
``csrc/kernels/legacy/intranode.cu`` of github.com/deepseek-ai/DeepEP, v2.1.0):

- **layout**: expert ``e`` lives on rank ``e // L`` (``L = num_experts / num_ranks``);
  ``num_tokens_per_rank[r]`` counts tokens with at least one expert on ``r``,
  ``num_tokens_per_expert[e]`` counts ``(topk_idx == e)``, ``is_token_in_rank[t, r]``;
  ``num_tokens_per_rdma_rank`` is ``None`` (intranode).
- **dispatch**: rank ``r`` receives every token ``t`` of every rank ``s`` with
  ``is_token_in_rank[t, r]``, ordered by source rank, then token index (DeepEP's channels are
  contiguous token ranges, so its order is the same). ``x`` may be any dtype whose rows are a
  multiple of 16 bytes (bf16, fp8 ``(x, scales)`` with f32 or int scales, ...): rows are moved
  as bytes. ``recv_topk_idx`` holds local expert indices (``-1`` for experts elsewhere),
  ``recv_topk_weights`` the weights with ``0`` where the index is ``-1``;
  ``num_recv_tokens_per_expert_list[e]`` is the sum over source ranks of their
  ``num_tokens_per_expert[r*L + e]``, aligned up to ``expert_alignment``. With
  ``num_worst_tokens > 0`` the outputs have that many rows (``recv_topk_idx`` is ``-1`` past the
  received ones) and the list is empty. A cached dispatch (``handle=...``, no top-k) reuses the
  routing and returns ``(recv_x, None, None, None, None, event)``.
- **combine**: every rank sends each received row back to its source; the source reduces
  ``out[t] = bf16(f32(bias_0[t]) + f32(bias_1[t]) + Σ_r f32(y_r[t]))``, ranks ascending, exactly
  the kernel's order (no expert weights are applied; DeepEP's combine is a plain sum). With
  ``topk_weights`` the weights come back the same way: ``Σ_r w_r[t]`` in f32 from 0.
- **handle**: DeepEP's 6-tuple ``(rank_prefix_matrix, channel_prefix_matrix,
  recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``. There is one
  "channel": ``channel_prefix_matrix[r, 0]`` = tokens this rank sends to ``r``,
  ``recv_channel_prefix_matrix[s, 0]`` = tokens received from ``s``; ``send_head[t, r]`` = the
  position of token ``t`` among the tokens sent to ``r`` (``-1`` if not sent).

Transport: one :class:`~moecomm.wire.stage.StageSender` / ``StageReceiver`` pair per ordered
pair of ranks (opaque byte packages, chunked through slots), receivers of a rank sharing one
doorbell (:class:`~moecomm.wire.stage.StageInbox`). Every collective call is an all-to-all
of byte packages, tagged with a per-buffer call counter; the sends are interleaved with the
receives so that no two ranks can block each other on full rings. Every wait has a deadline:
``moecomm.DeadlineExceededError`` naming the ranks still missing, ``PeerLostError`` for a dead peer.
``async_finish``, ``previous_event``, ``allocate_on_comm_stream`` and ``config`` are accepted
and ignored (host calls complete before they return; ``event`` is a completed event).

Wiring (``deep_ep.Buffer``): ``NormalMode(rank, num_ranks, exchange_fn, ShmTransport(),
timeout=timeout)`` where ``exchange_fn(mine: dict) -> list[dict]`` gathers one JSON-able dict
from every rank (an ``all_gather_object`` or a Store round with its own key prefix). The
channels are set up at the first collective call (``dispatch``/``combine``/``barrier``), which
every rank makes; ``get_dispatch_layout`` is local.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from moecomm.compat.api import CompletedEvent
from moecomm.compat.normal.mailbox import DEFAULT_TIMEOUT_S, Mailbox, pack, unpack
from moecomm.compat.rendezvous import exchange
from moecomm.errors import ProtocolError
from moecomm.wire.shm import ShmTransport
from moecomm.wire.transport import Transport

__all__ = ["NormalCalls", "NormalHandle", "NormalMode", "check_bias", "check_cpu"]


# ------------------------------------------------------------------------ handle
class NormalHandle(tuple):
    """DeepEP's intranode handle ``(rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)`` plus, as
    attributes, what our combine needs."""

    def __new__(cls, *items):
        return super().__new__(cls, items)

    owner: int
    num_tokens: int  # tokens of this rank at dispatch
    hidden_bytes: int
    recv_counts: list  # tokens received from each rank
    send_rows: list  # per destination rank: int64 token indices sent there, ascending
    num_recv_tokens: int
    num_topk: int


def check_cpu(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise NotImplementedError(
            f"{name} is on {t.device}: the normal mode runs on the host transport (CPU tensors); "
            "deep_ep.Buffer.get_dispatch_layout / dispatch / combine and ElasticBuffer.dispatch "
            "/ combine on CUDA tensors are not implemented by moecomm"
        )
    return t


def check_bias(bias, n: int, hidden: int) -> tuple:
    """DeepEP's combine ``bias``: None, a tensor or a pair of them, each bf16 ``[n, hidden]`` on
    the host; returns the pair ``(bias_0, bias_1)`` (None where not given)."""
    pair = bias if isinstance(bias, tuple) else (bias, None)
    for b in pair:
        if b is not None:
            check_cpu("bias", b)
            if b.dtype != torch.bfloat16 or tuple(b.shape) != (n, hidden):
                raise ValueError(f"bias must be bf16 [{n}, {hidden}]")
    return pair


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# ------------------------------------------------------------------------ the mode
class NormalMode:
    """``get_dispatch_layout`` / ``dispatch`` / ``combine`` of DeepEP's normal mode for one rank.

    ``exchange(mine) -> list`` gathers one JSON-able dict from every rank, by rank; it is called
    once, at the first collective call. ``transport`` is a host transport (``ShmTransport()``).
    """

    def __init__(
        self,
        rank: int,
        num_ranks: int,
        exchange: Callable[[dict], list],
        transport: Transport,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        name: str = "deep_ep.Buffer (normal mode)",
    ) -> None:
        if not (isinstance(num_ranks, int) and num_ranks >= 1 and 0 <= rank < num_ranks):
            raise ValueError(f"need 0 <= rank < num_ranks, got rank={rank}, num_ranks={num_ranks}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.rank, self.num_ranks, self.timeout, self.name = rank, num_ranks, float(timeout), name
        self._exchange, self._transport = exchange, transport
        self._mailbox: Mailbox | None = None
        self._destroyed = False

    # ---------------------------------------------------------------- plumbing
    def setup(self) -> None:
        """Sets the channels up (collective); done by the first collective call otherwise."""
        if self._destroyed:
            raise RuntimeError(f"{self.name}: used after destroy()")
        if self._mailbox is None:
            self._mailbox = Mailbox(
                self.rank,
                self.num_ranks,
                self._exchange,
                self._transport,
                timeout=self.timeout,
                name=self.name,
            )

    def all_to_all(self, packages: list[list[torch.Tensor | None]]) -> list[list]:
        """Collective: ``packages[p]`` (a list of tensors) to rank ``p``; returns, by source
        rank, the lists sent to us."""
        self.setup()
        assert self._mailbox is not None
        got = self._mailbox.all_to_all([pack(p) for p in packages])
        return [unpack(g) for g in got]

    def barrier(self) -> None:
        self.all_to_all([[] for _ in range(self.num_ranks)])

    def destroy(self) -> None:
        if self._mailbox is not None:
            self._mailbox.close()
            self._mailbox = None
        self._destroyed = True

    # ---------------------------------------------------------------- layout
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        check_cpu("topk_idx", topk_idx)
        if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
            raise ValueError(
                f"topk_idx must be int64 [num_tokens, num_topk], got {topk_idx.dtype} "
                f"{list(topk_idx.shape)}"
            )
        r = self.num_ranks
        if not (isinstance(num_experts, int) and num_experts > 0 and num_experts % r == 0):
            raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of {r}")
        if topk_idx.numel() and (topk_idx.min() < -1 or topk_idx.max() >= num_experts):
            raise ValueError(f"topk_idx must hold -1 or experts in [0, {num_experts})")
        per = num_experts // r
        n = topk_idx.shape[0]
        valid = topk_idx >= 0
        owner = torch.where(valid, topk_idx // per, torch.full_like(topk_idx, -1))
        is_token_in_rank = torch.zeros((n, r), dtype=torch.bool)
        for k in range(topk_idx.shape[1]):
            rows = valid[:, k].nonzero().flatten()
            is_token_in_rank[rows, owner[rows, k]] = True
        num_tokens_per_rank = is_token_in_rank.sum(0).to(torch.int32)
        flat = topk_idx[valid]
        num_tokens_per_expert = torch.bincount(flat, minlength=num_experts).to(torch.int32)
        return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, CompletedEvent()

    # ---------------------------------------------------------------- dispatch
    def dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config=None,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        x, scales = x if isinstance(x, tuple) else (x, None)
        n, hidden_bytes = self._check_x(x, scales)
        r = self.num_ranks
        if not (isinstance(expert_alignment, int) and expert_alignment >= 1):
            raise ValueError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
        if not (isinstance(num_worst_tokens, int) and num_worst_tokens >= 0):
            raise ValueError(f"num_worst_tokens must be an int >= 0, got {num_worst_tokens!r}")
        cached = handle is not None
        if cached:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle=...) takes no topk_idx/topk_weights")
            if not isinstance(handle, NormalHandle) or handle.owner != id(self):
                raise ValueError("handle must come from a dispatch of this buffer")
            if handle.num_tokens != n:
                raise ValueError(f"x has {n} tokens, the handle's dispatch had {handle.num_tokens}")
            is_token_in_rank = handle[4]
            send_rows = handle.send_rows
        else:
            if num_tokens_per_rank is None or is_token_in_rank is None:
                raise ValueError("dispatch needs num_tokens_per_rank and is_token_in_rank")
            if num_tokens_per_expert is None:
                raise ValueError("dispatch needs num_tokens_per_expert")
            check_cpu("is_token_in_rank", is_token_in_rank)
            if is_token_in_rank.dtype != torch.bool or tuple(is_token_in_rank.shape) != (n, r):
                raise ValueError(
                    f"is_token_in_rank must be bool [{n}, {r}], got {is_token_in_rank.dtype} "
                    f"{list(is_token_in_rank.shape)}"
                )
            check_cpu("num_tokens_per_rank", num_tokens_per_rank)
            if num_tokens_per_rank.shape != (r,):
                raise ValueError(f"num_tokens_per_rank must be [{r}]")
            check_cpu("num_tokens_per_expert", num_tokens_per_expert)
            if num_tokens_per_expert.dim() != 1 or num_tokens_per_expert.numel() % r:
                raise ValueError(f"num_tokens_per_expert must be [num_experts], a multiple of {r}")
            if (topk_idx is None) != (topk_weights is None):
                raise ValueError("give both topk_idx and topk_weights, or neither")
            if topk_idx is not None:
                check_cpu("topk_idx", topk_idx)
                check_cpu("topk_weights", topk_weights)
                if topk_idx.dim() != 2 or topk_idx.shape[0] != n or topk_idx.dtype != torch.int64:
                    raise ValueError(f"topk_idx must be int64 [{n}, num_topk]")
                if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_idx.shape:
                    raise ValueError(f"topk_weights must be float32 {list(topk_idx.shape)}")
            elif num_worst_tokens > 0:
                raise ValueError("num_worst_tokens needs topk_idx and topk_weights")
            send_rows = [is_token_in_rank[:, p].nonzero().flatten() for p in range(r)]
        num_experts = 0 if cached else num_tokens_per_expert.numel()
        per = num_experts // r
        packages = []
        for p in range(r):
            rows = send_rows[p]
            pkg: list[torch.Tensor | None] = [x[rows], None if scales is None else scales[rows]]
            if not cached:
                pkg.append(rows.to(torch.int32))
                pkg.append(num_tokens_per_rank.to(torch.int32))
                pkg.append(num_tokens_per_expert[p * per : (p + 1) * per].to(torch.int32))
                if topk_idx is not None:
                    idx = topk_idx[rows]
                    local = (idx >= p * per) & (idx < (p + 1) * per)
                    pkg.append(torch.where(local, idx - p * per, torch.full_like(idx, -1)))
                    pkg.append(torch.where(local, topk_weights[rows], torch.zeros(())))
            packages.append(pkg)
        got = self.all_to_all(packages)
        counts = [g[0].shape[0] for g in got]
        total = sum(counts)
        event = CompletedEvent()
        if cached:
            if counts != handle.recv_counts:
                raise ProtocolError(
                    f"{self.name} rank {self.rank}: cached dispatch received {counts} tokens "
                    f"per rank, the handle's dispatch {handle.recv_counts}"
                )
            rows_out = handle[3].shape[0]  # padded like the handle's dispatch (num_worst_tokens)
            recv_x = self._cat([g[0] for g in got], x, rows_out)
            if scales is not None:
                recv_s = self._cat([g[1] for g in got], scales, rows_out)
                return (recv_x, recv_s), None, None, None, None, event
            return recv_x, None, None, None, None, event
        rows_out = max(total, num_worst_tokens)
        recv_x = self._cat([g[0] for g in got], x, rows_out)
        recv_s = None if scales is None else self._cat([g[1] for g in got], scales, rows_out)
        recv_src_idx = torch.cat([g[2] for g in got]) if total else torch.empty(0, torch.int32)
        if rows_out > total:
            pad = torch.full((rows_out - total,), -1, dtype=torch.int32)
            recv_src_idx = torch.cat([recv_src_idx.to(torch.int32), pad])
        per_rank = torch.stack([g[3] for g in got])  # [src, dst]
        rank_prefix_matrix = per_rank.cumsum(0).to(torch.int32)
        expert_counts = torch.stack([g[4] for g in got]).sum(0)
        if num_worst_tokens > 0:
            recv_list: list[int] = []
        else:
            recv_list = [_align(int(c), expert_alignment) for c in expert_counts.tolist()]
        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            k = topk_idx.shape[1]
            recv_topk_idx = torch.full((rows_out, k), -1, dtype=torch.int64)
            recv_topk_weights = torch.zeros((rows_out, k), dtype=torch.float32)
            if total:
                recv_topk_idx[:total] = torch.cat([g[5] for g in got])
                recv_topk_weights[:total] = torch.cat([g[6] for g in got])
        send_head = torch.full((n, r), -1, dtype=torch.int32)
        for p in range(r):
            send_head[send_rows[p], p] = torch.arange(send_rows[p].numel(), dtype=torch.int32)
        sent = torch.tensor([int(s.numel()) for s in send_rows], dtype=torch.int32)
        h = NormalHandle(
            rank_prefix_matrix,
            sent.view(r, 1),
            torch.tensor(counts, dtype=torch.int32).view(r, 1),
            recv_src_idx,
            is_token_in_rank,
            send_head,
        )
        h.owner, h.num_tokens, h.hidden_bytes = id(self), n, hidden_bytes
        h.recv_counts, h.send_rows, h.num_recv_tokens = counts, send_rows, total
        h.num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        out_x = recv_x if recv_s is None else (recv_x, recv_s)
        return out_x, recv_topk_idx, recv_topk_weights, recv_list, h, event

    # ---------------------------------------------------------------- combine
    def send_back(self, x: torch.Tensor, handle: NormalHandle, extra=None):
        """Collective: rows ``x[prefix_s : prefix_s + count_s]`` (and of each tensor in `extra`)
        go back to source rank ``s``. Returns, by rank ``r``, ``(send_rows_r, [tensors])``: the
        token indices we sent to ``r`` at dispatch and the rows ``r`` sent back for them."""
        extra = list(extra or [])
        packages, start = [], 0
        for s in range(self.num_ranks):
            c = handle.recv_counts[s]
            packages.append([x[start : start + c]] + [e[start : start + c] for e in extra])
            start += c
        got = self.all_to_all(packages)
        out = []
        for r, g in enumerate(got):
            if g[0].shape[0] != handle.send_rows[r].numel():
                raise ProtocolError(
                    f"{self.name} rank {self.rank}: rank {r} sent back {g[0].shape[0]} rows "
                    f"for the {handle.send_rows[r].numel()} tokens dispatched to it"
                )
            out.append((handle.send_rows[r], g))
        return out

    def combine(
        self,
        x: torch.Tensor,
        handle,
        topk_weights=None,
        bias=None,
        config=None,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        if not isinstance(handle, NormalHandle) or handle.owner != id(self):
            raise ValueError("handle must come from a (non-cached) dispatch of this buffer")
        check_cpu("x", x)
        n, total = handle.num_tokens, handle.num_recv_tokens
        if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[0] < total:
            raise ValueError(
                f"x must be bf16 [{total}, hidden] (the received tokens), got {x.dtype} "
                f"{list(x.shape)}"
            )
        hidden = x.shape[1]
        extra = []
        if topk_weights is not None:
            check_cpu("topk_weights", topk_weights)
            if (
                topk_weights.dim() != 2
                or topk_weights.dtype != torch.float32
                or topk_weights.shape[0] < total
            ):
                raise ValueError(f"topk_weights must be float32 [{total}, num_topk]")
            extra.append(topk_weights)
        acc = torch.zeros((n, hidden), dtype=torch.float32)
        for b in check_bias(bias, n, hidden):
            if b is not None:
                acc += b.float()
        back = self.send_back(x, handle, extra)
        w = None if topk_weights is None else torch.zeros((n, topk_weights.shape[1]))
        for rows, g in back:  # ranks ascending, each token at most once per rank
            acc[rows] += g[0].float()
            if w is not None:
                w[rows] += g[1]
        return acc.to(torch.bfloat16), w, CompletedEvent()

    # ---------------------------------------------------------------- helpers
    def _check_x(self, x, scales) -> tuple[int, int]:
        check_cpu("x", x)
        if x.dim() != 2:
            raise ValueError(f"x must be [num_tokens, hidden], got {list(x.shape)}")
        hidden_bytes = x.shape[1] * x.element_size()
        if hidden_bytes % 16:
            raise ValueError(f"a row of x must be a multiple of 16 bytes, got {hidden_bytes}")
        if scales is not None:
            check_cpu("scales", scales)
            if x.element_size() != 1:
                raise ValueError(f"(x, scales) needs a 1-byte x (fp8), got {x.dtype}")
            if scales.dtype not in (torch.float32, torch.int32) or scales.dim() != 2:
                raise ValueError("scales must be float32 or int32 [num_tokens, num_scales]")
            if scales.shape[0] != x.shape[0]:
                raise ValueError(f"scales has {scales.shape[0]} rows, x {x.shape[0]}")
        return x.shape[0], hidden_bytes

    @staticmethod
    def _cat(parts: list, like: torch.Tensor, rows: int) -> torch.Tensor:
        out = torch.empty((rows, like.shape[1]), dtype=like.dtype)
        start = 0
        for p in parts:
            out[start : start + p.shape[0]] = p
            start += p.shape[0]
        return out


# ------------------------------------------------------------------------ Buffer's methods
def _answered_by_normal_mode(method):
    """A ``deep_ep.Buffer`` method answered by `method` of the Buffer's :class:`NormalMode`, with
    its signature (DeepEP's): arguments are bound first, so a wrong call fails as a plain method
    would, before the normal mode is set up."""
    signature = inspect.signature(method)
    name = method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        signature.bind(self, *args, **kwargs)
        return getattr(self._normal_mode(), name)(*args, **kwargs)

    return call


class NormalCalls:
    """``deep_ep.Buffer``'s normal-mode methods, answered by a :class:`NormalMode`.

    DeepEP lets one ``Buffer`` serve both modes (normal calls on a buffer built for low latency
    too), so these are methods of every Buffer: the NormalMode is built at the first call over the
    Buffer's own rendezvous (process group, mpi4py comm or store, keys under ``.../normal``) and
    torn down by ``destroy()``. Mixed into deep_ep.Buffer, which provides rank, num_ranks, group,
    store, store_prefix, comm, timeout and _check_open()."""

    _normal: NormalMode | None = None

    def _normal_mode(self) -> NormalMode:
        self._check_open()
        if self._normal is None:

            def gather(mine: dict) -> list[dict]:
                return exchange(mine, self.rank, self.num_ranks, self.group, self.store,
                                f"{self.store_prefix}/normal", self.timeout, self.comm)  # fmt: skip

            self._normal = NormalMode(
                self.rank, self.num_ranks, gather, ShmTransport(), timeout=self.timeout
            )
        return self._normal

    get_dispatch_layout = _answered_by_normal_mode(NormalMode.get_dispatch_layout)
    dispatch = _answered_by_normal_mode(NormalMode.dispatch)
    combine = _answered_by_normal_mode(NormalMode.combine)

    def _close_normal(self) -> None:
        if self._normal is not None:
            self._normal.destroy()
            self._normal = None
