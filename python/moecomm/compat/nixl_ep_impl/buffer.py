"""NIXL-EP's ``nixl_ep`` package over moecomm: ``Buffer``, ``EventOverlap``, ``Config`` (its
``__all__``) and ``topk_idx_t``, with the signatures of NIXL-EP's ``nixl_ep/buffer.py``
(github.com/ai-dynamo/nixl ``examples/device/ep``, commit 8770b655, buffer.py as of c5a9850f),
so that vLLM's ``NixlEPAll2AllManager`` and ``NixlEPPrepareAndFinalize`` run unchanged on
``from moecomm.compat.nixl_ep import Buffer`` (docs/compat-nixl-ep.md).

Answered, on CPU tensors over the host transport (shared memory between the processes of one
machine): the low-latency ``dispatch`` / ``combine`` (= ``low_latency_dispatch`` /
``low_latency_combine``), ``get_next_combine_buffer``, ``update_memory_buffers``,
``connect_ranks`` / ``disconnect_ranks`` (ranks added and removed at run time),
``set_tcp_store_group``, the mask calls (``update_mask_buffer``, ``query_mask_buffer``,
``clean_mask_buffer``; a rank that does not answer within ``timeout_ms`` or whose process dies is
masked, as NIXL-EP's kernels do), ``barrier``, ``get_dispatch_layout``, ``destroy``, the size
hints, ``capture``, ``set_num_sms``, ``is_sm90_compiled``, ``get_dispatch_config`` /
``get_combine_config``, and ``get_local_buffer_tensor`` (an empty tensor: see its docstring).
Refused with ``NotImplementedError`` naming the call: CUDA tensors, the high-throughput mode
(``low_latency_mode=False``, ``ht_dispatch``, ``ht_combine``), ``get_comm_stream``, a slice of
``get_local_buffer_tensor``, ``connect_ranks`` without a store (NIXL-EP's etcd path).

moecomm's extension, opt-in: ``Buffer(..., replicas={expert: [ranks]})`` or the environment
variable ``MOECOMM_NIXL_EP_REPLICAS`` (the same map as JSON): a masked rank's experts are served
by their live replicas instead of dropped (``deep_ep.Buffer(replicas=...)``'s routing; the
receive tensors then have one row block per hosted replica too, ``Buffer.local_experts``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os

import torch

from moecomm.compat.api import Config as DeepEPConfig
from moecomm.compat.api import EventHandle, refused, table_config
from moecomm.compat.low_latency.replicas import ReplicaPlan, check_replicas_arg
from moecomm.compat.nixl_ep_impl.runtime import Runtime, size_hint

__all__ = ["Buffer", "Config", "EventOverlap"]

DEFAULT_TIMEOUT_MS = 30_000
# NIXL-EP waits this long for a peer's metadata in connect_ranks.
DEFAULT_CONNECT_TIMEOUT_S = 300.0
DEFAULT_STORE_PREFIX = "moecomm.nixl_ep"
REPLICAS_ENV = "MOECOMM_NIXL_EP_REPLICAS"


_refused = functools.partial(refused, "nixl_ep.Buffer")

_HT = (
    "NIXL-EP's high-throughput kernels (internode, RDMA ranks of 8 GPUs); moecomm answers "
    "the low-latency mode here (dispatch/combine), and DeepEP's normal mode on the host in "
    "moecomm.compat.deep_ep"
)


class _HostEvent:
    """The event of a host call: complete when the call returned."""

    def current_stream_wait(self) -> None:
        return None


class EventOverlap:
    """NIXL-EP's ``EventOverlap(event=None, extra_tensors=None)``: ``current_stream_wait()``
    (NIXL-EP asserts an event: calls made without ``async_finish`` return none), and
    ``with event:`` waits at the end of the block."""

    def __init__(self, event=None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is None:
            raise RuntimeError(
                "EventOverlap.current_stream_wait: no event (NIXL-EP returns one only with "
                "async_finish=True)"
            )
        self.event.current_stream_wait()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


class Config(DeepEPConfig):
    """NIXL-EP's ``Config(num_sms=20, num_max_nvl_chunked_send_tokens=6,
    num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
    num_max_rdma_chunked_recv_tokens=256)``, the high-throughput kernels' tuning record, with its
    checks and size hints (csrc/config.hpp, DeepEP's: ``deep_ep.Config`` under NIXL-EP's name).
    moecomm's calls take none."""

    _api = "nixl_ep"
    _upstream = "NIXL-EP"


