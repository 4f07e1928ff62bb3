// CPU quantize kernel. Addresses arrive as integers; the Python API (moecomm.ops.quant) has
// already checked dtype, shape and strides of the tensors they come from.
#include <pybind11/pybind11.h>

#include "kernels/cpu/quant.h"
#include "registry.h"

namespace py = pybind11;

namespace moecomm::bindings {

void register_kernels_quant(py::module_& m) {
  m.def(
      "quantize_cpu",
      [](uintptr_t x, protocol::Encoding in, uint64_t x_row_stride, uint32_t tokens,
         uint32_t hidden, protocol::Encoding out, uintptr_t q, uintptr_t scales) {
        kernels::cpu::QuantizeArgs a;
        a.x = reinterpret_cast<const void*>(x);
        a.in = in;
        a.x_row_stride = x_row_stride;
        a.tokens = tokens;
        a.hidden = hidden;
        a.out = out;
        a.q = reinterpret_cast<void*>(q);
        a.scales = reinterpret_cast<float*>(scales);
        kernels::cpu::quantize(a);
      },
      py::arg("x"), py::arg("in_encoding"), py::arg("x_row_stride"), py::arg("tokens"),
      py::arg("hidden"), py::arg("out_encoding"), py::arg("q"), py::arg("scales"),
      py::call_guard<py::gil_scoped_release>());
}

}  // namespace moecomm::bindings
