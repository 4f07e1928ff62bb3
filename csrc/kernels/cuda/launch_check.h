// What every launcher of the device data path checks: before it enqueues, the arguments the
// client and the server launchers share (the slot shape, the workspace, float dtypes); after each
// kernel, the launch error, and in the device debug mode (MOECOMM_DEVICE_DEBUG=1,
// docs/device-dispatch.md) the kernel's own outcome: the stream is synchronized and an error (an
// illegal address, a trap) is thrown naming the kernel that raised it, instead of surfacing at
// some later, unrelated call. Host code (the launchers, and the binding that reports whether the
// mode is on).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/align.h"
#include "common/error.h"
#include "kernels/cuda/dispatch_index.h"
#include "protocol/header.h"

namespace moecomm::kernels::cuda {

// The variable that turns the mode on (any value but empty or "0"), read once per process: the
// launchers are on the decode hot path, and the Python side that prints the trace reads it too.
constexpr const char* kDeviceDebugEnv = "MOECOMM_DEVICE_DEBUG";

inline bool is_float_dtype(protocol::Encoding e) {
  return e == protocol::Encoding::kBF16 || e == protocol::Encoding::kFP16 ||
         e == protocol::Encoding::kF32;
}

// `what` names the argument with its launcher ("combine: out").
inline void check_float_dtype(protocol::Encoding e, const char* what) {
  MC_CHECK(is_float_dtype(e), what, " must be BF16, FP16 or F32, got encoding ",
           static_cast<int>(e));
}

// The slot shape a client and its servers agreed on, as both ends' launchers check it; `who`
// starts the message ("device client", "device server").
inline void check_slot_config(const protocol::SlotConfig& c, const char* who) {
  MC_CHECK(c.max_tokens >= 1 && c.hidden >= 1, who, ": max_tokens and hidden must be >= 1, got ",
           c.max_tokens, " and ", c.hidden);
  MC_CHECK(c.topk >= 1 && c.topk <= kMaxTopk, who, ": topk must be in [1, ", kMaxTopk, "], got ",
           c.topk);
  MC_CHECK(protocol::encoding_known(static_cast<uint8_t>(c.encoding)), who,
           ": unknown request encoding ", static_cast<int>(c.encoding));
  MC_CHECK(protocol::encoding_known(static_cast<uint8_t>(c.out_encoding)) &&
               !protocol::encoding_quantized(c.out_encoding),
           who, ": the response encoding must be BF16, FP16 or F32, got ",
           static_cast<int>(c.out_encoding));
}

// The workspace is carved into cache-line aligned pieces (client/server_workspace_layout).
inline void check_workspace(const void* workspace, const char* who) {
  MC_CHECK(workspace != nullptr && reinterpret_cast<uintptr_t>(workspace) % kCacheLine == 0, who,
           ": workspace must be a non-null, ", kCacheLine, "-byte aligned device pointer");
}

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
