#include <cuda_runtime.h>
#include <nvshmem.h>

#include "common/error.h"
#include "transport/device/cuda_util.h"
#include "transport/nvshmem/nvshmem_runtime.h"

namespace moecomm::transport::nvshmem {
namespace {

cudaStream_t as_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}

}  // namespace

NvshmemPeerTable::NvshmemPeerTable(std::shared_ptr<NvshmemRegion> local, uint32_t max_peers)
    : local_(std::move(local)), max_peers_(max_peers) {
  MC_CHECK(local_ != nullptr && !local_->freed(), "a peer table needs a live local region");
  MC_CHECK(max_peers >= 1 && max_peers <= kMaxPeers, "max_peers ", max_peers, " outside [1, ",
           kMaxPeers, "]");
  DeviceBuffer pe(sizeof(int32_t) * max_peers);
  DeviceBuffer alive(sizeof(uint32_t) * max_peers);
  stream_ = new_stream_zeroing(
      {{pe.get(), sizeof(int32_t) * max_peers}, {alive.get(), sizeof(uint32_t) * max_peers}});
  peer_pe_ = static_cast<int32_t*>(pe.release());
  alive_ = static_cast<uint32_t*>(alive.release());
  host_pe_.assign(max_peers, 0);
  host_alive_.assign(max_peers, 0);
}

NvshmemPeerTable::~NvshmemPeerTable() {
  cudaFree(peer_pe_);
  cudaFree(alive_);
  cudaStreamDestroy(as_stream(stream_));
  cudaGetLastError();
}

void NvshmemPeerTable::check_index(uint32_t index) const {
  MC_CHECK(index < max_peers_, "peer index ", index, " out of range [0, ", max_peers_, ")");
}

void NvshmemPeerTable::write_entry(uint32_t index, int32_t pe, uint32_t alive) {
  // Caller holds mu_.
  // The PE first, then the alive bit, in stream order: a kernel that sees alive = 1 finds the
  // right PE. The table's own non-blocking stream, so the writes overtake kernels running on any
  // other stream (mark_dead exists to stop them); the pageable sources are staged before
  // cudaMemcpyAsync returns, and the synchronisation makes the values visible on return.
  MC_CUDA_CHECK(cudaMemcpyAsync(peer_pe_ + index, &pe, sizeof(pe), cudaMemcpyHostToDevice,
                                as_stream(stream_)));
  MC_CUDA_CHECK(cudaMemcpyAsync(alive_ + index, &alive, sizeof(alive), cudaMemcpyHostToDevice,
                                as_stream(stream_)));
  MC_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream_)));
  host_pe_[index] = pe;
  host_alive_[index] = alive;
}

void NvshmemPeerTable::set_peer(uint32_t index, int pe) {
  check_index(index);
  const int n = n_pes();
  MC_CHECK(pe >= 0 && pe < n, "PE ", pe, " outside the job's [0, ", n, ")");
  std::lock_guard<std::mutex> lock(mu_);
  write_entry(index, pe, 1);
}

void NvshmemPeerTable::mark_dead(uint32_t index) {
  check_index(index);
  std::lock_guard<std::mutex> lock(mu_);
  write_entry(index, host_pe_[index], 0);
}

bool NvshmemPeerTable::alive(uint32_t index) const {
  check_index(index);
  std::lock_guard<std::mutex> lock(mu_);
  return host_alive_[index] != 0;
}

int NvshmemPeerTable::pe(uint32_t index) const {
  check_index(index);
  std::lock_guard<std::mutex> lock(mu_);
  return host_pe_[index];
}

NvshmemBackend NvshmemPeerTable::backend() const {
  NvshmemBackend b;
  b.local_base = local_->device_ptr();
  b.peer_pe = peer_pe_;
  b.alive = alive_;
  b.max_peers = max_peers_;
  return b;
}

}  // namespace moecomm::transport::nvshmem
