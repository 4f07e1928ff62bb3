// moecomm._cuda: the GPU data path (CUDA-IPC transport and device kernels). Built only when nvcc
// is present; it imports on a machine with no driver (the CUDA runtime is linked statically and
// loads the driver lazily), so Python can tell "no device" from "not built". device_count and
// no_device_reason are registered with the IPC transport (ipc.cc).
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include "../error_map.h"
#include "registry.h"

namespace py = pybind11;

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "moecomm GPU data path (CUDA-IPC transport, device dispatch/combine kernels)";
  m.attr("runtime_version") = CUDART_VERSION;
  moecomm::bindings::register_local_error_translator();
  moecomm::bindings::cuda::register_all(m);
}
