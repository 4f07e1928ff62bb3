"""DeepEP's module-level API apart from the buffers, which every API of ``moecomm.compat``
shares: ``Config`` (the high-throughput kernels' tuning record, ``deep_ep._C.Config``), the
recommended configs by rank count (``Buffer.get_dispatch_config`` / ``get_combine_config``),
the domain-size functions of ``deep_ep/utils/envs.py``, ``topk_idx_t``, the events of
``deep_ep/utils/event.py`` (``EventHandle``, ``EventOverlap``, and moecomm's
``CompletedEvent``), and the error of a call moecomm refuses by name.

moecomm's normal mode moves rows over its host channels, so a ``Config`` is accepted and
ignored by the calls; it is kept with DeepEP's checks and size hints (callers such as SGLang
size ``num_nvl_bytes`` / ``num_rdma_bytes`` with them, which moecomm ignores as well)."""

from __future__ import annotations

import torch

__all__ = [
    "CompletedEvent",
    "Config",
    "EventHandle",
    "EventOverlap",
    "combine_config",
    "dispatch_config",
    "get_logical_domain_size",
    "get_physical_domain_size",
    "refused",
    "table_config",
    "topk_idx_t",
]

# ``deep_ep.topk_idx_t`` / ``nixl_ep.topk_idx_t`` (the C++ ``topk_idx_t``, int64 in their
# default builds).
topk_idx_t = torch.int64


def refused(owner: str, method: str, why: str) -> NotImplementedError:
    """The error of ``{owner}.{method}`` (``owner``: ``deep_ep.Buffer``, ``nixl_ep.Buffer``,
    ``ElasticBuffer``), a call moecomm does not implement."""
    return NotImplementedError(f"{owner}.{method} is not implemented by moecomm: {why}")


# csrc/kernels/legacy/compiled.cuh and config.hpp of DeepEP.
NUM_MAX_NVL_PEERS = 8
_NUM_MAX_TOPK = 128
_NUM_MAX_SCALES = 128
_SOURCE_META_BYTES = 8  # sizeof(internode::SourceMeta): two ints
_TOPK_IDX_BYTES = 8  # sizeof(topk_idx_t): int64
_INT, _FLOAT, _INT4 = 4, 4, 16


def _align_up(a: int, b: int) -> int:
    return (a + b - 1) // b * b


