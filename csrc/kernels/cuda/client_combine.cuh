// Client combine on the device, templated on the transport backend. Two launches:
//   1. wait    one thread per server: waits (deadline) for RESPONSE_READY|seq on our own
//              response slot, validates the header, waits until the arrival counter reaches
//              the header's arrival_target (cumulative, never reset: layout.h), and writes the
//              server's ServerStatus. Never hangs: a timeout, a dead peer, an error answer or a
//              bad header is a status, and that server's contribution is skipped;
//   2. reduce  one block per token: y[t] = Σ over servers with status kOk, in increasing server
//              order, of their response row (f32 accumulation), then cast: exactly
//              moecomm.ops.combine's order, so the result is bit-identical to the host path.
// The slots are free again when the kernels complete: the server released its request slot
// before it signalled, and a stale word in our response slot never matches a newer sequence.
// After a timeout the slot is remembered as pending: the next dispatch on it skips that server
// (kSlotBusy) until the late answer shows the server let go of the request. Late payload bytes
// are harmless: the server's next arrival_target counts them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/error.h"
#include "kernels/cuda/client_dispatch.cuh"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/device_dispatch.h"
#include "kernels/cuda/launch_check.h"
#include "protocol/validate.h"
#include "transport/device/device_ops.cuh"

namespace moecomm::kernels::cuda::client {

// One thread per server; each spins on its own word, so warps diverge by design. 128 threads
// keeps the grid to one block for up to 128 servers.
constexpr int kWaitThreads = 128;
// Reduce: one block per token over the hidden dimension (the pack kernels' shape).
constexpr int kReduceThreads = 256;

struct CombineParams {
  ClientWorkspace ws;
  protocol::SlotConfig slot;
  uint32_t num_servers;
  uint64_t client_id;
  const uint64_t* response_ring_offset;
  uint32_t slot_index;
  uint32_t layer_id;
  uint32_t num_tokens;
  void* out;
  Encoding out_dtype;
  uint64_t timeout_ns;
  uint64_t response_slot_bytes;
};

__device__ inline uint64_t response_slot(const CombineParams& p, uint32_t s) {
  return ring_slot_offset(p.response_ring_offset[s], p.response_slot_bytes, p.slot_index);
}

// Waits for the answer of server s; returns its status and writes the detail.
template <typename Backend>
__device__ ServerStatus await_server(const Backend& b, const CombineParams& p, uint32_t s,
                                     uint64_t deadline, int32_t* detail) {
  using transport::device::DeviceWait;
  *detail = 0;
  const uint64_t seq = p.ws.sent_seq[s];
  if (seq == 0) return ServerStatus::kNotSent;
  if (seq == kBusySeq) return ServerStatus::kSlotBusy;
  const uint64_t slot = response_slot(p, s);
  const uint64_t want = protocol::make_signal(protocol::SlotState::kResponseReady, seq);
  using transport::device::WaitSite;
  uint64_t word = read_signal(b, slot + protocol::kSignalOffset, s, WaitSite::kCombineSignal);
  // Wait for the word to change until it is ours: older answers (a server we failed over from)
  // pass by without ending the wait.
  while (word != want) {
    if (protocol::signal_state(word) == protocol::SlotState::kOffline)
      return ServerStatus::kOffline;
    const transport::WaitPredicate changed{transport::WaitOp::kNotEqual, ~uint64_t{0}, word};
    const DeviceWait w = transport::device::wait_word(b, slot + protocol::kSignalOffset, changed,
                                                      deadline, s, &word, WaitSite::kCombineSignal);
    if (w != DeviceWait::kOk) return static_cast<ServerStatus>(w);
  }
  protocol::Expectation e;
  e.kind = protocol::MessageKind::kResponse;
  e.config = p.slot;
  e.slot_bytes = p.response_slot_bytes;
  e.client_id = p.client_id;
  e.seq = seq;
  protocol::SlotHeader h;
  const protocol::ValidateCode code = protocol::read_and_validate(b.local(slot), e, &h);
  if (code != protocol::ValidateCode::kOk) {
    *detail = static_cast<int32_t>(code);
    return ServerStatus::kBadHeader;
  }
  ServerStatus status = ServerStatus::kOk;
  if (h.status != 0) {
    status = ServerStatus::kRemoteError;
    *detail = h.status;
  } else if (h.num_tokens != static_cast<uint32_t>(p.ws.count[s])) {
    status = ServerStatus::kMismatch;
    *detail = static_cast<int32_t>(MismatchField::kNumTokens);
  } else if (h.encoding != static_cast<uint8_t>(p.slot.out_encoding)) {
    status = ServerStatus::kMismatch;
    *detail = static_cast<int32_t>(MismatchField::kEncoding);
  } else if (h.layer_id != p.layer_id) {
    status = ServerStatus::kMismatch;
    *detail = static_cast<int32_t>(MismatchField::kLayer);
  }
  // Only an answer we will read needs its bytes; 0 = the writer put them before the signal.
  if (status == ServerStatus::kOk && h.arrival_target != 0) {
    const DeviceWait w = wait_at_least(b, slot + protocol::kArrivalOffset, h.arrival_target,
                                       deadline, s, WaitSite::kCombineArrival);
    if (w == DeviceWait::kTimeout) status = ServerStatus::kPayloadTimeout;
    if (w == DeviceWait::kPeerLost) status = ServerStatus::kPeerLost;
  }
  return status;
}

template <typename Backend>
__global__ void __launch_bounds__(kWaitThreads) wait_kernel(Backend b, CombineParams p) {
  const uint32_t s = blockIdx.x * kWaitThreads + threadIdx.x;
  if (s >= p.num_servers) return;
  const uint64_t deadline = transport::device::now_ns() + p.timeout_ns;
  int32_t detail = 0;
  const ServerStatus st = await_server(b, p, s, deadline, &detail);
  // No answer seen: the server may still hold the request; the next dispatch on this slot
  // checks for the late answer before it writes the slot again (client_dispatch.cuh).
  if (st == ServerStatus::kTimeout || st == ServerStatus::kPeerLost) {
    p.ws.pending_seq[s] = p.ws.sent_seq[s];
  }
  p.ws.status[s] = static_cast<int32_t>(st);
  p.ws.detail[s] = detail;
}

template <typename Backend>
__global__ void __launch_bounds__(kReduceThreads) reduce_kernel(Backend b, CombineParams p) {
  __shared__ const uint8_t* src[kMaxTopk];
  __shared__ uint32_t num_src;
  const uint64_t t = blockIdx.x;
  const uint32_t lane = threadIdx.x % dev::kWarpSize;
  const uint64_t out_row =
      uint64_t{p.slot.hidden} * protocol::encoding_elem_bytes(p.slot.out_encoding);
  if (threadIdx.x < dev::kWarpSize) {
    // Warp 0 lists this token's answering servers in increasing order (ballot per 32 servers).
    uint32_t n = 0;
    for (uint32_t s0 = 0; s0 < p.num_servers; s0 += dev::kWarpSize) {
      const uint32_t s = s0 + lane;
      int32_t row = kNoPosition;
      if (s < p.num_servers && p.ws.status[s] == static_cast<int32_t>(ServerStatus::kOk)) {
        row = p.ws.pos[t * p.num_servers + s];
      }
      const unsigned ballot = __ballot_sync(dev::kFullMask, row >= 0);
      const uint32_t i = n + __popc(ballot & ((1u << lane) - 1u));
      if (row >= 0 && i < kMaxTopk) {
        src[i] = b.local(response_slot(p, s) + protocol::kPayloadOffset) + uint64_t(row) * out_row;
      }
      n += __popc(ballot);
    }
    if (lane == 0) num_src = n < kMaxTopk ? n : kMaxTopk;
  }
  __syncthreads();
  const uint32_t n = num_src;
  const Encoding in = p.slot.out_encoding;
  void* y =
      static_cast<uint8_t*>(p.out) + t * p.slot.hidden * protocol::encoding_elem_bytes(p.out_dtype);
  for (uint32_t c = threadIdx.x; c < p.slot.hidden; c += kReduceThreads) {
    float acc = 0.0f;
    for (uint32_t i = 0; i < n; ++i) acc += dev::load_f32(src[i], c, in);
    dev::store_f32(y, c, p.out_dtype, acc);
  }
}

template <typename Backend>
void launch_combine(const Backend& backend, uint32_t max_peers, const ClientConfig& cfg,
                    const CombineArgs& a, void* stream) {
  check_client_call("combine", cfg, max_peers, backend.local_base, a.slot, a.workspace,
                    a.num_tokens);
  check_float_dtype(a.out_dtype, "combine: out");
  MC_CHECK(a.num_tokens == 0 || a.out != nullptr, "combine: out must be a non-null device pointer");
  MC_CHECK(a.timeout_ns > 0,
           "combine: timeout_ns must be > 0 (a wait without a deadline could "
           "hang the stream)");
  const CombineParams p{carve_client_workspace(a.workspace, cfg),
                        cfg.slot,
                        cfg.num_servers,
                        cfg.client_id,
                        cfg.response_ring_offset,
                        a.slot,
                        a.layer_id,
                        a.num_tokens,
                        a.out,
                        a.out_dtype,
                        a.timeout_ns,
                        protocol::response_slot_bytes(cfg.slot)};
  auto s = static_cast<cudaStream_t>(stream);
  const auto wait_blocks = static_cast<uint32_t>(ceil_div(cfg.num_servers, kWaitThreads));
  wait_kernel<Backend><<<wait_blocks, kWaitThreads, 0, s>>>(backend, p);
  check_kernel(s, "combine wait");
  if (a.num_tokens > 0) {
    reduce_kernel<Backend><<<a.num_tokens, kReduceThreads, 0, s>>>(backend, p);
    check_kernel(s, "combine reduce");
  }
}

}  // namespace moecomm::kernels::cuda::client
