// Device helpers shared by the CUDA kernels: element conversions, warp/block reductions and
// scans, a search over sorted offsets, and the quantization steps of moecomm.ops.quant (IEEE
// division, round-half-even conversions, step for step as the torch reference, which is what
// makes results bit-exact).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "protocol/header.h"

namespace moecomm::kernels::cuda::dev {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

constexpr float kInt8Max = 127.0f;     // symmetric: -128 is never produced
constexpr float kFp8E4M3Max = 448.0f;  // largest finite e4m3 (fn) value
constexpr float kZeroScale = 1.0f;     // scale of an all-zero group, as in moecomm.ops.quant
// Block-scaled fp8 (kFP8E4M3B128): one warp per 128-channel block, so each lane owns 4 channels.
constexpr int kLanesPerScaleBlock = static_cast<int>(protocol::kScaleBlock) / kWarpSize;
static_assert(protocol::kScaleBlock % kWarpSize == 0, "a scale block spans whole warps");

__device__ __forceinline__ float to_f32(float v) {
  return v;
}
__device__ __forceinline__ float to_f32(__half v) {
  return __half2float(v);
}
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

// Element i of an unquantized array (kBF16, kFP16, kF32) as f32; exact.
__device__ __forceinline__ float load_f32(const void* p, uint64_t i, protocol::Encoding enc) {
  switch (enc) {
    case protocol::Encoding::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case protocol::Encoding::kFP16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// Stores v rounded to nearest even into element i (what torch's .to(dtype) does).
__device__ __forceinline__ void store_f32(void* p, uint64_t i, protocol::Encoding enc, float v) {
  switch (enc) {
    case protocol::Encoding::kBF16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      break;
    case protocol::Encoding::kFP16:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
      break;
  }
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

__device__ __forceinline__ float scale_of(float amax, float qmax) {
  return amax == 0.0f ? kZeroScale : __fdiv_rn(amax, qmax);
}

template <bool kInt8>
__device__ __forceinline__ uint8_t encode(float v, float scale) {
  const float qmax = kInt8 ? kInt8Max : kFp8E4M3Max;
  const float y = fminf(fmaxf(__fdiv_rn(v, scale), -qmax), qmax);
  if constexpr (kInt8) {
    return static_cast<uint8_t>(static_cast<int8_t>(__float2int_rn(y)));
  } else {
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
  }
}

// Block-scaled fp8 of one 128-channel block of `row`, by one warp (all lanes call it): lane l
// owns channels block * 128 + l + 32 * i. store(c, byte) receives the e4m3 byte of each of the
// lane's channels below `hidden`; every lane returns the block's scale. The quantize kernel and
// the dispatch pack both encode through here, so their bytes are the same.
template <typename T, typename Store>
__device__ __forceinline__ float quantize_block128_warp(const T* row, uint32_t hidden,
                                                        uint32_t block, uint32_t lane,
                                                        Store store) {
  const uint32_t base = block * protocol::kScaleBlock + lane;
  float v[kLanesPerScaleBlock];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kLanesPerScaleBlock; ++i) {
    const uint32_t c = base + i * kWarpSize;
    v[i] = c < hidden ? to_f32(row[c]) : 0.0f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
  const float scale = scale_of(warp_max(amax), kFp8E4M3Max);
#pragma unroll
  for (int i = 0; i < kLanesPerScaleBlock; ++i) {
    const uint32_t c = base + i * kWarpSize;
    if (c < hidden) store(c, encode<false>(v[i], scale));
  }
  return scale;
}

template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x % kWarpSize;
  for (int d = 1; d < kWarpSize; d *= 2) {
    const T up = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v += up;
  }
  return v;
}

// Inclusive scan over a block of kThreads threads; `total` receives the block sum. `warp_sums`
// is shared memory of kThreads / 32 entries. Every thread of the block must call it; it ends
// with a barrier, so warp_sums can be reused at once.
template <int kThreads, typename T>
__device__ T block_inclusive_scan(T v, T* warp_sums, T* total) {
  constexpr int kWarps = kThreads / kWarpSize;
  static_assert(kThreads % kWarpSize == 0 && kWarps <= kWarpSize, "one warp scans the warps");
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  v = warp_inclusive_scan(v);
  if (lane == kWarpSize - 1) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T s = lane < kWarps ? warp_sums[lane] : T{0};
    s = warp_inclusive_scan(s);
    if (lane < kWarps) warp_sums[lane] = s;
  }
  __syncthreads();
  if (warp > 0) v += warp_sums[warp - 1];
  *total = warp_sums[kWarps - 1];
  __syncthreads();
  return v;
}

// Block-wide max of v over kThreads threads; every thread gets the result.
template <int kThreads>
__device__ float block_max(float v, float* warp_max_smem) {
  constexpr int kWarps = kThreads / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  v = warp_max(v);
  if (lane == 0) warp_max_smem[warp] = v;
  __syncthreads();
  float m = lane < kWarps ? warp_max_smem[lane] : 0.0f;
  m = warp_max(m);
  __syncthreads();  // warp_max_smem is reused by the next call
  return m;
}

// One scale per token (kInt8, kFP8E4M3) over a block of kThreads threads: the amax of the row,
// then its scale; every thread gets it. `warp_max_smem`: kThreads / 32 floats of shared memory.
template <int kThreads, typename T>
__device__ float token_scale(const T* row, uint32_t hidden, float qmax, float* warp_max_smem) {
  float amax = 0.0f;
  for (uint32_t c = threadIdx.x; c < hidden; c += kThreads) {
    amax = fmaxf(amax, fabsf(to_f32(row[c])));
  }
  return scale_of(block_max<kThreads>(amax, warp_max_smem), qmax);
}

// The largest i in [0, n) with sorted[i] <= x, for a non-decreasing `sorted` with sorted[0] <= x
// (the caller's invariant) and n >= 1. Equal entries resolve to the last of them, so an empty
// range (its start equal to the next one's) is passed over.
template <typename T, typename V>
__device__ __forceinline__ int32_t last_at_most(const T* sorted, int32_t n, V x) {
  int32_t lo = 0;
  int32_t hi = n;
  while (hi - lo > 1) {
    const int32_t mid = (lo + hi) / 2;
    if (sorted[mid] <= x) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace moecomm::kernels::cuda::dev
