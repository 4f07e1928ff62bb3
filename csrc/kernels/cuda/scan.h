// Group-shrink on the GPU: from per-expert row counts, a prefix scan gives the row offsets, the
// compact list of active experts and their tiles, so the grouped GEMM launches over active
// experts only. Everything stays in device memory: no host synchronisation, CUDA-graph safe.
#pragma once

#include <cstdint>

namespace moecomm::kernels::cuda {

// Outputs of launch_group_shrink, all device memory. Entries past totals[0] (active lists) and
// totals[1] (tiles) are left as they were.
struct ShrinkOutputs {
  int64_t* offsets;       // [num_experts + 1] exclusive prefix sum of the counts
  int32_t* active;        // [num_experts] active experts (count > 0), ascending
  int32_t* tile_counts;   // [num_experts] ceil(count / block_m) per active expert
  int32_t* tile_offsets;  // [num_experts + 1] exclusive prefix sum of tile_counts
  int32_t* totals;        // [2] = {num_active, num_tiles}
};

// One block scans `counts` [num_experts] (device) in chunks, carrying the running totals.
void launch_group_shrink(const int32_t* counts, int32_t num_experts, int32_t block_m,
                         const ShrinkOutputs& out, void* stream);

// For every tile id t < max_tiles: the active expert it belongs to and its block of block_m
// rows inside that expert; tiles past totals[1] get expert -1 (the GEMM launch is sized by the
// host-known bound max_tiles and those programs exit at once).
void launch_tile_map(const int32_t* tile_offsets, const int32_t* active, const int32_t* totals,
                     int32_t max_tiles, int32_t* tile_expert, int32_t* tile_mblock, void* stream);

}  // namespace moecomm::kernels::cuda
