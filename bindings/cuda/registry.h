// Each binding file of moecomm._cuda registers its part of the module here.
#pragma once

#include <pybind11/pybind11.h>

namespace moecomm::bindings::cuda {

void register_ipc(pybind11::module_& m);
void register_kernels(pybind11::module_& m);

inline void register_all(pybind11::module_& m) {
  register_ipc(m);
  register_kernels(m);
}

}  // namespace moecomm::bindings::cuda
