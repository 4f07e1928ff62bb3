"""``deep_ep.Buffer``'s normal-mode methods, answered by ``_normal.NormalMode``.

DeepEP lets one ``Buffer`` serve both modes (normal calls on a buffer built for low latency
too), so these are methods of every Buffer: the NormalMode is built at the first call over the
Buffer's own rendezvous (process group, mpi4py comm or store, keys under ``.../normal``) and
torn down by ``destroy()``. Signatures are DeepEP's (``deep_ep/buffers/legacy.py``).
"""

from __future__ import annotations

from moecomm.compat._ll_support import exchange
from moecomm.compat._normal import NormalMode
from moecomm.transport import ShmTransport

__all__ = ["NormalCalls"]


class NormalCalls:
    """Mixed into deep_ep.Buffer, which provides rank, num_ranks, group, store, store_prefix,
    comm, timeout and _check_open()."""

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

    def get_dispatch_layout(
        self,
        topk_idx,
        num_experts: int,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        return self._normal_mode().get_dispatch_layout(
            topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream
        )

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
        return self._normal_mode().dispatch(
            x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
            num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
            config, previous_event, async_finish, allocate_on_comm_stream,
        )  # fmt: skip

    def combine(
        self,
        x,
        handle,
        topk_weights=None,
        bias=None,
        config=None,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        return self._normal_mode().combine(
            x, handle, topk_weights, bias, config, previous_event, async_finish,
            allocate_on_comm_stream,
        )  # fmt: skip

    def _close_normal(self) -> None:
        if self._normal is not None:
            self._normal.destroy()
            self._normal = None
