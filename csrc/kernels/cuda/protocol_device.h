// Device-side use of the slot protocol: validating the headers of many slots at once on the GPU
// (what a GPU expert server does with the requests that landed in its memory).
#pragma once

#include <cstdint>

#include "protocol/validate.h"

namespace moecomm::kernels::cuda {

// Validates `num_slots` slots laid out `slot_stride` bytes apart from `slots` (device memory);
// writes one ValidateCode per slot into `codes` (device memory). The signal word of each slot
// supplies the expected sequence number; slots not in REQUEST_READY get code -1.
void launch_validate_requests(const uint8_t* slots, uint64_t slot_stride, uint32_t num_slots,
                              const protocol::Expectation& expect, int32_t* codes, void* stream);

}  // namespace moecomm::kernels::cuda
