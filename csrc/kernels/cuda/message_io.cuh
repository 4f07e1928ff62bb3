// The device side of one slot message, shared by the client's dispatch and the server's answer
// kernels: finishing a message whose payload went out in chunks (the last warp stamps the
// arrival target and puts header + signal), and reading the words a peer signals into our region.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "protocol/header.h"
#include "protocol/layout.h"
#include "protocol/signal.h"
#include "transport/device/device_ops.cuh"

namespace moecomm::kernels::cuda::client {

// A message's progress word (the workspaces' done_warps, one u64 per destination slot): the
// warps that finished in the low kProgressWarpBits bits, the payload bytes they put above them.
// One atomic add per warp carries both, so the last warp learns both in one read.
constexpr uint32_t kProgressWarpBits = 16;
constexpr uint64_t kProgressWarpMask = (uint64_t{1} << kProgressWarpBits) - 1;
static_assert(sizeof(uint64_t) == sizeof(unsigned long long), "atomicAdd on the progress word");

// Whether this warp puts its chunks to `peer`: the liveness mask read once, by lane 0, for the
// whole warp (put_signal_warp needs every lane, and lanes reading the mask themselves could see
// it flip between them).
template <typename Backend>
__device__ bool warp_peer_alive(const Backend& b, uint32_t peer, uint32_t lane) {
  bool alive = false;
  if (lane == 0) alive = b.peer_alive(peer);
  return __shfl_sync(dev::kFullMask, alive, 0);
}

// Called by every warp of an entry's put grid after its chunks, with the payload bytes it put
// (`warp_bytes`): counts the warp done; the last one (it sees every other warp's count and
// bytes) decides once, with protocol::stamp_message, whether the message goes out (every chunk
// was put and the peer is alive now), advances the writer's total by the bytes put (layout.h:
// chunks that landed are counted, sent or not), stamps the header's arrival target and puts it
// with the signal. So the signal never precedes a chunk's issue, and the receiver's counter
// check covers chunks still in flight (NVSHMEM delivers non-blocking puts in any order).
// Every warp must call it (a warp that returns early would leave the count short for good).
// `fill(hdr)` runs in the last warp's lane 0 before the stamp: the server writes its header
// there (no other warp touches it, so nothing crosses blocks but the count); the client's header
// was written by an earlier launch.
template <typename Backend, typename Fill>
__device__ void finish_message(const Backend& b, uint32_t peer, uint64_t* progress,
                               uint32_t num_warps, uint64_t warp_bytes, uint64_t* arrival_sent,
                               protocol::SlotHeader* hdr, uint64_t remote_slot, uint64_t signal,
                               uint32_t lane, Fill fill) {
  bool put = false;
  if (lane == 0) {
    __threadfence();  // this warp's puts (and writes) come before it counts itself done
    const uint64_t before = atomicAdd(reinterpret_cast<unsigned long long*>(progress),
                                      (warp_bytes << kProgressWarpBits) | 1u);
    if ((before & kProgressWarpMask) == num_warps - 1) {
      __threadfence();  // acquire side of the count: every other warp's work is before this
      *progress = 0;    // only the last warp is left: no one else touches it this message
      fill(hdr);
      const uint64_t bytes_put = (before >> kProgressWarpBits) + warp_bytes;
      const protocol::MessageStamp m =
          protocol::stamp_message(*arrival_sent, hdr->payload_bytes, bytes_put, b.peer_alive(peer));
      *arrival_sent = m.arrival_sent;
      hdr->arrival_target = m.arrival_target;
      put = m.put_header;
      // The header staging is read by the put (by the NIC under NVSHMEM): make it visible.
      if (put) __threadfence_system();
    }
  }
  put = __shfl_sync(dev::kFullMask, put, 0);
  if (!put) return;
  b.put_signal_warp(peer, remote_slot + protocol::kHeaderOffset, hdr, sizeof(protocol::SlotHeader),
                    remote_slot + protocol::kSignalOffset, signal, transport::SignalOp::kSet);
}

// Reads a word of our own region that a peer signals, through wait_word with a predicate that
// holds at once: the backend's post-wait step (NVSHMEM makes data delivered before the signal
// visible) then runs on every path that goes on to read what the signal published.
template <typename Backend>
__device__ uint64_t read_signal(const Backend& b, uint64_t offset, uint32_t peer,
                                transport::device::WaitSite site) {
  // No real signal word is all ones (state 0xff is not a state), so this always holds.
  const transport::WaitPredicate any{transport::WaitOp::kNotEqual, ~uint64_t{0}, ~uint64_t{0}};
  uint64_t word = 0;
  transport::device::wait_word(b, offset, any, ~uint64_t{0}, peer, &word, site);
  return word;
}

// Waits until the cumulative arrival counter at `offset` of our region reaches `target`
// (layout.h: it only grows), the deadline passes or `peer` is marked dead. One record in the
// debug trace (op kWaitOpAtLeast, value = target), not one per chunk that moved the counter.
template <typename Backend>
__device__ transport::device::DeviceWait wait_at_least(const Backend& b, uint64_t offset,
                                                       uint64_t target, uint64_t deadline_ns,
                                                       uint32_t peer,
                                                       transport::device::WaitSite site) {
  using transport::device::DeviceWait;
  transport::device::WaitTrace* const trace = b.wait_trace;
  const uint64_t start = trace != nullptr ? transport::device::now_ns() : 0;
  // The first read holds at once (no counter is all ones): the backend's post-wait step runs.
  const transport::WaitPredicate any{transport::WaitOp::kNotEqual, ~uint64_t{0}, ~uint64_t{0}};
  uint64_t seen = 0;
  DeviceWait status = transport::device::poll_word(b, offset, any, ~uint64_t{0}, peer, &seen);
  while (status == DeviceWait::kOk && seen < target) {
    const transport::WaitPredicate changed{transport::WaitOp::kNotEqual, ~uint64_t{0}, seen};
    status = transport::device::poll_word(b, offset, changed, deadline_ns, peer, &seen);
  }
  if (trace != nullptr) {
    transport::device::record_wait(trace, offset, transport::device::kWaitOpAtLeast, ~uint64_t{0},
                                   target, seen, start, status, peer, site);
  }
  return status;
}

}  // namespace moecomm::kernels::cuda::client
