#include <cuda_runtime.h>

#include "common/error.h"
#include "transport/cuda_ipc/ipc_peer_table.h"
#include "transport/device/cuda_util.h"

namespace moecomm::transport::cuda_ipc {
namespace {

cudaStream_t as_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}
cudaEvent_t as_event(void* e) {
  return static_cast<cudaEvent_t>(e);
}

}  // namespace

IpcPeerTable::IpcPeerTable(std::shared_ptr<IpcTransport> transport, std::shared_ptr<Region> local,
                           uint32_t max_peers, std::vector<uintptr_t> kernel_streams)
    : transport_(std::move(transport)),
      local_(std::move(local)),
      max_peers_(max_peers),
      kernel_streams_(std::move(kernel_streams)) {
  MC_CHECK(transport_ != nullptr && local_ != nullptr,
           "a peer table needs a transport and a "
           "local region");
  const IpcRegion& r = as_ipc(*local_);
  MC_CHECK(r.owned(), "the local region of a peer table must be our own, got ", r.describe());
  MC_CHECK(max_peers >= 1 && max_peers <= kMaxPeerTableSize, "max_peers ", max_peers,
           " outside [1, ", kMaxPeerTableSize, "]");
  device_ = transport_->device();
  MC_CHECK(r.device() == device_, "the local region lives on device ", r.device(),
           ", the transport on device ", device_);
  DeviceGuard guard(device_);
  // The tables are allocated and freed in the order of the table's own stream: its
  // destruction (garbage collection, possibly while another kernel of the process spins on a
  // device wait) then never synchronises the device.
  cudaStream_t s = nullptr;
  MC_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  try {
    DeviceBuffer base(sizeof(uint8_t*) * max_peers, s, device_);
    DeviceBuffer alive(sizeof(uint32_t) * max_peers, s, device_);
    MC_CUDA_CHECK(cudaMemsetAsync(base.get(), 0, sizeof(uint8_t*) * max_peers, s));
    MC_CUDA_CHECK(cudaMemsetAsync(alive.get(), 0, sizeof(uint32_t) * max_peers, s));
    // Zeroed before any kernel on any stream reads them.
    MC_CUDA_CHECK(cudaStreamSynchronize(s));
    peer_base_ = static_cast<uint8_t**>(base.release());
    alive_ = static_cast<uint32_t*>(alive.release());
  } catch (...) {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    throw;
  }
  stream_ = s;
  entries_.resize(max_peers);
}

IpcPeerTable::~IpcPeerTable() {
  // The owner destroys the table only once no kernel uses it; wait for retirements anyway so a
  // mapping is never closed under a kernel that was given a stream to finish on.
  DeviceGuard guard(device_, std::nothrow);
  for (Entry& e : entries_) {
    for (void* ev : e.retire_events) cudaEventSynchronize(as_event(ev));
    destroy_events(e);
    e.region.reset();
  }
  stream_free(peer_base_, as_stream(stream_), device_);
  stream_free(alive_, as_stream(stream_), device_);
  cudaStreamDestroy(as_stream(stream_));
  cudaGetLastError();
}

void IpcPeerTable::destroy_events(Entry& e) {
  for (void* ev : e.retire_events) cudaEventDestroy(as_event(ev));
  e.retire_events.clear();
}

void IpcPeerTable::check_index(uint32_t index) const {
  MC_CHECK(index < max_peers_, "peer index ", index, " out of range [0, ", max_peers_, ")");
}

void IpcPeerTable::write_alive(uint32_t index, uint32_t value) {
  DeviceGuard guard(device_);
  // Pageable source: the copy is staged before cudaMemcpyAsync returns; the synchronisation
  // makes the new value visible to kernels before we return.
  MC_CUDA_CHECK(cudaMemcpyAsync(alive_ + index, &value, sizeof(value), cudaMemcpyHostToDevice,
                                as_stream(stream_)));
  MC_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream_)));
}

void IpcPeerTable::write_base(uint32_t index, uint8_t* base) {
  DeviceGuard guard(device_);
  MC_CUDA_CHECK(cudaMemcpyAsync(peer_base_ + index, &base, sizeof(base), cudaMemcpyHostToDevice,
                                as_stream(stream_)));
  MC_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream_)));
}

