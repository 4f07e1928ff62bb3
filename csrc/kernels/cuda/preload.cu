// preload_kernels: every function of this library's device module loaded now (cuFuncLoad over
// cuModuleEnumerateFunctions, driver entry points looked up through the runtime, since the
// extension links the runtime statically and not libcuda).
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <vector>

#include "common/error.h"
#include "kernels/cuda/preload.h"

namespace moecomm::kernels::cuda {
namespace {

// The module handle comes from this kernel: the library is device-linked into one module
// (CUDA_SEPARABLE_COMPILATION with the device link inside moecomm_cuda), so its module holds
// every kernel of the library.
__global__ void preload_anchor_kernel() {}

// cuModuleEnumerateFunctions, cuFuncLoad and cuFuncIsLoaded arrived with CUDA 12.4.
constexpr unsigned int kEnumerateSince = 12040;

template <typename Fn>
Fn driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &fn, kEnumerateSince, cudaEnableDefault, &found);
  cudaGetLastError();
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) return nullptr;
  return reinterpret_cast<Fn>(fn);
}

}  // namespace

PreloadReport preload_kernels(int device) {
  const auto t0 = std::chrono::steady_clock::now();
  PreloadReport r;
  int count = 0;
  MC_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (device < 0) MC_CUDA_CHECK(cudaGetDevice(&device));
  MC_CHECK(device < count, "device ", device, " out of range: ", count, " visible");
  MC_CUDA_CHECK(cudaSetDevice(device));
  r.device = device;
  cudaFunction_t anchor = nullptr;
  MC_CUDA_CHECK(
      cudaGetFuncBySymbol(&anchor, reinterpret_cast<const void*>(&preload_anchor_kernel)));
  using GetModule = CUresult (*)(CUmodule*, CUfunction);
  using Count = CUresult (*)(unsigned int*, CUmodule);
  using Enumerate = CUresult (*)(CUfunction*, unsigned int, CUmodule);
  using Load = CUresult (*)(CUfunction);
  using IsLoaded = CUresult (*)(CUfunctionLoadingState*, CUfunction);
  const auto get_module = driver_entry<GetModule>("cuFuncGetModule");
  const auto get_count = driver_entry<Count>("cuModuleGetFunctionCount");
  const auto enumerate = driver_entry<Enumerate>("cuModuleEnumerateFunctions");
  const auto load = driver_entry<Load>("cuFuncLoad");
  const auto is_loaded = driver_entry<IsLoaded>("cuFuncIsLoaded");
  if (!get_module || !get_count || !enumerate || !load || !is_loaded) {
    // An older driver: the anchor's attributes load its module's code on the drivers we know;
    // say which path ran, the caller prints it.
    cudaFuncAttributes attr{};
    MC_CUDA_CHECK(
        cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(&preload_anchor_kernel)));
    r.how = "cudaFuncGetAttributes on the module's anchor (the driver has no cuFuncLoad)";
  } else {
    CUmodule mod = nullptr;
    MC_CHECK(get_module(&mod, reinterpret_cast<CUfunction>(anchor)) == CUDA_SUCCESS,
             "cuFuncGetModule failed for the preload anchor");
    unsigned int n = 0;
    MC_CHECK(get_count(&n, mod) == CUDA_SUCCESS, "cuModuleGetFunctionCount failed");
    std::vector<CUfunction> fns(n);
    MC_CHECK(n == 0 || enumerate(fns.data(), n, mod) == CUDA_SUCCESS,
             "cuModuleEnumerateFunctions failed");
    for (CUfunction f : fns) {
      CUfunctionLoadingState state{};
      if (is_loaded(&state, f) == CUDA_SUCCESS && state == CU_FUNCTION_LOADING_STATE_LOADED) {
        continue;
      }
      MC_CHECK(load(f) == CUDA_SUCCESS, "cuFuncLoad failed for one of ", n,
               " functions of the module");
      ++r.loaded_now;
    }
    r.functions = n;
    r.how = "cuModuleEnumerateFunctions + cuFuncLoad";
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace moecomm::kernels::cuda
