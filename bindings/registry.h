// One registration function per component; module.cc only calls them.
#pragma once

#include <pybind11/pybind11.h>

namespace moecomm::bindings {

void register_errors(pybind11::module_& m);
void register_protocol(pybind11::module_& m);
void register_transport(pybind11::module_& m);
void register_nixl(pybind11::module_& m);
void register_slots(pybind11::module_& m);
void register_kernels_moe(pybind11::module_& m);
void register_eplb(pybind11::module_& m);
void register_kernels_dispatch(pybind11::module_& m);

}  // namespace moecomm::bindings
