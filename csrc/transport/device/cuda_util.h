// RAII helpers for the CUDA host code of the transports (nvcc translation units only): the
// current device restored on scope exit, device memory freed unless released.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <new>
#include <utility>

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

// A new non-blocking stream, with every (pointer, bytes) of `zeroed` set to zero on it and
// synchronized: the device tables of a peer table start empty before any kernel reads them. On
// an error the stream is destroyed and the first failure thrown.
inline cudaStream_t new_stream_zeroing(std::initializer_list<std::pair<void*, uint64_t>> zeroed) {
  cudaStream_t s = nullptr;
  MC_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaError_t first = cudaSuccess;
  for (const auto& [ptr, bytes] : zeroed) {
    const cudaError_t e = cudaMemsetAsync(ptr, 0, bytes, s);
    if (first == cudaSuccess) first = e;
  }
  const cudaError_t e = cudaStreamSynchronize(s);
  if (first == cudaSuccess) first = e;
  if (first != cudaSuccess) {
    cudaStreamDestroy(s);
    MC_CUDA_CHECK(first);
  }
  return s;
}

}  // namespace moecomm::transport
