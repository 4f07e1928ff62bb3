// Is there a CUDA device, and if not, why: asked by both GPU transports before their first CUDA
// call, so a machine without a GPU or driver gets a clear error instead of a crash.
#pragma once

#include <cstdint>
#include <string>

namespace moecomm::transport {

// What a device wait probe saw (tests and diagnostics of both GPU transports).
struct WaitProbeResult {
  uint32_t status = 0;  // transport::WaitStatus numbering
  uint64_t observed = 0;
  uint64_t elapsed_ns = 0;  // device globaltimer, from kernel start to the verdict
};

// Number of CUDA devices this process sees; 0 without a driver or device (never throws).
int device_count();
// Why device_count() is 0 (the CUDA error), or "" when a device is visible.
std::string no_device_reason();
// Throws moecomm::Error (kSystem) naming `who` and the reason when no CUDA device is usable.
void require_device(const char* who);

}  // namespace moecomm::transport
