"""Expert-path compute: quantization, dispatch packing, reorganization, grouped GEMM, combine."""

from moecomm.ops.combine import combine, combine_reference
from moecomm.ops.dispatch import ExpertMap, ServerBatch, pack_dispatch, pack_dispatch_reference
from moecomm.ops.quant import (
    dequantize,
    dequantize_reference,
    encoding_dtype,
    encoding_for_dtype,
    quantize,
    quantize_reference,
    scales_per_token,
)
from moecomm.ops.triton_quant import triton_quantize

__all__ = [
    "ExpertMap",
    "ServerBatch",
    "combine",
    "combine_reference",
    "dequantize",
    "dequantize_reference",
    "encoding_dtype",
    "encoding_for_dtype",
    "pack_dispatch",
    "pack_dispatch_reference",
    "quantize",
    "quantize_reference",
    "scales_per_token",
    "triton_quantize",
]
