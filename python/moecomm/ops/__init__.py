"""Expert-path compute: quantization, dispatch packing, reorganization, grouped GEMM, combine."""
