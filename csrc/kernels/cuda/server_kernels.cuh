// The GPU expert server's data movement, templated on the transport backend. One step:
//   gather   poll     one block: every (client, slot) entry's signal (acquire), header
//                     (validated), payload (arrival counter >= the header's arrival_target:
//                     cumulative, never reset, layout.h), expert ids; admits entries in
//                     order up to max_step_tokens; a scan gives their step batch offsets;
//            copy     a static grid over (entry, row block): activations, scales, ids (padded
//                     to the connection's topk with -1) and scores, concatenated;
//            reorg    histogram, column scan, group-shrink, scatter (reorg.h, scan.h) with the
//                     capacity as the token count: unfilled tokens carry ids -1 and cost
//                     nothing, so the host never needs the step's real size;
//   (the caller's grouped GEMM: layout rows -> score-weighted expert outputs)
//   respond  rows     y[token] = Σ_k expert_out[slot_of[token, k]] in k order (f32), cast;
//            put      per answered entry: one warp releases our request slot (READY|seq ->
//                     IDLE|seq, compare-exchange as slot_io does); every warp puts payload
//                     chunks that ADD to the client's arrival counter; the last warp to finish
//                     stamps arrival_target (all bytes ever sent to that slot) and puts the
//                     header with SET RESPONSE_READY|seq; then every warp quiets its puts (the
//                     response staging is rewritten by the next step).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/error.h"
#include "kernels/cuda/client_dispatch.cuh"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/device_dispatch.h"
#include "protocol/validate.h"
#include "transport/device/device_ops.cuh"

namespace moecomm::kernels::cuda::server {

using protocol::Encoding;

// Poll: one block, one warp per entry (32 entries per round); lane 0 waits and validates, the
// warp checks the expert ids together. Admission is sequential in entry order (thread 0).
constexpr int kPollThreads = 1024;
constexpr int kPollWarps = kPollThreads / dev::kWarpSize;
// Copy and respond: one warp per row, 8 rows per block.
constexpr int kRowThreads = 256;
constexpr int kRowsPerBlock = kRowThreads / dev::kWarpSize;
// Respond rows: one block per this many tokens, all threads across the hidden dimension.
constexpr int kRespondTokensPerBlock = 4;
constexpr int kRespondThreads = 256;
// Same chunking as the client's request puts.
constexpr int kPutBlocksPerEntry = client::kPutBlocksPerServer;
constexpr int kPutThreads = client::kPutThreads;
constexpr int kPutWarps = kPutThreads / dev::kWarpSize;

struct ServerParams {
  ServerWorkspaceLayout lay;
  uint8_t* ws;
  protocol::SlotConfig slot;
  uint32_t num_clients;
  uint32_t num_slots;
  const uint64_t* client_ids;
  const uint64_t* request_ring_offset;
  const uint64_t* response_ring_offset;
  uint32_t num_experts;
  uint32_t max_step_tokens;
  uint64_t request_slot_bytes;
  uint64_t response_slot_bytes;
};

template <typename T>
__device__ __forceinline__ T* part(const ServerParams& p, uint64_t offset) {
  return reinterpret_cast<T*>(p.ws + offset);
}

__device__ inline uint64_t request_slot(const ServerParams& p, uint32_t entry) {
  return ring_slot_offset(p.request_ring_offset[entry / p.num_slots], p.request_slot_bytes,
                          entry % p.num_slots);
}

// Copies `bytes` with all 32 lanes, in 16-byte vectors when both ends allow.
__device__ inline void warp_copy(uint8_t* dst, const uint8_t* src, uint64_t bytes, uint32_t lane) {
  constexpr uint64_t kVec = 16;
  uint64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % kVec) == 0) {
    const uint64_t n = bytes / kVec;
    for (uint64_t i = lane; i < n; i += dev::kWarpSize) {
      reinterpret_cast<int4*>(dst)[i] = reinterpret_cast<const int4*>(src)[i];
    }
    done = n * kVec;
  }
  for (uint64_t i = done + lane; i < bytes; i += dev::kWarpSize) dst[i] = src[i];
}

