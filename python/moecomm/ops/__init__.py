"""Expert-path compute: quantization, dispatch packing, reorganization, grouped GEMM, combine."""

from moecomm.ops.grouped_gemm import (
    DEFAULT_BLOCK_M,
    ShrunkGroups,
    expert_forward,
    group_shrink,
    grouped_mlp_contiguous,
    grouped_mlp_masked,
    stack_gate_up,
)
from moecomm.ops.reorg import ExpertLayout, combine_rows, gather_tokens, reorganize

__all__ = [
    "DEFAULT_BLOCK_M",
    "ExpertLayout",
    "ShrunkGroups",
    "combine_rows",
    "expert_forward",
    "gather_tokens",
    "group_shrink",
    "grouped_mlp_contiguous",
    "grouped_mlp_masked",
    "reorganize",
    "stack_gate_up",
]
