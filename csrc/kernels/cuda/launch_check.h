// What every launcher of the device data path runs after each kernel: the launch error, and in
// the device debug mode (MOECOMM_DEVICE_DEBUG=1, docs/device-dispatch.md) the kernel's own
// outcome: the stream is synchronized and an error (an illegal address, a trap) is thrown naming
// the kernel that raised it, instead of surfacing at some later, unrelated call. Host code (the
// launchers, and the binding that reports whether the mode is on).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "common/error.h"

namespace moecomm::kernels::cuda {

// The variable that turns the mode on (any value but empty or "0"), read once per process: the
// launchers are on the decode hot path, and the Python side that prints the trace reads it too.
constexpr const char* kDeviceDebugEnv = "MOECOMM_DEVICE_DEBUG";

inline bool device_debug_enabled() {
  static const bool on = [] {
    const char* v = std::getenv(kDeviceDebugEnv);
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }();
  return on;
}

inline void check_kernel(cudaStream_t stream, const char* kernel) {
  const cudaError_t launch = cudaGetLastError();
  if (launch != cudaSuccess) {
    MC_THROW(ErrorKind::kSystem, "CUDA error ", cudaGetErrorName(launch), " launching ", kernel,
             ": ", cudaGetErrorString(launch));
  }
  if (!device_debug_enabled()) return;
  // A launch captured into a graph runs at replay: nothing to wait for (and synchronizing a
  // capturing stream would invalidate the capture).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t query = cudaStreamIsCapturing(stream, &capture);
  if (query != cudaSuccess) {
    MC_THROW(ErrorKind::kSystem, "CUDA error ", cudaGetErrorName(query), " after ", kernel, ": ",
             cudaGetErrorString(query));
  }
  if (capture != cudaStreamCaptureStatusNone) return;
  const cudaError_t ran = cudaStreamSynchronize(stream);
  if (ran != cudaSuccess) {
    MC_THROW(ErrorKind::kSystem, "device debug: kernel ", kernel,
             " failed: ", cudaGetErrorName(ran), ": ", cudaGetErrorString(ran));
  }
}

}  // namespace moecomm::kernels::cuda
