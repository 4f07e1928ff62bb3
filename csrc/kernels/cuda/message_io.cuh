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

// Called by every warp of an entry's put grid after its chunks: counts the warp done; the last
// one (it sees every other warp's count) stamps the header's arrival target and puts it with
// the signal. So the signal never precedes a chunk's issue, and the receiver's counter check
// covers chunks still in flight (NVSHMEM delivers non-blocking puts in any order).
// Every warp must call it (a warp that returns early would leave the count short for good); the
// last one puts only if the peer is still alive.
// `fill(hdr)` runs in the last warp's lane 0 before the stamp: the server writes its header
// there (no other warp touches it, so nothing crosses blocks but the count); the client's header
// was written by an earlier launch.
template <typename Backend, typename Fill>
__device__ void finish_message(const Backend& b, uint32_t peer, uint32_t* done, uint32_t num_warps,
                               uint64_t* arrival_sent, protocol::SlotHeader* hdr,
                               uint64_t remote_slot, uint64_t signal, uint32_t lane, Fill fill) {
  bool last = false;
  if (lane == 0) {
    __threadfence();  // this warp's puts (and writes) come before it counts itself done
    last = atomicAdd(done, 1u) == num_warps - 1;
    if (last) {
      __threadfence();  // acquire side of the count: every other warp's work is before this
      *done = 0;        // only the last warp is left: no one else touches it this message
      fill(hdr);
      const uint64_t target = *arrival_sent + hdr->payload_bytes;
      *arrival_sent = target;
      hdr->arrival_target = hdr->payload_bytes == 0 ? 0 : target;
      // The header staging is read by the put (by the NIC under NVSHMEM): make it visible.
      __threadfence_system();
    }
  }
  last = __shfl_sync(dev::kFullMask, last, 0);
  if (!last || !b.peer_alive(peer)) return;
  b.put_signal_warp(peer, remote_slot + protocol::kHeaderOffset, hdr, sizeof(protocol::SlotHeader),
                    remote_slot + protocol::kSignalOffset, signal, transport::SignalOp::kSet);
}

// Reads a word of our own region that a peer signals, through wait_word with a predicate that
// holds at once: the backend's post-wait step (NVSHMEM makes data delivered before the signal
// visible) then runs on every path that goes on to read what the signal published.
template <typename Backend>
__device__ uint64_t read_signal(const Backend& b, uint64_t offset, uint32_t peer) {
  // No real signal word is all ones (state 0xff is not a state), so this always holds.
  const transport::WaitPredicate any{transport::WaitOp::kNotEqual, ~uint64_t{0}, ~uint64_t{0}};
  uint64_t word = 0;
  transport::device::wait_word(b, offset, any, ~uint64_t{0}, peer, &word);
  return word;
}

// Waits until the cumulative arrival counter at `offset` of our region reaches `target`
// (layout.h: it only grows), the deadline passes or `peer` is marked dead.
template <typename Backend>
__device__ transport::device::DeviceWait wait_at_least(const Backend& b, uint64_t offset,
                                                       uint64_t target, uint64_t deadline_ns,
                                                       uint32_t peer) {
  uint64_t seen = read_signal(b, offset, peer);
  while (seen < target) {
    const transport::WaitPredicate changed{transport::WaitOp::kNotEqual, ~uint64_t{0}, seen};
    const auto w = transport::device::wait_word(b, offset, changed, deadline_ns, peer, &seen);
    if (w != transport::device::DeviceWait::kOk) return w;
  }
  return transport::device::DeviceWait::kOk;
}

}  // namespace moecomm::kernels::cuda::client
