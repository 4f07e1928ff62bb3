#include <cuda_runtime.h>
#include <cuda/atomic>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>

#include "common/align.h"
#include "common/error.h"
#include "transport/cuda_ipc/ipc_transport.h"
#include "transport/device/cuda_util.h"

namespace moecomm::transport::cuda_ipc {

static_assert(sizeof(cudaIpcMemHandle_t) == kMemHandleBytes, "CUDA IPC handle size changed");
static_assert(sizeof(cudaUUID_t) == kUuidBytes, "CUDA UUID size changed");

namespace {

using SystemWord = ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system>;

// The signal of a host-side writer: every earlier put of this transport has completed (the
// puts synchronise their stream), and the system-scope fence plus release publish them to a
// reader on any device or on a host that observes the new word.
__global__ void signal_kernel(uint64_t* word, uint64_t value, bool add) {
  __threadfence_system();
  if (add) {
    SystemWord(*word).fetch_add(value, ::cuda::memory_order_release);
  } else {
    SystemWord(*word).store(value, ::cuda::memory_order_release);
  }
}

__global__ void cas_kernel(uint64_t* word, uint64_t expected, uint64_t desired, uint64_t* ok) {
  *ok = SystemWord(*word).compare_exchange_strong(expected, desired, ::cuda::memory_order_acq_rel)
            ? 1
            : 0;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void check_range(const Region& r, uint64_t offset, uint64_t bytes, const char* what) {
  MC_CHECK(offset <= r.size() && bytes <= r.size() - offset, what, " of ", bytes,
           " bytes at offset ", offset, " is outside ", r.describe(), " (", r.size(), " bytes)");
}

void check_word(const Region& r, uint64_t offset) {
  MC_CHECK(offset % sizeof(uint64_t) == 0, "signal word offset ", offset, " is not 8-byte aligned");
  check_range(r, offset, sizeof(uint64_t), "signal word");
}

std::array<uint8_t, kUuidBytes> device_uuid(int device) {
  cudaDeviceProp prop{};
  MC_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::array<uint8_t, kUuidBytes> out{};
  std::memcpy(out.data(), &prop.uuid, kUuidBytes);
  return out;
}

// The ordinal, in this process, of the device with `uuid`; -1 when it is not visible.
int find_device(const std::array<uint8_t, kUuidBytes>& uuid) {
  const int n = device_count();
  for (int d = 0; d < n; ++d) {
    if (device_uuid(d) == uuid) return d;
  }
  return -1;
}

cudaStream_t as_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}

std::string describe_gpu(int device) {
  const auto uuid = device_uuid(device);
  return "GPU " + std::to_string(device) + " (" + hex_encode(uuid.data(), uuid.size()) + ")";
}

// Mapping a peer's region needs peer access, and the protocol needs more: signals and arrival
// counters are system-scope atomics on the peer's memory (add_release, compare_exchange). Over
// plain PCIe P2P those are not atomic (the link has no native atomics), so an arrival counter
// could lose an ADD and a message never complete; refuse such a pair up front.
void check_peer_link(int ours, int owner) {
  int access = 0;
  MC_CUDA_CHECK(cudaDeviceCanAccessPeer(&access, ours, owner));
  MC_CHECK_KIND(access != 0, ErrorKind::kSystem, describe_gpu(ours), " cannot access ",
                describe_gpu(owner),
                " (no peer access over NVLink/PCIe): cannot map its region; use the shm or "
                "NVSHMEM transport between them");
  int atomics = 0;
  MC_CUDA_CHECK(
      cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, ours, owner));
  MC_CHECK_KIND(atomics != 0, ErrorKind::kSystem, describe_gpu(ours), " can access ",
                describe_gpu(owner),
                " but not with native atomics (a PCIe-only link?): the slot protocol's signal "
                "and arrival-counter atomics would not be atomic; use the shm or NVSHMEM "
                "transport between them");
}

}  // namespace

IpcRegion& as_ipc(Region& r) {
  auto* p = dynamic_cast<IpcRegion*>(&r);
  MC_CHECK(p != nullptr, r.describe(), " does not belong to the cuda_ipc transport");
  return *p;
}

const IpcRegion& as_ipc(const Region& r) {
  const auto* p = dynamic_cast<const IpcRegion*>(&r);
  MC_CHECK(p != nullptr, r.describe(), " does not belong to the cuda_ipc transport");
  return *p;
}

IpcRegion::IpcRegion(uint8_t* ptr, uint64_t bytes, bool owned, int device, IpcHandle handle)
    : ptr_(ptr), bytes_(bytes), owned_(owned), device_(device), handle_(std::move(handle)) {}

