#include "registry.h"
namespace moecomm::bindings::cuda {
void register_ipc(pybind11::module_&) {}
}  // namespace moecomm::bindings::cuda
