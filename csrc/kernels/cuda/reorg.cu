// Token reorganization kernels: static grid over the flat copies of all batches, one warp per
// tile of kReorgCopiesPerTile copies.
#include <cuda_runtime.h>

#include "common/align.h"
#include "common/error.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/reorg.h"

namespace moecomm::kernels::cuda {
namespace {

using dev::kFullMask;
using dev::kWarpSize;
static_assert(kReorgCopiesPerTile == kWarpSize, "one warp handles one tile");
// Warps per block: 8 tiles per block keeps blocks small enough that a decode step
// (a few thousand copies, ~100 tiles) still spreads over many SMs.
constexpr int kWarpsPerBlock = 8;
constexpr int kThreadsPerBlock = kWarpsPerBlock * kWarpSize;
// Threads per block of the per-expert column scan: one thread per expert.
constexpr int kScanThreadsPerBlock = 128;
// Rows are copied in 16-byte vectors when every address allows it.
constexpr int64_t kVectorBytes = 16;

// Expert of copy i, or -1 when the copy is absent, for another server, or out of range (the
// ids come from a client: a bad one must not make us write outside the layout).
__device__ __forceinline__ int32_t copy_expert(const ReorgInputs& in, int64_t i,
                                               int64_t num_copies) {
  if (i >= num_copies) return -1;
  const int32_t e = in.ids[i];
  return (e >= 0 && e < in.num_experts) ? e : -1;
}

__global__ void histogram_kernel(ReorgInputs in, int64_t num_tiles, int32_t* tile_hist) {
  const int64_t tile = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (tile >= num_tiles) return;  // uniform per warp
  const int lane = threadIdx.x % kWarpSize;
  const int64_t num_copies = in.num_tokens * in.topk;
  const int32_t e = copy_expert(in, tile * kWarpSize + lane, num_copies);
  const unsigned peers = __match_any_sync(kFullMask, e);
  // The lowest lane of each group of equal experts writes the group's size.
  if (e >= 0 && lane == __ffs(peers) - 1) {
    tile_hist[tile * in.num_experts + e] = __popc(peers);
  }
}

__global__ void column_scan_kernel(const int32_t* tile_hist, int64_t num_tiles, int32_t num_experts,
                                   int32_t* tile_prefix, int32_t* counts) {
  const int32_t e = static_cast<int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= num_experts) return;
  int32_t run = 0;
  for (int64_t t = 0; t < num_tiles; ++t) {
    tile_prefix[t * num_experts + e] = run;
    run += tile_hist[t * num_experts + e];
  }
  counts[e] = run;
}

template <typename Unit>
__device__ void copy_row(const ReorgRows& rows, int64_t token, int64_t pos, int lane) {
  const auto* src = reinterpret_cast<const Unit*>(static_cast<const char*>(rows.x) +
                                                  token * rows.row_stride_bytes);
  auto* dst = reinterpret_cast<Unit*>(static_cast<char*>(rows.out) + pos * rows.row_bytes);
  const int64_t units = rows.row_bytes / static_cast<int64_t>(sizeof(Unit));
  for (int64_t u = lane; u < units; u += kWarpSize) dst[u] = src[u];
}

template <typename Unit>
__global__ void scatter_kernel(ReorgInputs in, ReorgRows rows, const int64_t* offsets,
                               const int32_t* tile_prefix, ReorgOutputs out, int64_t num_tiles) {
  const int64_t tile = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (tile >= num_tiles) return;  // uniform per warp
  const int lane = threadIdx.x % kWarpSize;
  const int64_t num_copies = in.num_tokens * in.topk;
  const int64_t i = tile * kWarpSize + lane;
  const int32_t e = copy_expert(in, i, num_copies);
  const unsigned peers = __match_any_sync(kFullMask, e);
  const unsigned earlier_lanes = (1u << lane) - 1u;
  const int64_t token = i / in.topk;
  int64_t pos = -1;
  if (e >= 0) {
    pos = offsets[e] + tile_prefix[tile * in.num_experts + e] + __popc(peers & earlier_lanes);
    // Its batch: the last b with batch_offsets[b] <= token (empty batches are passed over).
    const int32_t b = dev::last_at_most(in.batch_offsets, in.num_batches, token);
    out.src_token[pos] = token;
    out.src_batch[pos] = b;
    out.src_row[pos] = static_cast<int32_t>(token - in.batch_offsets[b]);
    out.src_k[pos] = static_cast<int32_t>(i - token * in.topk);
    out.scores[pos] = in.scores[i];
  }
  if (i < num_copies) out.slot_of[i] = pos;
  // The warp copies its rows one after another, all lanes on one row: coalesced accesses.
  for (int j = 0; j < kWarpSize; ++j) {
    const int64_t pos_j = __shfl_sync(kFullMask, pos, j);
    const int64_t token_j = __shfl_sync(kFullMask, token, j);
    if (pos_j >= 0) copy_row<Unit>(rows, token_j, pos_j, lane);
  }
}

bool vector_aligned(const ReorgRows& rows) {
  const auto x = reinterpret_cast<uint64_t>(rows.x);
  const auto out = reinterpret_cast<uint64_t>(rows.out);
  return is_aligned(x, kVectorBytes) && is_aligned(out, kVectorBytes) &&
         is_aligned(static_cast<uint64_t>(rows.row_stride_bytes), kVectorBytes) &&
         is_aligned(static_cast<uint64_t>(rows.row_bytes), kVectorBytes);
}

void check_inputs(const ReorgInputs& in) {
  MC_CHECK(in.num_experts > 0, "reorg: expected num_experts > 0, got ", in.num_experts);
  MC_CHECK(in.topk > 0, "reorg: expected topk > 0, got ", in.topk);
  MC_CHECK(in.num_tokens >= 0, "reorg: expected num_tokens >= 0, got ", in.num_tokens);
  MC_CHECK(in.num_batches > 0, "reorg: expected num_batches > 0, got ", in.num_batches);
}

int grid_for(int64_t num_tiles) {
  return static_cast<int>(ceil_div(static_cast<uint64_t>(num_tiles), kWarpsPerBlock));
}

}  // namespace

