// Group-shrink: block-wide prefix scans over the per-expert counts, and the tile map.
#include <cuda_runtime.h>

#include "common/align.h"
#include "common/error.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/scan.h"

namespace moecomm::kernels::cuda {
namespace {

// One block of this many threads scans the counts: a server hosts hundreds of experts, so one
// or two chunks cover them and a single block needs no inter-block carry.
constexpr int kScanThreads = 1024;
constexpr int kScanWarps = kScanThreads / dev::kWarpSize;
// Threads per block of the tile map: one thread per tile.
constexpr int kTileMapThreads = 256;

// The shared block scan (device_common.cuh) at this file's block size.
template <typename T>
__device__ T block_inclusive_scan(T v, T* warp_sums, T* total) {
  return dev::block_inclusive_scan<kScanThreads>(v, warp_sums, total);
}

__global__ void __launch_bounds__(kScanThreads)
    group_shrink_kernel(const int32_t* counts, int32_t num_experts, int32_t block_m,
                        ShrinkOutputs out) {
  __shared__ int64_t row_sums[kScanWarps];
  __shared__ int32_t int_sums[kScanWarps];
  int64_t rows = 0;
  int32_t n_active = 0;
  int32_t n_tiles = 0;
  if (threadIdx.x == 0) {
    out.offsets[0] = 0;
    out.tile_offsets[0] = 0;
  }
  for (int32_t e0 = 0; e0 < num_experts; e0 += kScanThreads) {
    const int32_t e = e0 + static_cast<int32_t>(threadIdx.x);
    const int32_t c = e < num_experts ? counts[e] : 0;
    const int32_t act = c > 0 ? 1 : 0;
    const int32_t tiles = static_cast<int32_t>(ceil_div(static_cast<uint64_t>(c), block_m));
    int64_t chunk_rows = 0;
    int32_t chunk_active = 0;
    int32_t chunk_tiles = 0;
    const int64_t row_incl = block_inclusive_scan<int64_t>(c, row_sums, &chunk_rows);
    const int32_t act_incl = block_inclusive_scan<int32_t>(act, int_sums, &chunk_active);
    const int32_t tile_incl = block_inclusive_scan<int32_t>(tiles, int_sums, &chunk_tiles);
    if (e < num_experts) {
      out.offsets[e + 1] = rows + row_incl;
      if (act) {
        const int32_t pos = n_active + act_incl - 1;
        out.active[pos] = e;
        out.tile_counts[pos] = tiles;
        out.tile_offsets[pos + 1] = n_tiles + tile_incl;
      }
    }
    rows += chunk_rows;
    n_active += chunk_active;
    n_tiles += chunk_tiles;
  }
  if (threadIdx.x == 0) {
    out.totals[0] = n_active;
    out.totals[1] = n_tiles;
  }
}

__global__ void tile_map_kernel(const int32_t* tile_offsets, const int32_t* active,
                                const int32_t* totals, int32_t max_tiles, int32_t* tile_expert,
                                int32_t* tile_mblock) {
  const int32_t t = static_cast<int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (t >= max_tiles) return;
  const int32_t n_active = totals[0];
  if (t >= totals[1]) {
    tile_expert[t] = -1;
    tile_mblock[t] = 0;
    return;
  }
  // Largest a with tile_offsets[a] <= t: tile_offsets[0] = 0 <= t always holds, and
  // tile_offsets[n_active] = num_tiles > t, so a < n_active.
  const int32_t a = dev::last_at_most(tile_offsets, n_active, t);
  tile_expert[t] = active[a];
  tile_mblock[t] = t - tile_offsets[a];
}

}  // namespace

void launch_group_shrink(const int32_t* counts, int32_t num_experts, int32_t block_m,
                         const ShrinkOutputs& out, void* stream) {
  MC_CHECK(num_experts > 0, "group_shrink: expected num_experts > 0, got ", num_experts);
  MC_CHECK(block_m > 0, "group_shrink: expected block_m > 0, got ", block_m);
  group_shrink_kernel<<<1, kScanThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      counts, num_experts, block_m, out);
  check_kernel(static_cast<cudaStream_t>(stream), "group shrink");
}

void launch_tile_map(const int32_t* tile_offsets, const int32_t* active, const int32_t* totals,
                     int32_t max_tiles, int32_t* tile_expert, int32_t* tile_mblock, void* stream) {
  MC_CHECK(max_tiles >= 0, "tile_map: expected max_tiles >= 0, got ", max_tiles);
  if (max_tiles == 0) return;
  const int blocks = static_cast<int>(ceil_div(static_cast<uint64_t>(max_tiles), kTileMapThreads));
  tile_map_kernel<<<blocks, kTileMapThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      tile_offsets, active, totals, max_tiles, tile_expert, tile_mblock);
  check_kernel(static_cast<cudaStream_t>(stream), "tile map");
}

}  // namespace moecomm::kernels::cuda
