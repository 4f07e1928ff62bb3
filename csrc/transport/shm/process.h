// Process identity that survives pid reuse: (pid, start time in clock ticks since boot).
#pragma once

#include <sys/types.h>

#include <cstdint>

namespace moecomm::transport::shm {

struct ProcessId {
  int64_t pid = 0;
  uint64_t start_ticks = 0;
};

// The calling process.
ProcessId self_process();

// True while the process exists, is the same one (start time matches) and is not a zombie.
bool process_alive(const ProcessId& p);

}  // namespace moecomm::transport::shm
