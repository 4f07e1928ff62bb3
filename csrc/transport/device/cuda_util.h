// RAII helpers for the CUDA host code of the transports (nvcc translation units only): the
// current device restored on scope exit, device memory freed unless released.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <new>

#include "common/error.h"

namespace moecomm::transport {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    MC_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      MC_CUDA_CHECK(cudaSetDevice(device));
      changed_ = true;
    }
  }
  // For destructors: failures are swallowed (and cleared), nothing throws.
  DeviceGuard(int device, const std::nothrow_t&) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      changed_ = cudaSetDevice(device) == cudaSuccess;
    }
    cudaGetLastError();
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// cudaMalloc'd bytes, freed on scope exit unless release()d.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(uint64_t bytes) { MC_CUDA_CHECK(cudaMalloc(&ptr_, bytes)); }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  void* release() {
    void* p = ptr_;
    ptr_ = nullptr;
    return p;
  }

 private:
  void* ptr_ = nullptr;
};

}  // namespace moecomm::transport
