// Placeholder until the transport branch provides moecomm._nvshmem (the merge replaces this
// file): csrc/transport/nvshmem/instantiate_kernels.cu makes the NVSHMEM library, and with it
// this module, part of the build.
#include <pybind11/pybind11.h>

PYBIND11_MODULE(_nvshmem, m) {
  m.doc() = "moecomm NVSHMEM data path (placeholder)";
}
