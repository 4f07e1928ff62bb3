"""Expert-path compute: quantization, dispatch packing, reorganization, grouped GEMM, combine."""

from moecomm.ops.combine import combine, combine_reference
from moecomm.ops.dispatch import ExpertMap, ServerBatch, pack_dispatch, pack_dispatch_reference
from moecomm.ops.grouped_gemm import (
    DEFAULT_BLOCK_M,
    ShrunkGroups,
    expert_forward,
    group_shrink,
    grouped_mlp_contiguous,
    grouped_mlp_masked,
    stack_gate_up,
)
from moecomm.ops.quant import (
    dequantize,
    dequantize_reference,
    encoding_dtype,
    encoding_for_dtype,
    quantize,
    quantize_reference,
    scales_per_token,
)
from moecomm.ops.reorg import ExpertLayout, combine_rows, gather_tokens, reorganize
from moecomm.ops.workspace import ExpertWorkspace

__all__ = [
    "DEFAULT_BLOCK_M",
    "ExpertLayout",
    "ExpertMap",
    "ExpertWorkspace",
    "ServerBatch",
    "ShrunkGroups",
    "combine",
    "combine_reference",
    "combine_rows",
    "dequantize",
    "dequantize_reference",
    "encoding_dtype",
    "encoding_for_dtype",
    "expert_forward",
    "gather_tokens",
    "group_shrink",
    "grouped_mlp_contiguous",
    "grouped_mlp_masked",
    "pack_dispatch",
    "pack_dispatch_reference",
    "quantize",
    "quantize_reference",
    "reorganize",
    "scales_per_token",
    "stack_gate_up",
]


def __getattr__(name: str):
    # The Triton twin of `quantize` was reachable only from tests and is gone; it returned the
    # same bits as `quantize` for the same arguments, so its name now forwards there.
    if name == "triton_quantize":
        import warnings

        warnings.warn(
            "moecomm.ops.triton_quantize is deprecated: use moecomm.ops.quantize (same "
            "arguments, same bits)",
            DeprecationWarning,
            stacklevel=2,
        )
        return quantize
    raise AttributeError(f"module 'moecomm.ops' has no attribute {name!r}")
