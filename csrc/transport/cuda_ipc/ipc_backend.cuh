// Device side of the CUDA-IPC transport: peers' regions are mapped into our address space
// (cudaIpcOpenMemHandle on the host), so a put is a warp of 16-byte stores over NVLink/PCIe and
// a signal is a system-scope release store or add on the peer's word.
//
// The data members compile under any C++ compiler (host code and bindings fill the struct);
// the member functions only under nvcc.
#pragma once

#include <cstdint>

#include "transport/device/backend_base.h"

#if defined(__CUDACC__)
#include "transport/device/device_ops.cuh"
#endif

namespace moecomm::transport::cuda_ipc {

// Bytes each lane moves per step when source and destination are both 16-byte aligned.
constexpr uint64_t kVectorBytes = 16;
constexpr uint32_t kWarpSize = 32;

// Plain-old-data, passed to kernels by value. The peer array is device memory owned by the host
// side (IpcPeerTable), which rewrites it when peers join or leave.
struct IpcBackend : device::BackendBase {
  uint8_t* const* peer_base = nullptr;  // [max_peers] mapped peer regions (nullptr = no peer)

#if defined(__CUDACC__)
  // All lanes of the warp call this with the same arguments.
  __device__ void put_warp(uint32_t peer, uint64_t offset, const void* src, uint64_t bytes) const {
    const uint32_t lane = threadIdx.x % kWarpSize;
    uint8_t* dst = peer_base[peer] + offset;
    const auto* s = static_cast<const uint8_t*>(src);
    const bool vec =
        ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(s)) % kVectorBytes) == 0;
    uint64_t done = 0;
    if (vec) {
      const uint64_t n = bytes / kVectorBytes;
      auto* d4 = reinterpret_cast<int4*>(dst);
      const auto* s4 = reinterpret_cast<const int4*>(s);
      for (uint64_t i = lane; i < n; i += kWarpSize) d4[i] = s4[i];
      done = n * kVectorBytes;
    }
    for (uint64_t i = done + lane; i < bytes; i += kWarpSize) dst[i] = s[i];
  }

  __device__ void put_signal_warp(uint32_t peer, uint64_t offset, const void* src, uint64_t bytes,
                                  uint64_t sig_offset, uint64_t value, SignalOp op) const {
    put_warp(peer, offset, src, bytes);
    // Every lane's stores happen before lane 0's fence (warp barrier), and the fence is
    // cumulative at system scope, so the release below publishes the whole warp's data.
    __syncwarp();
    if (threadIdx.x % kWarpSize == 0) {
      __threadfence_system();
      auto* word = reinterpret_cast<uint64_t*>(peer_base[peer] + sig_offset);
      if (op == SignalOp::kSet) {
        device::store_release(word, value);
      } else {
        device::add_release(word, value);
      }
    }
    __syncwarp();
  }

  // put_signal_warp's system fence already covers this warp's earlier put_warp stores.
  __device__ void fence_warp() const {}

  // Stores into mapped peer memory are complete when the warp has executed them.
  __device__ void quiet_warp() const {}

  // Called by wait_word once the predicate holds: the acquire load already ordered the data.
  __device__ void complete_wait(uint64_t /*offset*/) const {}
#endif  // __CUDACC__
};

}  // namespace moecomm::transport::cuda_ipc