int64_t reorg_num_tiles(int64_t num_tokens, int32_t topk) {
  return static_cast<int64_t>(ceil_div(
      static_cast<uint64_t>(num_tokens) * static_cast<uint64_t>(topk), kReorgCopiesPerTile));
}

void launch_reorg_histogram(const ReorgInputs& in, int32_t* tile_hist, void* stream) {
  check_inputs(in);
  const int64_t num_tiles = reorg_num_tiles(in.num_tokens, in.topk);
  if (num_tiles == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  MC_CUDA_CHECK(cudaMemsetAsync(
      tile_hist, 0, static_cast<size_t>(num_tiles) * in.num_experts * sizeof(int32_t), s));
  histogram_kernel<<<grid_for(num_tiles), kThreadsPerBlock, 0, s>>>(in, num_tiles, tile_hist);
  check_kernel(s, "reorg histogram");
}

void launch_reorg_column_scan(const int32_t* tile_hist, int64_t num_tiles, int32_t num_experts,
                              int32_t* tile_prefix, int32_t* counts, void* stream) {
  MC_CHECK(num_experts > 0, "reorg: expected num_experts > 0, got ", num_experts);
  const int blocks =
      static_cast<int>(ceil_div(static_cast<uint64_t>(num_experts), kScanThreadsPerBlock));
  column_scan_kernel<<<blocks, kScanThreadsPerBlock, 0, static_cast<cudaStream_t>(stream)>>>(
      tile_hist, num_tiles, num_experts, tile_prefix, counts);
  check_kernel(static_cast<cudaStream_t>(stream), "reorg column scan");
}

void launch_reorg_scatter(const ReorgInputs& in, const ReorgRows& rows, const int64_t* offsets,
                          const int32_t* tile_prefix, const ReorgOutputs& out, void* stream) {
  check_inputs(in);
  MC_CHECK(rows.row_bytes > 0 && rows.row_bytes % 2 == 0,
           "reorg: expected a positive, even row size in bytes, got ", rows.row_bytes);
  const int64_t num_tiles = reorg_num_tiles(in.num_tokens, in.topk);
  if (num_tiles == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (vector_aligned(rows)) {
    scatter_kernel<uint4><<<grid_for(num_tiles), kThreadsPerBlock, 0, s>>>(
        in, rows, offsets, tile_prefix, out, num_tiles);
  } else {
    scatter_kernel<uint16_t><<<grid_for(num_tiles), kThreadsPerBlock, 0, s>>>(
        in, rows, offsets, tile_prefix, out, num_tiles);
  }
  check_kernel(s, "reorg scatter");
}

}  // namespace moecomm::kernels::cuda
