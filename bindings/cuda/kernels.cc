// Placeholder until the kernels branch provides register_kernels (the merge replaces this file).
#include "registry.h"
namespace moecomm::bindings::cuda {
void register_kernels(pybind11::module_&) {}
}  // namespace moecomm::bindings::cuda
