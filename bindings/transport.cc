// Transports and regions. Regions export the buffer protocol so Python can view them as tensors
// without copying; the exported view keeps the region object (and so its mapping) alive.
#include <pybind11/pybind11.h>

#include <pybind11/stl.h>
#include <algorithm>

#include <memory>

#include "common/error.h"
#include "registry.h"
#include "transport/shm/shm_transport.h"
#include "transport/transport.h"

namespace py = pybind11;

namespace moecomm::bindings {

using namespace moecomm::transport;

namespace {

// The first part of every wait spins with the GIL held: on a hot path the peer's signal usually
// lands within it, and giving up and re-taking the GIL costs about as much as such a spin. Short
// enough that other Python threads never notice.
constexpr int64_t kHeldSpinNs = 2'000;

// Turns a wait outcome into a value or the matching exception.
uint64_t wait_or_throw(Transport& t, Region& local, uint64_t offset, const WaitPredicate& pred,
                       int64_t timeout_ns, const Region* peer) {
  const int64_t held = timeout_ns < 0 ? kHeldSpinNs : std::min(timeout_ns, kHeldSpinNs);
  WaitResult r = t.wait(local, offset, pred, held, peer);
  if (r.status == WaitStatus::kTimeout && (timeout_ns < 0 || timeout_ns > held)) {
    py::gil_scoped_release release;
    r = t.wait(local, offset, pred, timeout_ns < 0 ? timeout_ns : timeout_ns - held, peer);
  }
  if (r.status == WaitStatus::kTimeout) {
    MC_THROW(ErrorKind::kTimeout, "wait on ", local.describe(), " offset ", offset,
             " timed out after ", timeout_ns, " ns (last value ", r.value, ")");
  }
  if (r.status == WaitStatus::kPeerLost) {
    MC_THROW(ErrorKind::kPeerLost, "peer died while waiting: ", peer->describe());
  }
  return r.value;
}

}  // namespace

void register_transport(py::module_& m) {
  py::enum_<SignalOp>(m, "SignalOp").value("SET", SignalOp::kSet).value("ADD", SignalOp::kAdd);
  py::enum_<WaitOp>(m, "WaitOp")
      .value("EQUAL", WaitOp::kEqual)
      .value("NOT_EQUAL", WaitOp::kNotEqual);

  py::class_<Region, std::shared_ptr<Region>>(m, "Region", py::buffer_protocol())
      .def_buffer([](Region& r) {
        MC_CHECK(r.data() != nullptr, r.describe(), " has no local mapping");
        return py::buffer_info(r.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(r.size())}, {1});
      })
      .def_property_readonly("size", &Region::size)
      .def_property_readonly("handle", &Region::handle)
      .def_property_readonly("owned", &Region::owned)
      .def_property_readonly("closed", &Region::closed)
      .def_property_readonly("address",
                             [](Region& r) { return reinterpret_cast<uintptr_t>(r.data()); })
      .def("close", &Region::close)
      .def("describe", &Region::describe)
      .def("__repr__", [](const Region& r) { return "<moecomm.Region " + r.describe() + ">"; });

  py::class_<Transport, std::shared_ptr<Transport>>(m, "Transport")
      .def_property_readonly("name", &Transport::name)
      .def("create_region", &Transport::create_region, py::arg("bytes"))
      .def("attach", &Transport::attach, py::arg("handle"))
      .def(
          "put",
          [](Transport& t, Region& dst, uint64_t offset, uintptr_t src, uint64_t bytes) {
            t.put(dst, offset, reinterpret_cast<const void*>(src), bytes);
          },
          py::arg("dst"), py::arg("offset"), py::arg("src_address"), py::arg("bytes"),
          py::call_guard<py::gil_scoped_release>())
      .def("signal", &Transport::signal, py::arg("dst"), py::arg("offset"), py::arg("value"),
           py::arg("op") = SignalOp::kSet, py::call_guard<py::gil_scoped_release>())
      .def(
          "wait",
          [](Transport& t, Region& local, uint64_t offset, WaitOp op, uint64_t value, uint64_t mask,
             int64_t timeout_ns, std::shared_ptr<Region> peer) {
            return wait_or_throw(t, local, offset, WaitPredicate{op, mask, value}, timeout_ns,
                                 peer.get());
          },
          py::arg("local"), py::arg("offset"), py::arg("op"), py::arg("value"),
          py::arg("mask") = ~uint64_t{0}, py::arg("timeout_ns"), py::arg("peer") = nullptr)
      .def(
          "read",
          [](Transport& t, Region& region, uint64_t offset, uintptr_t dst, uint64_t bytes) {
            t.read(region, offset, reinterpret_cast<void*>(dst), bytes);
          },
          py::arg("region"), py::arg("offset"), py::arg("dst_address"), py::arg("bytes"),
          py::call_guard<py::gil_scoped_release>())
      .def("load", &Transport::load, py::arg("local"), py::arg("offset"),
           py::call_guard<py::gil_scoped_release>())
      .def("compare_exchange", &Transport::compare_exchange, py::arg("local"), py::arg("offset"),
           py::arg("expected"), py::arg("desired"))
      .def("fence", &Transport::fence, py::call_guard<py::gil_scoped_release>())
      .def("peer_alive", &Transport::peer_alive, py::arg("peer"),
           py::call_guard<py::gil_scoped_release>());

  py::class_<shm::ShmTransport, Transport, std::shared_ptr<shm::ShmTransport>>(m, "ShmTransport")
      .def(py::init([](int64_t spin_ns, bool reap_on_start) {
             return std::make_shared<shm::ShmTransport>(shm::ShmOptions{spin_ns, reap_on_start});
           }),
           py::arg("spin_ns") = shm::kDefaultSpinNs, py::arg("reap_on_start") = true)
      .def_property_readonly("spin_ns",
                             [](const shm::ShmTransport& t) { return t.options().spin_ns; });

  m.def("shm_reap_stale_segments", &shm::reap_stale_segments, py::arg("pid") = 0);
  m.def("shm_list_segments", &shm::list_segments, py::arg("pid") = 0);
  m.attr("SHM_DEFAULT_SPIN_NS") = shm::kDefaultSpinNs;
}

}  // namespace moecomm::bindings