IpcRegion::~IpcRegion() {
  // Destructors cannot throw: errors here (a dead context at exit) are cleared and ignored.
  if (owned_) {
    // Exported memory comes from cudaMalloc, and cudaFree would synchronise the device: run
    // by garbage collection while a wait kernel of this process spins, it would block until
    // that wait's deadline. Put off to release_deferred_frees() (the transport's end, or the
    // owner's call at a quiet point).
    deferred_frees().defer(device_, ptr_);
    return;
  }
  DeviceGuard guard(device_, std::nothrow);
  cudaIpcCloseMemHandle(ptr_);
  cudaGetLastError();
}

std::string IpcRegion::describe() const {
  std::ostringstream os;
  os << "cuda_ipc region of " << bytes_ << " bytes on GPU "
     << hex_encode(handle_.device_uuid.data(), kUuidBytes) << " owned by pid " << handle_.pid
     << (owned_ ? " (ours)" : "");
  return os.str();
}

IpcTransport::IpcTransport(int device) : self_(shm::self_process()), boot_id_(node_boot_id()) {
  require_device("the cuda_ipc transport");
  if (device < 0) MC_CUDA_CHECK(cudaGetDevice(&device));
  MC_CHECK(device < device_count(), "device ", device, " out of range: ", device_count(),
           " visible");
  device_ = device;
  DeviceGuard guard(device_);
  cudaStream_t s = nullptr;
  MC_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
  try {
    scratch_ = static_cast<uint64_t*>(stream_alloc(sizeof(uint64_t), s, device_));
    MC_CUDA_CHECK(cudaStreamSynchronize(s));  // usable from any stream from now on
  } catch (...) {
    stream_free(scratch_, s, device_);
    cudaStreamDestroy(s);
    throw;
  }
}

IpcTransport::~IpcTransport() {
  DeviceGuard guard(device_, std::nothrow);
  stream_free(scratch_, as_stream(stream_), device_);
  cudaStreamDestroy(as_stream(stream_));
  cudaGetLastError();
  // The regions this process dropped so far: their owners are gone, and with this transport
  // every peer table over it (they hold it) and the kernels they were given.
  release_dropped_regions();
}

size_t release_dropped_regions() noexcept {
  return release_deferred_frees();
}

std::shared_ptr<Region> IpcTransport::create_region(uint64_t bytes) {
  MC_CHECK(bytes > 0 && bytes <= kMaxRegionBytes, "cuda_ipc region size ", bytes, " outside [1, ",
           kMaxRegionBytes, "]");
  DeviceGuard guard(device_);
  const uint64_t alloc = align_up(bytes, kCacheLine);
  DeviceBuffer mem(alloc);
  // Zero-filled like a fresh shm segment: signal words start IDLE, counters at 0.
  MC_CUDA_CHECK(cudaMemsetAsync(mem.get(), 0, alloc, as_stream(stream_)));
  MC_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream_)));
  cudaIpcMemHandle_t raw;
  MC_CUDA_CHECK(cudaIpcGetMemHandle(&raw, mem.get()));
  IpcHandle h;
  h.boot_id = boot_id_;
  h.pid = self_.pid;
  h.start_ticks = self_.start_ticks;
  h.device_uuid = device_uuid(device_);
  h.bytes = alloc;
  std::memcpy(h.mem_handle.data(), &raw, kMemHandleBytes);
  auto region = std::make_shared<IpcRegion>(static_cast<uint8_t*>(mem.get()), alloc, true, device_,
                                            std::move(h));
  mem.release();  // the region frees it now
  return region;
}

std::shared_ptr<Region> IpcTransport::attach(const std::string& handle) {
  IpcHandle h = check_attachable(handle, boot_id_, self_.pid);
  // CUDA can open a handle whose GPU this process does not see (CUDA_VISIBLE_DEVICES); when
  // it does see it and it is another GPU than ours, check the link for a clear error.
  const int owner_device = find_device(h.device_uuid);
  if (owner_device >= 0 && owner_device != device_) check_peer_link(device_, owner_device);
  DeviceGuard guard(device_);
  cudaIpcMemHandle_t raw;
  std::memcpy(&raw, h.mem_handle.data(), kMemHandleBytes);
  void* ptr = nullptr;
  MC_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, raw, cudaIpcMemLazyEnablePeerAccess));
  const uint64_t bytes = h.bytes;
  return std::make_shared<IpcRegion>(static_cast<uint8_t*>(ptr), bytes, false, device_,
                                     std::move(h));
}

