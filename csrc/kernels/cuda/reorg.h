// Token reorganization on the GPU expert server (EaaS Algorithm 1): the token copies of several
// client batches, concatenated, are laid out per expert. The grid is static over the flat list
// of copies (batch, row, k): an empty batch owns no thread, and no block waits on another.
//
// Three launches on one stream, then group-shrink (scan.h) in between for the offsets:
//   1. launch_reorg_histogram   per-tile expert histograms          (tile = one warp of copies)
//   2. launch_reorg_column_scan per-expert prefix over tiles, counts
//   3. launch_group_shrink      offsets (and the active list for the GEMM)
//   4. launch_reorg_scatter     places each copy and its activation row
// Rows of one expert keep the flat order of their copies, exactly as the torch reference does,
// so the result is deterministic and bit-identical to it.
#pragma once

#include <cstdint>

namespace moecomm::kernels::cuda {

// Copies per histogram/scatter tile: one warp, so the in-tile rank is one __match_any_sync.
constexpr int32_t kReorgCopiesPerTile = 32;

// Routing of all batches, concatenated; device memory.
struct ReorgInputs {
  const int32_t* ids;            // [num_tokens * topk] local expert id, or -1 (other server)
  const float* scores;           // [num_tokens * topk] router scores
  const int64_t* batch_offsets;  // [num_batches + 1] first token of each batch
  int32_t num_batches;
  int64_t num_tokens;
  int32_t topk;
  int32_t num_experts;
};

// Activations: row t of x starts at x + t * row_stride_bytes; each row is row_bytes long
// (hidden * element size; fp16/bf16/fp32 all have even sizes).
struct ReorgRows {
  const void* x;
  int64_t row_stride_bytes;
  int64_t row_bytes;
  void* out;  // [N, row_bytes], dense
};

// Back-map of every layout row; device memory sized by the number of copies routed here.
struct ReorgOutputs {
  int64_t* src_token;  // [N]
  int32_t* src_batch;  // [N]
  int32_t* src_row;    // [N]
  int32_t* src_k;      // [N]
  float* scores;       // [N]
  int64_t* slot_of;    // [num_tokens * topk] layout row of each copy, or -1
};

// Number of tiles of the flat copy list: the first dimension of tile_hist / tile_prefix.
int64_t reorg_num_tiles(int64_t num_tokens, int32_t topk);

// tile_hist [num_tiles * num_experts] (zeroed here) receives each tile's expert histogram.
void launch_reorg_histogram(const ReorgInputs& in, int32_t* tile_hist, void* stream);

// tile_prefix[t, e] = Σ_{t' < t} tile_hist[t', e]; counts[e] = Σ_t tile_hist[t, e].
void launch_reorg_column_scan(const int32_t* tile_hist, int64_t num_tiles, int32_t num_experts,
                              int32_t* tile_prefix, int32_t* counts, void* stream);

// Places copy i of expert e at offsets[e] + tile_prefix[tile(i), e] + (earlier copies of e in
// its tile), writes the back-map and copies its activation row.
void launch_reorg_scatter(const ReorgInputs& in, const ReorgRows& rows, const int64_t* offsets,
                          const int32_t* tile_prefix, const ReorgOutputs& out, void* stream);

}  // namespace moecomm::kernels::cuda
