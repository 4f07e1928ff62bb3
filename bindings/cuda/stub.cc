// Placeholder until the transport branch provides register_ipc (the merge replaces this file).
#include "registry.h"
namespace moecomm::bindings::cuda {
void register_ipc(pybind11::module_&) {}
}  // namespace moecomm::bindings::cuda