uint32_t IpcPeerTable::add_peer(const std::string& handle) {
  std::lock_guard<std::mutex> lock(mu_);
  collect_locked();
  uint32_t index = max_peers_;
  for (uint32_t i = 0; i < max_peers_; ++i) {
    if (entries_[i].state == PeerState::kFree) {
      index = i;
      break;
    }
  }
  MC_CHECK(index < max_peers_, "peer table full: ", max_peers_,
           " peers active, dead or retiring (remove peers, or let their kernels finish)");
  std::shared_ptr<Region> region = transport_->attach(handle);  // throws on a refused handle
  // Pointer first, then the alive bit: a kernel that sees alive = 1 finds the mapping.
  write_base(index, as_ipc(*region).device_ptr());
  write_alive(index, 1);
  entries_[index].region = std::move(region);
  entries_[index].state = PeerState::kActive;
  return index;
}

void IpcPeerTable::mark_dead(uint32_t index) {
  check_index(index);
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = entries_[index];
  MC_CHECK(e.state == PeerState::kActive || e.state == PeerState::kDead, "peer ", index,
           " is not connected");
  write_alive(index, 0);
  e.state = PeerState::kDead;
}

void IpcPeerTable::remove_peer(uint32_t index, const std::vector<uintptr_t>& streams) {
  check_index(index);
  const std::vector<uintptr_t>& on = streams.empty() ? kernel_streams_ : streams;
  MC_CHECK(!on.empty(), "remove_peer(", index,
           "): name the streams of the kernels that may still use the peer (none were given "
           "here or when the table was built); the mapping closes once they are done");
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = entries_[index];
  MC_CHECK(e.state == PeerState::kActive || e.state == PeerState::kDead, "peer ", index,
           " is not connected");
  write_alive(index, 0);
  DeviceGuard guard(device_);
  for (uintptr_t stream : on) {
    cudaEvent_t ev = nullptr;
    cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (err == cudaSuccess) {
      err = cudaEventRecord(ev, reinterpret_cast<cudaStream_t>(stream));
      if (err != cudaSuccess) cudaEventDestroy(ev);
    }
    if (err != cudaSuccess) {
      // Nothing was retired: the peer stays (dead) with its mapping, and may be removed again.
      destroy_events(e);
      e.state = PeerState::kDead;
      MC_CUDA_CHECK(err);
    }
    e.retire_events.push_back(ev);
  }
  e.state = PeerState::kRetiring;
  collect_locked();
}

uint32_t IpcPeerTable::collect() {
  std::lock_guard<std::mutex> lock(mu_);
  return collect_locked();
}

uint32_t IpcPeerTable::collect_locked() {
  uint32_t closed = 0;
  for (uint32_t i = 0; i < max_peers_; ++i) {
    Entry& e = entries_[i];
    if (e.state != PeerState::kRetiring) continue;
    bool done = true;
    for (void* ev : e.retire_events) {
      const cudaError_t q = cudaEventQuery(as_event(ev));
      if (q == cudaErrorNotReady) {
        cudaGetLastError();  // not an error: the kernels are still running
        done = false;
        break;
      }
      MC_CUDA_CHECK(q);
    }
    if (!done) continue;
    write_base(i, nullptr);
    destroy_events(e);
    e.region.reset();  // closes the IPC mapping
    e.state = PeerState::kFree;
    ++closed;
  }
  return closed;
}

PeerState IpcPeerTable::state(uint32_t index) const {
  check_index(index);
  std::lock_guard<std::mutex> lock(mu_);
  return entries_[index].state;
}

uint32_t IpcPeerTable::active_peers() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t n = 0;
  for (const Entry& e : entries_) n += e.state == PeerState::kActive ? 1 : 0;
  return n;
}

std::shared_ptr<Region> IpcPeerTable::peer_region(uint32_t index) const {
  check_index(index);
  std::lock_guard<std::mutex> lock(mu_);
  MC_CHECK(entries_[index].region != nullptr, "peer ", index, " has no region");
  return entries_[index].region;
}

IpcBackend IpcPeerTable::backend() const {
  IpcBackend b;
  b.local_base = as_ipc(*local_).device_ptr();
  b.peer_base = peer_base_;
  b.alive = alive_;
  b.max_peers = max_peers_;
  return b;
}

}  // namespace moecomm::transport::cuda_ipc
