// What the two device backends (cuda_ipc::IpcBackend, nvshmem::NvshmemBackend) hold alike: our
// region, the host-maintained liveness mask of the peer table and its size, and the debug mode's
// wait trace, with the members of the kernels' Backend interface (device_ops.cuh) that need
// nothing else. Each backend adds how it reaches a peer (mapped bases, NVSHMEM PEs) and its put,
// fence and wait steps.
//
// The data members compile under any C++ compiler (host code and bindings fill the structs);
// the member functions only under nvcc.
#pragma once

#include <cstdint>

#include "common/error.h"
#include "transport/device/wait_trace.h"

#if defined(__CUDACC__)
#include "transport/device/device_ops.cuh"
#endif

namespace moecomm::transport::device {

// Plain-old-data, passed to kernels by value inside the backend. The arrays are device memory
// owned by the host side (the peer tables), which rewrites them when peers join or leave.
struct BackendBase {
  uint8_t* local_base = nullptr;    // our own region
  const uint32_t* alive = nullptr;  // [max_peers] 1 = alive, 0 = gone or never joined
  uint32_t max_peers = 0;
  // The debug mode's wait trace (device memory), or nullptr: nothing recorded.
  WaitTrace* wait_trace = nullptr;

  // The fields above from a host description that names them alike (kernels::cuda::IpcPeers,
  // NvshmemPeers), after checking the pointers every kernel dereferences: those two and the
  // description's own peer array, `route`. `what` names the three in the message.
  template <typename Peers>
  static BackendBase of(const Peers& p, const void* route, const char* what) {
    MC_CHECK(p.local_base != nullptr && route != nullptr && p.alive != nullptr, what,
             " must be non-null device pointers");
    return BackendBase{p.local_base, p.alive, p.max_peers, p.wait_trace};
  }

#if defined(__CUDACC__)
  __device__ uint32_t num_peers() const { return max_peers; }

  __device__ bool peer_alive(uint32_t peer) const { return alive_in_mask(alive, max_peers, peer); }

  __device__ uint8_t* local(uint64_t offset) const { return local_base + offset; }
#endif  // __CUDACC__
};

}  // namespace moecomm::transport::device
