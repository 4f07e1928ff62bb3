// moecomm.eplb packing kernels. Addresses arrive as integers; moecomm.eplb.native has already
// checked dtype, shape and contiguity of the numpy arrays they come from.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "kernels/cpu/eplb_pack.h"
#include "registry.h"

namespace py = pybind11;

namespace moecomm::bindings {
namespace {

kernels::cpu::EplbPacking packing(int64_t rows, int64_t packs, int64_t slots, uintptr_t table,
                                  uintptr_t slot_w, uintptr_t slot_l, uintptr_t loads,
                                  uintptr_t row_group) {
  return {rows,
          packs,
          slots,
          reinterpret_cast<int64_t*>(table),
          reinterpret_cast<double*>(slot_w),
          reinterpret_cast<int64_t*>(slot_l),
          reinterpret_cast<double*>(loads),
          reinterpret_cast<const int64_t*>(row_group)};  // 0 -> nullptr: a group per row
}

}  // namespace

void register_eplb(py::module_& m) {
  m.def(
      "eplb_rounds",
      [](int64_t rows, int64_t packs, int64_t slots, uintptr_t table, uintptr_t slot_w,
         uintptr_t slot_l, uintptr_t loads, uintptr_t weights, uintptr_t labels) {
        py::gil_scoped_release release;
        kernels::cpu::eplb_rounds(packing(rows, packs, slots, table, slot_w, slot_l, loads, 0),
                                  reinterpret_cast<const double*>(weights),
                                  reinterpret_cast<const int64_t*>(labels));
      },
      "Greedy rounds of moecomm.eplb.packing into preallocated arrays.");
  m.def(
      "eplb_dedup",
      [](int64_t rows, int64_t packs, int64_t slots, uintptr_t table, uintptr_t slot_w,
         uintptr_t slot_l, uintptr_t loads, uintptr_t row_group, int64_t max_steps) {
        py::gil_scoped_release release;
        kernels::cpu::eplb_dedup(
            packing(rows, packs, slots, table, slot_w, slot_l, loads, row_group), max_steps);
      },
      "De-duplication swaps of moecomm.eplb.packing, in place.");
  m.def(
      "eplb_refine",
      [](int64_t rows, int64_t packs, int64_t slots, uintptr_t table, uintptr_t slot_w,
         uintptr_t slot_l, uintptr_t loads, uintptr_t row_group, int64_t max_steps,
         double min_relative_gain) {
        py::gil_scoped_release release;
        kernels::cpu::eplb_refine(
            packing(rows, packs, slots, table, slot_w, slot_l, loads, row_group), max_steps,
            min_relative_gain);
      },
      "Refinement swaps of moecomm.eplb.packing, in place.");
  m.def(
      "eplb_replica_counts",
      [](uintptr_t weights, int64_t rows, int64_t experts, int64_t num_slots, int64_t max_count,
         double offset, uintptr_t counts) {
        py::gil_scoped_release release;
        kernels::cpu::eplb_replica_counts(reinterpret_cast<const double*>(weights), rows, experts,
                                          num_slots, max_count, offset,
                                          reinterpret_cast<int64_t*>(counts));
      },
      "Replica counts of moecomm.eplb.replicas into a preallocated [rows, experts] array.");
  m.def(
      "eplb_log2phy",
      [](uintptr_t phy2log, int64_t rows, int64_t slots, int64_t experts, uintptr_t log2phy,
         uintptr_t logcnt) {
        bool ok = false;
        {
          py::gil_scoped_release release;
          ok = kernels::cpu::eplb_log2phy(reinterpret_cast<const int64_t*>(phy2log), rows, slots,
                                          experts, reinterpret_cast<int64_t*>(log2phy),
                                          reinterpret_cast<int64_t*>(logcnt));
        }
        if (!ok) throw py::value_error("phy2log holds an expert id out of range or too often");
      },
      "log2phy and logcnt from phy2log into preallocated arrays.");
}

}  // namespace moecomm::bindings
