// The host object behind IpcBackend: it owns the device arrays a kernel reads (peer_base[],
// alive[]) and the IPC mappings they point into. Peers join and leave while kernels run.
//
// Rules, so that a running kernel never touches an unmapped address:
//   join:  add_peer() maps the peer, writes peer_base[i], then alive[i] = 1. A kernel may
//          address index i only if it was launched after add_peer() returned.
//   leave: first drop the peer from every host-side map (expert map, replica lists), so no new
//          launch addresses it; then remove_peer(i, stream). It writes alive[i] = 0 at once
//          (kernels in flight see it through peer_alive and stop putting to / waiting on it)
//          and records an event on each of `streams`, the streams of the kernels that may still
//          use the peer (by default the kernel streams named at construction; never silently the
//          legacy stream: closing a mapping under a live kernel is a sticky illegal-address
//          error). The mapping is closed and peer_base[i] cleared only once every event has
//          completed (collect(), also run by every add/remove); until then the index is
//          "retiring" and not reused.
//   death: mark_dead(i) only clears alive[i] (a liveness monitor saw the process go); the
//          mapping stays until remove_peer.
// Every table write is a copy on the table's own non-blocking stream plus a synchronisation of
// that stream only: it overtakes the kernels it is meant to stop, on whatever stream they run.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/cuda_ipc/ipc_backend.cuh"
#include "transport/cuda_ipc/ipc_transport.h"

namespace moecomm::transport::cuda_ipc {

// A table larger than this is a caller bug (one entry per connected peer process).
constexpr uint32_t kMaxPeerTableSize = 4096;

enum class PeerState : uint8_t { kFree = 0, kActive = 1, kDead = 2, kRetiring = 3 };

// Thread-safe (one lock per table): a watchdog thread may mark_dead while another thread adds.
class IpcPeerTable {
 public:
  // `local` is the region peers write into (owned by this process, same transport).
  // `kernel_streams`: cudaStream_t values (as integers; 0 is the legacy stream and must be named
  // to be used) on which kernels using this table run; remove_peer's default.
  IpcPeerTable(std::shared_ptr<IpcTransport> transport, std::shared_ptr<Region> local,
               uint32_t max_peers, std::vector<uintptr_t> kernel_streams = {});
  ~IpcPeerTable();
  IpcPeerTable(const IpcPeerTable&) = delete;
  IpcPeerTable& operator=(const IpcPeerTable&) = delete;

  // Maps the peer region named by `handle`; returns its index. Throws when the table is full
  // (after collecting finished retirements) or the handle is refused.
  uint32_t add_peer(const std::string& handle);
  // See the rules above. `streams`: cudaStream_t values as integers; empty = the kernel
  // streams given at construction (an error when there were none).
  void remove_peer(uint32_t index, const std::vector<uintptr_t>& streams = {});
  void mark_dead(uint32_t index);
  // Closes the mappings whose retirement event has completed; returns how many.
  uint32_t collect();

  PeerState state(uint32_t index) const;
  uint32_t max_peers() const { return max_peers_; }
  int device() const { return device_; }
  uint32_t active_peers() const;
  std::shared_ptr<Region> peer_region(uint32_t index) const;
  IpcBackend backend() const;
  const std::vector<uintptr_t>& kernel_streams() const { return kernel_streams_; }

 private:
  struct Entry {
    PeerState state = PeerState::kFree;
    std::shared_ptr<Region> region;
    std::vector<void*> retire_events;  // cudaEvent_t, one per stream, while retiring
  };
  void check_index(uint32_t index) const;
  uint32_t collect_locked();
  static void destroy_events(Entry& e);
  void write_alive(uint32_t index, uint32_t value);
  void write_base(uint32_t index, uint8_t* base);

  std::shared_ptr<IpcTransport> transport_;
  std::shared_ptr<Region> local_;
  uint32_t max_peers_;
  int device_;
  void* stream_ = nullptr;         // cudaStream_t for table updates
  uint8_t** peer_base_ = nullptr;  // device [max_peers]
  uint32_t* alive_ = nullptr;      // device [max_peers]
  std::vector<uintptr_t> kernel_streams_;
  mutable std::mutex mu_;
  std::vector<Entry> entries_;
};

// Device-side checks (tests and diagnostics), one kernel launch each.
using ProbeResult = WaitProbeResult;

// Launches one thread that runs device::wait_word on the table's backend, without waiting for
// it; the host polls done() and reads result().
// `timeout_ns` must be >= 0: the destructor waits for the kernel, so a probe without a
// deadline on a word nobody writes would hang whoever drops it.
class DeviceWaitProbe {
 public:
  DeviceWaitProbe(const IpcPeerTable& table, uint64_t offset, const WaitPredicate& pred,
                  int64_t timeout_ns, uint32_t peer);
  ~DeviceWaitProbe();
  DeviceWaitProbe(const DeviceWaitProbe&) = delete;
  DeviceWaitProbe& operator=(const DeviceWaitProbe&) = delete;
  bool done();
  ProbeResult result();  // blocks until the kernel has finished

 private:
  void release() noexcept;
  int device_;
  void* stream_ = nullptr;
  void* event_ = nullptr;
  ProbeResult* result_dev_ = nullptr;
};

// One warp runs IpcBackend::put_signal_warp: `bytes` of host memory `src` (staged in device
// memory) to `offset` of peer `peer`, then the signal; returns when the kernel is done.
void device_put_signal(const IpcPeerTable& table, uint32_t peer, uint64_t offset, const void* src,
                       uint64_t bytes, uint64_t sig_offset, uint64_t value, SignalOp op);

}  // namespace moecomm::transport::cuda_ipc
