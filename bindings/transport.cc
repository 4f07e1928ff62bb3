// Transports and regions. Regions export the buffer protocol so Python can view them as tensors
// without copying; the exported view keeps the region object (and so its mapping) alive.
#include <pybind11/pybind11.h>

#include <pybind11/stl.h>
#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <vector>

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

// Signals and loads of the shm transport are a store or a load (plus at most a futex wake): they
// never block, so they keep the GIL — releasing and re-taking it would cost more than the call
// and hand the interpreter to another thread at every signal of a round trip.
bool never_blocks(Transport& t) {
  return dynamic_cast<shm::ShmTransport*>(&t) != nullptr;
}

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

// The transport's own round-trip floor, for benchmarks: `iters` signal/wait exchanges on the word
// at `offset` (the lead signals i and waits for i in its own region; the other side waits for i
// and answers with i), all in C++ with the GIL released. The lead returns each round trip's ns.
std::vector<int64_t> ping_pong(Transport& t, Region& local, Region& peer, uint64_t offset,
                               int64_t iters, bool lead, int64_t timeout_ns) {
  std::vector<int64_t> out;
  if (lead) out.reserve(static_cast<size_t>(std::max<int64_t>(iters, 0)));
  for (int64_t i = 1; i <= iters; ++i) {
    const auto value = static_cast<uint64_t>(i);
    const auto t0 = std::chrono::steady_clock::now();
    if (lead) t.signal(peer, offset, value, SignalOp::kSet);
    const WaitResult r = t.wait(local, offset, WaitPredicate{WaitOp::kEqual, ~uint64_t{0}, value},
                                timeout_ns, &peer);
    MC_CHECK(r.status == WaitStatus::kOk, "ping_pong: no answer to exchange ", i, " within ",
             timeout_ns, " ns");
    if (lead) {
      out.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - t0)
                        .count());
    } else {
      t.signal(peer, offset, value, SignalOp::kSet);
    }
  }
  return out;
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
      .def(
          "signal",
          [](Transport& t, Region& dst, uint64_t offset, uint64_t value, SignalOp op) {
            if (never_blocks(t)) return t.signal(dst, offset, value, op);
            py::gil_scoped_release release;
            t.signal(dst, offset, value, op);
          },
          py::arg("dst"), py::arg("offset"), py::arg("value"), py::arg("op") = SignalOp::kSet)
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
      .def(
          "load",
          [](Transport& t, Region& local, uint64_t offset) {
            if (never_blocks(t)) return t.load(local, offset);
            py::gil_scoped_release release;
            return t.load(local, offset);
          },
          py::arg("local"), py::arg("offset"))
      .def("compare_exchange", &Transport::compare_exchange, py::arg("local"), py::arg("offset"),
           py::arg("expected"), py::arg("desired"))
      .def("fence", &Transport::fence, py::call_guard<py::gil_scoped_release>())
      .def("peer_alive", &Transport::peer_alive, py::arg("peer"),
           py::call_guard<py::gil_scoped_release>())
      .def("ping_pong", &ping_pong, py::arg("local"), py::arg("peer"), py::arg("offset"),
           py::arg("iters"), py::arg("lead"), py::arg("timeout_ns"),
           py::call_guard<py::gil_scoped_release>());

  py::class_<shm::ShmTransport, Transport, std::shared_ptr<shm::ShmTransport>>(m, "ShmTransport")
      .def(py::init([](int64_t spin_ns, bool reap_on_start, std::optional<bool> watch_death) {
             return std::make_shared<shm::ShmTransport>(shm::ShmOptions{
                 spin_ns, reap_on_start, watch_death.value_or(shm::default_watch_death())});
           }),
           py::arg("spin_ns") = shm::kDefaultSpinNs, py::arg("reap_on_start") = true,
           py::arg("watch_death") = py::none())
      .def_property_readonly("spin_ns",
                             [](const shm::ShmTransport& t) { return t.options().spin_ns; })
      .def_property_readonly("watch_death",
                             [](const shm::ShmTransport& t) { return t.options().watch_death; });

  m.def("shm_set_default_watch_death", &shm::set_default_watch_death, py::arg("on"));
  m.def("shm_default_watch_death", &shm::default_watch_death);

  m.def("shm_reap_stale_segments", &shm::reap_stale_segments, py::arg("pid") = 0);
  m.def("shm_list_segments", &shm::list_segments, py::arg("pid") = 0);
  m.attr("SHM_DEFAULT_SPIN_NS") = shm::kDefaultSpinNs;
}

}  // namespace moecomm::bindings
