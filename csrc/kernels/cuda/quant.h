// Per-token activation quantization on the GPU: the encodings INT8, FP8_E4M3 and FP8_E4M3_B128 of
// protocol/header.h, bit-identical to moecomm.ops.quant.quantize (the torch reference):
//   s = amax / qmax over the token (or 128-channel block), 1 for a group of zeros;
//   q = round_half_even(x / s) onto the int8 / e4m3 grid, saturating at qmax.
#pragma once

#include <cstdint>

#include "protocol/header.h"

namespace moecomm::kernels::cuda {

struct QuantizeArgs {
  const void* x = nullptr;  // [tokens, hidden] device memory, row stride x_row_stride elements
  protocol::Encoding in = protocol::Encoding::kBF16;  // kBF16, kFP16 or kF32
  uint64_t x_row_stride = 0;                          // elements between rows, >= hidden
  uint32_t tokens = 0;
  uint32_t hidden = 0;
  protocol::Encoding out = protocol::Encoding::kFP8E4M3;  // kInt8, kFP8E4M3 or kFP8E4M3B128
  void* q = nullptr;        // [tokens, hidden] contiguous, one byte per element
  float* scales = nullptr;  // [tokens, encoding_scales_per_token(out, hidden)] contiguous
};

// Checks the arguments (throws moecomm::Error naming the bad one) and enqueues the kernel on
// `stream` (a cudaStream_t). tokens == 0 enqueues nothing. No host synchronisation.
void launch_quantize(const QuantizeArgs& args, void* stream);

}  // namespace moecomm::kernels::cuda
