// Backend `cuda_ipc`, host side: regions are device memory (cudaMalloc) that processes on the
// same node map into their own address space with CUDA IPC handles. The host control path of the
// slot protocol (slot_io) runs over it unchanged; kernels reach the same memory through
// IpcPeerTable / IpcBackend.
//
// Every operation is synchronous when it returns, like the shm backend: a put has landed, a
// signal has been stored, a read has arrived in host memory. That costs a stream
// synchronisation per call; it is the control path, the data path is the device kernels.
//
// Lifetime: CUDA leaves it undefined what happens when the owner frees exported memory that a
// peer still has open. The owner must therefore keep a region until every peer has detached
// (the disconnect handshake), and a peer destroys its attached region (cudaIpcCloseMemHandle)
// on disconnect or on losing the owner. A process that dies has its mappings torn down by the
// driver.
//
// Host code never dereferences device memory: Region::data() is nullptr for these regions and
// device_ptr() gives the device address (valid in this process, on device()).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "transport/cuda_ipc/ipc_handle.h"
#include "transport/device/cuda_device.h"
#include "transport/shm/process.h"
#include "transport/transport.h"

namespace moecomm::transport::cuda_ipc {

// A waiter first polls back to back (each poll is a device-to-host copy, a few µs), ...
constexpr int kBusyPolls = 64;
// ... then sleeps between polls, doubling from this ...
constexpr int64_t kMinPollSleepNs = 2'000;
// ... up to this: long enough that an idle waiter costs little CPU, short enough that a reply
// is noticed well within a decode step.
constexpr int64_t kMaxPollSleepNs = 200'000;
// How often a waiter checks that the peer process still exists.
constexpr int64_t kPeerCheckIntervalNs = 20'000'000;

using transport::device_count;
using transport::no_device_reason;

class IpcRegion final : public Region {
 public:
  // Owned: `ptr` came from cudaMalloc in this process. Attached: from cudaIpcOpenMemHandle.
  IpcRegion(uint8_t* ptr, uint64_t bytes, bool owned, int device, IpcHandle handle);
  ~IpcRegion() override;
  IpcRegion(const IpcRegion&) = delete;
  IpcRegion& operator=(const IpcRegion&) = delete;

  uint8_t* data() override { return nullptr; }  // the host has no mapping of device memory
  uint64_t size() const override { return bytes_; }
  std::string handle() const override { return format_handle(handle_); }
  bool owned() const override { return owned_; }
  // CUDA cannot revoke an exported handle: closing only marks the region so that this
  // process stops using it; the memory stays valid until the object is destroyed.
  void close() override { closed_ = true; }
  bool closed() const override { return closed_; }
  std::string describe() const override;

  uint8_t* device_ptr() const { return ptr_; }
  int device() const { return device_; }
  shm::ProcessId owner() const { return {handle_.pid, handle_.start_ticks}; }

 private:
  uint8_t* ptr_;
  uint64_t bytes_;
  bool owned_;
  int device_;
  IpcHandle handle_;
  bool closed_ = false;
};

class IpcTransport final : public Transport {
 public:
  // `device` < 0: the calling thread's current device. Throws when no device is usable.
  explicit IpcTransport(int device = -1);
  ~IpcTransport() override;
  IpcTransport(const IpcTransport&) = delete;
  IpcTransport& operator=(const IpcTransport&) = delete;

  std::string name() const override { return "cuda_ipc"; }
  std::shared_ptr<Region> create_region(uint64_t bytes) override;
  // Refuses, before any CUDA call, a handle from another node or from this very process (CUDA
  // forbids opening one's own handle) and a handle whose owner is gone.
  std::shared_ptr<Region> attach(const std::string& handle) override;
  // `src` may be host or device memory (unified addressing tells which).
  void put(Region& dst, uint64_t offset, const void* src, uint64_t bytes) override;
  void signal(Region& dst, uint64_t offset, uint64_t value, SignalOp op) override;
  WaitResult wait(Region& local, uint64_t offset, const WaitPredicate& pred, int64_t timeout_ns,
                  const Region* peer) override;
  void read(Region& region, uint64_t offset, void* dst, uint64_t bytes) override;
  uint64_t load(Region& local, uint64_t offset) override;
  bool compare_exchange(Region& local, uint64_t offset, uint64_t expected,
                        uint64_t desired) override;
  void fence() override;
  bool peer_alive(const Region& peer) override;

  int device() const { return device_; }

 private:
  int device_ = 0;
  void* stream_ = nullptr;       // cudaStream_t, non-blocking: never waits on the legacy stream
  uint64_t* scratch_ = nullptr;  // device word for compare_exchange results
  std::mutex scratch_mu_;
  shm::ProcessId self_;
  std::string boot_id_;
};

// Downcasts with a clear error when a region of another transport is passed.
IpcRegion& as_ipc(Region& r);
const IpcRegion& as_ipc(const Region& r);

// Frees the owned regions dropped so far (their cudaFree is put off: it synchronises the device,
// so it waits for a point where no device wait of this process spins; the transport's
// destruction is one, this call another). How many were freed.
size_t release_dropped_regions() noexcept;

}  // namespace moecomm::transport::cuda_ipc
