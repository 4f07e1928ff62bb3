// Host launchers of the GPU expert server's step (server_kernels.cuh), templated on the backend.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/error.h"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/reorg.h"
#include "kernels/cuda/scan.h"
#include "kernels/cuda/server_kernels.cuh"

namespace moecomm::kernels::cuda::server {

inline void check_server_config(const ServerConfig& cfg, uint32_t max_peers, const void* local,
                                const void* workspace) {
  constexpr const char* kWho = "device server";
  const protocol::SlotConfig& c = cfg.slot;
  MC_CHECK(cfg.num_clients >= 1 && cfg.num_clients <= max_peers,
           "device server: num_clients must be in [1, max_peers=", max_peers, "], got ",
           cfg.num_clients);
  MC_CHECK(cfg.num_slots >= 1, "device server: num_slots must be >= 1, got ", cfg.num_slots);
  MC_CHECK(local != nullptr, "device server: the local region base is null");
  check_slot_config(c, kWho);
  // The reorganization moves rows in 2-byte units at least.
  const uint64_t row_bytes = uint64_t{c.hidden} * protocol::encoding_elem_bytes(c.encoding);
  MC_CHECK(row_bytes % 2 == 0,
           "device server: an activation row must be an even number of "
           "bytes (hidden even for 1-byte encodings), got ",
           row_bytes);
  MC_CHECK(cfg.num_experts >= 1, "device server: num_experts must be >= 1");
  MC_CHECK(cfg.max_step_tokens >= c.max_tokens, "device server: max_step_tokens (",
           cfg.max_step_tokens, ") must hold at least one full request (max_tokens ", c.max_tokens,
           ")");
  MC_CHECK(cfg.client_ids && cfg.request_ring_offset && cfg.response_ring_offset,
           "device server: client_ids, request_ring_offset and response_ring_offset are required");
  check_workspace(workspace, kWho);
}

inline ServerParams server_params(const ServerConfig& cfg, void* workspace) {
  return ServerParams{server_workspace_layout(cfg.slot, cfg.num_clients, cfg.num_slots,
                                              cfg.max_step_tokens, cfg.num_experts),
                      static_cast<uint8_t*>(workspace),
                      cfg.slot,
                      cfg.num_clients,
                      cfg.num_slots,
                      cfg.client_ids,
                      cfg.request_ring_offset,
                      cfg.response_ring_offset,
                      cfg.num_experts,
                      cfg.max_step_tokens,
                      protocol::request_slot_bytes(cfg.slot),
                      protocol::response_slot_bytes(cfg.slot)};
}

template <typename Backend>
void launch_gather(const Backend& b, uint32_t max_peers, const ServerConfig& cfg,
                   const ServerGatherArgs& a, void* stream) {
  check_server_config(cfg, max_peers, b.local_base, a.workspace);
  MC_CHECK(a.block_m >= 1, "server gather: block_m must be >= 1, got ", a.block_m);
  MC_CHECK(a.layer_hosted == nullptr || a.num_layers >= 1,
           "server gather: layer_hosted needs num_layers >= 1");
  const ServerParams p = server_params(cfg, a.workspace);
  const ServerWorkspaceLayout& l = p.lay;
  auto* ws = static_cast<uint8_t*>(a.workspace);
  auto s = static_cast<cudaStream_t>(stream);
  poll_kernel<Backend><<<1, kPollThreads, 0, s>>>(b, p, a);
  check_kernel(s, "server gather poll");
  // Tokens past the step's real count must route nowhere: all-ones bytes are int32 -1.
  constexpr int kAllOnes = 0xff;
  MC_CUDA_CHECK(cudaMemsetAsync(ws + l.ids, kAllOnes, l.max_rows * sizeof(int32_t), s));
  const dim3 copy_grid(static_cast<uint32_t>(l.num_entries),
                       static_cast<uint32_t>(ceil_div(cfg.slot.max_tokens, kRowsPerBlock)));
  copy_kernel<Backend><<<copy_grid, kRowThreads, 0, s>>>(b, p);
  check_kernel(s, "server gather copy");

  ReorgInputs in{};
  in.ids = reinterpret_cast<const int32_t*>(ws + l.ids);
  in.scores = reinterpret_cast<const float*>(ws + l.scores);
  in.batch_offsets = reinterpret_cast<const int64_t*>(ws + l.batch_offsets);
  in.num_batches = static_cast<int32_t>(l.num_entries);
  in.num_tokens = cfg.max_step_tokens;
  in.topk = static_cast<int32_t>(cfg.slot.topk);
  in.num_experts = static_cast<int32_t>(cfg.num_experts);
  auto* tile_hist = reinterpret_cast<int32_t*>(ws + l.tile_hist);
  auto* tile_prefix = reinterpret_cast<int32_t*>(ws + l.tile_prefix);
  auto* counts = reinterpret_cast<int32_t*>(ws + l.counts);
  launch_reorg_histogram(in, tile_hist, stream);
  launch_reorg_column_scan(tile_hist, static_cast<int64_t>(l.num_tiles), in.num_experts,
                           tile_prefix, counts, stream);
  ShrinkOutputs shrink{};
  shrink.offsets = reinterpret_cast<int64_t*>(ws + l.offsets);
  shrink.active = reinterpret_cast<int32_t*>(ws + l.active);
  shrink.tile_counts = reinterpret_cast<int32_t*>(ws + l.tile_counts);
  shrink.tile_offsets = reinterpret_cast<int32_t*>(ws + l.tile_offsets);
  shrink.totals = reinterpret_cast<int32_t*>(ws + l.totals);
  launch_group_shrink(counts, in.num_experts, a.block_m, shrink, stream);
  ReorgRows rows{};
  rows.x = ws + l.x;
  rows.row_stride_bytes = static_cast<int64_t>(l.row_bytes);
  rows.row_bytes = static_cast<int64_t>(l.row_bytes);
  rows.out = ws + l.rows;
  ReorgOutputs out{};
  out.src_token = reinterpret_cast<int64_t*>(ws + l.src_token);
  out.src_batch = reinterpret_cast<int32_t*>(ws + l.src_batch);
  out.src_row = reinterpret_cast<int32_t*>(ws + l.src_row);
  out.src_k = reinterpret_cast<int32_t*>(ws + l.src_k);
  out.scores = reinterpret_cast<float*>(ws + l.row_scores);
  out.slot_of = reinterpret_cast<int64_t*>(ws + l.slot_of);
  launch_reorg_scatter(in, rows, shrink.offsets, tile_prefix, out, stream);
}

template <typename Backend>
void launch_respond(const Backend& b, uint32_t max_peers, const ServerConfig& cfg,
                    const ServerRespondArgs& a, void* stream) {
  check_server_config(cfg, max_peers, b.local_base, a.workspace);
  check_float_dtype(a.expert_out_dtype, "server respond: expert_out");
  MC_CHECK(a.expert_out != nullptr, "server respond: expert_out must be a non-null device pointer");
  const ServerParams p = server_params(cfg, a.workspace);
  auto s = static_cast<cudaStream_t>(stream);
  const auto entries = static_cast<uint32_t>(p.lay.num_entries);
  const dim3 rows_grid(
      entries, static_cast<uint32_t>(ceil_div(cfg.slot.max_tokens, kRespondTokensPerBlock)));
  respond_rows_kernel<<<rows_grid, kRespondThreads, 0, s>>>(p, a.expert_out, a.expert_out_dtype);
  check_kernel(s, "server respond rows");
  const dim3 put_grid(entries, kPutBlocksPerEntry);
  respond_put_kernel<Backend><<<put_grid, kPutThreads, 0, s>>>(b, p);
  check_kernel(s, "server respond put");
}

}  // namespace moecomm::kernels::cuda::server
