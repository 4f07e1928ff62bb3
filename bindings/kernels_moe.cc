// Expert-compute CPU kernels. Addresses arrive as integers; moecomm.ops.grouped_gemm has
// already checked dtype, shape, device and contiguity of the tensors they come from.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "kernels/cpu/expert_mlp.h"
#include "registry.h"

namespace py = pybind11;

namespace moecomm::bindings {
namespace {

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace

void register_kernels_moe(py::module_& m) {
  m.def("expert_mlp_has_avx2", &kernels::cpu::expert_mlp_has_avx2,
        "True when the AVX2+FMA expert-MLP kernels run on this CPU.");
  m.def(
      "expert_mlp_f32",
      [](uintptr_t x, int64_t ldx, uintptr_t row_begin, uintptr_t row_count, uintptr_t experts,
         int64_t num_run, uintptr_t w13, uintptr_t w2, uintptr_t scores, uintptr_t out, int64_t ldo,
         int64_t hidden, int64_t inter, int threads) {
        kernels::cpu::ExpertMlpArgs a{};
        a.x = ptr<const float>(x);
        a.ldx = ldx;
        a.row_begin = ptr<const int64_t>(row_begin);
        a.row_count = ptr<const int64_t>(row_count);
        a.experts = ptr<const int32_t>(experts);
        a.num_run = num_run;
        a.w13 = ptr<const float>(w13);
        a.w2 = ptr<const float>(w2);
        a.scores = ptr<const float>(scores);  // 0 → nullptr: no scores
        a.out = ptr<float>(out);
        a.ldo = ldo;
        a.hidden = hidden;
        a.inter = inter;
        kernels::cpu::expert_mlp_f32(a, threads);
      },
      py::arg("x"), py::arg("ldx"), py::arg("row_begin"), py::arg("row_count"), py::arg("experts"),
      py::arg("num_run"), py::arg("w13"), py::arg("w2"), py::arg("scores"), py::arg("out"),
      py::arg("ldo"), py::arg("hidden"), py::arg("inter"), py::arg("threads"),
      py::call_guard<py::gil_scoped_release>(),
      "Grouped expert MLP (float32; masked or contiguous through row_begin/row_count) over the "
      "listed experts; scores may be 0.");
}

}  // namespace moecomm::bindings
