// Alignment helpers. Every part of a slot starts on a 64-byte boundary (one cache line on the
// CPUs we target; also the granularity at which NIC/GPU writes do not tear across parts).
#pragma once

#include <cstdint>

#include "common/macros.h"

namespace moecomm {

// One cache line: parts of a slot written by different sides never share a line.
constexpr uint64_t kCacheLine = 64;

MC_HOST_DEVICE constexpr uint64_t align_up(uint64_t x, uint64_t a) {
  return (x + a - 1) / a * a;
}

MC_HOST_DEVICE constexpr bool is_aligned(uint64_t x, uint64_t a) {
  return x % a == 0;
}

MC_HOST_DEVICE constexpr uint64_t ceil_div(uint64_t x, uint64_t d) {
  return (x + d - 1) / d;
}

}  // namespace moecomm
