// The nixl transport: its Engine is a Python object over NIXL's Python API (NIXL ships no C++
// headers in its wheels). Every call into it takes the GIL; the transport never holds a lock of
// its own across one.
#include <pybind11/pybind11.h>

#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "registry.h"
#include "transport/nixl/nixl_transport.h"

namespace py = pybind11;

namespace moecomm::bindings {

using namespace moecomm::transport;
using nixl::Segment;
using nixl::XferStatus;

namespace {

const char* kind_name(nixl::MemKind k) {
  return k == nixl::MemKind::kCuda ? "cuda" : "host";
}

// Forwards to a Python engine (moecomm.wire.nixl.NixlEngine); Python errors become moecomm errors.
class PyEngine final : public nixl::Engine {
 public:
  explicit PyEngine(py::object obj) : obj_(std::move(obj)) {}
  ~PyEngine() override {
    if (!Py_IsInitialized()) {  // interpreter gone: the object dies with it
      obj_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    obj_ = py::object();
  }
  std::string agent_name() override { return call<std::string>("agent_name"); }
  std::string register_memory(uint64_t addr, uint64_t bytes, nixl::MemKind kind,
                              int32_t device) override {
    return call<std::string>("register_memory", addr, bytes,
                             kind == nixl::MemKind::kCuda ? "cuda" : "host", device);
  }
  void deregister_memory(uint64_t addr, uint64_t bytes) override {
    if (Py_IsInitialized()) call<py::object>("deregister_memory", addr, bytes);
  }
  std::string add_peer(const std::string& blob) override {
    return call<std::string>("add_peer", blob);
  }
  void release_peer(const std::string& agent) override {
    if (Py_IsInitialized()) call<py::object>("release_peer", agent);
  }
  XferStatus write(const std::string& agent, const std::vector<Segment>& segs,
                   int64_t timeout_ns) override {
    return xfer("write", agent, segs, timeout_ns);
  }
  XferStatus read(const std::string& agent, const std::vector<Segment>& segs,
                  int64_t timeout_ns) override {
    return xfer("read", agent, segs, timeout_ns);
  }
  XferStatus write_notify(const std::string& agent, const std::vector<Segment>& segs,
                          const std::vector<nixl::Word>& words, int64_t timeout_ns) override {
    py::gil_scoped_acquire gil;
    py::list w;
    for (const nixl::Word& x : words) w.append(py::make_tuple(x.addr, x.value));
    return static_cast<XferStatus>(
        call_locked<int>("write_notify", agent, segment_list(segs), w, timeout_ns));
  }
  std::vector<nixl::Word> drain_notifs() override {
    if (!Py_IsInitialized()) return {};
    py::gil_scoped_acquire gil;
    std::vector<nixl::Word> out;
    for (py::handle t : call_locked<py::list>("drain_notifs")) {
      auto pair = t.cast<py::tuple>();
      out.push_back({pair[0].cast<uint64_t>(), pair[1].cast<uint64_t>()});
    }
    return out;
  }

 private:
  XferStatus xfer(const char* op, const std::string& agent, const std::vector<Segment>& segs,
                  int64_t timeout_ns) {
    py::gil_scoped_acquire gil;
    return static_cast<XferStatus>(call_locked<int>(op, agent, segment_list(segs), timeout_ns));
  }

  static py::list segment_list(const std::vector<Segment>& segs) {
    py::list l;
    for (const Segment& s : segs) {
      l.append(py::make_tuple(s.local, s.remote, s.bytes, kind_name(s.local_kind), s.local_device,
                              kind_name(s.remote_kind), s.remote_device));
    }
    return l;
  }

  template <typename R, typename... A>
  R call(const char* fn, A&&... args) {
    py::gil_scoped_acquire gil;
    return call_locked<R>(fn, std::forward<A>(args)...);
  }

  template <typename R, typename... A>
  R call_locked(const char* fn, A&&... args) {
    try {
      return obj_.attr(fn)(std::forward<A>(args)...).template cast<R>();
    } catch (py::error_already_set& e) {
      // A bad argument (a malformed blob) stays a ValueError, an unreachable peer a lost one;
      // anything else is the agent's.
      const ErrorKind kind = e.matches(PyExc_ValueError)        ? ErrorKind::kInvalidArgument
                             : e.matches(PyExc_ConnectionError) ? ErrorKind::kPeerLost
                                                                : ErrorKind::kSystem;
      const std::string what = py::str(e.value());
      e.restore();
      PyErr_Clear();
      MC_THROW(kind, "nixl engine ", fn, ": ", what);
    }
  }

  py::object obj_;
};

}  // namespace

void register_nixl(py::module_& m) {
  py::class_<nixl::NixlTransport, Transport, std::shared_ptr<nixl::NixlTransport>>(
      m, "NixlTransport", py::dynamic_attr())
      .def(py::init([](py::object engine, int64_t spin_ns, int64_t poll_ns, int64_t xfer_timeout_ns,
                       bool notify, int64_t max_poll_ns, bool borrow) {
             return std::make_shared<nixl::NixlTransport>(
                 std::make_shared<PyEngine>(std::move(engine)),
                 nixl::NixlOptions{spin_ns, poll_ns, xfer_timeout_ns, notify, max_poll_ns, borrow});
           }),
           py::arg("engine"), py::arg("spin_ns") = nixl::kDefaultSpinNs,
           py::arg("poll_ns") = nixl::kDefaultPollNs,
           py::arg("xfer_timeout_ns") = nixl::kDefaultXferTimeoutNs, py::arg("notify") = true,
           py::arg("max_poll_ns") = nixl::kDefaultMaxPollNs, py::arg("borrow") = true)
      .def("drain", &nixl::NixlTransport::drain, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("notify",
                             [](const nixl::NixlTransport& t) { return t.options().notify; })
      .def_property_readonly("agent_name", &nixl::NixlTransport::agent_name)
      .def("peers", &nixl::NixlTransport::peers)
      .def(
          "register_external",
          [](nixl::NixlTransport& t, uintptr_t addr, uint64_t bytes, const std::string& memory,
             int32_t device) {
            MC_CHECK(memory == "host" || memory == "cuda", "memory must be host or cuda, got '",
                     memory, "'");
            return t.register_external(
                addr, bytes, memory == "cuda" ? nixl::MemKind::kCuda : nixl::MemKind::kHost,
                device);
          },
          py::arg("address"), py::arg("bytes"), py::arg("memory") = "host", py::arg("device") = 0)
      .def("put_region", &nixl::NixlTransport::put_region, py::arg("dst"), py::arg("offset"),
           py::arg("src"), py::arg("src_offset"), py::arg("bytes"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("spin_ns",
                             [](const nixl::NixlTransport& t) { return t.options().spin_ns; })
      .def_property_readonly("max_poll_ns",
                             [](const nixl::NixlTransport& t) { return t.options().max_poll_ns; })
      .def_property_readonly("borrow",
                             [](const nixl::NixlTransport& t) { return t.options().borrow; })
      // (puts, bytes) sent in place from our own registered memory, with no staging copy.
      .def_property_readonly("zero_copy_stats", [](const nixl::NixlTransport& t) {
        const nixl::ZeroCopyStats z = t.zero_copy_stats();
        return py::make_tuple(z.puts, z.bytes);
      });
  m.attr("NIXL_XFER_DONE") = static_cast<int>(XferStatus::kDone);
  m.attr("NIXL_XFER_PEER_LOST") = static_cast<int>(XferStatus::kPeerLost);
  m.attr("NIXL_XFER_TIMEOUT") = static_cast<int>(XferStatus::kTimeout);
}

}  // namespace moecomm::bindings
