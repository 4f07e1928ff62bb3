// Device-side probes of the NVSHMEM backend: the code paths the dispatch/combine kernels use
// (wait_word with NVSHMEM's post-wait step, putmem_signal_nbi_warp), each in a minimal kernel.
// They are also what makes this library's device link pull in libnvshmem_device.a.
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "common/error.h"
#include "transport/device/cuda_util.h"
#include "transport/device/device_ops.cuh"
#include "transport/nvshmem/nvshmem_runtime.h"

namespace moecomm::transport::nvshmem {
namespace {

constexpr uint32_t kOneWarp = 32;

__global__ void put_signal_kernel(NvshmemBackend b, uint32_t peer, uint64_t dst_offset,
                                  uint64_t src_offset, uint64_t bytes, uint64_t sig_offset,
                                  uint64_t value, SignalOp op) {
  b.put_signal_warp(peer, dst_offset, b.local(src_offset), bytes, sig_offset, value, op);
  __syncwarp();
  // Non-blocking puts complete at quiet, not at kernel exit.
  if (threadIdx.x == 0) nvshmem_quiet();
}

// A probe runs on a non-blocking stream of its own: off the legacy stream, so it neither waits
// for nor holds up kernels (or peer-table writes) on other streams.
class OwnStream {
 public:
  OwnStream() { MC_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~OwnStream() {
    cudaStreamSynchronize(s_);  // a throw between launch and sync must not free in-use memory
    cudaStreamDestroy(s_);
    cudaGetLastError();
  }
  OwnStream(const OwnStream&) = delete;
  OwnStream& operator=(const OwnStream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

void check_span(const NvshmemRegion& r, uint64_t offset, uint64_t bytes, const char* what) {
  MC_CHECK(offset <= r.size() && bytes <= r.size() - offset, what, " of ", bytes,
           " bytes at offset ", offset, " is outside the region (", r.size(), " bytes)");
}

}  // namespace

NvshmemProbeResult device_wait(const NvshmemPeerTable& table, uint64_t offset,
                               const WaitPredicate& pred, int64_t timeout_ns, uint32_t peer) {
  MC_CHECK(peer < table.max_peers(), "peer index ", peer, " out of range");
  MC_CHECK(offset % sizeof(uint64_t) == 0, "wait offset ", offset, " is not 8-byte aligned");
  MC_CHECK(timeout_ns >= 0, "a device wait needs a deadline: timeout_ns must be >= 0, got ",
           timeout_ns, " (the call blocks until the kernel ends)");
  check_span(table.local(), offset, sizeof(uint64_t), "wait word");
  DeviceBuffer out(sizeof(NvshmemProbeResult));
  OwnStream s;
  device::wait_probe_kernel<NvshmemBackend><<<1, 1, 0, s.get()>>>(
      table.backend(), offset, pred, timeout_ns, peer, static_cast<NvshmemProbeResult*>(out.get()));
  MC_CUDA_CHECK(cudaGetLastError());
  NvshmemProbeResult r;
  MC_CUDA_CHECK(cudaMemcpyAsync(&r, out.get(), sizeof(r), cudaMemcpyDeviceToHost, s.get()));
  MC_CUDA_CHECK(cudaStreamSynchronize(s.get()));
  return r;
}

void device_put_signal(const NvshmemPeerTable& table, uint32_t peer, uint64_t dst_offset,
                       uint64_t src_offset, uint64_t bytes, uint64_t sig_offset, uint64_t value,
                       SignalOp op) {
  MC_CHECK(peer < table.max_peers() && table.alive(peer), "peer ", peer, " is not alive");
  const NvshmemRegion& r = table.local();
  check_span(r, dst_offset, bytes, "put");
  check_span(r, src_offset, bytes, "put source");
  MC_CHECK(sig_offset % sizeof(uint64_t) == 0, "signal offset ", sig_offset, " is unaligned");
  check_span(r, sig_offset, sizeof(uint64_t), "signal word");
  OwnStream s;
  put_signal_kernel<<<1, kOneWarp, 0, s.get()>>>(table.backend(), peer, dst_offset, src_offset,
                                                 bytes, sig_offset, value, op);
  MC_CUDA_CHECK(cudaGetLastError());
  MC_CUDA_CHECK(cudaStreamSynchronize(s.get()));
}

}  // namespace moecomm::transport::nvshmem
