#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "common/error.h"
#include "transport/device/cuda_util.h"
#include "transport/nvshmem/nvshmem_runtime.h"

namespace moecomm::transport::nvshmem {

static_assert(sizeof(nvshmemx_uniqueid_t) == kUniqueIdBytes, "NVSHMEM unique id size changed");

namespace {

std::atomic<bool> g_initialized{false};

void require_initialized(const char* what) {
  MC_CHECK(g_initialized.load(), what, " needs NVSHMEM to be initialized (call init first)");
}

// Live NvshmemRegions of this process: start address -> size (is_symmetric).
std::mutex g_regions_mu;
std::map<uintptr_t, uint64_t> g_regions;

void register_region(const void* p, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(g_regions_mu);
  g_regions[reinterpret_cast<uintptr_t>(p)] = bytes;
}

void unregister_region(const void* p) {
  std::lock_guard<std::mutex> lock(g_regions_mu);
  g_regions.erase(reinterpret_cast<uintptr_t>(p));
}

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0';
}

}  // namespace

std::vector<std::pair<std::string, std::string>> transport_env_defaults() {
  std::vector<std::pair<std::string, std::string>> out;
  const char* opt = std::getenv(kEnvMoecommIbgda);
  if (opt != nullptr && std::strcmp(opt, "0") == 0) return out;
  for (const auto& [name, value] : {std::pair<const char*, std::string>{kEnvEnableIbgda, "1"},
                                    {kEnvRcPerPe, std::to_string(kIbgdaRcPerPe)},
                                    {kEnvQpDepth, std::to_string(kQpDepth)}}) {
    if (!env_set(name)) out.emplace_back(name, value);
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> apply_transport_env_defaults() {
  auto defaults = transport_env_defaults();
  for (const auto& [name, value] : defaults) {
    MC_CHECK_KIND(setenv(name.c_str(), value.c_str(), /*overwrite=*/0) == 0, ErrorKind::kSystem,
                  "setenv(", name, ") failed");
  }
  return defaults;
}

bool is_symmetric(const void* p, uint64_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(g_regions_mu);
  auto it = g_regions.upper_bound(a);  // first region starting after a
  if (it == g_regions.begin()) return false;
  --it;  // the last region starting at or before a
  const uint64_t off = a - it->first;
  return off <= it->second && bytes <= it->second - off;
}

void require_symmetric(const void* p, uint64_t bytes, const char* what) {
  MC_CHECK(is_symmetric(p, bytes), what, " (", bytes, " bytes at ", p,
           ") is not inside an NvshmemRegion: a source of NVSHMEM puts must be symmetric "
           "memory (allocate it with NvshmemRegion, collectively, and pass its device_ptr)");
}

void check_unique_id(const std::string& uid) {
  MC_CHECK(uid.size() == kUniqueIdBytes, "an NVSHMEM unique id is ", kUniqueIdBytes, " bytes, got ",
           uid.size());
  int32_t version = 0;
  std::memcpy(&version, uid.data(), sizeof(version));
  MC_CHECK(version == kUniqueIdVersion, "not an NVSHMEM unique id: version field is ", version,
           ", expected ", kUniqueIdVersion, " (ids come from get_unique_id on rank 0)");
}

void check_init_args(int rank, int nranks) {
  MC_CHECK(nranks >= 1, "nranks must be >= 1, got ", nranks);
  MC_CHECK(rank >= 0 && rank < nranks, "rank ", rank, " outside [0, ", nranks, ")");
}

std::string get_unique_id() {
  require_device("the NVSHMEM transport");
  apply_transport_env_defaults();  // NVSHMEM may read its environment here already
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  const int status = nvshmemx_get_uniqueid(&id);
  MC_CHECK_KIND(status == 0, ErrorKind::kSystem, "nvshmemx_get_uniqueid failed with status ",
                status);
  std::string out(kUniqueIdBytes, '\0');
  std::memcpy(out.data(), &id, kUniqueIdBytes);
  return out;
}

void init(const std::string& uid, int rank, int nranks, int device) {
  check_unique_id(uid);
  check_init_args(rank, nranks);
  require_device("the NVSHMEM transport");
  MC_CHECK(!g_initialized.load(), "NVSHMEM is already initialized in this process (PE ",
           nvshmem_my_pe(), "); it is initialized once per process");
  if (device >= 0) {
    MC_CHECK(device < device_count(), "device ", device, " out of range");
    MC_CUDA_CHECK(cudaSetDevice(device));  // NVSHMEM binds the PE to the current device
  }
  apply_transport_env_defaults();
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, uid.data(), kUniqueIdBytes);
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int status = nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr);
  MC_CHECK_KIND(status == 0, ErrorKind::kSystem,
                "nvshmemx_set_attr_uniqueid_args failed with "
                "status ",
                status);
  // nvshmemx_init_attr is an inline wrapper that calls exit() when this fails; library code
  // must throw instead, so the wrapper's body is reproduced without the exit.
  int provided = 0;
  nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                NVSHMEM_VENDOR_PATCH_VERSION};
  status = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID,
                                &attr, version);
  MC_CHECK_KIND(status == 0, ErrorKind::kSystem, "NVSHMEM initialization (rank ", rank, " of ",
                nranks, ") failed with status ", status);
  g_initialized.store(true);
}