class Config:
    """``deep_ep.Config(num_sms=20, num_max_nvl_chunked_send_tokens=6,
    num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
    num_max_rdma_chunked_recv_tokens=256)`` with DeepEP's checks (``csrc/legacy/config.hpp``):
    the RDMA receive chunk is aligned up to a multiple of the send chunk.

    ``moecomm.compat.nixl_ep.Config`` is this class under NIXL-EP's name (NIXL-EP's
    ``csrc/config.hpp`` is DeepEP's): ``_api`` and ``_upstream`` name the module and the
    project in the errors and the repr."""

    _api = "deep_ep"
    _upstream = "DeepEP"

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ) -> None:
        values = (
            num_sms,
            num_max_nvl_chunked_send_tokens,
            num_max_nvl_chunked_recv_tokens,
            num_max_rdma_chunked_send_tokens,
            num_max_rdma_chunked_recv_tokens,
        )
        if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise TypeError(f"{self._api}.Config takes five ints, got {values!r}")
        nvl_send, nvl_recv = num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens
        rdma_send, rdma_recv = num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens
        self._check(num_sms >= 0, "num_sms >= 0")
        self._check(nvl_send > 0 and nvl_recv > 0, "NVL chunk sizes > 0")
        self._check(nvl_send < nvl_recv, "num_max_nvl_chunked_send_tokens < ..._recv_tokens")
        self._check(rdma_send > 0 and rdma_recv > 0, "RDMA chunk sizes > 0")
        rdma_recv = _align_up(rdma_recv, rdma_send)
        self._check(rdma_send < rdma_recv, "num_max_rdma_chunked_send_tokens < ..._recv_tokens")
        self._check(rdma_send <= rdma_recv // 2, "num_max_rdma_chunked_send_tokens <= recv / 2")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = nvl_send
        self.num_max_nvl_chunked_recv_tokens = nvl_recv
        self.num_max_rdma_chunked_send_tokens = rdma_send
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    def _fields(self) -> tuple[int, int, int, int, int]:
        return (
            self.num_sms,
            self.num_max_nvl_chunked_send_tokens,
            self.num_max_nvl_chunked_recv_tokens,
            self.num_max_rdma_chunked_send_tokens,
            self.num_max_rdma_chunked_recv_tokens,
        )

    def _check(self, ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"{self._api}.Config: needs {what} (as {self._upstream} asserts)")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and (other._api, other._fields()) == (
            self._api,
            self._fields(),
        )

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return f"{self._api}.Config{self._fields()}"

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's NVLink buffer size for this config (bytes, 128-aligned)."""
        self._check(
            num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0,
            f"num_ranks ({num_ranks}) < {NUM_MAX_NVL_PEERS} or a multiple of it",
        )
        self._check(num_ranks <= NUM_MAX_NVL_PEERS or self.num_sms % 2 == 0, "an even num_sms")
        num_rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        num_nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        per = (self.num_sms // 2) * num_nvl_ranks
        recv = self.num_max_nvl_chunked_recv_tokens
        n = per * (2 * num_rdma_ranks + 3) * _INT
        n += per * recv * hidden_bytes
        n += per * recv * _SOURCE_META_BYTES
        n += per * recv * _NUM_MAX_TOPK * _TOPK_IDX_BYTES
        n += per * recv * _NUM_MAX_TOPK * _FLOAT
        n += per * recv * _NUM_MAX_SCALES * _FLOAT
        return _align_up(n, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer size for this config (0 within one NVLink domain)."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        self._check(
            num_ranks % NUM_MAX_NVL_PEERS == 0, f"num_ranks a multiple of {NUM_MAX_NVL_PEERS}"
        )
        self._check(self.num_sms % 2 == 0, "an even num_sms")
        per = (self.num_sms // 2) * (num_ranks // NUM_MAX_NVL_PEERS)
        recv = self.num_max_rdma_chunked_recv_tokens
        n = per * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * _INT
        n += per * recv * hidden_bytes * 2
        n += per * recv * _SOURCE_META_BYTES * 2
        n += per * recv * _NUM_MAX_TOPK * _TOPK_IDX_BYTES * 2
        n += per * recv * _NUM_MAX_TOPK * _FLOAT * 2
        n += per * recv * _NUM_MAX_SCALES * _FLOAT * 2
        n += per * recv * _INT4 * 2
        return _align_up(n, 128)


# deep_ep/buffers/legacy.py: Buffer.get_dispatch_config / get_combine_config, by rank count:
# (nvl send, nvl recv, rdma send, rdma recv); num_sms is Buffer.num_sms at the call.
_DISPATCH = {
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (36, 288, 20, 128),
    24: (32, 288, 8, 128),
    32: (32, 288, 8, 128),
    48: (32, 288, 8, 128),
    64: (32, 288, 8, 128),
    96: (20, 480, 12, 128),
    128: (20, 560, 12, 128),
    144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
_COMBINE = {
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (4, 288, 12, 128),
    24: (1, 288, 8, 128),
    32: (1, 288, 8, 128),
    48: (1, 288, 8, 128),
    64: (1, 288, 8, 128),
    96: (1, 480, 8, 128),
    128: (1, 560, 8, 128),
    144: (2, 720, 8, 128),
    160: (2, 720, 8, 128),
}


def table_config(table: dict, num_ranks: int, num_sms: int, cls: type[Config] = Config) -> Config:
    """``cls(num_sms, *table[num_ranks])``: a recommended config from a table of chunk sizes by
    rank count (DeepEP's here, NIXL-EP's in ``nixl_ep``)."""
    if num_ranks not in table:
        # DeepEP and NIXL-EP assert the same (their tuned tables have no other rank counts).
        raise ValueError(f"Unsupported number of EP ranks: {num_ranks}")
    return cls(num_sms, *table[num_ranks])


def dispatch_config(num_ranks: int, num_sms: int) -> Config:
    return table_config(_DISPATCH, num_ranks, num_sms)


def combine_config(num_ranks: int, num_sms: int) -> Config:
    return table_config(_COMBINE, num_ranks, num_sms)


def _group_size(group) -> int:
    if hasattr(group, "size"):
        return int(group.size())
    if hasattr(group, "Get_size"):  # an mpi4py communicator
        return int(group.Get_size())
    raise TypeError(f"expected a ProcessGroup, got {type(group).__name__}")


def get_physical_domain_size(group) -> tuple[int, int]:
    """``(num_rdma_ranks, num_nvlink_ranks)``: moecomm's transports here (shared memory, CUDA
    IPC) serve the ranks of one machine, so one RDMA rank and every rank in the scale-up
    domain."""
    return 1, _group_size(group)


def get_logical_domain_size(group, allow_hybrid_mode: bool = True) -> tuple[int, int]:
    """``(num_scaleout_ranks, num_scaleup_ranks)``: as the physical domain (no hybrid mode)."""
    return 1, _group_size(group)


# ---------------------------------------------------------------------------- events
class EventHandle:
    """DeepEP's ``deep_ep.EventHandle``: an event recorded on the current CUDA stream at
    construction; ``current_stream_wait()`` makes the (then) current stream wait for it.

    Where CUDA was never initialised in this process no device work exists to order, so the
    handle records nothing (``event`` is None) and its wait is a no-op: the host calls of
    moecomm are complete when they return."""

    def __init__(self) -> None:
        self.event = None
        if torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """DeepEP's ``deep_ep.EventOverlap`` (``deep_ep/utils/event.py``): ``event`` (an
    :class:`EventHandle`-like object, or None), ``extra_tensors``, ``current_stream_wait()``,
    ``register_hook_after_wait``, ``with event:`` / ``with event(release_handle=True):``.

    One difference: DeepEP asserts ``event is not None`` in ``current_stream_wait``; here an
    event of None stands for a call that completed on the host before it returned (moecomm's
    host path), so the wait is a no-op (the hook still runs)."""

    def __init__(self, event=None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            self.hook_after_wait()
            self.hook_after_wait = None
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait) -> None:
        if self.hook_after_wait is not None:
            raise RuntimeError("A hook is already registered on this `EventOverlap`")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


class CompletedEvent(EventOverlap):
    """The event of a host call: complete when the call returned (``event`` is None, as
    DeepEP's is without ``async_finish``)."""

    def __init__(self) -> None:
        super().__init__(None)
