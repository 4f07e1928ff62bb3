// Device-side probes of the CUDA-IPC backend: the same device code paths the dispatch/combine
// kernels use (wait_word, put_signal_warp), each in a minimal kernel, so tests can exercise them
// across processes.
#include <cuda_runtime.h>

#include <memory>

#include "common/error.h"
#include "transport/cuda_ipc/ipc_peer_table.h"
#include "transport/device/cuda_util.h"
#include "transport/device/device_ops.cuh"

namespace moecomm::transport::cuda_ipc {
namespace {

constexpr uint32_t kOneWarp = 32;

__global__ void put_signal_kernel(IpcBackend b, uint32_t peer, uint64_t offset, const void* src,
                                  uint64_t bytes, uint64_t sig_offset, uint64_t value,
                                  SignalOp op) {
  b.put_signal_warp(peer, offset, src, bytes, sig_offset, value, op);
}

}  // namespace

DeviceWaitProbe::DeviceWaitProbe(const IpcPeerTable& table, uint64_t offset,
                                 const WaitPredicate& pred, int64_t timeout_ns, uint32_t peer) {
  const IpcBackend b = table.backend();
  MC_CHECK(peer < b.max_peers, "peer index ", peer, " out of range [0, ", b.max_peers, ")");
  MC_CHECK(offset % sizeof(uint64_t) == 0, "wait offset ", offset, " is not 8-byte aligned");
  MC_CHECK(timeout_ns >= 0, "a device wait probe needs a deadline: timeout_ns must be >= 0, got ",
           timeout_ns, " (the probe's destructor waits for its kernel)");
  device_ = table.device();
  DeviceGuard guard(device_);
  try {
    cudaStream_t s = nullptr;
    MC_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    stream_ = s;
    cudaEvent_t ev = nullptr;
    MC_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    event_ = ev;
    // Stream-ordered: release() frees it on this stream, with no device-wide synchronisation.
    result_dev_ = static_cast<ProbeResult*>(stream_alloc(sizeof(ProbeResult), s, device_));
    device::wait_probe_kernel<IpcBackend>
        <<<1, 1, 0, s>>>(b, offset, pred, timeout_ns, peer, result_dev_);
    MC_CUDA_CHECK(cudaGetLastError());
    MC_CUDA_CHECK(cudaEventRecord(ev, s));
  } catch (...) {
    release();  // a constructor that throws runs no destructor
    throw;
  }
}

void DeviceWaitProbe::release() noexcept {
  DeviceGuard guard(device_, std::nothrow);
  // Its own kernel only (it has a deadline); a cudaFree here would also wait for every other
  // kernel of the process, a spinning combine included.
  if (stream_ != nullptr) cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  stream_free(result_dev_, static_cast<cudaStream_t>(stream_), device_);
  if (event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  result_dev_ = nullptr;
  event_ = stream_ = nullptr;
  cudaGetLastError();
}

DeviceWaitProbe::~DeviceWaitProbe() {
  release();
}

bool DeviceWaitProbe::done() {
  const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (q == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  MC_CUDA_CHECK(q);
  return true;
}

ProbeResult DeviceWaitProbe::result() {
  DeviceGuard guard(device_);
  ProbeResult r;
  MC_CUDA_CHECK(cudaMemcpyAsync(&r, result_dev_, sizeof(r), cudaMemcpyDeviceToHost,
                                static_cast<cudaStream_t>(stream_)));
  MC_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
  return r;
}

void device_put_signal(const IpcPeerTable& table, uint32_t peer, uint64_t offset, const void* src,
                       uint64_t bytes, uint64_t sig_offset, uint64_t value, SignalOp op) {
  const IpcBackend b = table.backend();
  MC_CHECK(peer < b.max_peers, "peer index ", peer, " out of range [0, ", b.max_peers, ")");
  MC_CHECK(table.state(peer) == PeerState::kActive, "peer ", peer, " is not an active peer");
  const uint64_t size = table.peer_region(peer)->size();
  MC_CHECK(offset <= size && bytes <= size - offset, "put of ", bytes, " bytes at offset ", offset,
           " is outside the peer region (", size, " bytes)");
  MC_CHECK(sig_offset % sizeof(uint64_t) == 0 && sig_offset + sizeof(uint64_t) <= size,
           "signal offset ", sig_offset, " is unaligned or outside the peer region");
  MC_CHECK(bytes == 0 || src != nullptr, "put from a null source");
  DeviceGuard guard(table.device());
  cudaStream_t s = nullptr;
  MC_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaError_t err = cudaSuccess;
  {
    // The staging copy lives on this stream: allocated and freed in its order, so the put
    // never synchronises the device (a put while another kernel spins must not wait for it).
    std::unique_ptr<DeviceBuffer> staged;
    try {
      staged = std::make_unique<DeviceBuffer>(bytes > 0 ? bytes : 1, s, table.device());
    } catch (...) {
      cudaStreamDestroy(s);
      throw;
    }
    err =
        bytes > 0 ? cudaMemcpyAsync(staged->get(), src, bytes, cudaMemcpyDefault, s) : cudaSuccess;
    if (err == cudaSuccess) {
      put_signal_kernel<<<1, kOneWarp, 0, s>>>(b, peer, offset, staged->get(), bytes, sig_offset,
                                               value, op);
      err = cudaGetLastError();
    }
  }  // the free is enqueued after the kernel
  const cudaError_t sync = cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  MC_CUDA_CHECK(err);
  MC_CUDA_CHECK(sync);
}

}  // namespace moecomm::transport::cuda_ipc
