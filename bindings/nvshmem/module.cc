// moecomm._nvshmem: the NVSHMEM transport's host side for Python. Bootstrap by unique id (no
// MPI: rank 0's id travels over moecomm's control plane), symmetric regions, the peer table
// behind NvshmemBackend, device probes, and the device data path's launchers over this backend
// (the config and argument classes are moecomm._cuda's). Arguments are checked before any CUDA
// or NVSHMEM call, and every call needs a device first, so a machine without a GPU gets a Python
// exception, never a crash.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "../error_map.h"
#include "common/error.h"
#include "kernels/cuda/device_dispatch.h"
#include "transport/nvshmem/nvshmem_runtime.h"

namespace py = pybind11;

using namespace moecomm::transport;
namespace nv = moecomm::transport::nvshmem;
namespace kc = moecomm::kernels::cuda;

namespace {

using NoGil = py::call_guard<py::gil_scoped_release>;

// The kernels' view of a table, straight from C++.
kc::NvshmemPeers kernel_peers(const nv::NvshmemPeerTable& t) {
  const nv::NvshmemBackend b = t.backend();
  kc::NvshmemPeers p;
  p.local_base = b.local_base;
  p.peer_pe = b.peer_pe;
  p.alive = b.alive;
  p.max_peers = b.max_peers;
  return p;
}

template <typename P>
void pointer_property(py::class_<kc::NvshmemPeers>& cls, const char* name,
                      P kc::NvshmemPeers::* field) {
  cls.def_property(
      name, [field](const kc::NvshmemPeers& c) { return reinterpret_cast<uintptr_t>(c.*field); },
      [field](kc::NvshmemPeers& c, uintptr_t v) { c.*field = reinterpret_cast<P>(v); });
}

// The four launchers, as moecomm._cuda binds their CUDA-IPC twins: stream = cudaStream_t as int.
template <typename Cfg, typename Args>
void bind_launcher(py::module_& m, const char* name,
                   void (*launch)(const kc::NvshmemPeers&, const Cfg&, const Args&, void*),
                   const char* doc) {
  m.def(
      name,
      [launch](const kc::NvshmemPeers& peers, const Cfg& cfg, const Args& args, uintptr_t stream) {
        launch(peers, cfg, args, reinterpret_cast<void*>(stream));
      },
      py::arg("peers"), py::arg("config"), py::arg("args"), py::arg("stream") = 0, NoGil(), doc);
}

void register_kernels(py::module_& m) {
  py::class_<kc::NvshmemPeers> peers(m, "NvshmemPeers",
                                     "NVSHMEM peer table as the kernels see it (pointers as ints)");
  peers.def(py::init<>()).def_readwrite("max_peers", &kc::NvshmemPeers::max_peers);
  pointer_property(peers, "local_base", &kc::NvshmemPeers::local_base);
  pointer_property(peers, "peer_pe", &kc::NvshmemPeers::peer_pe);
  pointer_property(peers, "alive", &kc::NvshmemPeers::alive);
  pointer_property(peers, "wait_trace", &kc::NvshmemPeers::wait_trace);
  bind_launcher<kc::ClientConfig, kc::DispatchArgs>(
      m, "client_dispatch", &kc::launch_client_dispatch,
      "enqueues route + pack + put on `stream`; args.workspace must be symmetric");
  bind_launcher<kc::ClientConfig, kc::CombineArgs>(
      m, "client_combine", &kc::launch_client_combine,
      "enqueues wait + reduce on `stream`; per-server statuses land in the workspace");
  bind_launcher<kc::ServerConfig, kc::ServerGatherArgs>(
      m, "server_gather", &kc::launch_server_gather,
      "enqueues poll + copy + reorganize + group-shrink on `stream`");
  bind_launcher<kc::ServerConfig, kc::ServerRespondArgs>(
      m, "server_respond", &kc::launch_server_respond,
      "enqueues the per-token sums and the response puts; args.workspace must be symmetric");
}

}  // namespace

PYBIND11_MODULE(_nvshmem, m) {
  m.doc() = "moecomm NVSHMEM transport: unique-id bootstrap, symmetric regions, peer table";
  // WaitStatus, SignalOp, WaitOp and the exception classes live in moecomm._C; ClientConfig,
  // DispatchArgs and the other launcher arguments in moecomm._cuda (shared pybind11 types).
  py::module_::import("moecomm._C");
  py::module_::import("moecomm._cuda");
  moecomm::bindings::register_local_error_translator();
  register_kernels(m);

  m.attr("IBGDA_RC_PER_PE") = nv::kIbgdaRcPerPe;
  m.attr("QP_DEPTH") = nv::kQpDepth;
  m.def("transport_env_defaults", &nv::transport_env_defaults,
        "the NVSHMEM_* settings get_unique_id/init would add now: [(name, value)] (none the user "
        "set; none under MOECOMM_NVSHMEM_IBGDA=0)");
  m.def(
      "is_symmetric",
      [](uintptr_t ptr, uint64_t bytes) {
        return nv::is_symmetric(reinterpret_cast<const void*>(ptr), bytes);
      },
      py::arg("ptr"), py::arg("bytes"),
      "whether [ptr, ptr + bytes) lies in one live NvshmemRegion (a valid put source)");

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
      // Table writes synchronise the table's own stream: release the GIL so a watchdog
      // thread's mark_dead never waits for another Python thread.
      .def("set_peer", &nv::NvshmemPeerTable::set_peer, py::arg("index"), py::arg("pe"), NoGil())
      .def("mark_dead", &nv::NvshmemPeerTable::mark_dead, py::arg("index"), NoGil())
      .def("alive", &nv::NvshmemPeerTable::alive, py::arg("index"))
      .def("pe", &nv::NvshmemPeerTable::pe, py::arg("index"))
      .def_property_readonly("max_peers", &nv::NvshmemPeerTable::max_peers)
      .def("kernel_peers", &kernel_peers,
           "the kernels' view (NvshmemPeers) of this table, for client_dispatch and friends")
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
