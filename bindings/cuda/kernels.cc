// moecomm._cuda: the device dispatch/combine and GPU-server launchers over the CUDA-IPC backend.
// Thin: device pointers and streams travel as Python ints, every check lives in the launchers
// (csrc/kernels/cuda/), which throw moecomm::Error; this file only converts and releases the GIL.
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "common/error.h"
#include "kernels/cuda/device_dispatch.h"
#include "kernels/cuda/dispatch_index.h"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/preload.h"
#include "registry.h"
#include "transport/cuda_ipc/ipc_transport.h"
#include "transport/device/wait_trace.h"

namespace py = pybind11;

namespace moecomm::bindings::cuda {
namespace {

namespace kc = moecomm::kernels::cuda;
using protocol::Encoding;

Encoding to_encoding(int v, const char* field) {
  MC_CHECK(protocol::encoding_known(static_cast<uint8_t>(v)), field,
           ": expected an Encoding value in [", int{protocol::kMinEncoding}, ", ",
           int{protocol::kMaxEncoding}, "], got ", v);
  return static_cast<Encoding>(v);
}

// A read-write property holding a device pointer, seen from Python as an int (0 = null).
template <typename C, typename P>
void pointer_property(py::class_<C>& cls, const char* name, P C::* field) {
  cls.def_property(
      name, [field](const C& c) { return reinterpret_cast<uintptr_t>(c.*field); },
      [field](C& c, uintptr_t v) { c.*field = reinterpret_cast<P>(v); });
}

template <typename C>
void encoding_property(py::class_<C>& cls, const char* name, Encoding C::* field) {
  cls.def_property(
      name, [field](const C& c) { return static_cast<int>(c.*field); },
      [field, name](C& c, int v) { c.*field = to_encoding(v, name); });
}

// The SlotConfig fields, flattened onto a config class (moecomm._C owns the SlotConfig type).
template <typename C>
void slot_properties(py::class_<C>& cls) {
  cls.def_property(
      "max_tokens", [](const C& c) { return c.slot.max_tokens; },
      [](C& c, uint32_t v) { c.slot.max_tokens = v; });
  cls.def_property(
      "hidden", [](const C& c) { return c.slot.hidden; },
      [](C& c, uint32_t v) { c.slot.hidden = v; });
  cls.def_property(
      "topk", [](const C& c) { return c.slot.topk; }, [](C& c, uint32_t v) { c.slot.topk = v; });
  cls.def_property(
      "encoding", [](const C& c) { return static_cast<int>(c.slot.encoding); },
      [](C& c, int v) { c.slot.encoding = to_encoding(v, "encoding"); });
  cls.def_property(
      "out_encoding", [](const C& c) { return static_cast<int>(c.slot.out_encoding); },
      [](C& c, int v) { c.slot.out_encoding = to_encoding(v, "out_encoding"); });
}

py::dict client_layout_dict(const kc::ClientConfig& c) {
  const kc::ClientWorkspaceLayout l = kc::client_workspace_layout(c.num_servers, c.slot);
  py::dict d;
  d["staging"] = l.staging;
  d["staging_stride"] = l.staging_stride;
  d["headers"] = l.headers;
  d["pos"] = l.pos;
  d["count"] = l.count;
  d["sent_seq"] = l.sent_seq;
  d["status"] = l.status;
  d["detail"] = l.detail;
  d["arrival_sent"] = l.arrival_sent;
  d["pending_seq"] = l.pending_seq;
  d["done_warps"] = l.done_warps;
  d["total"] = l.total;
  return d;
}

py::dict server_layout_dict(const kc::ServerConfig& c) {
  const kc::ServerWorkspaceLayout l = kc::server_workspace_layout(
      c.slot, c.num_clients, c.num_slots, c.max_step_tokens, c.num_experts);
  py::dict d;
  for (const auto& [name, value] : {std::pair<const char*, uint64_t>{"entries", l.entries},
                                    {"batch_offsets", l.batch_offsets},
                                    {"x", l.x},
                                    {"row_bytes", l.row_bytes},
                                    {"scales", l.scales},
                                    {"ids", l.ids},
                                    {"scores", l.scores},
                                    {"counts", l.counts},
                                    {"src_token", l.src_token},
                                    {"src_batch", l.src_batch},
                                    {"src_row", l.src_row},
                                    {"src_k", l.src_k},
                                    {"row_scores", l.row_scores},
                                    {"slot_of", l.slot_of},
                                    {"rows", l.rows},
                                    {"offsets", l.offsets},
                                    {"active", l.active},
                                    {"tile_counts", l.tile_counts},
                                    {"tile_offsets", l.tile_offsets},
                                    {"totals", l.totals},
                                    {"response", l.response},
                                    {"headers", l.headers},
                                    {"arrival_sent", l.arrival_sent},
                                    {"done_warps", l.done_warps},
                                    {"num_entries", l.num_entries},
                                    {"max_rows", l.max_rows},
                                    {"num_tiles", l.num_tiles},
                                    {"total", l.total}}) {
    d[name] = value;
  }
  return d;
}

void bind_configs(py::module_& m) {
  py::class_<kc::IpcPeers> peers(m, "IpcPeers", "CUDA-IPC peer table (device pointers as ints)");
  peers.def(py::init<>()).def_readwrite("max_peers", &kc::IpcPeers::max_peers);
  pointer_property(peers, "local_base", &kc::IpcPeers::local_base);
  pointer_property(peers, "peer_base", &kc::IpcPeers::peer_base);
  pointer_property(peers, "alive", &kc::IpcPeers::alive);
  pointer_property(peers, "wait_trace", &kc::IpcPeers::wait_trace);

  py::class_<kc::ClientConfig> cc(m, "ClientConfig", "a device client's connection settings");
  cc.def(py::init<>())
      .def_readwrite("num_servers", &kc::ClientConfig::num_servers)
      .def_readwrite("num_slots", &kc::ClientConfig::num_slots)
      .def_readwrite("client_id", &kc::ClientConfig::client_id);
  slot_properties(cc);
  pointer_property(cc, "request_ring_offset", &kc::ClientConfig::request_ring_offset);
  pointer_property(cc, "response_ring_offset", &kc::ClientConfig::response_ring_offset);

  py::class_<kc::DispatchArgs> da(m, "DispatchArgs", "one dispatch (device pointers as ints)");
  da.def(py::init<>())
      .def_readwrite("x_row_stride", &kc::DispatchArgs::x_row_stride)
      .def_readwrite("ids_int64", &kc::DispatchArgs::ids_int64)
      .def_readwrite("num_tokens", &kc::DispatchArgs::num_tokens)
      .def_readwrite("topk", &kc::DispatchArgs::topk)
      .def_readwrite("num_experts", &kc::DispatchArgs::num_experts)
      .def_readwrite("layer_id", &kc::DispatchArgs::layer_id)
      .def_readwrite("slot", &kc::DispatchArgs::slot);
  encoding_property(da, "x_dtype", &kc::DispatchArgs::x_dtype);
  encoding_property(da, "weights_dtype", &kc::DispatchArgs::weights_dtype);
  pointer_property(da, "x", &kc::DispatchArgs::x);
  pointer_property(da, "x_scales", &kc::DispatchArgs::x_scales);
  pointer_property(da, "topk_ids", &kc::DispatchArgs::topk_ids);
  pointer_property(da, "topk_weights", &kc::DispatchArgs::topk_weights);
  pointer_property(da, "expert_server", &kc::DispatchArgs::expert_server);
  pointer_property(da, "expert_local", &kc::DispatchArgs::expert_local);
  pointer_property(da, "next_seq", &kc::DispatchArgs::next_seq);
  pointer_property(da, "workspace", &kc::DispatchArgs::workspace);

  py::class_<kc::CombineArgs> ca(m, "CombineArgs", "one combine (device pointers as ints)");
  ca.def(py::init<>())
      .def_readwrite("num_tokens", &kc::CombineArgs::num_tokens)
      .def_readwrite("layer_id", &kc::CombineArgs::layer_id)
      .def_readwrite("slot", &kc::CombineArgs::slot)
      .def_readwrite("timeout_ns", &kc::CombineArgs::timeout_ns);
  encoding_property(ca, "out_dtype", &kc::CombineArgs::out_dtype);
  pointer_property(ca, "workspace", &kc::CombineArgs::workspace);
  pointer_property(ca, "out", &kc::CombineArgs::out);

  py::class_<kc::ServerConfig> sc(m, "ServerConfig", "a GPU expert server's step settings");
  sc.def(py::init<>())
      .def_readwrite("num_clients", &kc::ServerConfig::num_clients)
      .def_readwrite("num_slots", &kc::ServerConfig::num_slots)
      .def_readwrite("num_experts", &kc::ServerConfig::num_experts)
      .def_readwrite("max_step_tokens", &kc::ServerConfig::max_step_tokens);
  slot_properties(sc);
  pointer_property(sc, "client_ids", &kc::ServerConfig::client_ids);
  pointer_property(sc, "request_ring_offset", &kc::ServerConfig::request_ring_offset);
  pointer_property(sc, "response_ring_offset", &kc::ServerConfig::response_ring_offset);

  py::class_<kc::ServerGatherArgs> ga(m, "ServerGatherArgs", "one server gather");
  ga.def(py::init<>())
      .def_readwrite("layer_id", &kc::ServerGatherArgs::layer_id)
      .def_readwrite("num_layers", &kc::ServerGatherArgs::num_layers)
      .def_readwrite("arrival_timeout_ns", &kc::ServerGatherArgs::arrival_timeout_ns)
      .def_readwrite("block_m", &kc::ServerGatherArgs::block_m)
      .def_readwrite("draining", &kc::ServerGatherArgs::draining);
  pointer_property(ga, "layer_hosted", &kc::ServerGatherArgs::layer_hosted);
  pointer_property(ga, "workspace", &kc::ServerGatherArgs::workspace);

  py::class_<kc::ServerRespondArgs> ra(m, "ServerRespondArgs", "one server respond");
  ra.def(py::init<>());
  encoding_property(ra, "expert_out_dtype", &kc::ServerRespondArgs::expert_out_dtype);
  pointer_property(ra, "expert_out", &kc::ServerRespondArgs::expert_out);
  pointer_property(ra, "workspace", &kc::ServerRespondArgs::workspace);
}

// The debug trace's layout (transport/device/wait_trace.h), for the host decoder
// (moecomm.runtime.device_debug) and the test that checks it against its own copy.
py::dict wait_trace_layout() {
  namespace td = transport::device;
  py::dict fields;
  for (const auto& [name, offset] :
       {std::pair<const char*, size_t>{"index", offsetof(td::WaitRecord, index)},
        {"offset", offsetof(td::WaitRecord, offset)},
        {"mask", offsetof(td::WaitRecord, mask)},
        {"value", offsetof(td::WaitRecord, value)},
        {"observed", offsetof(td::WaitRecord, observed)},
        {"start_ns", offsetof(td::WaitRecord, start_ns)},
        {"elapsed_ns", offsetof(td::WaitRecord, elapsed_ns)},
        {"op", offsetof(td::WaitRecord, op)},
        {"status", offsetof(td::WaitRecord, status)},
        {"peer", offsetof(td::WaitRecord, peer)},
        {"site", offsetof(td::WaitRecord, site)},
        {"block", offsetof(td::WaitRecord, block)},
        {"thread", offsetof(td::WaitRecord, thread)}}) {
    fields[name] = offset;
  }
  py::dict sites;
  for (const auto& [name, site] :
       {std::pair<const char*, td::WaitSite>{"UNKNOWN", td::WaitSite::kUnknown},
        {"PROBE", td::WaitSite::kProbe},
        {"COMBINE_SIGNAL", td::WaitSite::kCombineSignal},
        {"COMBINE_ARRIVAL", td::WaitSite::kCombineArrival},
        {"GATHER_SIGNAL", td::WaitSite::kGatherSignal},
        {"GATHER_ARRIVAL", td::WaitSite::kGatherArrival}}) {
    sites[name] = static_cast<uint32_t>(site);
  }
  py::dict d;
  d["bytes"] = td::kWaitTraceBytes;
  d["header_bytes"] = sizeof(td::WaitTraceHeader);
  d["record_bytes"] = sizeof(td::WaitRecord);
  d["records"] = td::kWaitTraceRecords;
  d["next_offset"] = offsetof(td::WaitTraceHeader, next);
  d["fields"] = fields;
  d["sites"] = sites;
  d["op_at_least"] = td::kWaitOpAtLeast;
  return d;
}

}  // namespace

void register_kernels(py::module_& m) {
  bind_configs(m);
  m.attr("MAX_TOPK") = kc::kMaxTopk;
  py::dict status;
  status["OK"] = static_cast<int>(kc::ServerStatus::kOk);
  status["TIMEOUT"] = static_cast<int>(kc::ServerStatus::kTimeout);
  status["PEER_LOST"] = static_cast<int>(kc::ServerStatus::kPeerLost);
  status["NOT_SENT"] = static_cast<int>(kc::ServerStatus::kNotSent);
  status["OFFLINE"] = static_cast<int>(kc::ServerStatus::kOffline);
  status["BAD_HEADER"] = static_cast<int>(kc::ServerStatus::kBadHeader);
  status["REMOTE_ERROR"] = static_cast<int>(kc::ServerStatus::kRemoteError);
  status["MISMATCH"] = static_cast<int>(kc::ServerStatus::kMismatch);
  status["PAYLOAD_TIMEOUT"] = static_cast<int>(kc::ServerStatus::kPayloadTimeout);
  status["SLOT_BUSY"] = static_cast<int>(kc::ServerStatus::kSlotBusy);
  m.attr("SERVER_STATUS") = status;
  m.attr("WAIT_TRACE") = wait_trace_layout();
  m.attr("DEVICE_DEBUG_ENV") = kc::kDeviceDebugEnv;
  m.def("device_debug", &kc::device_debug_enabled,
        "whether the launchers run in the device debug mode (synchronize and check after every "
        "kernel); read once per process from MOECOMM_DEVICE_DEBUG");

  m.def(
      "preload_kernels",
      [](int device) {
        kc::PreloadReport r;
        {
          py::gil_scoped_release release;
          r = kc::preload_kernels(device);
        }
        py::dict d;
        d["device"] = r.device;
        d["functions"] = r.functions;
        d["loaded_now"] = r.loaded_now;
        d["seconds"] = r.seconds;
        d["how"] = r.how;
        return d;
      },
      py::arg("device") = -1,
      "loads every kernel of this module's device code on `device` (-1: the current one) now, "
      "instead of at its first launch; never synchronises the device. {device, functions, "
      "loaded_now, seconds, how}");
  m.def("release_deferred_frees", &moecomm::transport::cuda_ipc::release_dropped_regions,
        py::call_guard<py::gil_scoped_release>(),
        "frees the CUDA IPC regions dropped so far (their cudaFree synchronises the device, so "
        "they wait for a point where no device wait of this process spins); how many");
  m.def("client_workspace_layout", &client_layout_dict, py::arg("config"),
        "byte offsets of every part of one client workspace (one per micro-batch slot)");
  m.def("server_workspace_layout", &server_layout_dict, py::arg("config"),
        "byte offsets of every part of the server workspace");
  m.def(
      "client_dispatch",
      [](const kc::IpcPeers& peers, const kc::ClientConfig& cfg, const kc::DispatchArgs& args,
         uintptr_t stream) {
        kc::launch_client_dispatch(peers, cfg, args, reinterpret_cast<void*>(stream));
      },
      py::arg("peers"), py::arg("config"), py::arg("args"), py::arg("stream") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "enqueues route + pack + put on `stream` (a cudaStream_t as int); no synchronisation");
  m.def(
      "client_combine",
      [](const kc::IpcPeers& peers, const kc::ClientConfig& cfg, const kc::CombineArgs& args,
         uintptr_t stream) {
        kc::launch_client_combine(peers, cfg, args, reinterpret_cast<void*>(stream));
      },
      py::arg("peers"), py::arg("config"), py::arg("args"), py::arg("stream") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "enqueues wait + reduce on `stream`; per-server statuses land in the workspace");
  m.def(
      "server_gather",
      [](const kc::IpcPeers& peers, const kc::ServerConfig& cfg, const kc::ServerGatherArgs& args,
         uintptr_t stream) {
        kc::launch_server_gather(peers, cfg, args, reinterpret_cast<void*>(stream));
      },
      py::arg("peers"), py::arg("config"), py::arg("args"), py::arg("stream") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "enqueues poll + copy + reorganize + group-shrink on `stream`");
  m.def(
      "server_respond",
      [](const kc::IpcPeers& peers, const kc::ServerConfig& cfg, const kc::ServerRespondArgs& args,
         uintptr_t stream) {
        kc::launch_server_respond(peers, cfg, args, reinterpret_cast<void*>(stream));
      },
      py::arg("peers"), py::arg("config"), py::arg("args"), py::arg("stream") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "enqueues the per-token sums and the response puts on `stream`");
}

}  // namespace moecomm::bindings::cuda
