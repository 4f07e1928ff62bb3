// moecomm._nvshmem: the NVSHMEM transport's host side for Python. Bootstrap by unique id (no
// MPI: rank 0's id travels over moecomm's control plane), symmetric regions, the peer table
// behind NvshmemBackend, and device probes. Arguments are checked before any CUDA or NVSHMEM
// call, and every call needs a device first, so a machine without a GPU gets a Python
// exception, never a crash.
#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "../error_map.h"
#include "common/error.h"
#include "transport/nvshmem/nvshmem_runtime.h"

namespace py = pybind11;

using namespace moecomm::transport;
namespace nv = moecomm::transport::nvshmem;

namespace {

py::dict backend_to_dict(const nv::NvshmemBackend& b) {
  py::dict d;
  d["local_base"] = reinterpret_cast<uintptr_t>(b.local_base);
  d["peer_pe"] = reinterpret_cast<uintptr_t>(b.peer_pe);
  d["alive"] = reinterpret_cast<uintptr_t>(b.alive);
  d["max_peers"] = b.max_peers;
  return d;
}

}  // namespace

PYBIND11_MODULE(_nvshmem, m) {
  m.doc() = "moecomm NVSHMEM transport: unique-id bootstrap, symmetric regions, peer table";
  // WaitStatus, SignalOp, WaitOp and the exception classes live in moecomm._C.
  py::module_::import("moecomm._C");
  moecomm::bindings::register_local_error_translator();

  m.attr("UNIQUE_ID_BYTES") = nv::kUniqueIdBytes;
  m.def("device_count", &nv::device_count);
  m.def("no_device_reason", &nv::no_device_reason);
  m.def(
      "check_unique_id", [](const py::bytes& uid) { nv::check_unique_id(uid); },
      py::arg("unique_id"), "ValueError unless `unique_id` has the size and version of an id");
  m.def(
      "get_unique_id", [] { return py::bytes(nv::get_unique_id()); },
      "rank 0, before init: the bootstrap id to hand to every rank");
  m.def(
      "init",
      [](const py::bytes& uid, int rank, int nranks, int device) {
        const std::string raw = uid;
        py::gil_scoped_release release;  // collective: blocks until every rank has joined
        nv::init(raw, rank, nranks, device);
      },
      py::arg("unique_id"), py::arg("rank"), py::arg("nranks"), py::arg("device") = -1);
  m.def("initialized", &nv::initialized);
  m.def("my_pe", [] {
    moecomm::transport::require_device("the NVSHMEM transport");
    return nv::my_pe();
  });
  m.def("n_pes", [] {
    moecomm::transport::require_device("the NVSHMEM transport");
    return nv::n_pes();
  });
  m.def(
      "barrier_all",
      [] {
        moecomm::transport::require_device("the NVSHMEM transport");
        nv::barrier_all();
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "finalize",
      [] {
        moecomm::transport::require_device("the NVSHMEM transport");
        nv::finalize();
      },
      py::call_guard<py::gil_scoped_release>());

  py::class_<nv::NvshmemRegion, std::shared_ptr<nv::NvshmemRegion>>(m, "NvshmemRegion")
      .def(py::init([](uint64_t bytes) {
             moecomm::transport::require_device("the NVSHMEM transport");
             py::gil_scoped_release release;  // collective
             return std::make_shared<nv::NvshmemRegion>(bytes);
           }),
           py::arg("bytes"), "collective: every PE allocates the same sizes in the same order")
      .def_property_readonly(
          "device_ptr",
          [](const nv::NvshmemRegion& r) { return reinterpret_cast<uintptr_t>(r.device_ptr()); })
      .def_property_readonly("size", &nv::NvshmemRegion::size)
      .def_property_readonly("freed", &nv::NvshmemRegion::freed)
      .def("free", &nv::NvshmemRegion::free, py::call_guard<py::gil_scoped_release>(), "collective")
      .def(
          "write",
          [](nv::NvshmemRegion& r, uint64_t offset, const py::bytes& data) {
            const std::string raw = data;
            r.write(offset, raw.data(), raw.size());
          },
          py::arg("offset"), py::arg("data"))
      .def(
          "read",
          [](const nv::NvshmemRegion& r, uint64_t offset, uint64_t nbytes) {
            std::string out(nbytes, '\0');
            r.read(offset, out.data(), nbytes);
            return py::bytes(out);
          },
          py::arg("offset"), py::arg("nbytes"));

  py::class_<nv::NvshmemPeerTable>(m, "NvshmemPeerTable")
      .def(py::init([](std::shared_ptr<nv::NvshmemRegion> local, uint32_t max_peers) {
             moecomm::transport::require_device("the NVSHMEM transport");
             return std::make_unique<nv::NvshmemPeerTable>(std::move(local), max_peers);
           }),
           py::arg("local"), py::arg("max_peers"))
      .def("set_peer", &nv::NvshmemPeerTable::set_peer, py::arg("index"), py::arg("pe"))
      .def("mark_dead", &nv::NvshmemPeerTable::mark_dead, py::arg("index"))
      .def("alive", &nv::NvshmemPeerTable::alive, py::arg("index"))
      .def("pe", &nv::NvshmemPeerTable::pe, py::arg("index"))
      .def_property_readonly("max_peers", &nv::NvshmemPeerTable::max_peers)
      .def("backend", [](const nv::NvshmemPeerTable& t) { return backend_to_dict(t.backend()); })
      .def(
          "device_wait",
          [](const nv::NvshmemPeerTable& t, uint64_t offset, WaitOp op, uint64_t value,
             uint64_t mask, int64_t timeout_ns, uint32_t peer) {
            nv::NvshmemProbeResult r;
            {
              py::gil_scoped_release release;
              r = nv::device_wait(t, offset, WaitPredicate{op, mask, value}, timeout_ns, peer);
            }
            py::dict d;
            d["status"] = static_cast<WaitStatus>(r.status);
            d["observed"] = r.observed;
            d["elapsed_ns"] = r.elapsed_ns;
            return d;
          },
          py::arg("offset"), py::arg("op"), py::arg("value"), py::arg("mask") = ~uint64_t{0},
          py::arg("timeout_ns"), py::arg("peer"))
      .def("put_signal", &nv::device_put_signal, py::arg("peer"), py::arg("dst_offset"),
           py::arg("src_offset"), py::arg("bytes"), py::arg("sig_offset"), py::arg("value"),
           py::arg("op") = SignalOp::kSet, py::call_guard<py::gil_scoped_release>());
}
