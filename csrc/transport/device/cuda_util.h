// RAII helpers for the CUDA host code of the transports (nvcc translation units only): the
// current device restored on scope exit, device memory freed unless released, and device
// memory allocated and freed in stream order.
//
// Why stream order: cudaFree synchronises the whole device. While a kernel spins on a device
// wait (a combine waiting for a server, a probe), a cudaFree anywhere in the process (a
// destructor run by garbage collection, a put's staging buffer) blocks the host until that
// kernel ends, at its deadline. cudaFreeAsync enqueues the free on one stream and returns.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <new>
#include <utility>

#include "common/error.h"
#include "transport/device/deferred_free.h"

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

// Whether `device` has the stream-ordered allocator (cudaMallocAsync); asked once per device.
// Without it (an old driver, some virtualised devices) the stream-ordered helpers below fall
// back to cudaMalloc/cudaFree, device synchronisation included.
inline bool stream_ordered_supported(int device) {
  constexpr int kMaxDevices = 64;
  static int known[kMaxDevices] = {};  // 0 unknown, 1 yes, 2 no
  static std::mutex mu;
  if (device < 0 || device >= kMaxDevices) return false;
  std::lock_guard<std::mutex> lock(mu);
  if (known[device] == 0) {
    int v = 0;
    const bool ok =
        cudaDeviceGetAttribute(&v, cudaDevAttrMemoryPoolsSupported, device) == cudaSuccess;
    cudaGetLastError();
    known[device] = ok && v != 0 ? 1 : 2;
  }
  return known[device] == 1;
}

// `bytes` of device memory usable by work on `stream` (and, after a synchronisation of it, by
// any stream) on the current device, `device`.
inline void* stream_alloc(uint64_t bytes, cudaStream_t stream, int device) {
  void* p = nullptr;
  if (stream_ordered_supported(device)) {
    MC_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream));
  } else {
    MC_CUDA_CHECK(cudaMalloc(&p, bytes));
  }
  return p;
}

// Frees what stream_alloc returned, once the work enqueued on `stream` before it is done; returns
// at once (no device synchronisation) where the device has the stream-ordered allocator. For
// destructors: nothing throws, errors are cleared.
inline void stream_free(void* p, cudaStream_t stream, int device) noexcept {
  if (p == nullptr) return;
  if (stream_ordered_supported(device)) {
    cudaFreeAsync(p, stream);
  } else {
    cudaFree(p);
  }
  cudaGetLastError();
}

// Device bytes freed on scope exit unless release()d, from one of two allocators:
// DeviceBuffer(bytes) takes cudaMalloc memory (what a CUDA IPC export needs) and frees it with
// cudaFree; DeviceBuffer(bytes, stream, device) allocates and frees in stream order (stream_alloc,
// stream_free: no device synchronisation).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(uint64_t bytes) { MC_CUDA_CHECK(cudaMalloc(&ptr_, bytes)); }
  DeviceBuffer(uint64_t bytes, cudaStream_t stream, int device)
      : ptr_(stream_alloc(bytes, stream, device)),
        stream_(stream),
        device_(device),
        stream_ordered_(true) {}
  ~DeviceBuffer() {
    if (ptr_ == nullptr) return;
    if (stream_ordered_) {
      stream_free(ptr_, stream_, device_);
    } else {
      cudaFree(ptr_);
    }
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
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
  bool stream_ordered_ = false;
};

// The process's deferred cudaFree calls: memory that must come from cudaMalloc (a CUDA IPC
// export) and so cannot be freed in stream order is handed here by its owner's destructor and
// freed at a point where no device wait of this process may spin (DeferredFrees::drain's
// callers: the transport's destruction, release_deferred_frees()).
inline DeferredFrees& deferred_frees() {
  static DeferredFrees frees;
  return frees;
}

// Frees every deferred pointer now (cudaFree on its device); the number freed.
inline size_t release_deferred_frees() noexcept {
  return deferred_frees().drain([](int device, void* p) {
    int previous = 0;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device &&
                          cudaSetDevice(device) == cudaSuccess;
    cudaFree(p);
    if (switched) cudaSetDevice(previous);
    cudaGetLastError();
  });
}

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
