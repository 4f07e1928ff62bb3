"""``deep_ep.ElasticBuffer``'s handle, and the refusals of the surface moecomm does not answer
(elastic.py)."""

from __future__ import annotations

import torch

__all__ = ["AGRS", "ENGRAM", "PP", "EPHandle", "refuse"]


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
    def refused(self, *args, **kwargs):
        raise NotImplementedError(f"ElasticBuffer.{method} is not implemented by moecomm: {why}")

    refused.__name__ = method
    return refused


ENGRAM = "Engram (remote KV-cache fetch over RDMA into CPU storage) has no moecomm equivalent"
PP = "pipeline-parallel send/recv belongs to moecomm.stage_channel / moecomm.pipeline"
AGRS = "all-gather/reduce-scatter sessions are not an expert-parallel operation moecomm serves"
