// Client dispatch on the device, templated on the transport backend (device_ops.cuh). Three
// launches on one stream, each reading what the previous one wrote, so no kernel needs a grid
// barrier and no count ever travels to the host:
//   1. route  one block per server: routes every (token, k), a block scan gives each token its
//             row in the server's request (pos), the count, the ids/scores rows, the header,
//             and bumps the server's sequence number in device memory;
//   2. pack   one block per token: quantizes (or converts) the row once and writes it, and its
//             scales, into the staging payload of every server the token goes to;
//   3. put    a few blocks per server: the payload in chunks that ADD their bytes to the slot's
//             arrival counter (cumulative, layout.h); the last warp to finish puts the header
//             (arrival_target = all bytes ever sent to that slot) with SET REQUEST_READY|seq.
// A slot whose previous request timed out is not reused until the late answer (or OFFLINE) shows
// the server let go of it: that server gets kSlotBusy and nothing is sent (the host fails over).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/error.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/device_dispatch.h"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/message_io.cuh"
#include "protocol/signal.h"
#include "transport/device/device_ops.cuh"

namespace moecomm::kernels::cuda::client {

using protocol::Encoding;

// Route: one block scans all tokens for one server; 512 threads = 16 warps, so the block scan
// is one shuffle round per warp plus one for the warp sums, and a decode batch (<= 512 tokens)
// is a single chunk.
constexpr int kRouteThreads = 512;
// Pack: one block per token, 8 warps: the quantize kernels' shape (see quant.cu).
constexpr int kPackThreads = 256;
constexpr int kPackWarps = kPackThreads / dev::kWarpSize;
// Put: a payload is cut into chunks of this size, one warp-put each: large enough that a NIC
// put's fixed cost is amortised, small enough that a 1 MB payload spreads over 32 warps.
constexpr uint64_t kPutChunkBytes = 32 * 1024;
constexpr int kPutThreads = 256;
constexpr int kPutWarps = kPutThreads / dev::kWarpSize;
// Blocks per server: 4 x 8 warps = 32 warps in flight per destination covers NVLink bandwidth
// for decode-sized payloads without flooding the grid when there are many servers.
constexpr int kPutBlocksPerServer = 4;
static_assert(uint64_t{kPutBlocksPerServer} * kPutWarps <= kProgressWarpMask,
              "the warps of one message must fit the progress word's count (message_io.cuh)");

// The workspace carved per client_workspace_layout.
struct ClientWorkspace {
  uint8_t* staging;
  uint64_t staging_stride;
  protocol::SlotHeader* headers;
  int32_t* pos;
  int32_t* count;
  uint64_t* sent_seq;
  int32_t* status;
  int32_t* detail;
  uint64_t* arrival_sent;
  uint64_t* pending_seq;
  uint64_t* done_warps;
};

// sent_seq of a server skipped because its slot is still busy (no real sequence is all ones:
// sequences have 56 bits).
constexpr uint64_t kBusySeq = ~uint64_t{0};

inline ClientWorkspace carve_client_workspace(void* base, const ClientConfig& cfg) {
  const ClientWorkspaceLayout l = client_workspace_layout(cfg.num_servers, cfg.slot);
  auto* b = static_cast<uint8_t*>(base);
  return ClientWorkspace{b + l.staging,
                         l.staging_stride,
                         reinterpret_cast<protocol::SlotHeader*>(b + l.headers),
                         reinterpret_cast<int32_t*>(b + l.pos),
                         reinterpret_cast<int32_t*>(b + l.count),
                         reinterpret_cast<uint64_t*>(b + l.sent_seq),
                         reinterpret_cast<int32_t*>(b + l.status),
                         reinterpret_cast<int32_t*>(b + l.detail),
                         reinterpret_cast<uint64_t*>(b + l.arrival_sent),
                         reinterpret_cast<uint64_t*>(b + l.pending_seq),
                         reinterpret_cast<uint64_t*>(b + l.done_warps)};
}

// Everything the dispatch kernels read, by value.
struct DispatchParams {
  ClientWorkspace ws;
  protocol::SlotConfig slot;
  uint32_t num_servers;
  uint32_t num_slots;
  uint64_t client_id;
  const uint64_t* request_ring_offset;
  const void* x;
  uint64_t x_row_stride;
  const float* x_scales;
  const void* ids;
  bool ids_int64;
  const void* weights;
  Encoding weights_dtype;
  uint32_t num_tokens;
  uint32_t topk;
  const int32_t* expert_server;
  const int32_t* expert_local;
  uint32_t num_experts;
  uint32_t layer_id;
  uint32_t slot_index;
  uint64_t* next_seq;
  const uint8_t* local_base;             // our region: the response slots
  const uint64_t* response_ring_offset;  // [num_servers]
  uint64_t response_slot_bytes;
};

__device__ inline protocol::PayloadLayout request_layout(const DispatchParams& p, uint32_t n) {
  return protocol::request_payload_layout(n, p.slot.hidden, p.topk, p.slot.encoding);
}

// Whether this slot's request ring entry at server s is free to write. It is when the last
// request was answered (combine saw the answer: pending_seq 0), or when the answer to the
// request that timed out has arrived since, or the server marked the slot OFFLINE: a server
// releases the request slot before it signals the answer (slot_io's rule, kept by the server
// kernels). Reads only our own memory.
__device__ inline bool slot_released(const DispatchParams& p, uint32_t s) {
  const uint64_t pending = p.ws.pending_seq[s];
  if (pending == 0) return true;
  const uint64_t off =
      ring_slot_offset(p.response_ring_offset[s], p.response_slot_bytes, p.slot_index) +
      protocol::kSignalOffset;
  const uint64_t w =
      transport::device::load_acquire(reinterpret_cast<const uint64_t*>(p.local_base + off));
  const protocol::SlotState state = protocol::signal_state(w);
  const bool answered =
      state == protocol::SlotState::kResponseReady && protocol::signal_seq(w) >= pending;
  if (!answered && state != protocol::SlotState::kOffline) return false;
  p.ws.pending_seq[s] = 0;
  return true;
}

__global__ void __launch_bounds__(kRouteThreads) route_kernel(DispatchParams p) {
  __shared__ int32_t warp_sums[kRouteThreads / dev::kWarpSize];
  const auto s = static_cast<int32_t>(blockIdx.x);
  const uint32_t num_servers = p.num_servers;
  // Pass 1: pos[t, s] by a block scan over the tokens, chunk by chunk with a carry.
  int32_t carry = 0;
  for (uint32_t t0 = 0; t0 < p.num_tokens; t0 += kRouteThreads) {
    const uint32_t t = t0 + threadIdx.x;
    int32_t mine = 0;
    if (t < p.num_tokens) {
      for (uint32_t k = 0; k < p.topk && !mine; ++k) {
        const Route r = route_expert(load_id(p.ids, p.ids_int64, uint64_t{t} * p.topk + k),
                                     p.expert_server, p.expert_local, p.num_experts, num_servers);
        mine = r.server == s;
      }
    }
    int32_t chunk = 0;
    const int32_t incl = dev::block_inclusive_scan<kRouteThreads>(mine, warp_sums, &chunk);
    if (t < p.num_tokens) {
      p.ws.pos[uint64_t{t} * num_servers + s] = mine ? carry + incl - 1 : kNoPosition;
    }
    carry += chunk;
  }
  const auto n = static_cast<uint32_t>(carry);
  // Pass 2: the ids and scores rows. Each thread reads back only the pos entries it wrote
  // itself (same t -> thread mapping), so no barrier is needed in between.
  const protocol::PayloadLayout layout = request_layout(p, n);
  uint8_t* stage = p.ws.staging + uint64_t(s) * p.ws.staging_stride;
  for (uint32_t t = threadIdx.x; t < p.num_tokens; t += kRouteThreads) {
    const int32_t row = p.ws.pos[uint64_t{t} * num_servers + s];
    if (row < 0) continue;
    const RequestRow off = request_row(layout, row, p.slot.hidden, p.topk, p.slot.encoding);
    auto* ids = reinterpret_cast<int32_t*>(stage + off.ids);
    auto* scores = reinterpret_cast<float*>(stage + off.scores);
    for (uint32_t k = 0; k < p.topk; ++k) {
      const uint64_t i = uint64_t{t} * p.topk + k;
      const Route r = route_expert(load_id(p.ids, p.ids_int64, i), p.expert_server, p.expert_local,
                                   p.num_experts, num_servers);
      const bool here = r.server == s;
      ids[k] = here ? r.local : kNoExpert;
      scores[k] = here ? dev::load_f32(p.weights, i, p.weights_dtype) : 0.0f;
    }
  }
  if (threadIdx.x != 0) return;
  p.ws.count[s] = static_cast<int32_t>(n);
  if (n == 0) {
    p.ws.sent_seq[s] = 0;  // nothing sent: combine does not wait for this server
    return;
  }
  if (!slot_released(p, static_cast<uint32_t>(s))) {
    p.ws.sent_seq[s] = kBusySeq;
    return;
  }
  // A new sequence number per request, kept in device memory: every graph replay sends new
  // ones, and a late answer to an older request can never be mistaken for this one.
  const uint64_t seq = (p.next_seq[s] + 1) & protocol::kMaxSeq;
  p.next_seq[s] = seq;
  p.ws.sent_seq[s] = seq;
  protocol::SlotHeader h{};
  h.magic = protocol::kMagic;
  h.version = protocol::kVersion;
  h.kind = static_cast<uint8_t>(protocol::MessageKind::kRequest);
  h.encoding = static_cast<uint8_t>(p.slot.encoding);
  h.layer_id = p.layer_id;
  h.num_tokens = n;
  h.hidden = p.slot.hidden;
  h.topk = p.topk;
  h.payload_bytes = layout.total;
  h.client_id = p.client_id;
  h.seq = seq;
  p.ws.headers[s] = h;  // arrival_target: set by the put kernel's last warp
}

// Where token t's row and scales go in each of its servers' staging payloads.
struct PackTargets {
  uint8_t* act[kMaxTopk];
  float* scales[kMaxTopk];
  uint32_t n;
};

__device__ inline void find_targets(const DispatchParams& p, uint64_t t, PackTargets* out) {
  int32_t servers[kMaxTopk];
  const uint32_t n = token_servers(p.ids, p.ids_int64, t, p.topk, p.expert_server, p.expert_local,
                                   p.num_experts, p.num_servers, servers);
  for (uint32_t i = 0; i < n; ++i) {
    const int32_t s = servers[i];
    const int32_t row = p.ws.pos[t * p.num_servers + s];
    const protocol::PayloadLayout layout = request_layout(p, static_cast<uint32_t>(p.ws.count[s]));
    const RequestRow off = request_row(layout, row, p.slot.hidden, p.topk, p.slot.encoding);
    uint8_t* stage = p.ws.staging + uint64_t(s) * p.ws.staging_stride;
    out->act[i] = stage + off.act;
    out->scales[i] = reinterpret_cast<float*>(stage + off.scales);
  }
  out->n = n;
}

// TIn: the element type of x; uint8_t is an already quantized x (DispatchArgs::x_scales), whose
// e4m3 bytes and scales are copied as they are into the staging payload of every server the
// token goes to.
template <typename TIn>
__global__ void __launch_bounds__(kPackThreads) pack_kernel(DispatchParams p) {
  __shared__ PackTargets dst;
  __shared__ float warp_smem[kPackWarps];
  const uint64_t t = blockIdx.x;
  if (threadIdx.x == 0) find_targets(p, t, &dst);
  __syncthreads();
  const uint32_t n = dst.n;
  if (n == 0) return;  // uniform over the block
  const uint32_t hidden = p.slot.hidden;
  const TIn* row = static_cast<const TIn*>(p.x) + t * p.x_row_stride;
  const Encoding enc = p.slot.encoding;
  if constexpr (std::is_same_v<TIn, uint8_t>) {
    for (uint32_t c = threadIdx.x; c < hidden; c += kPackThreads) {
      const uint8_t q = row[c];
      for (uint32_t i = 0; i < n; ++i) dst.act[i][c] = q;
    }
    const uint64_t spt = protocol::encoding_scales_per_token(enc, hidden);
    const float* scales = p.x_scales + t * spt;
    for (uint64_t b = threadIdx.x; b < spt; b += kPackThreads) {
      const float s = scales[b];
      for (uint32_t i = 0; i < n; ++i) dst.scales[i][b] = s;
    }
  } else if (enc == Encoding::kInt8 || enc == Encoding::kFP8E4M3) {
    // One scale per token: the block-wide amax, then one pass that encodes.
    const bool int8 = enc == Encoding::kInt8;
    const float scale = dev::token_scale<kPackThreads>(
        row, hidden, int8 ? dev::kInt8Max : dev::kFp8E4M3Max, warp_smem);
    if (threadIdx.x == 0) {
      for (uint32_t i = 0; i < n; ++i) *dst.scales[i] = scale;
    }
    for (uint32_t c = threadIdx.x; c < hidden; c += kPackThreads) {
      const float v = dev::to_f32(row[c]);
      const uint8_t q = int8 ? dev::encode<true>(v, scale) : dev::encode<false>(v, scale);
      for (uint32_t i = 0; i < n; ++i) dst.act[i][c] = q;
    }
  } else if (enc == Encoding::kFP8E4M3B128) {
    // One scale per 128 channels: each warp walks the blocks of the token, kPackWarps apart.
    const uint32_t warp = threadIdx.x / dev::kWarpSize;
    const uint32_t lane = threadIdx.x % dev::kWarpSize;
    const auto num_blocks = static_cast<uint32_t>(ceil_div(hidden, protocol::kScaleBlock));
    for (uint32_t b = warp; b < num_blocks; b += kPackWarps) {
      const float scale =
          dev::quantize_block128_warp(row, hidden, b, lane, [n](uint32_t c, uint8_t q) {
            for (uint32_t i = 0; i < n; ++i) dst.act[i][c] = q;
          });
      if (lane == 0) {
        for (uint32_t i = 0; i < n; ++i) dst.scales[i][b] = scale;
      }
    }
  } else {
    // Unquantized: the value converted like torch's .to(dtype) (exact when the dtypes match).
    for (uint32_t c = threadIdx.x; c < hidden; c += kPackThreads) {
      const float v = dev::to_f32(row[c]);
      for (uint32_t i = 0; i < n; ++i) dev::store_f32(dst.act[i], c, enc, v);
    }
  }
}

template <typename Backend>
__global__ void __launch_bounds__(kPutThreads)
    put_kernel(Backend backend, DispatchParams p, uint64_t request_slot_bytes) {
  const uint32_t s = blockIdx.x;
  const auto n = static_cast<uint32_t>(p.ws.count[s]);
  // A dead server's mapping may be gone, a busy slot must not be overwritten: send nothing,
  // combine reports why.
  const uint64_t seq = p.ws.sent_seq[s];
  if (n == 0 || seq == kBusySeq) return;  // uniform over the server's grid
  const uint64_t total = request_layout(p, n).total;
  const uint64_t slot =
      ring_slot_offset(p.request_ring_offset[s], request_slot_bytes, p.slot_index);
  const uint8_t* stage = p.ws.staging + uint64_t{s} * p.ws.staging_stride;
  const uint32_t warp = blockIdx.y * kPutWarps + threadIdx.x / dev::kWarpSize;
  const uint32_t num_warps = gridDim.y * kPutWarps;
  const uint32_t lane = threadIdx.x % dev::kWarpSize;
  // The liveness mask may flip mid-kernel: read once per warp, and every warp still counts
  // itself, with the bytes it put (finish_message counts those, sent or not: layout.h).
  const bool alive = warp_peer_alive(backend, s, lane);
  uint64_t put_bytes = 0;
  for (uint64_t off = uint64_t{warp} * kPutChunkBytes; alive && off < total;
       off += uint64_t{num_warps} * kPutChunkBytes) {
    const uint64_t bytes = total - off < kPutChunkBytes ? total - off : kPutChunkBytes;
    backend.put_signal_warp(s, slot + protocol::kPayloadOffset + off, stage + off, bytes,
                            slot + protocol::kArrivalOffset, bytes, transport::SignalOp::kAdd);
    put_bytes += bytes;
  }
  finish_message(backend, s, p.ws.done_warps + s, num_warps, put_bytes, p.ws.arrival_sent + s,
                 p.ws.headers + s, slot,
                 protocol::make_signal(protocol::SlotState::kRequestReady, seq), lane,
                 [](protocol::SlotHeader*) {});
  // The staging is rewritten by the next dispatch on this slot: our puts must have left it.
  backend.quiet_warp();
}

// Argument checks shared by dispatch and combine (`op` names which); `max_peers` is the
// backend's peer table size.
inline void check_client_call(const char* op, const ClientConfig& cfg, uint32_t max_peers,
                              const void* local, uint32_t slot, const void* workspace,
                              uint32_t num_tokens) {
  constexpr const char* kWho = "device client";
  MC_CHECK(cfg.num_servers >= 1, "device client: num_servers must be >= 1, got ", cfg.num_servers);
  MC_CHECK(cfg.num_servers <= max_peers, "device client: num_servers ", cfg.num_servers,
           " exceeds the peer table's max_peers ", max_peers);
  MC_CHECK(local != nullptr, "device client: the local region base is null");
  MC_CHECK(cfg.num_slots >= 1 && slot < cfg.num_slots, "device client: slot ", slot,
           " out of range for ", cfg.num_slots, " slots");
  check_slot_config(cfg.slot, kWho);
  MC_CHECK(cfg.request_ring_offset != nullptr && cfg.response_ring_offset != nullptr,
           "device client: request_ring_offset and response_ring_offset are required");
  check_workspace(workspace, kWho);
  MC_CHECK(num_tokens <= cfg.slot.max_tokens, op, ": ", num_tokens, " tokens exceed max_tokens ",
           cfg.slot.max_tokens);
}

template <typename Backend>
void launch_dispatch(const Backend& backend, uint32_t max_peers, const ClientConfig& cfg,
                     const DispatchArgs& a, void* stream) {
  check_client_call("dispatch", cfg, max_peers, backend.local_base, a.slot, a.workspace,
                    a.num_tokens);
  MC_CHECK(a.topk >= 1 && a.topk <= cfg.slot.topk, "dispatch: topk must be in [1, ", cfg.slot.topk,
           "], got ", a.topk);
  const bool quantized = a.x_dtype == Encoding::kFP8E4M3B128;
  MC_CHECK(is_float_dtype(a.x_dtype) || quantized,
           "dispatch: x must be BF16, FP16, F32 or already quantized FP8_E4M3_B128, got encoding ",
           static_cast<int>(a.x_dtype));
  MC_CHECK(!quantized || cfg.slot.encoding == Encoding::kFP8E4M3B128,
           "dispatch: an already quantized x (FP8_E4M3_B128) needs that request encoding, got ",
           static_cast<int>(cfg.slot.encoding));
  MC_CHECK(!quantized || a.num_tokens == 0 || a.x_scales != nullptr,
           "dispatch: an already quantized x needs x_scales");
  check_float_dtype(a.weights_dtype, "dispatch: topk_weights");
  MC_CHECK(a.x_row_stride >= cfg.slot.hidden, "dispatch: x_row_stride must be >= hidden (",
           cfg.slot.hidden, "), got ", a.x_row_stride);
  MC_CHECK(a.num_tokens == 0 || (a.x && a.topk_ids && a.topk_weights),
           "dispatch: x, topk_ids and topk_weights must be non-null device pointers");
  MC_CHECK(a.expert_server && a.expert_local && a.num_experts >= 1,
           "dispatch: the expert map (expert_server, expert_local, num_experts >= 1) is required");
  MC_CHECK(a.next_seq != nullptr, "dispatch: next_seq (one u64 per server) is required");
  const DispatchParams p{carve_client_workspace(a.workspace, cfg),
                         cfg.slot,
                         cfg.num_servers,
                         cfg.num_slots,
                         cfg.client_id,
                         cfg.request_ring_offset,
                         a.x,
                         a.x_row_stride,
                         a.x_scales,
                         a.topk_ids,
                         a.ids_int64,
                         a.topk_weights,
                         a.weights_dtype,
                         a.num_tokens,
                         a.topk,
                         a.expert_server,
                         a.expert_local,
                         a.num_experts,
                         a.layer_id,
                         a.slot,
                         a.next_seq,
                         backend.local_base,
                         cfg.response_ring_offset,
                         protocol::response_slot_bytes(cfg.slot)};
  auto s = static_cast<cudaStream_t>(stream);
  route_kernel<<<cfg.num_servers, kRouteThreads, 0, s>>>(p);
  check_kernel(s, "dispatch route");
  if (a.num_tokens > 0) {
    switch (a.x_dtype) {
      case Encoding::kFP8E4M3B128:  // already quantized: its bytes and scales as they are
        pack_kernel<uint8_t><<<a.num_tokens, kPackThreads, 0, s>>>(p);
        break;
      case Encoding::kBF16:
        pack_kernel<__nv_bfloat16><<<a.num_tokens, kPackThreads, 0, s>>>(p);
        break;
      case Encoding::kFP16:
        pack_kernel<__half><<<a.num_tokens, kPackThreads, 0, s>>>(p);
        break;
      default:
        pack_kernel<float><<<a.num_tokens, kPackThreads, 0, s>>>(p);
        break;
    }
    check_kernel(s, "dispatch pack");
  }
  const dim3 grid(cfg.num_servers, kPutBlocksPerServer);
  put_kernel<Backend>
      <<<grid, kPutThreads, 0, s>>>(backend, p, protocol::request_slot_bytes(cfg.slot));
  check_kernel(s, "dispatch put");
}

}  // namespace moecomm::kernels::cuda::client