// Lane 0: what to do with one entry, before the expert-id check and admission.
template <typename Backend>
__device__ EntryState examine(const Backend& b, const ServerParams& p, const ServerGatherArgs& a,
                              uint32_t entry) {
  EntryState st{};
  const uint64_t slot = request_slot(p, entry);
  const uint64_t word = client::read_signal(b, slot + protocol::kSignalOffset, entry / p.num_slots,
                                            transport::device::WaitSite::kGatherSignal);
  if (protocol::signal_state(word) != protocol::SlotState::kRequestReady) return st;
  st.seq = protocol::signal_seq(word);
  protocol::Expectation e;
  e.kind = protocol::MessageKind::kRequest;
  e.config = p.slot;
  e.slot_bytes = p.request_slot_bytes;
  e.client_id = p.client_ids[entry / p.num_slots];
  e.seq = st.seq;
  protocol::SlotHeader h;
  const protocol::ValidateCode code = protocol::read_and_validate(b.local(slot), e, &h);
  st.layer_id = h.layer_id;
  st.action = static_cast<int32_t>(EntryAction::kReject);
  if (code != protocol::ValidateCode::kOk) {
    st.code = static_cast<int32_t>(code);
    return st;
  }
  if (h.encoding != static_cast<uint8_t>(p.slot.encoding)) {
    st.code = static_cast<int32_t>(protocol::ValidateCode::kBadEncoding);
    return st;
  }
  if (h.layer_id != a.layer_id) {
    const bool hosted =
        a.layer_hosted != nullptr && h.layer_id < a.num_layers && a.layer_hosted[h.layer_id] != 0;
    if (hosted) return EntryState{};  // served by the step of its own layer
    st.code = static_cast<int32_t>(protocol::ResponseStatus::kUnknownLayer);
    return st;
  }
  if (a.draining) {
    st.code = static_cast<int32_t>(protocol::ResponseStatus::kDraining);
    return st;
  }
  if (h.arrival_target != 0) {
    const auto w =
        client::wait_at_least(b, slot + protocol::kArrivalOffset, h.arrival_target,
                              transport::device::now_ns() + a.arrival_timeout_ns,
                              entry / p.num_slots, transport::device::WaitSite::kGatherArrival);
    if (w != transport::device::DeviceWait::kOk) return EntryState{};  // next step
  }
  st.action = static_cast<int32_t>(EntryAction::kServe);
  st.num_tokens = h.num_tokens;
  st.topk = h.topk;
  return st;
}

