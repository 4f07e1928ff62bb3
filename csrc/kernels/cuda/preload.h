// Loading this library's device code before a process says it is ready. Host code.
//
// Why: with lazy module loading (CUDA's default since 12.2) a kernel is loaded on its first
// launch. A process that joins a GPU where another process's kernel is spinning on a device
// wait (a peer joining a running client, a second DeepEP rank, a server starting beside a
// client) would then load modules, and launch for the first time, while that kernel holds the
// GPU; loading every kernel before "ready" moves that work out of the protocol's way.
#pragma once

#include <cstdint>
#include <string>

namespace moecomm::kernels::cuda {

struct PreloadReport {
  int device = 0;
  uint32_t functions = 0;   // device functions of the library's module
  uint32_t loaded_now = 0;  // of those, not loaded before this call
  double seconds = 0.0;
  std::string how;  // the mechanism used (a driver without it falls back, and says so)
};

// Loads every kernel of moecomm_cuda's device code on `device` (-1: the current one); makes the
// device's primary context current. Never synchronises the device. Idempotent: a second call
// loads nothing (loaded_now 0). Throws moecomm::Error when there is no device.
PreloadReport preload_kernels(int device);

}  // namespace moecomm::kernels::cuda
