// A list of device allocations whose free is put off to a later, chosen point. Plain C++ (no
// CUDA header): the transports' CUDA code holds one per process (cuda_util.h:
// deferred_frees()), and a host-only test builds it with g++
// (tests/gpu/test_deferred_free_host.py).
//
// Why put a free off: memory exported over CUDA IPC must come from cudaMalloc, and cudaFree
// synchronises the whole device, so a free while a kernel of this process spins on a device wait
// blocks the host until that wait's deadline. The owner's destructor hands the pointer here
// instead, and it is freed where no wait can spin.
#pragma once

#include <cstddef>
#include <mutex>
#include <utility>
#include <vector>

namespace moecomm::transport {

class DeferredFrees {
 public:
  // Records `ptr` (on `device`) to be freed by the next drain(). Never throws: it is called
  // from destructors; a pointer that cannot be recorded (out of memory) is dropped (leaked),
  // which is the lesser harm than a blocking free under a spinning kernel.
  void defer(int device, void* ptr) noexcept {
    if (ptr == nullptr) return;
    try {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.emplace_back(device, ptr);
    } catch (...) {
    }
  }

  // Calls free(device, ptr) for every recorded pointer, oldest first, outside the lock (a free
  // may take long; defer() from another thread must not wait for it); returns how many.
  template <typename Free>
  size_t drain(Free&& free) noexcept {
    std::vector<std::pair<int, void*>> todo;
    {
      std::lock_guard<std::mutex> lock(mu_);
      todo.swap(pending_);
    }
    for (const auto& [device, ptr] : todo) free(device, ptr);
    return todo.size();
  }

  size_t pending() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_.size();
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::pair<int, void*>> pending_;
};

}  // namespace moecomm::transport
