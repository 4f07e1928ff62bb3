// Each binding file of moecomm._cuda registers its part of the module here.
#pragma once

#include <pybind11/pybind11.h>

namespace moecomm::bindings::cuda {

void register_ipc(pybind11::module_& m);
void register_kernels(pybind11::module_& m);

// Kernels first: the IPC bindings return their IpcPeers type (IpcPeerTable.kernel_peers), and
// pybind11 names a type in a signature only once it is registered.
inline void register_all(pybind11::module_& m) {
  register_kernels(m);
  register_ipc(m);
}

}  // namespace moecomm::bindings::cuda
