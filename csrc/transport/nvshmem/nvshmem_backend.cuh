// Device side of the NVSHMEM transport: every region is a range of NVSHMEM's symmetric heap, so
// a peer's copy of our region sits at the same offset in its heap, and a put is
// nvshmemx_putmem_signal_nbi_warp (IBGDA: the GPU rings the NIC itself, no CPU on the path).
//
// The data members compile under any C++ compiler (host code and bindings fill the struct);
// the member functions, and NVSHMEM's device headers, only under nvcc.
#pragma once

#include <cstdint>

#include "transport/device/backend_base.h"

#if defined(__CUDACC__)
#include <nvshmem.h>
#include <nvshmemx.h>

#include "transport/device/device_ops.cuh"
#endif

namespace moecomm::transport::nvshmem {

// Plain-old-data, passed to kernels by value; the arrays are device memory the host side
// rewrites when peers are marked alive or dead (NVSHMEM's PE set itself is fixed at start).
// local_base is symmetric: the same offset on every PE, which is how a put names its target.
struct NvshmemBackend : device::BackendBase {
  const int32_t* peer_pe = nullptr;  // [max_peers] NVSHMEM PE of each moecomm peer

#if defined(__CUDACC__)
  // No ordering against a later put_signal_warp: a caller that needs this data covered by a
  // later signal calls fence_warp() in between (see below). The kernels never mix the two: every
  // payload chunk is its own put_signal_warp (ADD of its bytes to the slot's arrival counter).
  __device__ void put_warp(uint32_t peer, uint64_t offset, const void* src, uint64_t bytes) const {
    nvshmemx_putmem_nbi_warp(local_base + offset, src, bytes, peer_pe[peer]);
  }

  // The data and the signal of ONE put travel in order (putmem_signal's definition); nothing
  // else is ordered, and nothing needs to be: chunks of a payload each ADD their own bytes to the
  // arrival counter, and the reader waits for the sum. No nvshmem_fence here: with IBGDA a fence
  // quiets every QP to every PE, which costs a round trip per chunk, and a QP that holds an error
  // completion (a dead peer) then traps every later put of this warp, to live peers too.
  __device__ void put_signal_warp(uint32_t peer, uint64_t offset, const void* src, uint64_t bytes,
                                  uint64_t sig_offset, uint64_t value, SignalOp op) const {
    nvshmemx_putmem_signal_nbi_warp(
        local_base + offset, src, bytes, reinterpret_cast<uint64_t*>(local_base + sig_offset),
        value, op == SignalOp::kSet ? NVSHMEM_SIGNAL_SET : NVSHMEM_SIGNAL_ADD, peer_pe[peer]);
  }

  // Orders this warp's earlier put_warp calls before its later puts (all lanes call it). Only
  // for the put_warp-then-signal pattern; never on the chunk path (see put_signal_warp).
  __device__ void fence_warp() const {
    __syncwarp();
    if (threadIdx.x % 32 == 0) nvshmem_fence();
    __syncwarp();
  }

  // All lanes: every put this warp issued has left its source buffer and landed at the target
  // (nvshmem_quiet). Called at the end of a put kernel whose sources (staging) the next launch
  // on the stream rewrites: kernel completion does not complete non-blocking puts.
  __device__ void quiet_warp() const {
    __syncwarp();
    if (threadIdx.x % 32 == 0) nvshmem_quiet();
    __syncwarp();
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