template <typename Backend>
__global__ void __launch_bounds__(kPollThreads)
    poll_kernel(Backend b, ServerParams p, ServerGatherArgs a) {
  __shared__ EntryState cand[kPollWarps];
  const uint32_t warp = threadIdx.x / dev::kWarpSize;
  const uint32_t lane = threadIdx.x % dev::kWarpSize;
  const auto num_entries = static_cast<uint32_t>(p.lay.num_entries);
  auto* entries = part<EntryState>(p, p.lay.entries);
  auto* batch_offsets = part<int64_t>(p, p.lay.batch_offsets);
  int64_t carry = 0;  // meaningful in thread 0
  for (uint32_t base = 0; base < num_entries; base += kPollWarps) {
    const uint32_t entry = base + warp;
    EntryState st{};
    if (entry < num_entries && lane == 0) st = examine(b, p, a, entry);
    __syncwarp();  // lane 0 acquired the payload; the other lanes read the ids below
    // The warp checks the ids together: a local expert outside [0, E) is rejected by name.
    const int32_t action = __shfl_sync(dev::kFullMask, st.action, 0);
    if (action == static_cast<int32_t>(EntryAction::kServe)) {
      const uint32_t n = __shfl_sync(dev::kFullMask, st.num_tokens, 0);
      const uint32_t topk = __shfl_sync(dev::kFullMask, st.topk, 0);
      const protocol::PayloadLayout l =
          protocol::request_payload_layout(n, p.slot.hidden, topk, p.slot.encoding);
      const auto* ids = reinterpret_cast<const int32_t*>(
          b.local(request_slot(p, entry) + protocol::kPayloadOffset + l.ids_offset));
      bool bad = false;
      for (uint64_t i = lane; i < uint64_t{n} * topk; i += dev::kWarpSize) {
        bad = bad || ids[i] < kNoExpert || ids[i] >= static_cast<int32_t>(p.num_experts);
      }
      if (__any_sync(dev::kFullMask, bad) && lane == 0) {
        st.action = static_cast<int32_t>(EntryAction::kReject);
        st.code = static_cast<int32_t>(protocol::ResponseStatus::kUnknownExpert);
      }
    }
    if (lane == 0) cand[warp] = st;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (uint32_t i = 0; i < kPollWarps && base + i < num_entries; ++i) {
        EntryState c = cand[i];
        if (c.action == static_cast<int32_t>(EntryAction::kServe)) {
          if (carry + c.num_tokens > p.max_step_tokens) {
            c = EntryState{};  // no room this step: it stays REQUEST_READY for the next
          }
        }
        batch_offsets[base + i] = carry;
        if (c.action == static_cast<int32_t>(EntryAction::kServe)) carry += c.num_tokens;
        entries[base + i] = c;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) batch_offsets[num_entries] = carry;
}

template <typename Backend>
__global__ void __launch_bounds__(kRowThreads) copy_kernel(Backend b, ServerParams p) {
  const uint32_t entry = blockIdx.x;
  const EntryState st = part<EntryState>(p, p.lay.entries)[entry];
  if (st.action != static_cast<int32_t>(EntryAction::kServe)) return;
  const uint32_t row = blockIdx.y * kRowsPerBlock + threadIdx.x / dev::kWarpSize;
  if (row >= st.num_tokens) return;  // uniform per warp
  const uint32_t lane = threadIdx.x % dev::kWarpSize;
  const uint64_t g = part<int64_t>(p, p.lay.batch_offsets)[entry] + row;
  const Encoding enc = p.slot.encoding;
  const uint32_t topk = p.slot.topk;
  const protocol::PayloadLayout l =
      protocol::request_payload_layout(st.num_tokens, p.slot.hidden, st.topk, enc);
  const uint8_t* payload = b.local(request_slot(p, entry) + protocol::kPayloadOffset);
  const RequestRow src = request_row(l, row, p.slot.hidden, st.topk, enc);
  warp_copy(part<uint8_t>(p, p.lay.x) + g * p.lay.row_bytes, payload + src.act, p.lay.row_bytes,
            lane);
  const uint64_t spt = protocol::encoding_scales_per_token(enc, p.slot.hidden);
  warp_copy(part<uint8_t>(p, p.lay.scales) + g * spt * sizeof(float), payload + src.scales,
            spt * sizeof(float), lane);
  const auto* ids = reinterpret_cast<const int32_t*>(payload + src.ids);
  const auto* scores = reinterpret_cast<const float*>(payload + src.scores);
  for (uint32_t k = lane; k < topk; k += dev::kWarpSize) {
    const bool has = k < st.topk;
    part<int32_t>(p, p.lay.ids)[g * topk + k] = has ? ids[k] : kNoExpert;
    part<float>(p, p.lay.scores)[g * topk + k] = has ? scores[k] : 0.0f;
  }
}

__global__ void __launch_bounds__(kRespondThreads)
    respond_rows_kernel(ServerParams p, const void* expert_out, Encoding expert_dtype) {
  const uint32_t entry = blockIdx.x;
  const EntryState st = part<EntryState>(p, p.lay.entries)[entry];
  if (st.action != static_cast<int32_t>(EntryAction::kServe)) return;
  const uint64_t first = part<int64_t>(p, p.lay.batch_offsets)[entry];
  const auto* slot_of = part<int64_t>(p, p.lay.slot_of);
  const uint32_t hidden = p.slot.hidden;
  const uint32_t topk = p.slot.topk;
  void* out = part<uint8_t>(p, p.lay.response);
  const uint32_t r0 = blockIdx.y * kRespondTokensPerBlock;
  for (uint32_t r = r0; r < r0 + kRespondTokensPerBlock && r < st.num_tokens; ++r) {
    const uint64_t g = first + r;
    for (uint32_t c = threadIdx.x; c < hidden; c += kRespondThreads) {
      float acc = 0.0f;
      for (uint32_t k = 0; k < topk; ++k) {
        const int64_t i = slot_of[g * topk + k];
        if (i >= 0) acc += dev::load_f32(expert_out, uint64_t(i) * hidden + c, expert_dtype);
      }
      dev::store_f32(out, g * hidden + c, p.slot.out_encoding, acc);
    }
  }
}

template <typename Backend>
__global__ void __launch_bounds__(kPutThreads) respond_put_kernel(Backend b, ServerParams p) {
  const uint32_t entry = blockIdx.x;
  const EntryState st = part<EntryState>(p, p.lay.entries)[entry];
  if (st.action == static_cast<int32_t>(EntryAction::kNone)) return;
  const bool serve = st.action == static_cast<int32_t>(EntryAction::kServe);
  const uint32_t client = entry / p.num_slots;
  const uint64_t remote =
      ring_slot_offset(p.response_ring_offset[client], p.response_slot_bytes, entry % p.num_slots);
  const uint64_t local = request_slot(p, entry);
  const uint32_t warp = blockIdx.y * kPutWarps + threadIdx.x / dev::kWarpSize;
  const uint32_t lane = threadIdx.x % dev::kWarpSize;
  const uint64_t total =
      serve ? protocol::response_payload_layout(st.num_tokens, p.slot.hidden, p.slot.out_encoding)
                  .total
            : 0;
  auto* hdr = part<protocol::SlotHeader>(p, p.lay.headers) + entry;
  if (warp == 0 && lane == 0) {
    // Release our request slot before the client can see the answer (it may reuse the slot at
    // once): READY|seq -> IDLE|seq, which fails harmlessly if the client already gave up and
    // wrote a newer request. Warp 0 counts itself done after this, so the signal, raised by the
    // last warp, comes after it. Our arrival counter is never reset (layout.h).
    uint64_t expected = protocol::make_signal(protocol::SlotState::kRequestReady, st.seq);
    ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system>(
        *reinterpret_cast<uint64_t*>(b.local(local + protocol::kSignalOffset)))
        .compare_exchange_strong(expected,
                                 protocol::make_signal(protocol::SlotState::kIdle, st.seq),
                                 ::cuda::memory_order_acq_rel);
  }
  const uint64_t client_id = p.client_ids[client];
  const uint32_t hidden = p.slot.hidden;
  const Encoding out_enc = p.slot.out_encoding;
  // Run by the last warp: the header is written and read by the same thread.
  auto fill = [&](protocol::SlotHeader* h) {
    protocol::SlotHeader v{};
    v.magic = protocol::kMagic;
    v.version = protocol::kVersion;
    v.kind = static_cast<uint8_t>(protocol::MessageKind::kResponse);
    v.encoding = static_cast<uint8_t>(serve ? out_enc : Encoding::kBF16);
    v.layer_id = st.layer_id;
    v.num_tokens = serve ? st.num_tokens : 0;
    v.hidden = hidden;
    v.payload_bytes = total;
    v.client_id = client_id;
    v.seq = st.seq;
    v.status = serve ? 0 : st.code;
    *h = v;  // arrival_target: stamped next by finish_message
  };
  const uint64_t out_row =
      uint64_t{p.slot.hidden} * protocol::encoding_elem_bytes(p.slot.out_encoding);
  const uint8_t* src =
      part<uint8_t>(p, p.lay.response) + part<int64_t>(p, p.lay.batch_offsets)[entry] * out_row;
  const uint32_t num_warps = gridDim.y * kPutWarps;
  // Liveness read once per warp; every warp counts itself done below, with the bytes it put,
  // even when the client is dead (see finish_message).
  const bool alive = client::warp_peer_alive(b, client, lane);
  uint64_t put_bytes = 0;
  for (uint64_t off = uint64_t{warp} * client::kPutChunkBytes; alive && off < total;
       off += uint64_t{num_warps} * client::kPutChunkBytes) {
    const uint64_t left = total - off;
    const uint64_t bytes = left < client::kPutChunkBytes ? left : client::kPutChunkBytes;
    b.put_signal_warp(client, remote + protocol::kPayloadOffset + off, src + off, bytes,
                      remote + protocol::kArrivalOffset, bytes, transport::SignalOp::kAdd);
    put_bytes += bytes;
  }
  client::finish_message(b, client, part<uint64_t>(p, p.lay.done_warps) + entry, num_warps,
                         put_bytes, part<uint64_t>(p, p.lay.arrival_sent) + entry, hdr, remote,
                         protocol::make_signal(protocol::SlotState::kResponseReady, st.seq), lane,
                         fill);
  // The response staging is rewritten by the next step's rows kernel.
  b.quiet_warp();
}

}  // namespace moecomm::kernels::cuda::server
