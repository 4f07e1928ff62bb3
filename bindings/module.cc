#include "registry.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "moecomm native core: slot protocol, transports, slot I/O";
  moecomm::bindings::register_errors(m);
  moecomm::bindings::register_protocol(m);
  moecomm::bindings::register_transport(m);
  moecomm::bindings::register_nixl(m);
  moecomm::bindings::register_slots(m);
  moecomm::bindings::register_kernels_moe(m);
  moecomm::bindings::register_eplb(m);
  moecomm::bindings::register_kernels_dispatch(m);
}
