// The 64-bit signal word that opens every slot: bits 0-7 hold the state, bits 8-63 a sequence
// number chosen by the client. The sequence number makes the word ABA-safe: a client waiting for
// the answer to request n ignores a late answer to request n-1 from a server it failed over from.
#pragma once

#include <cstdint>

#include "common/macros.h"

namespace moecomm::protocol {

enum class SlotState : uint8_t {
  kIdle = 0,
  kRequestReady = 1,
  kResponseReady = 2,
  kOffline = 3,
};

constexpr uint32_t kStateBits = 8;
constexpr uint64_t kStateMask = (uint64_t{1} << kStateBits) - 1;
constexpr uint32_t kSeqBits = 64 - kStateBits;
constexpr uint64_t kMaxSeq = (uint64_t{1} << kSeqBits) - 1;
constexpr uint8_t kNumStates = 4;

MC_HOST_DEVICE constexpr uint64_t make_signal(SlotState state, uint64_t seq) {
  return ((seq & kMaxSeq) << kStateBits) | static_cast<uint64_t>(state);
}

MC_HOST_DEVICE constexpr SlotState signal_state(uint64_t word) {
  return static_cast<SlotState>(word & kStateMask);
}

MC_HOST_DEVICE constexpr uint64_t signal_seq(uint64_t word) {
  return word >> kStateBits;
}

MC_HOST_DEVICE constexpr bool signal_state_known(uint64_t word) {
  return (word & kStateMask) < kNumStates;
}

}  // namespace moecomm::protocol
