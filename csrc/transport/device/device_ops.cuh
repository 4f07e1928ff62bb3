// What a device kernel needs from a transport, and the pieces every backend shares: system-scope
// acquire/release on 64-bit signal words, the device clock, and a wait loop with a deadline.
//
// Kernels (dispatch, combine, the server's gather) are templates over a Backend type with these
// members, all callable from device code:
//
//   uint32_t num_peers() const;
//   bool peer_alive(uint32_t peer) const;          // host-maintained liveness mask
//   uint8_t* local(uint64_t offset) const;          // our own region: peers write here
//   // All 32 lanes call it with the same arguments: copies `bytes` from `src` (device memory)
//   // to `offset` of the peer's region, then raises the word at `sig_offset` of the peer's
//   // region with `op` (kSet: store, kAdd: add) such that a reader who observes the new word
//   // also observes the data (release, system scope). Non-blocking for other warps.
//   void put_signal_warp(uint32_t peer, uint64_t offset, const void* src, uint64_t bytes,
//                        uint64_t sig_offset, uint64_t value, transport::SignalOp op) const;
//   // Same without a signal. NOT ordered before a later put_signal_warp unless fence_warp()
//   // runs in between (NVSHMEM orders only the data and signal of one put_signal). The kernels
//   // never need it: each payload chunk is a put_signal_warp that ADDs its bytes to the slot's
//   // arrival counter, and the header's put SETs the signal word.
//   void put_warp(uint32_t peer, uint64_t offset, const void* src, uint64_t bytes) const;
//   // All 32 lanes: this warp's earlier put_warp data lands before its later puts (NVSHMEM:
//   // nvshmem_fence, costly with IBGDA; CUDA IPC: nothing, put_signal_warp fences anyway).
//   void fence_warp() const;
//   // All lanes: this warp's puts have completed (their sources may be rewritten). NVSHMEM:
//   // nvshmem_quiet (non-blocking puts outlive the kernel otherwise); CUDA IPC: nothing.
//   void quiet_warp() const;
//   // Called by wait_word (one thread) after the predicate held on the word at `offset` of our
//   // region: whatever the backend needs so data delivered before that signal is visible
//   // (CUDA IPC: nothing beyond the acquire load; NVSHMEM: its own post-wait step).
//   void complete_wait(uint64_t offset) const;
//
// Waiting is always on our own memory, so it is backend independent (wait_word below): a peer
// writes into our region with release, we read with acquire.
#pragma once

#include <cuda/atomic>

#include <cstdint>

#include "common/macros.h"
#include "transport/device/cuda_device.h"
#include "transport/transport.h"

namespace moecomm::transport::device {

// Same numbering as transport::WaitStatus so a device status word reads the same on the host.
enum class DeviceWait : uint32_t {
  kOk = static_cast<uint32_t>(WaitStatus::kOk),
  kTimeout = static_cast<uint32_t>(WaitStatus::kTimeout),
  kPeerLost = static_cast<uint32_t>(WaitStatus::kPeerLost),
};

// Nanoseconds from the global timer (same clock for every SM of a device).
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The peer (another GPU over NVLink, or the NIC) writes these words: system scope.
__device__ __forceinline__ uint64_t load_acquire(const uint64_t* word) {
  return ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system>(*const_cast<uint64_t*>(word))
      .load(::cuda::memory_order_acquire);
}

__device__ __forceinline__ void store_release(uint64_t* word, uint64_t value) {
  ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system>(*word).store(
      value, ::cuda::memory_order_release);
}

__device__ __forceinline__ void add_release(uint64_t* word, uint64_t value) {
  ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system>(*word).fetch_add(
      value, ::cuda::memory_order_release);
}

__device__ __forceinline__ bool satisfied(const WaitPredicate& p, uint64_t word) {
  const bool eq = (word & p.mask) == p.value;
  return p.op == WaitOp::kEqual ? eq : !eq;
}

// Polls the word at `offset` of our own region until `pred` holds (acquire), `deadline_ns` on
// now_ns() passes, or `peer` is marked dead. Never spins past the deadline: a dead peer or a
// lost message ends as a status code the host can read, not a hung kernel.
// Called by one thread; `*observed` receives the last word read.
template <typename Backend>
__device__ DeviceWait wait_word(const Backend& b, uint64_t offset, const WaitPredicate& pred,
                                uint64_t deadline_ns, uint32_t peer, uint64_t* observed) {
  const auto* word = reinterpret_cast<const uint64_t*>(b.local(offset));
  // Liveness is a host-written mask; reading it every iteration would add a global load to the
  // hot loop, so it is checked once every this many polls.
  constexpr uint32_t kPollsPerLivenessCheck = 64;
  for (uint32_t i = 0;; ++i) {
    const uint64_t w = load_acquire(word);
    *observed = w;
    if (satisfied(pred, w)) {
      b.complete_wait(offset);
      return DeviceWait::kOk;
    }
    if (i % kPollsPerLivenessCheck == 0) {
      if (!b.peer_alive(peer)) return DeviceWait::kPeerLost;
      if (now_ns() >= deadline_ns) return DeviceWait::kTimeout;
    }
  }
}

// One thread runs wait_word and reports what it saw (the transports' probes; tests). The probes'
// host sides reject a negative timeout: a probe without a deadline could hang its owner.
template <typename Backend>
__global__ void wait_probe_kernel(Backend b, uint64_t offset, WaitPredicate pred,
                                  int64_t timeout_ns, uint32_t peer, WaitProbeResult* out) {
  const uint64_t start = now_ns();
  const uint64_t deadline = start + static_cast<uint64_t>(timeout_ns < 0 ? 0 : timeout_ns);
  uint64_t observed = 0;
  const DeviceWait st = wait_word(b, offset, pred, deadline, peer, &observed);
  out->status = static_cast<uint32_t>(st);
  out->observed = observed;
  out->elapsed_ns = now_ns() - start;
}

}  // namespace moecomm::transport::device
