#include "transport/device/cuda_device.h"

#include <cuda_runtime.h>

#include "common/error.h"

namespace moecomm::transport {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // not sticky; clear it so later calls start clean
    return 0;
  }
  return n;
}

std::string no_device_reason() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
  }
  return n == 0 ? "no CUDA device visible" : "";
}

void require_device(const char* who) {
  const std::string why = no_device_reason();
  MC_CHECK_KIND(why.empty(), ErrorKind::kSystem, "no usable CUDA device (", why, "): ", who,
                " needs a GPU");
}

}  // namespace moecomm::transport
