// Host side of the NVSHMEM transport: bootstrap without MPI, symmetric regions, and the peer
// table behind NvshmemBackend. Plain C++ declarations (bindings include this); the definitions
// are nvcc translation units linked with NVSHMEM.
//
// Bootstrap: rank 0 calls get_unique_id() and hands the bytes to every other rank over
// moecomm's control plane (HTTP / membership); every rank then calls init(uid, rank, nranks,
// device). init is collective: it returns only once all `nranks` PEs have joined.
//
// NVSHMEM's job membership is fixed at init and its heap is symmetric: see
// docs/gpu-transports.md for how moecomm maps joining and leaving servers onto that
// (pre-provisioned PEs, liveness masks).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "transport/device/cuda_device.h"
#include "transport/nvshmem/nvshmem_backend.cuh"
#include "transport/transport.h"

namespace moecomm::transport::nvshmem {

// sizeof(nvshmemx_uniqueid_t); checked against NVSHMEM's header in the .cu.
constexpr size_t kUniqueIdBytes = 128;
// The version field NVSHMEM writes at the start of a unique id: (1 << 16) + its size. A byte
// string without it did not come from nvshmemx_get_uniqueid.
constexpr int32_t kUniqueIdVersion = (1 << 16) + static_cast<int32_t>(kUniqueIdBytes);
// A peer table larger than this is a caller bug (one entry per PE of the job).
constexpr uint32_t kMaxPeers = 4096;

using transport::device_count;
using transport::no_device_reason;

// Transport settings moecomm gives NVSHMEM unless the user set them (NVSHMEM reads its
// environment when it first starts up: get_unique_id() on rank 0, init() everywhere).
//
// IBGDA (the GPU posts work requests to the NIC itself) is what the device kernels are written
// for; NVSHMEM's default remote transport is the CPU-proxy one (IBRC), which puts a host thread
// on every put. On a node without an InfiniBand/RoCE NIC NVSHMEM only warns that the remote
// transport could not start and carries intra-node traffic over P2P, as without the setting.
constexpr const char* kEnvEnableIbgda = "NVSHMEM_IB_ENABLE_IBGDA";
constexpr const char* kEnvRcPerPe = "NVSHMEM_IBGDA_NUM_RC_PER_PE";
constexpr const char* kEnvQpDepth = "NVSHMEM_QP_DEPTH";
// MOECOMM_NVSHMEM_IBGDA=0 leaves all three to NVSHMEM's own defaults.
constexpr const char* kEnvMoecommIbgda = "MOECOMM_NVSHMEM_IBGDA";
// RC queue pairs per peer PE. A request's payload is put by 4 blocks x 8 warps per server
// (client_dispatch.cuh), and NVSHMEM maps a warp to a QP by warp id: 8 QPs give each QP about 4
// warps to serialize on its producer index and let the NIC work on 8 queues per peer at once.
// Cost: 8 QPs x depth x 64 B of WQE ring per peer PE (512 KiB at the depth below).
constexpr int kIbgdaRcPerPe = 8;
// Work requests per QP. The largest payload (256 tokens x 7168 bf16 = 3.5 MiB) is 112 chunks of
// 32 KiB, each a put plus a signal atomic: 224 requests per message, 28 per QP over 8 QPs, about
// 112 with 4 slots in flight. 1024 leaves ~9x headroom, so a poster never stalls waiting for a
// free slot (that wait polls completions on the GPU, in the middle of a put loop).
constexpr int kQpDepth = 1024;

// The (name, value) pairs apply_transport_env_defaults() would set now: none of a name the
// user already set, none at all under MOECOMM_NVSHMEM_IBGDA=0. No CUDA or NVSHMEM call.
std::vector<std::pair<std::string, std::string>> transport_env_defaults();
// Sets them (setenv without overwrite); returns what it set. get_unique_id and init call it.
std::vector<std::pair<std::string, std::string>> apply_transport_env_defaults();

// Argument checks of init(), usable without a GPU. Throw kInvalidArgument.
void check_unique_id(const std::string& uid);
void check_init_args(int rank, int nranks);

// Rank 0 only, before init: the bootstrap id every rank passes to init.
std::string get_unique_id();
// Collective over all `nranks` processes. `device` < 0 keeps the current device. NVSHMEM's own
// wrapper exits the process on failure; this one throws.
void init(const std::string& uid, int rank, int nranks, int device);
bool initialized();
int my_pe();
int n_pes();
// Collective, like every allocation and free of the symmetric heap.
void barrier_all();
// Collective. Regions must have been freed (or abandoned) first.
void finalize();

// A range of the symmetric heap: every PE holds one at the same offset, so a peer's copy of
// our region is addressed with our own pointer and the peer's PE number.
//
// Allocation and free are COLLECTIVE: every PE of the job must make the same calls in the same
// order with the same sizes, or the heap offsets diverge (or the call hangs). moecomm therefore
// allocates all regions once, right after init, and frees them only at shutdown. The
// destructor does not free (a free that waits for a dead PE would hang the process); call
// free() collectively, or let finalize / process exit reclaim the heap.
class NvshmemRegion {
 public:
  explicit NvshmemRegion(uint64_t bytes);  // collective, zero-filled
  ~NvshmemRegion();  // does not free (see above); forgets the range for is_symmetric
  NvshmemRegion(const NvshmemRegion&) = delete;
  NvshmemRegion& operator=(const NvshmemRegion&) = delete;

