// moecomm._cuda: the GPU data path (CUDA-IPC transport and device kernels). Built only when nvcc
// is present; it imports on a machine with no driver (the CUDA runtime is linked statically and
// loads the driver lazily), so Python can tell "no device" from "not built".
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include "registry.h"

namespace py = pybind11;

namespace {

// Devices visible to this process; 0 when there is no driver or no device (not an error: the
// caller decides whether a GPU is required).
int device_count() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
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

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "moecomm GPU data path (CUDA-IPC transport, device dispatch/combine kernels)";
  m.def("device_count", &device_count, "CUDA devices visible to this process (0 without a driver)");
  m.def("no_device_reason", &no_device_reason,
        "why device_count() is 0, or an empty string when a device is visible");
  m.attr("runtime_version") = CUDART_VERSION;
  moecomm::bindings::cuda::register_all(m);
}
