// Device side of the NVSHMEM transport: every region is a range of NVSHMEM's symmetric heap, so
// a peer's copy of our region sits at the same offset in its heap, and a put is
// nvshmemx_putmem_signal_nbi_warp (IBGDA: the GPU rings the NIC itself, no CPU on the path).
//
// The data members compile under any C++ compiler (host code and bindings fill the struct);
// the member functions, and NVSHMEM's device headers, only under nvcc.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#include <nvshmem.h>
#include <nvshmemx.h>

#include "transport/device/device_ops.cuh"
#endif

namespace moecomm::transport::nvshmem {

// Plain-old-data, passed to kernels by value; arrays are device memory the host side rewrites
// when peers are marked alive or dead (NVSHMEM's PE set itself is fixed at start).
struct NvshmemBackend {
  uint8_t* local_base = nullptr;     // our region: symmetric, same offset on every PE
  const int32_t* peer_pe = nullptr;  // [max_peers] NVSHMEM PE of each moecomm peer
  const uint32_t* alive = nullptr;   // [max_peers] liveness mask
  uint32_t max_peers = 0;

#if defined(__CUDACC__)
  __device__ uint32_t num_peers() const { return max_peers; }

  __device__ bool peer_alive(uint32_t peer) const {
    return peer < max_peers && ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system>(
                                   *const_cast<uint32_t*>(alive + peer))
                                       .load(::cuda::memory_order_relaxed) != 0;
  }

  __device__ uint8_t* local(uint64_t offset) const { return local_base + offset; }

  __device__ void put_warp(uint32_t peer, uint64_t offset, const void* src, uint64_t bytes) const {
    nvshmemx_putmem_nbi_warp(local_base + offset, src, bytes, peer_pe[peer]);
  }

  __device__ void put_signal_warp(uint32_t peer, uint64_t offset, const void* src, uint64_t bytes,
                                  uint64_t sig_offset, uint64_t value, SignalOp op) const {
    // Earlier put_warp calls of this warp to the same PE must land before this signal:
    // putmem_signal only orders its own data, so fence first.
    if (threadIdx.x % 32 == 0) nvshmem_fence();
    __syncwarp();
    nvshmemx_putmem_signal_nbi_warp(
        local_base + offset, src, bytes, reinterpret_cast<uint64_t*>(local_base + sig_offset),
        value, op == SignalOp::kSet ? NVSHMEM_SIGNAL_SET : NVSHMEM_SIGNAL_ADD, peer_pe[peer]);
  }

  // Called by wait_word once the predicate holds on a word a peer signalled. NVSHMEM's own
  // waits end with a transport-specific step that makes the data delivered before the signal
  // visible to this thread (with IBGDA the NIC writes GPU memory over PCIe); a wait on a
  // condition that already holds (any value >= 0) runs exactly that step and returns at once.
  __device__ void complete_wait(uint64_t offset) const {
    nvshmem_signal_wait_until(reinterpret_cast<uint64_t*>(local_base + offset), NVSHMEM_CMP_GE, 0);
  }
#endif  // __CUDACC__
};

}  // namespace moecomm::transport::nvshmem
