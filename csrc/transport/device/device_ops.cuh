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
//   // The debug mode's wait trace (wait_trace.h), or nullptr: then nothing is recorded.
//   WaitTrace* wait_trace;
//
// Waiting is always on our own memory, so it is backend independent (wait_word below): a peer
// writes into our region with release, we read with acquire.
#pragma once

#include <cuda/atomic>

#include <cstdint>

#include "common/macros.h"
#include "transport/device/cuda_device.h"
#include "transport/device/wait_trace.h"
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

// A backend's peer_alive: the host-maintained mask `alive` [max_peers], 1 = alive. The host
// rewrites it while kernels run, hence the relaxed system-scope load (no ordering needed: a
// stale read only delays noticing a loss by one check).
__device__ __forceinline__ bool alive_in_mask(const uint32_t* alive, uint32_t max_peers,
                                              uint32_t peer) {
  return peer < max_peers && ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system>(
                                 *const_cast<uint32_t*>(alive + peer))
                                     .load(::cuda::memory_order_relaxed) != 0;
}

__device__ __forceinline__ bool satisfied(const WaitPredicate& p, uint64_t word) {
  const bool eq = (word & p.mask) == p.value;
  return p.op == WaitOp::kEqual ? eq : !eq;
}

// Back-off of a device wait. A signal already in flight lands within the first polls, so a wait
// sleeps only after this many back-to-back acquire loads (a microsecond or two).
constexpr uint32_t kFastPolls = 128;
// The first sleep: about one L2 round trip, so a signal landing just after the fast polls is
// noticed almost as soon as by spinning.
constexpr uint32_t kBackoffStartNs = 32;
// The longest sleep, reached by doubling. __nanosleep sleeps up to twice its argument, so this
// bounds what the back-off adds to noticing a signal (a few microseconds, against round trips
// of tens), while a long wait issues one load per couple of microseconds instead of one per
// cycle: on one GPU without MPS the spinning client takes that much less of the SMs, issue
// slots and memory bandwidth the server's kernels need to write the awaited word.
constexpr uint32_t kBackoffCapNs = 2048;
// Liveness is a host-written mask; reading it every poll would add a global load to the hot
// loop, so it is checked once every this many polls.
constexpr uint32_t kPollsPerLivenessCheck = 64;

// Appends one record to the debug trace (wait_trace.h). The record's index is written last, so
// a record the host finds with index 0 is one that was being rewritten when it was copied.
__device__ inline void record_wait(WaitTrace* trace, uint64_t offset, uint32_t op, uint64_t mask,
                                   uint64_t value, uint64_t observed, uint64_t start_ns,
                                   DeviceWait status, uint32_t peer, WaitSite site) {
  const uint64_t n = atomicAdd(reinterpret_cast<unsigned long long*>(&trace->header.next), 1ull);
  WaitRecord* r = &trace->records[n % kWaitTraceRecords];
  *reinterpret_cast<volatile uint64_t*>(&r->index) = 0;
  __threadfence();
  r->offset = offset;
  r->mask = mask;
  r->value = value;
  r->observed = observed;
  r->start_ns = start_ns;
  r->elapsed_ns = now_ns() - start_ns;
  r->op = op;
  r->status = static_cast<uint32_t>(status);
  r->peer = peer;
  r->site = static_cast<uint32_t>(site);
  r->block = blockIdx.x;
  r->thread = threadIdx.x;
  __threadfence();
  *reinterpret_cast<volatile uint64_t*>(&r->index) = n + 1;
}

// Polls the word at `offset` of our own region until `pred` holds (acquire), `deadline_ns` on
// now_ns() passes, or `peer` is marked dead. Never spins past the deadline: a dead peer or a
// lost message ends as a status code the host can read, not a hung kernel. Polls back to back
// for kFastPolls, then sleeps between polls with exponential back-off (kBackoffStartNs doubling
// to kBackoffCapNs), checking the deadline after every poll from then on.
// Called by one thread; `*observed` receives the last word read. Records nothing (wait_word
// below does).
template <typename Backend>
__device__ DeviceWait poll_word(const Backend& b, uint64_t offset, const WaitPredicate& pred,
                                uint64_t deadline_ns, uint32_t peer, uint64_t* observed) {
  const auto* word = reinterpret_cast<const uint64_t*>(b.local(offset));
  uint32_t sleep_ns = kBackoffStartNs;
  for (uint32_t i = 0;; ++i) {
    const uint64_t w = load_acquire(word);
    *observed = w;
    if (satisfied(pred, w)) {
      b.complete_wait(offset);
      return DeviceWait::kOk;
    }
    const bool backing_off = i >= kFastPolls;
    if (i % kPollsPerLivenessCheck == 0 && !b.peer_alive(peer)) return DeviceWait::kPeerLost;
    if ((backing_off || i % kPollsPerLivenessCheck == 0) && now_ns() >= deadline_ns) {
      return DeviceWait::kTimeout;
    }
    if (backing_off) {
      __nanosleep(sleep_ns);
      sleep_ns = sleep_ns < kBackoffCapNs / 2 ? sleep_ns * 2 : kBackoffCapNs;
    }
  }
}

// poll_word, recorded in the debug trace under `site` when the backend carries one.
template <typename Backend>
__device__ DeviceWait wait_word(const Backend& b, uint64_t offset, const WaitPredicate& pred,
                                uint64_t deadline_ns, uint32_t peer, uint64_t* observed,
                                WaitSite site) {
  WaitTrace* const trace = b.wait_trace;
  const uint64_t start = trace != nullptr ? now_ns() : 0;
  const DeviceWait status = poll_word(b, offset, pred, deadline_ns, peer, observed);
  if (trace != nullptr) {
    record_wait(trace, offset, static_cast<uint32_t>(pred.op), pred.mask, pred.value, *observed,
                start, status, peer, site);
  }
  return status;
}

// One thread runs wait_word and reports what it saw (the transports' probes; tests). The probes'
// host sides reject a negative timeout: a probe without a deadline could hang its owner.
template <typename Backend>
__global__ void wait_probe_kernel(Backend b, uint64_t offset, WaitPredicate pred,
                                  int64_t timeout_ns, uint32_t peer, WaitProbeResult* out) {
  const uint64_t start = now_ns();
  const uint64_t deadline = start + static_cast<uint64_t>(timeout_ns < 0 ? 0 : timeout_ns);
  uint64_t observed = 0;
  const DeviceWait st = wait_word(b, offset, pred, deadline, peer, &observed, WaitSite::kProbe);
  out->status = static_cast<uint32_t>(st);
  out->observed = observed;
  out->elapsed_ns = now_ns() - start;
}

}  // namespace moecomm::transport::device
