// Slot I/O over a transport. Addresses of host buffers arrive as integers; the Python API has
// already checked dtype, shape and contiguity of the tensors they come from.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "common/error.h"
#include "registry.h"
#include "transport/slot_io.h"

namespace py = pybind11;

namespace moecomm::bindings {

using namespace moecomm::slots;

namespace {

template <typename T>
const T* ptr(uintptr_t address) {
  return reinterpret_cast<const T*>(address);
}

}  // namespace

void register_slots(py::module_& m) {
  py::enum_<WaitStatus>(m, "WaitStatus")
      .value("OK", WaitStatus::kOk)
      .value("TIMEOUT", WaitStatus::kTimeout)
      .value("PEER_LOST", WaitStatus::kPeerLost);

  py::class_<SlotRing>(m, "SlotRing")
      .def(py::init([](const SlotConfig& c, uint32_t num_slots, bool request, bool poison) {
             MC_CHECK(num_slots >= 1, "a slot ring needs at least one slot");
             return SlotRing{c, num_slots, request, poison};
           }),
           py::arg("config"), py::arg("num_slots"), py::arg("request"), py::arg("poison") = false)
      .def_readonly("config", &SlotRing::config)
      .def_readonly("num_slots", &SlotRing::num_slots)
      .def_readonly("request", &SlotRing::request)
      .def_readonly("poison", &SlotRing::poison)
      .def_property_readonly("slot_bytes", &SlotRing::slot_bytes)
      .def_property_readonly("region_bytes", &SlotRing::region_bytes)
      .def("slot_offset", &SlotRing::slot_offset, py::arg("slot"));

  py::class_<Incoming>(m, "Incoming")
      .def_readonly("slot", &Incoming::slot)
      .def_readonly("seq", &Incoming::seq)
      .def_readonly("offline", &Incoming::offline)
      .def_readonly("header", &Incoming::header)
      .def_readonly("code", &Incoming::code)
      .def_readonly("payload_offset", &Incoming::payload_offset)
      .def_property_readonly("act_offset", [](const Incoming& i) { return i.layout.act_offset; })
      .def_property_readonly("scale_offset",
                             [](const Incoming& i) { return i.layout.scale_offset; })
      .def_property_readonly("ids_offset", [](const Incoming& i) { return i.layout.ids_offset; })
      .def_property_readonly("scores_offset",
                             [](const Incoming& i) { return i.layout.scores_offset; });

  py::class_<Outcome>(m, "Outcome")
      .def_readonly("status", &Outcome::status)
      .def_readonly("offline", &Outcome::offline)
      .def_readonly("payload_late", &Outcome::payload_late)
      .def_readonly("word", &Outcome::word)
      .def_readonly("stale_dropped", &Outcome::stale_dropped)
      .def_readonly("header", &Outcome::header)
      .def_readonly("code", &Outcome::code)
      .def_readonly("payload_offset", &Outcome::payload_offset);

  m.def(
      "send_request",
      [](Transport& t, Region& server, const SlotRing& ring, uint32_t slot, uint64_t client_id,
         uint64_t seq, uint32_t layer_id, uint32_t num_tokens, uint32_t topk, Encoding encoding,
         uintptr_t activations, uintptr_t scales, uintptr_t expert_ids, uintptr_t scores,
         std::shared_ptr<Region> doorbell, bool wake) {
        RequestData r{layer_id,
                      num_tokens,
                      topk,
                      encoding,
                      ptr<void>(activations),
                      ptr<float>(scales),
                      ptr<int32_t>(expert_ids),
                      ptr<float>(scores)};
        send_request(t, server, ring, slot, client_id, seq, r, doorbell.get(), wake);
      },
      py::arg("transport"), py::arg("server"), py::arg("ring"), py::arg("slot"),
      py::arg("client_id"), py::arg("seq"), py::arg("layer_id"), py::arg("num_tokens"),
      py::arg("topk"), py::arg("encoding"), py::arg("activations"), py::arg("scales"),
      py::arg("expert_ids"), py::arg("scores"), py::arg("doorbell") = nullptr,
      py::arg("wake") = true, py::call_guard<py::gil_scoped_release>());

  m.def(
      "commit_request",
      [](Transport& t, Region& server, const SlotRing& ring, uint32_t slot, uint64_t client_id,
         uint64_t seq, uint32_t layer_id, uint32_t num_tokens, uint32_t topk, Encoding encoding,
         std::shared_ptr<Region> doorbell, bool wake) {
        commit_request(t, server, ring, slot, client_id, seq,
                       {layer_id, num_tokens, topk, encoding}, doorbell.get(), wake);
      },
      py::arg("transport"), py::arg("server"), py::arg("ring"), py::arg("slot"),
      py::arg("client_id"), py::arg("seq"), py::arg("layer_id"), py::arg("num_tokens"),
      py::arg("topk"), py::arg("encoding"), py::arg("doorbell") = nullptr, py::arg("wake") = true,
      py::call_guard<py::gil_scoped_release>());

  m.def("ring_doorbell", &ring_doorbell, py::arg("transport"), py::arg("doorbell"),
        py::call_guard<py::gil_scoped_release>());

  m.def("poll_requests", &poll_requests, py::arg("transport"), py::arg("local"), py::arg("ring"),
        py::arg("client_id"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "wait_doorbell",
      [](Transport& t, Region& local, uint64_t seen, int64_t timeout_ns,
         std::shared_ptr<Region> peer) {
        transport::WaitResult r;
        {
          py::gil_scoped_release release;
          r = wait_doorbell(t, local, seen, timeout_ns, peer.get());
        }
        return py::make_tuple(r.status, r.value);
      },
      py::arg("transport"), py::arg("local"), py::arg("seen"), py::arg("timeout_ns"),
      py::arg("peer") = nullptr);

  m.def(
      "send_response",
      [](Transport& t, Region& local, const SlotRing& request_ring, Region& client,
         const SlotRing& response_ring, uint32_t slot, uint64_t client_id, uint64_t seq,
         uint32_t layer_id, uint32_t num_tokens, Encoding encoding, uintptr_t activations) {
        send_response(t, local, request_ring, client, response_ring, slot, client_id, seq, layer_id,
                      num_tokens, encoding, ptr<void>(activations));
      },
      py::arg("transport"), py::arg("local"), py::arg("request_ring"), py::arg("client"),
      py::arg("response_ring"), py::arg("slot"), py::arg("client_id"), py::arg("seq"),
      py::arg("layer_id"), py::arg("num_tokens"), py::arg("encoding"), py::arg("activations"),
      py::call_guard<py::gil_scoped_release>());

  m.def("commit_response", &commit_response, py::arg("transport"), py::arg("local"),
        py::arg("request_ring"), py::arg("client"), py::arg("response_ring"), py::arg("slot"),
        py::arg("client_id"), py::arg("seq"), py::arg("layer_id"), py::arg("num_tokens"),
        py::arg("encoding"), py::call_guard<py::gil_scoped_release>());

  m.def("send_error", &send_error, py::arg("transport"), py::arg("local"), py::arg("request_ring"),
        py::arg("client"), py::arg("response_ring"), py::arg("slot"), py::arg("client_id"),
        py::arg("seq"), py::arg("layer_id"), py::arg("status"), py::arg("reason"),
        py::call_guard<py::gil_scoped_release>());

  m.def("release_response", &release_response, py::arg("transport"), py::arg("local"),
        py::arg("ring"), py::arg("slot"), py::arg("payload_bytes"),
        py::call_guard<py::gil_scoped_release>());

  m.def("mark_offline", &mark_offline, py::arg("transport"), py::arg("local"), py::arg("ring"),
        py::arg("slot"), py::arg("seq"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "send_stage",
      [](Transport& t, Region& receiver, const SlotRing& ring, uint32_t slot, uint64_t client_id,
         uint64_t seq, uint32_t tag, uint32_t chunk, uint32_t num_chunks, Encoding encoding,
         uintptr_t bytes, uint64_t num_bytes, std::shared_ptr<Region> doorbell, bool wake) {
        StageChunk c{tag, chunk, num_chunks, encoding, ptr<void>(bytes), num_bytes};
        send_stage(t, receiver, ring, slot, client_id, seq, c, doorbell.get(), wake);
      },
      py::arg("transport"), py::arg("receiver"), py::arg("ring"), py::arg("slot"),
      py::arg("client_id"), py::arg("seq"), py::arg("tag"), py::arg("chunk"), py::arg("num_chunks"),
      py::arg("encoding"), py::arg("bytes"), py::arg("num_bytes"), py::arg("doorbell") = nullptr,
      py::arg("wake") = true, py::call_guard<py::gil_scoped_release>());

  m.def("poll_stage", &poll_stage, py::arg("transport"), py::arg("local"), py::arg("ring"),
        py::arg("client_id"), py::call_guard<py::gil_scoped_release>());

  m.def("send_stage_ack", &send_stage_ack, py::arg("transport"), py::arg("local"),
        py::arg("data_ring"), py::arg("sender"), py::arg("ack_ring"), py::arg("slot"),
        py::arg("client_id"), py::arg("seq"), py::arg("chunk"), py::arg("status"),
        py::arg("reason"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "wait_stage_ack",
      [](Transport& t, Region& local, const SlotRing& ring, uint32_t slot, uint64_t client_id,
         uint64_t seq, int64_t timeout_ns, std::shared_ptr<Region> peer) {
        return wait_stage_ack(t, local, ring, slot, client_id, seq, timeout_ns, peer.get());
      },
      py::arg("transport"), py::arg("local"), py::arg("ring"), py::arg("slot"),
      py::arg("client_id"), py::arg("seq"), py::arg("timeout_ns"), py::arg("peer") = nullptr,
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "wait_any_response",
      [](Transport& t, const std::vector<std::shared_ptr<Region>>& locals,
         const std::vector<const SlotRing*>& rings, const std::vector<uint32_t>& slots,
         const std::vector<uint64_t>& seqs, const std::vector<std::shared_ptr<Region>>& peers,
         uint64_t client_id, int64_t timeout_ns) {
        const size_t n = locals.size();
        MC_CHECK(rings.size() == n && slots.size() == n && seqs.size() == n && peers.size() == n,
                 "wait_any_response: locals, rings, slots, seqs and peers differ in length");
        std::vector<AnswerWait> waits(n);
        for (size_t i = 0; i < n; ++i) {
          MC_CHECK(locals[i] != nullptr && rings[i] != nullptr, "wait_any_response: wait ", i,
                   " has no region or ring");
          waits[i] = {locals[i].get(), rings[i], slots[i], seqs[i], peers[i].get()};
        }
        const AnyOutcome out = wait_any_response(t, waits, client_id, timeout_ns);
        return std::make_pair(out.index, out.outcome);
      },
      py::arg("transport"), py::arg("locals"), py::arg("rings"), py::arg("slots"), py::arg("seqs"),
      py::arg("peers"), py::arg("client_id"), py::arg("timeout_ns"),
      py::call_guard<py::gil_scoped_release>(),
      "The first of several answers to come, or the first whose server died: (index, outcome);"
      " index -1 when the deadline passed first.");

  m.def(
      "wait_response",
      [](Transport& t, Region& local, const SlotRing& ring, uint32_t slot, uint64_t client_id,
         uint64_t seq, int64_t timeout_ns, std::shared_ptr<Region> peer) {
        return wait_response(t, local, ring, slot, client_id, seq, timeout_ns, peer.get());
      },
      py::arg("transport"), py::arg("local"), py::arg("ring"), py::arg("slot"),
      py::arg("client_id"), py::arg("seq"), py::arg("timeout_ns"), py::arg("peer") = nullptr,
      py::call_guard<py::gil_scoped_release>());
}

}  // namespace moecomm::bindings
