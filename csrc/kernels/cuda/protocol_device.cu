// Compiles the protocol headers in device code (the CI compile check of item 7 of the
// foundation) and provides the GPU twin of poll_requests' validation step.
#include <cuda_runtime.h>
#include <cuda/atomic>

#include "common/error.h"
#include "kernels/cuda/protocol_device.h"
#include "protocol/layout.h"
#include "protocol/signal.h"

namespace moecomm::kernels::cuda {
namespace {

// One thread per slot: validation is a few dozen integer compares, far below a warp's worth of
// work, so wider mappings would only add synchronisation.
constexpr int kThreadsPerBlock = 128;
constexpr int32_t kNotReady = -1;

__global__ void validate_requests_kernel(const uint8_t* slots, uint64_t slot_stride,
                                         uint32_t num_slots, protocol::Expectation expect,
                                         int32_t* codes) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= num_slots) return;
  const uint8_t* slot = slots + uint64_t{i} * slot_stride;
  // Acquire the signal word before touching the header (system scope: a peer GPU or the NIC
  // wrote it).
  auto* signal =
      const_cast<uint64_t*>(reinterpret_cast<const uint64_t*>(slot + protocol::kSignalOffset));
  const uint64_t word = ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system>(*signal).load(
      ::cuda::memory_order_acquire);
  if (protocol::signal_state(word) != protocol::SlotState::kRequestReady) {
    codes[i] = kNotReady;
    return;
  }
  protocol::Expectation e = expect;
  e.seq = protocol::signal_seq(word);
  e.slot_bytes = slot_stride;
  protocol::SlotHeader h;
  codes[i] = static_cast<int32_t>(protocol::read_and_validate(slot, e, &h));
}

}  // namespace

void launch_validate_requests(const uint8_t* slots, uint64_t slot_stride, uint32_t num_slots,
                              const protocol::Expectation& expect, int32_t* codes, void* stream) {
  if (num_slots == 0) return;
  const int blocks = static_cast<int>((num_slots + kThreadsPerBlock - 1) / kThreadsPerBlock);
  validate_requests_kernel<<<blocks, kThreadsPerBlock, 0, static_cast<cudaStream_t>(stream)>>>(
      slots, slot_stride, num_slots, expect, codes);
  MC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moecomm::kernels::cuda