void IpcTransport::put(Region& dst, uint64_t offset, const void* src, uint64_t bytes) {
  IpcRegion& r = as_ipc(dst);
  MC_CHECK(!r.closed(), "put into closed ", r.describe());
  check_range(r, offset, bytes, "put");
  if (bytes == 0) return;
  MC_CHECK(src != nullptr, "put from a null source");
  DeviceGuard guard(device_);
  MC_CUDA_CHECK(
      cudaMemcpyAsync(r.device_ptr() + offset, src, bytes, cudaMemcpyDefault, as_stream(stream_)));
  MC_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream_)));
}

void IpcTransport::signal(Region& dst, uint64_t offset, uint64_t value, SignalOp op) {
  IpcRegion& r = as_ipc(dst);
  MC_CHECK(!r.closed(), "signal into closed ", r.describe());
  check_word(r, offset);
  DeviceGuard guard(device_);
  auto* word = reinterpret_cast<uint64_t*>(r.device_ptr() + offset);
  signal_kernel<<<1, 1, 0, as_stream(stream_)>>>(word, value, op == SignalOp::kAdd);
  MC_CUDA_CHECK(cudaGetLastError());
  MC_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream_)));
}

void IpcTransport::read(Region& region, uint64_t offset, void* dst, uint64_t bytes) {
  IpcRegion& r = as_ipc(region);
  check_range(r, offset, bytes, "read");
  if (bytes == 0) return;
  DeviceGuard guard(device_);
  MC_CUDA_CHECK(
      cudaMemcpyAsync(dst, r.device_ptr() + offset, bytes, cudaMemcpyDefault, as_stream(stream_)));
  MC_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream_)));
  // Reads issued after this one (the payload after the signal) stay after it.
  std::atomic_thread_fence(std::memory_order_acquire);
}

uint64_t IpcTransport::load(Region& local, uint64_t offset) {
  check_word(local, offset);
  uint64_t w = 0;
  read(local, offset, &w, sizeof(w));
  return w;
}

WaitResult IpcTransport::wait(Region& local, uint64_t offset, const WaitPredicate& pred,
                              int64_t timeout_ns, const Region* peer) {
  check_word(as_ipc(local), offset);
  const IpcRegion* watched = peer != nullptr ? &as_ipc(*peer) : nullptr;
  const int64_t start = now_ns();
  const int64_t deadline = timeout_ns < 0 ? INT64_MAX : start + timeout_ns;
  int64_t next_peer_check = start;
  int64_t sleep_ns = kMinPollSleepNs;
  for (int polls = 0;; ++polls) {
    const uint64_t w = load(local, offset);
    if (pred.satisfied(w)) return {WaitStatus::kOk, w};
    const int64_t now = now_ns();
    if (now >= deadline) return {WaitStatus::kTimeout, w};
    if (watched != nullptr && now >= next_peer_check) {
      if (!shm::process_alive(watched->owner())) return {WaitStatus::kPeerLost, w};
      next_peer_check = now + kPeerCheckIntervalNs;
    }
    if (polls >= kBusyPolls) {
      std::this_thread::sleep_for(std::chrono::nanoseconds(std::min(sleep_ns, deadline - now)));
      sleep_ns = std::min(2 * sleep_ns, kMaxPollSleepNs);
    }
  }
}

bool IpcTransport::compare_exchange(Region& local, uint64_t offset, uint64_t expected,
                                    uint64_t desired) {
  IpcRegion& r = as_ipc(local);
  check_word(r, offset);
  std::lock_guard<std::mutex> lock(scratch_mu_);
  DeviceGuard guard(device_);
  auto* word = reinterpret_cast<uint64_t*>(r.device_ptr() + offset);
  cas_kernel<<<1, 1, 0, as_stream(stream_)>>>(word, expected, desired, scratch_);
  MC_CUDA_CHECK(cudaGetLastError());
  uint64_t ok = 0;
  MC_CUDA_CHECK(
      cudaMemcpyAsync(&ok, scratch_, sizeof(ok), cudaMemcpyDeviceToHost, as_stream(stream_)));
  MC_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream_)));
  return ok != 0;
}

void IpcTransport::fence() {
  DeviceGuard guard(device_);
  MC_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream_)));
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

bool IpcTransport::peer_alive(const Region& peer) {
  return shm::process_alive(as_ipc(peer).owner());
}

}  // namespace moecomm::transport::cuda_ipc