# NIXL-EP's recommended configs (buffer.py): num_ranks -> the four chunk sizes.
_DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (8, 288, 32, 128), 32: (32, 288, 32, 128), 64: (20, 288, 28, 128),
    128: (20, 560, 32, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}  # fmt: skip
_COMBINE_CONFIGS = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 64: (1, 288, 20, 128), 128: (1, 560, 12, 128),
    144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}  # fmt: skip


def _replicas_from_env() -> dict[int, list[int]] | None:
    raw = os.environ.get(REPLICAS_ENV, "").strip()
    if not raw:
        return None
    try:
        spec = json.loads(raw)
        return {int(e): [int(q) for q in ranks] for e, ranks in spec.items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{REPLICAS_ENV} must be a JSON object {{expert: [ranks]}}, got {raw!r}"
        ) from exc


class Buffer:
    """NIXL-EP's ``nixl_ep.Buffer`` on moecomm; see the module docstring and
    docs/compat-nixl-ep.md. moecomm's options are keyword-only after NIXL-EP's arguments."""

    num_sms: int = 20

    def __init__(
        self,
        disable_ll_nvlink: bool = False,
        explicitly_destroy: bool = False,
        rank: int = 0,
        low_latency_mode: bool = True,
        group=None,
        comm=None,
        tcp_store_group=None,
        timeout_ms: int = DEFAULT_TIMEOUT_MS,
        *,
        replicas: dict[int, list[int]] | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        store_prefix: str = DEFAULT_STORE_PREFIX,
    ) -> None:
        if group is not None and comm is not None:
            raise ValueError("pass group or comm, not both (as NIXL-EP asserts)")
        if not low_latency_mode:
            raise _refused("__init__(low_latency_mode=False)", _HT)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {rank!r}")
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms < 0:
            raise ValueError(f"timeout_ms must be an int >= 0, got {timeout_ms!r}")
        if not (isinstance(connect_timeout, (int, float)) and connect_timeout > 0):
            raise ValueError(f"connect_timeout must be > 0 seconds, got {connect_timeout!r}")
        self.rank = rank
        self.group_size = 0  # update_memory_buffers sets it
        self.low_latency_mode = True
        self.timeout_ms = timeout_ms
        self.explicitly_destroy = explicitly_destroy
        self.group, self.comm, self.tcp_store_group = group, comm, tcp_store_group
        self.disable_ll_nvlink = disable_ll_nvlink  # accepted: there is no NVLink path here
        self.num_nvl_bytes = self.num_rdma_bytes = 0
        if replicas is None:
            replicas = _replicas_from_env()
        timeout = max(timeout_ms, 1) / 1000.0
        self.runtime: Runtime | None = Runtime(
            rank, timeout, float(connect_timeout), store_prefix, replicas
        )

    def _rt(self, method: str) -> Runtime:
        if self.runtime is None:
            raise RuntimeError(f"nixl_ep.Buffer.{method}: this Buffer was destroyed")
        return self.runtime

    def destroy(self) -> None:
        """Releases the channels (peers waiting on this rank's answers fail at once). Needs
        ``explicitly_destroy=True``, as NIXL-EP asserts; otherwise the Buffer is released when
        it is garbage-collected."""
        if not self.explicitly_destroy:
            raise RuntimeError("`explicitly_destroy` flag must be set (as NIXL-EP asserts)")
        self._rt("destroy").destroy()
        self.runtime = None

    def __del__(self) -> None:
        runtime = getattr(self, "runtime", None)
        if runtime is not None and not getattr(self, "explicitly_destroy", True):
            with contextlib.suppress(Exception):
                runtime.destroy()

    # ------------------------------------------------------------------ static helpers
    @staticmethod
    def is_sm90_compiled():
        return False  # no NIXL-EP kernels here

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms % 2:
            raise ValueError("The SM count must be even")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_buffer_size_hint(
        num_max_dispatch_tokens_per_rank: int,
        hidden: int,
        num_ranks: int,
        num_experts: int,
    ) -> int:
        """Bytes of shared memory one rank maps at this shape (slots at top-8) with all
        ``num_ranks`` connected. ``update_memory_buffers`` accepts any ``num_rdma_bytes``: the
        slots are sized at the first dispatch."""
        return size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int,
        hidden: int,
        num_ranks: int,
        num_experts: int,
    ) -> int:
        return Buffer.get_low_latency_buffer_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts
        )

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return table_config(_DISPATCH_CONFIGS, num_ranks, Buffer.num_sms, Config)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return table_config(_COMBINE_CONFIGS, num_ranks, Buffer.num_sms, Config)

    def get_comm_stream(self) -> torch.Stream:
        raise _refused("get_comm_stream", "host calls run on the caller's thread; no stream")

    def get_local_buffer_tensor(
        self,
        dtype: torch.dtype,
        size: torch.Size | None = None,
        offset: int = 0,
        use_rdma_buffer: bool = False,
    ) -> torch.Tensor:
        """An empty tensor of `dtype`. NIXL-EP returns its registered buffer, which vLLM's
        fault-tolerance retry zeroes to reset the kernels' counters and flags; moecomm has no
        such buffer (a request and an answer ring per peer) and its rounds are numbered, so
        nothing needs resetting: zeroing the empty tensor is that no-op. A slice of the buffer
        (``size``) is refused: there are no bytes to give."""
        self._rt("get_local_buffer_tensor")
        if size is not None and torch.Size(size).numel() > 0:
            raise _refused(
                "get_local_buffer_tensor(size=...)",
                "moecomm's slots are one ring per peer in separate segments, not one registered "
                "buffer; there are no raw bytes to slice",
            )
        return torch.empty(0, dtype=dtype)

    # ------------------------------------------------------------------ membership, masks
    def update_memory_buffers(
        self,
        num_ranks: int,
        num_experts_per_rank: int,
        num_rdma_bytes: int,
        num_nvl_bytes: int = 0,
    ):
        """Sets the rank capacity (``num_ranks``) and ``num_experts_per_rank``; every rank but
        this one is masked until connected. The byte sizes are accepted and ignored."""
        self._rt("update_memory_buffers").update_memory_buffers(num_ranks, num_experts_per_rank)
        self.group_size = num_ranks
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes

    def set_tcp_store_group(self, tcp_store_group) -> None:
        self.tcp_store_group = tcp_store_group

    def connect_ranks(self, remote_ranks: list[int], activate: bool = True) -> None:
        """Connects this rank with `remote_ranks` (this rank and connected ones are skipped),
        through ``tcp_store_group``: blocks until each of them connects with this rank too.
        ``activate`` unmasks them; with False new ranks stay masked until
        ``update_mask_buffer(rank, False)``."""
        self._rt("connect_ranks").connect(self.tcp_store_group, remote_ranks, bool(activate))

    def disconnect_ranks(self, remote_ranks: list[int]) -> None:
        """Masks `remote_ranks` and drops this rank's channels to them (local; no store)."""
        self._rt("disconnect_ranks").disconnect(remote_ranks)

    def update_mask_buffer(self, rank_to_mask: int, mask: bool = False):
        """Masks (no data to or from it) or unmasks a rank; not this rank, and only a connected
        rank can be unmasked."""
        self._rt("update_mask_buffer").update_mask(rank_to_mask, mask)

    def query_mask_buffer(self, mask_status: torch.Tensor):
        """Writes every rank's mask (1 = masked) into int32 ``mask_status`` of ``num_ranks``
        entries (any device)."""
        self._rt("query_mask_buffer").query_mask(mask_status)

    def clean_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int):
        """NIXL-EP's earlier API (SGLang 0.5.23 calls it after a reconfiguration): zero this
        rank's low-latency buffer for that shape. moecomm's rings hold no counters or flags a
        zero-fill resets (their state is numbered rounds, re-synchronised by connect and the
        mask calls), so after checking the arguments there is nothing to do."""
        for name, value in (
            ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
            ("hidden", hidden),
            ("num_experts", num_experts),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"clean_buffer: {name} must be a positive int, got {value!r}")

    def clean_mask_buffer(self):
        """Unmasks the connected ranks and this one, masks the others."""
        self._rt("clean_mask_buffer").clean_mask()

    def barrier(self) -> None:
        """A round of the active ranks carrying nothing; masks a rank that does not arrive."""
        self._rt("barrier").barrier()

    @property
    def local_experts(self) -> list[int]:
        """The expert of each row block of recv_x: ``rank*L .. rank*L+L-1``, then (with
        moecomm's ``replicas``) the replicas this rank hosts, sorted."""
        rt = self._rt("local_experts")
        eng = rt.need("local_experts")
        if eng.shape is not None:
            return eng.local_experts
        spec = check_replicas_arg(rt.replicas, False, True, rt.num_ranks)
        plan = ReplicaPlan(spec, rt.num_ranks * rt.num_experts_per_rank, rt.num_ranks)
        return list(plan.local[self.rank])

    @property
    def dropped_copies(self) -> int:
        """(token, k) copies this rank routed to a masked rank (no live copy of the expert)."""
        return self._rt("dropped_copies").need("dropped_copies").dropped_copies

    # ------------------------------------------------------------------ data path
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """NIXL-EP's: ``(num_tokens_per_rank [num_ranks], num_tokens_per_rdma_rank (None up to 8
        ranks), num_tokens_per_expert [num_experts], is_token_in_rank [T, num_ranks], event)``,
        over the rank capacity."""
        out = self._rt("get_dispatch_layout").dispatch_layout(topk_idx, num_experts)
        return (*out, EventOverlap(_HostEvent() if async_finish else None))

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        """Returns ``(recv_x, recv_count, handle, event, hook)`` as NIXL-EP does: recv_x
        ``[L, rank_bound * M, H]`` bf16, or with use_fp8 ``(e4m3 data, scales)`` (f32
        ``[L, rank_bound * M, H/128]``, with use_ue8m0 int32 ``[.., H/512]``; column-major last
        two dims); ``rank_bound = num_experts / L`` (default: the active ranks). handle =
        ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden)``."""
        stats, cost = cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats
        recv_x, count, handle, hook = self._rt("dispatch").dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, stats, cost,
            use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
        )  # fmt: skip
        event = EventOverlap(_HostEvent(), (x, topk_idx)) if async_finish else EventOverlap()
        return recv_x, count, handle, event, hook

    # NIXL-EP's ``dispatch(*args, **kwargs)`` calls ``low_latency_dispatch``: the same method.
    dispatch = low_latency_dispatch

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: tuple,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ):
        """Returns ``(combined_x, event, hook)``: ``combined_x[t] = Σ_k w[t, k] · x(t, k)`` in
        f32 (k ascending), bf16 ``[num_tokens, hidden]``; copies routed to a rank masked by then
        count as -1 (NIXL-EP), or come from the replica they were routed to (moecomm's
        ``replicas``)."""
        combined, hook = self._rt("combine").combine(
            x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
            return_recv_hook, out, combine_wait_recv_cost_stats,
        )  # fmt: skip
        event = EventOverlap(_HostEvent(), (x, topk_idx)) if async_finish else EventOverlap()
        return combined, event, hook

    # NIXL-EP's ``combine(*args, **kwargs)`` calls ``low_latency_combine``: the same method.
    combine = low_latency_combine

    def get_next_combine_buffer(self, handle: tuple):
        """The bf16 ``[L, rank_bound * M, H]`` tensor the next ``combine(..., zero_copy=True)``
        reads the expert outputs from (fill it yourself); reused two combines later."""
        return self._rt("get_next_combine_buffer").next_combine_buffer(handle)

    # ------------------------------------------------------------------ refused
    def ht_dispatch(
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
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        raise _refused("ht_dispatch", _HT)

    def ht_combine(
        self,
        x,
        handle,
        topk_weights=None,
        bias=None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        raise _refused("ht_combine", _HT)
