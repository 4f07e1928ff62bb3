// Slot poisoning, a debug mode (MOECOMM_POISON_SLOTS=1, on in the test suite): the side that
// releases a slot first overwrites what it read from it, so a read after release — the peer may
// already be writing its next message there — fails every time instead of once in four runs.
#pragma once

#include <cstdint>

namespace moecomm::protocol {

// 0xFF is a NaN in every float encoding moecomm carries (f32, bf16, fp16, fp8 e4m3) and makes
// the header's magic invalid, so a late read of activations, scores, scales or the header fails
// validation or shows up as NaN.
constexpr uint8_t kPoisonByte = 0xFF;
// Expert ids get a value no server hosts (any range check rejects it, and -1, "not for this
// server", would be ignored silently) that stays small enough for a histogram over it to be a
// loud ~100 MB error rather than an out-of-memory kill.
constexpr int32_t kPoisonExpertId = 0x00BADBAD;

}  // namespace moecomm::protocol
