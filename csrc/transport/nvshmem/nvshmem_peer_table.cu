#include <cuda_runtime.h>
#include <nvshmem.h>

#include "common/error.h"
#include "transport/device/cuda_util.h"
#include "transport/nvshmem/nvshmem_runtime.h"

namespace moecomm::transport::nvshmem {

NvshmemPeerTable::NvshmemPeerTable(std::shared_ptr<NvshmemRegion> local, uint32_t max_peers)
    : local_(std::move(local)), max_peers_(max_peers) {
  MC_CHECK(local_ != nullptr && !local_->freed(), "a peer table needs a live local region");
  MC_CHECK(max_peers >= 1 && max_peers <= kMaxPeers, "max_peers ", max_peers, " outside [1, ",
           kMaxPeers, "]");
  DeviceBuffer pe(sizeof(int32_t) * max_peers);
  DeviceBuffer alive(sizeof(uint32_t) * max_peers);
  MC_CUDA_CHECK(cudaMemset(pe.get(), 0, sizeof(int32_t) * max_peers));
  MC_CUDA_CHECK(cudaMemset(alive.get(), 0, sizeof(uint32_t) * max_peers));
  MC_CUDA_CHECK(cudaDeviceSynchronize());
  peer_pe_ = static_cast<int32_t*>(pe.release());
  alive_ = static_cast<uint32_t*>(alive.release());
  host_pe_.assign(max_peers, 0);
  host_alive_.assign(max_peers, 0);
}

NvshmemPeerTable::~NvshmemPeerTable() {
  cudaFree(peer_pe_);
  cudaFree(alive_);
  cudaGetLastError();
}

void NvshmemPeerTable::check_index(uint32_t index) const {
  MC_CHECK(index < max_peers_, "peer index ", index, " out of range [0, ", max_peers_, ")");
}

void NvshmemPeerTable::write_entry(uint32_t index, int32_t pe, uint32_t alive) {
  // The PE first, then the alive bit: a kernel that sees alive = 1 finds the right PE. Plain
  // synchronous copies: this runs on joins and losses, not per message.
  MC_CUDA_CHECK(cudaMemcpy(peer_pe_ + index, &pe, sizeof(pe), cudaMemcpyHostToDevice));
  MC_CUDA_CHECK(cudaMemcpy(alive_ + index, &alive, sizeof(alive), cudaMemcpyHostToDevice));
  host_pe_[index] = pe;
  host_alive_[index] = alive;
}

void NvshmemPeerTable::set_peer(uint32_t index, int pe) {
  check_index(index);
  const int n = n_pes();
  MC_CHECK(pe >= 0 && pe < n, "PE ", pe, " outside the job's [0, ", n, ")");
  write_entry(index, pe, 1);
}

void NvshmemPeerTable::mark_dead(uint32_t index) {
  check_index(index);
  write_entry(index, host_pe_[index], 0);
}

bool NvshmemPeerTable::alive(uint32_t index) const {
  check_index(index);
  return host_alive_[index] != 0;
}

int NvshmemPeerTable::pe(uint32_t index) const {
  check_index(index);
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
