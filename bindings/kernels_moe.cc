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
         int64_t hidden, int64_t inter, int threads, uintptr_t scratch, int64_t scratch_floats) {
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
        a.scratch = ptr<float>(scratch);  // 0 → nullptr: allocated per call
        a.scratch_floats = scratch_floats;
        kernels::cpu::expert_mlp_f32(a, threads);
      },
      py::arg("x"), py::arg("ldx"), py::arg("row_begin"), py::arg("row_count"), py::arg("experts"),
      py::arg("num_run"), py::arg("w13"), py::arg("w2"), py::arg("scores"), py::arg("out"),
      py::arg("ldo"), py::arg("hidden"), py::arg("inter"), py::arg("threads"),
      py::arg("scratch") = 0, py::arg("scratch_floats") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "Grouped expert MLP (float32; masked or contiguous through row_begin/row_count) over the "
      "listed experts; scores may be 0; scratch (0: allocated per call) holds scratch_floats.");
  m.def(
      "expert_layout",
      [](uintptr_t ids, uintptr_t scores, int64_t num_copies, int64_t topk, uintptr_t batch_offsets,
         int64_t num_batches, int64_t num_experts, uintptr_t counts, uintptr_t offsets,
         uintptr_t cursor, uintptr_t active, uintptr_t src_token, uintptr_t src_batch,
         uintptr_t src_row, uintptr_t src_k, uintptr_t row_scores, uintptr_t slot_of) {
        kernels::cpu::ExpertLayoutArgs a{};
        a.ids = ptr<const int32_t>(ids);
        a.scores = ptr<const float>(scores);
        a.num_copies = num_copies;
        a.topk = topk;
        a.batch_offsets = ptr<const int64_t>(batch_offsets);
        a.num_batches = num_batches;
        a.num_experts = num_experts;
        a.counts = ptr<int32_t>(counts);
        a.offsets = ptr<int64_t>(offsets);
        a.cursor = ptr<int64_t>(cursor);
        a.active = ptr<int32_t>(active);
        a.src_token = ptr<int64_t>(src_token);
        a.src_batch = ptr<int32_t>(src_batch);
        a.src_row = ptr<int32_t>(src_row);
        a.src_k = ptr<int32_t>(src_k);
        a.row_scores = ptr<float>(row_scores);
        a.slot_of = ptr<int64_t>(slot_of);
        int64_t num_active = 0;
        const int64_t rows = kernels::cpu::expert_layout(a, &num_active);
        return py::make_tuple(rows, num_active);
      },
      py::arg("ids"), py::arg("scores"), py::arg("num_copies"), py::arg("topk"),
      py::arg("batch_offsets"), py::arg("num_batches"), py::arg("num_experts"), py::arg("counts"),
      py::arg("offsets"), py::arg("cursor"), py::arg("active"), py::arg("src_token"),
      py::arg("src_batch"), py::arg("src_row"), py::arg("src_k"), py::arg("row_scores"),
      py::arg("slot_of"),
      "Per-expert layout of the flat token copies (stable counting sort) into caller-owned "
      "buffers; returns (rows, active experts).");
}

}  // namespace moecomm::bindings
