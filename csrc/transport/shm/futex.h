// Thin wrappers over the futex syscall on process-shared memory (no FUTEX_PRIVATE_FLAG: the
// words live in POSIX shared memory mapped by several processes).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstdint>
#include <ctime>

namespace moecomm::transport::shm {

// Sleeps while *addr == expected, at most timeout_ns. Spurious returns are fine: callers loop.
inline void futex_wait(const uint32_t* addr, uint32_t expected, int64_t timeout_ns) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout_ns / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout_ns % 1000000000);
  syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void futex_wake_all(const uint32_t* addr) {
  syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace moecomm::transport::shm
