// The CUDA-IPC transport for Python. IpcTransport and IpcRegion derive from moecomm._C's
// Transport and Region, so slot I/O (moecomm._C.send_request, poll_requests, ...) takes them
// unchanged. Device addresses travel as ints. No CUDA call happens before the argument and
// device checks, so a machine without a GPU gets a Python exception, never a crash.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "kernels/cuda/device_dispatch.h"
#include "registry.h"
#include "transport/cuda_ipc/ipc_handle.h"
#include "transport/cuda_ipc/ipc_peer_table.h"
#include "transport/cuda_ipc/ipc_transport.h"
#include "transport/shm/process.h"

namespace py = pybind11;

namespace moecomm::bindings::cuda {

using namespace moecomm::transport;
using namespace moecomm::transport::cuda_ipc;

namespace {

py::dict handle_to_dict(const IpcHandle& h) {
  py::dict d;
  d["boot_id"] = h.boot_id;
  d["pid"] = h.pid;
  d["start_ticks"] = h.start_ticks;
  d["device_uuid"] = hex_encode(h.device_uuid.data(), h.device_uuid.size());
  d["bytes"] = h.bytes;
  d["mem_handle"] =
      py::bytes(reinterpret_cast<const char*>(h.mem_handle.data()), h.mem_handle.size());
  return d;
}

py::dict probe_to_dict(const ProbeResult& r) {
  py::dict d;
  d["status"] = static_cast<WaitStatus>(r.status);
  d["observed"] = r.observed;
  d["elapsed_ns"] = r.elapsed_ns;
  return d;
}

// The kernels' view of a table, straight from C++ (moecomm._cuda.IpcPeers).
kernels::cuda::IpcPeers kernel_peers(const IpcPeerTable& t) {
  const IpcBackend b = t.backend();
  kernels::cuda::IpcPeers p;
  p.local_base = b.local_base;
  p.peer_base = b.peer_base;
  p.alive = b.alive;
  p.max_peers = b.max_peers;
  return p;
}

py::dict backend_to_dict(const IpcBackend& b) {
  py::dict d;
  d["local_base"] = reinterpret_cast<uintptr_t>(b.local_base);
  d["peer_base"] = reinterpret_cast<uintptr_t>(b.peer_base);
  d["alive"] = reinterpret_cast<uintptr_t>(b.alive);
  d["max_peers"] = b.max_peers;
  return d;
}

}  // namespace

void register_ipc(py::module_& m) {
  // Transport, Region, WaitStatus and the exception translator live in moecomm._C.
  py::module_::import("moecomm._C");

  m.def("device_count", &cuda_ipc::device_count,
        "CUDA devices visible to this process (0 without a driver)");
  m.def("no_device_reason", &no_device_reason,
        "why device_count() is 0, or an empty string when a device is visible");
  m.def("node_boot_id", &node_boot_id, "this node's boot id, as cuda_ipc handles carry it");
  m.def(
      "parse_ipc_handle",
      [](const std::string& text) { return handle_to_dict(parse_handle(text)); }, py::arg("handle"),
      "fields of a cuda_ipc handle string; ValueError when malformed");
  m.def(
      "format_ipc_handle",
      [](const std::string& boot_id, int64_t pid, uint64_t start_ticks,
         const std::string& device_uuid, uint64_t bytes, const py::bytes& mem_handle) {
        const std::string raw = mem_handle;
        const std::string hex =
            hex_encode(reinterpret_cast<const uint8_t*>(raw.data()), raw.size());
        std::ostringstream os;
        os << kHandlePrefix << kHandleVersion << ':' << boot_id << ':' << pid << ':' << start_ticks
           << ':' << device_uuid << ':' << bytes << ':' << hex;
        // Through the parser, so a bad field is refused exactly as attach() would refuse it.
        return format_handle(parse_handle(os.str()));
      },
      py::arg("boot_id"), py::arg("pid"), py::arg("start_ticks"), py::arg("device_uuid"),
      py::arg("bytes"), py::arg("mem_handle"), "builds (and validates) a cuda_ipc handle string");
  m.def(
      "check_ipc_handle",
      [](const std::string& text) {
        return handle_to_dict(
            check_attachable(text, node_boot_id(), transport::shm::self_process().pid));
      },
      py::arg("handle"),
      "what attach() checks before any CUDA call: well formed, this node, another process, "
      "owner alive; returns the fields");
  m.attr("IPC_MEM_HANDLE_BYTES") = kMemHandleBytes;

  py::class_<IpcRegion, Region, std::shared_ptr<IpcRegion>>(m, "IpcRegion")
      .def_property_readonly(
          "device_ptr",
          [](const IpcRegion& r) { return reinterpret_cast<uintptr_t>(r.device_ptr()); })
      .def_property_readonly("device", &IpcRegion::device)
      .def_property_readonly("owner_pid", [](const IpcRegion& r) { return r.owner().pid; });

  py::class_<IpcTransport, Transport, std::shared_ptr<IpcTransport>>(m, "IpcTransport")
      .def(py::init<int>(), py::arg("device") = -1)
      .def_property_readonly("device", &IpcTransport::device)
      .def(
          "read",
          [](IpcTransport& t, Region& r, uint64_t offset, uint64_t nbytes) {
            std::string out(nbytes, '\0');
            {
              py::gil_scoped_release release;
              t.read(r, offset, out.data(), nbytes);
            }
            return py::bytes(out);
          },
          py::arg("region"), py::arg("offset"), py::arg("nbytes"),
          "copies bytes of a region (ours or a peer's) into a bytes object")
      .def(
          "write",
          [](IpcTransport& t, Region& r, uint64_t offset, const py::bytes& data) {
            const std::string raw = data;
            py::gil_scoped_release release;
            t.put(r, offset, raw.data(), raw.size());
          },
          py::arg("region"), py::arg("offset"), py::arg("data"), "put() from a bytes object");

  py::enum_<PeerState>(m, "PeerState")
      .value("FREE", PeerState::kFree)
      .value("ACTIVE", PeerState::kActive)
      .value("DEAD", PeerState::kDead)
      .value("RETIRING", PeerState::kRetiring);

  py::class_<DeviceWaitProbe>(m, "DeviceWaitProbe")
      .def("done", &DeviceWaitProbe::done)
      .def("result", [](DeviceWaitProbe& p) {
        ProbeResult r;
        {
          py::gil_scoped_release release;
          r = p.result();
        }
        return probe_to_dict(r);
      });

  // Table writes release the GIL: they synchronise a stream, and a watchdog thread's mark_dead
  // must not wait for the thread that holds the GIL.
  using NoGil = py::call_guard<py::gil_scoped_release>;
  py::class_<IpcPeerTable>(m, "IpcPeerTable")
      .def(py::init<std::shared_ptr<IpcTransport>, std::shared_ptr<Region>, uint32_t,
                    std::vector<uintptr_t>>(),
           py::arg("transport"), py::arg("local"), py::arg("max_peers"),
           py::arg("streams") = std::vector<uintptr_t>{},
           "`streams`: the cudaStream_t values (ints) the kernels using this table run on; "
           "remove_peer's default")
      .def("add_peer", &IpcPeerTable::add_peer, py::arg("handle"), NoGil())
      .def(
          "remove_peer",
          [](IpcPeerTable& t, uint32_t index, const std::optional<std::vector<uintptr_t>>& s) {
            t.remove_peer(index, s.value_or(std::vector<uintptr_t>{}));
          },
          py::arg("index"), py::arg("streams") = py::none(), NoGil(),
          "alive = 0 now; the mapping closes once the work queued on every stream of `streams` "
          "(default: the table's kernel streams) is done")
      .def("mark_dead", &IpcPeerTable::mark_dead, py::arg("index"), NoGil())
      .def("collect", &IpcPeerTable::collect, NoGil())
      .def("state", &IpcPeerTable::state, py::arg("index"))
      .def("peer_region", &IpcPeerTable::peer_region, py::arg("index"))
      .def_property_readonly("max_peers", &IpcPeerTable::max_peers)
      .def_property_readonly("active_peers", &IpcPeerTable::active_peers)
      .def_property_readonly("streams", &IpcPeerTable::kernel_streams)
      .def("kernel_peers", &kernel_peers,
           "the kernels' view (IpcPeers) of this table, for client_dispatch and friends")
      .def("backend", [](const IpcPeerTable& t) { return backend_to_dict(t.backend()); })
      .def(
          "launch_wait",
          [](const IpcPeerTable& t, uint64_t offset, WaitOp op, uint64_t value, uint64_t mask,
             int64_t timeout_ns, uint32_t peer) {
            return std::make_unique<DeviceWaitProbe>(t, offset, WaitPredicate{op, mask, value},
                                                     timeout_ns, peer);
          },
          py::arg("offset"), py::arg("op"), py::arg("value"), py::arg("mask") = ~uint64_t{0},
          py::arg("timeout_ns"), py::arg("peer"),
          "starts a one-thread kernel running device wait_word on our region; returns a probe")
      .def(
          "put_signal",
          [](const IpcPeerTable& t, uint32_t peer, uint64_t offset, const py::bytes& data,
             uint64_t sig_offset, uint64_t value, SignalOp op) {
            const std::string raw = data;
            py::gil_scoped_release release;
            device_put_signal(t, peer, offset, raw.data(), raw.size(), sig_offset, value, op);
          },
          py::arg("peer"), py::arg("offset"), py::arg("data"), py::arg("sig_offset"),
          py::arg("value"), py::arg("op") = SignalOp::kSet,
          "one warp of the device put_signal_warp path into peer `peer`");
}

}  // namespace moecomm::bindings::cuda
