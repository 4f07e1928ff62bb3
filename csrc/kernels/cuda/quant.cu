// Per-token quantize kernels. One block per token; the reductions stay inside the block, so no
// atomics and no second launch. The arithmetic (device_common.cuh) mirrors the torch reference
// step for step, which is what makes the results bit-identical; the device dispatch packs with
// the same helpers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "common/align.h"
#include "common/error.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/quant.h"

namespace moecomm::kernels::cuda {
namespace {

using protocol::Encoding;

using dev::encode;
using dev::kFp8E4M3Max;
using dev::kInt8Max;
using dev::kWarpSize;
using dev::to_f32;

// 8 warps per token: enough loads in flight to cover a 7K-channel row, few enough that the
// block-wide max is one shuffle round plus 8 shared-memory slots.
constexpr int kThreadsPerBlock = 256;
constexpr int kWarpsPerBlock = kThreadsPerBlock / kWarpSize;

// One scale per token: block-wide max, then one pass to encode.
template <typename T, bool kInt8>
__global__ void __launch_bounds__(kThreadsPerBlock)
    quantize_token_kernel(const T* __restrict__ x, uint64_t x_stride, uint32_t hidden,
                          uint8_t* __restrict__ q, float* __restrict__ scales) {
  __shared__ float warp_amax[kWarpsPerBlock];
  const uint64_t token = blockIdx.x;
  const T* row = x + token * x_stride;
  uint8_t* q_row = q + token * hidden;
  const float scale =
      dev::token_scale<kThreadsPerBlock>(row, hidden, kInt8 ? kInt8Max : kFp8E4M3Max, warp_amax);
  if (threadIdx.x == 0) scales[token] = scale;
  for (uint32_t c = threadIdx.x; c < hidden; c += kThreadsPerBlock) {
    q_row[c] = encode<kInt8>(to_f32(row[c]), scale);
  }
}

// One scale per 128-channel block: each warp walks the blocks of the token, kWarpsPerBlock apart.
template <typename T>
__global__ void __launch_bounds__(kThreadsPerBlock)
    quantize_block128_kernel(const T* __restrict__ x, uint64_t x_stride, uint32_t hidden,
                             uint32_t num_blocks, uint8_t* __restrict__ q,
                             float* __restrict__ scales) {
  const uint64_t token = blockIdx.x;
  const T* row = x + token * x_stride;
  uint8_t* q_row = q + token * hidden;
  const uint32_t warp = threadIdx.x / kWarpSize;
  const uint32_t lane = threadIdx.x % kWarpSize;
  for (uint32_t b = warp; b < num_blocks; b += kWarpsPerBlock) {
    const float scale = dev::quantize_block128_warp(
        row, hidden, b, lane, [q_row](uint32_t c, uint8_t byte) { q_row[c] = byte; });
    if (lane == 0) scales[token * num_blocks + b] = scale;
  }
}

template <typename T>
void launch_typed(const QuantizeArgs& a, cudaStream_t stream) {
  const T* x = static_cast<const T*>(a.x);
  auto* q = static_cast<uint8_t*>(a.q);
  const dim3 grid(a.tokens);
  switch (a.out) {
    case Encoding::kInt8:
      quantize_token_kernel<T, true>
          <<<grid, kThreadsPerBlock, 0, stream>>>(x, a.x_row_stride, a.hidden, q, a.scales);
      break;
    case Encoding::kFP8E4M3:
      quantize_token_kernel<T, false>
          <<<grid, kThreadsPerBlock, 0, stream>>>(x, a.x_row_stride, a.hidden, q, a.scales);
      break;
    default: {
      const auto num_blocks = static_cast<uint32_t>(ceil_div(a.hidden, protocol::kScaleBlock));
      quantize_block128_kernel<T><<<grid, kThreadsPerBlock, 0, stream>>>(
          x, a.x_row_stride, a.hidden, num_blocks, q, a.scales);
      break;
    }
  }
}

}  // namespace

void launch_quantize(const QuantizeArgs& a, void* stream) {
  MC_CHECK(a.in == Encoding::kBF16 || a.in == Encoding::kFP16 || a.in == Encoding::kF32,
           "quantize input must be BF16, FP16 or F32, got encoding ", static_cast<int>(a.in));
  MC_CHECK(protocol::encoding_quantized(a.out),
           "quantize output must be INT8, FP8_E4M3 or FP8_E4M3_B128, got encoding ",
           static_cast<int>(a.out));
  MC_CHECK(a.hidden >= 1, "hidden must be >= 1, got ", a.hidden);
  MC_CHECK(a.x_row_stride >= a.hidden, "x_row_stride must be >= hidden (", a.hidden, "), got ",
           a.x_row_stride);
  if (a.tokens == 0) return;
  MC_CHECK(a.x != nullptr && a.q != nullptr && a.scales != nullptr,
           "x, q and scales must be non-null device pointers");
  auto s = static_cast<cudaStream_t>(stream);
  switch (a.in) {
    case Encoding::kBF16:
      launch_typed<__nv_bfloat16>(a, s);
      break;
    case Encoding::kFP16:
      launch_typed<__half>(a, s);
      break;
    default:
      launch_typed<float>(a, s);
      break;
  }
  MC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moecomm::kernels::cuda
