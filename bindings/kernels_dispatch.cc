// The CPU dispatch router. Addresses arrive as integers; moecomm.ops.dispatch has checked
// dtypes, shapes and contiguity of the tensors they come from and keeps them alive.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "common/error.h"
#include "kernels/cpu/dispatch_route.h"
#include "registry.h"

namespace py = pybind11;

namespace moecomm::bindings {

void register_kernels_dispatch(py::module_& m) {
  m.def(
      "route_dispatch",
      [](int64_t num_tokens, int64_t topk, uintptr_t topk_ids, uintptr_t weights,
         int64_t num_experts, uintptr_t num_replicas, uintptr_t offsets, uintptr_t servers,
         uintptr_t locals, int rule, uintptr_t replica, int64_t num_servers,
         uintptr_t rows_per_server, uintptr_t rows, uintptr_t ids, uintptr_t scores) {
        MC_CHECK(rule >= 0 && rule <= 2, "unknown replica rule ", rule);
        kernels::cpu::route_dispatch(
            {num_tokens, topk, reinterpret_cast<const int64_t*>(topk_ids),
             reinterpret_cast<const float*>(weights), num_experts,
             reinterpret_cast<const int64_t*>(num_replicas),
             reinterpret_cast<const int64_t*>(offsets), reinterpret_cast<const int64_t*>(servers),
             reinterpret_cast<const int32_t*>(locals), static_cast<kernels::cpu::ReplicaRule>(rule),
             reinterpret_cast<const int64_t*>(replica), num_servers,
             reinterpret_cast<int64_t*>(rows_per_server), reinterpret_cast<int64_t*>(rows),
             reinterpret_cast<int32_t*>(ids), reinterpret_cast<float*>(scores)});
      },
      py::call_guard<py::gil_scoped_release>());
}

}  // namespace moecomm::bindings