bool initialized() {
  return g_initialized.load();
}

int my_pe() {
  require_initialized("my_pe");
  return nvshmem_my_pe();
}

int n_pes() {
  require_initialized("n_pes");
  return nvshmem_n_pes();
}

void barrier_all() {
  require_initialized("barrier_all");
  nvshmem_barrier_all();
}

void finalize() {
  require_initialized("finalize");
  nvshmem_finalize();
  g_initialized.store(false);
}

NvshmemRegion::NvshmemRegion(uint64_t bytes) {
  require_initialized("allocating a symmetric region");
  MC_CHECK(bytes > 0, "cannot allocate an empty symmetric region");
  ptr_ = static_cast<uint8_t*>(nvshmem_malloc(bytes));
  MC_CHECK_KIND(ptr_ != nullptr, ErrorKind::kSystem, "nvshmem_malloc of ", bytes,
                " bytes failed: the symmetric heap is too small (raise "
                "NVSHMEM_SYMMETRIC_SIZE) or the PEs asked for different sizes");
  bytes_ = bytes;
  // Zero-filled like every moecomm region; the barrier makes every PE's zeroes land before
  // any PE can signal into them.
  const cudaError_t err = cudaMemset(ptr_, 0, bytes);
  if (err != cudaSuccess) {
    nvshmem_free(ptr_);
    ptr_ = nullptr;
    MC_CUDA_CHECK(err);
  }
  MC_CUDA_CHECK(cudaDeviceSynchronize());
  nvshmem_barrier_all();
  register_region(ptr_, bytes_);
}

NvshmemRegion::~NvshmemRegion() {
  if (ptr_ != nullptr) unregister_region(ptr_);
}

void NvshmemRegion::free() {
  if (ptr_ == nullptr) return;
  unregister_region(ptr_);
  nvshmem_free(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
}

void NvshmemRegion::write(uint64_t offset, const void* src, uint64_t bytes) {
  MC_CHECK(ptr_ != nullptr, "write into a freed symmetric region");
  MC_CHECK(offset <= bytes_ && bytes <= bytes_ - offset, "write of ", bytes, " bytes at offset ",
           offset, " is outside the region (", bytes_, " bytes)");
  if (bytes > 0) MC_CUDA_CHECK(cudaMemcpy(ptr_ + offset, src, bytes, cudaMemcpyDefault));
}

void NvshmemRegion::read(uint64_t offset, void* dst, uint64_t bytes) const {
  MC_CHECK(ptr_ != nullptr, "read from a freed symmetric region");
  MC_CHECK(offset <= bytes_ && bytes <= bytes_ - offset, "read of ", bytes, " bytes at offset ",
           offset, " is outside the region (", bytes_, " bytes)");
  if (bytes > 0) MC_CUDA_CHECK(cudaMemcpy(dst, ptr_ + offset, bytes, cudaMemcpyDefault));
}

}  // namespace moecomm::transport::nvshmem
