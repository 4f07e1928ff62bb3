// Thin wrappers over the futex syscall on process-shared memory (no FUTEX_PRIVATE_FLAG: the
// words live in POSIX shared memory mapped by several processes).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
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

#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449  // the same number on every architecture (Linux 5.16)
#endif

// One word of a futex_waitv: sleep while *addr == expected (shared, 32-bit).
inline struct futex_waitv futex_waiter(const uint32_t* addr, uint32_t expected) {
  struct futex_waitv w{};
  w.val = expected;
  w.uaddr = reinterpret_cast<uintptr_t>(addr);
  w.flags = FUTEX_32;  // no FUTEX_PRIVATE_FLAG: the words are in shared memory
  return w;
}

// Sleeps while every word of `waiters` holds its expected value, at most timeout_ns: woken by a
// wake on any of them (futex_waitv(2), Linux 5.16). Spurious returns are fine: callers loop.
// Returns false only when the kernel has no futex_waitv (the caller then sleeps on one word).
inline bool futex_wait_any(struct futex_waitv* waiters, unsigned count, int64_t timeout_ns) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  const int64_t until = static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec + timeout_ns;
  ts.tv_sec = static_cast<time_t>(until / 1000000000);
  ts.tv_nsec = static_cast<long>(until % 1000000000);
  const long rc = syscall(SYS_futex_waitv, waiters, count, 0, &ts, CLOCK_MONOTONIC);
  return rc >= 0 || errno != ENOSYS;
}

}  // namespace moecomm::transport::shm