  uint8_t* device_ptr() const { return ptr_; }
  uint64_t size() const { return bytes_; }
  void free();  // collective
  bool freed() const { return ptr_ == nullptr; }
  // Host <-> our own copy of the region (device memory), synchronous.
  void write(uint64_t offset, const void* src, uint64_t bytes);
  void read(uint64_t offset, void* dst, uint64_t bytes) const;

 private:
  uint8_t* ptr_ = nullptr;
  uint64_t bytes_ = 0;
};

// Every source of a put must be symmetric (NVSHMEM's remote transports only reach registered
// memory): the kernels' workspaces are, when allocated as an NvshmemRegion of the layout's
// total size (client_workspace_layout / server_workspace_layout) and passed by device_ptr.
// True when [p, p + bytes) lies inside one live NvshmemRegion of this process.
bool is_symmetric(const void* p, uint64_t bytes);
// Throws kInvalidArgument naming `what` unless is_symmetric(p, bytes).
void require_symmetric(const void* p, uint64_t bytes, const char* what);

// peer_pe[] and alive[] in device memory (local, not symmetric) for NvshmemBackend. A moecomm
// peer index maps to a PE of the job; flipping alive is how a pre-provisioned PE joins or leaves.
class NvshmemPeerTable {
 public:
  NvshmemPeerTable(std::shared_ptr<NvshmemRegion> local, uint32_t max_peers);
  ~NvshmemPeerTable();
  NvshmemPeerTable(const NvshmemPeerTable&) = delete;
  NvshmemPeerTable& operator=(const NvshmemPeerTable&) = delete;

  // Points `index` at `pe` and marks it alive (pe in [0, n_pes)). Both writes go through the
  // table's own non-blocking stream, never the legacy one: mark_dead must land while the very
  // kernels it is meant to stop are still running (a legacy-stream copy would queue behind them).
  void set_peer(uint32_t index, int pe);
  void mark_dead(uint32_t index);
  bool alive(uint32_t index) const;
  int pe(uint32_t index) const;
  uint32_t max_peers() const { return max_peers_; }
  NvshmemBackend backend() const;
  const NvshmemRegion& local() const { return *local_; }

 private:
  void check_index(uint32_t index) const;
  void write_entry(uint32_t index, int32_t pe, uint32_t alive);

  // The bindings release the GIL: a watchdog thread's mark_dead may meet another thread's
  // set_peer.
  mutable std::mutex mu_;
  std::shared_ptr<NvshmemRegion> local_;
  uint32_t max_peers_;
  void* stream_ = nullptr;      // cudaStream_t (non-blocking) for the table's writes
  int32_t* peer_pe_ = nullptr;  // device
  uint32_t* alive_ = nullptr;   // device
  std::vector<int32_t> host_pe_;
  std::vector<uint32_t> host_alive_;
};

using NvshmemProbeResult = WaitProbeResult;

// One thread runs device::wait_word on the table's backend (NVSHMEM's post-wait step
// included), on a stream of its own; blocks until the kernel finishes (so at most timeout_ns
// plus launch latency). A negative timeout is refused: the call would never return.
NvshmemProbeResult device_wait(const NvshmemPeerTable& table, uint64_t offset,
                               const WaitPredicate& pred, int64_t timeout_ns, uint32_t peer);

// One warp: put_signal_warp of `bytes` from `src_offset` of our region (symmetric memory, as
// remote transports require of a source) to `dst_offset` of peer's, then nvshmem_quiet.
void device_put_signal(const NvshmemPeerTable& table, uint32_t peer, uint64_t dst_offset,
                       uint64_t src_offset, uint64_t bytes, uint64_t sig_offset, uint64_t value,
                       SignalOp op);

}  // namespace moecomm::transport::nvshmem
