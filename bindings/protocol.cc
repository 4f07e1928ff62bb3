// The wire format, exposed for the Python API and for tests (layout, signal words, headers,
// validation). No logic here: everything forwards to csrc/protocol.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>

#include "common/error.h"
#include "common/guarded_buffer.h"
#include "protocol/header.h"
#include "protocol/layout.h"
#include "protocol/signal.h"
#include "protocol/validate.h"
#include "registry.h"

namespace py = pybind11;

namespace moecomm::bindings {

using namespace moecomm::protocol;

namespace {

SlotHeader header_from_bytes(const py::bytes& b) {
  const std::string s = b;
  MC_CHECK(s.size() == sizeof(SlotHeader), "a header is ", sizeof(SlotHeader), " bytes, got ",
           s.size());
  SlotHeader h;
  std::memcpy(&h, s.data(), sizeof(h));
  return h;
}

py::dict layout_dict(const PayloadLayout& p) {
  py::dict d;
  d["act_offset"] = p.act_offset;
  d["act_bytes"] = p.act_bytes;
  d["scale_offset"] = p.scale_offset;
  d["scale_bytes"] = p.scale_bytes;
  d["ids_offset"] = p.ids_offset;
  d["ids_bytes"] = p.ids_bytes;
  d["scores_offset"] = p.scores_offset;
  d["scores_bytes"] = p.scores_bytes;
  d["total"] = p.total;
  return d;
}

}  // namespace

void register_protocol(py::module_& m) {
  py::enum_<SlotState>(m, "SlotState")
      .value("IDLE", SlotState::kIdle)
      .value("REQUEST_READY", SlotState::kRequestReady)
      .value("RESPONSE_READY", SlotState::kResponseReady)
      .value("OFFLINE", SlotState::kOffline);
  py::enum_<Encoding>(m, "Encoding")
      .value("BF16", Encoding::kBF16)
      .value("FP16", Encoding::kFP16)
      .value("F32", Encoding::kF32)
      .value("INT8", Encoding::kInt8)
      .value("FP8_E4M3", Encoding::kFP8E4M3)
      .value("FP8_E4M3_B128", Encoding::kFP8E4M3B128);
  py::enum_<MessageKind>(m, "MessageKind")
      .value("REQUEST", MessageKind::kRequest)
      .value("RESPONSE", MessageKind::kResponse)
      .value("STAGE", MessageKind::kStage);
  py::enum_<ResponseStatus>(m, "ResponseStatus")
      .value("OK", ResponseStatus::kOk)
      .value("UNKNOWN_LAYER", ResponseStatus::kUnknownLayer)
      .value("UNKNOWN_EXPERT", ResponseStatus::kUnknownExpert)
      .value("SERVER_ERROR", ResponseStatus::kServerError)
      .value("DRAINING", ResponseStatus::kDraining)
      .value("STALE_MAP", ResponseStatus::kStaleMap);
  py::enum_<ValidateCode>(m, "ValidateCode")
      .value("OK", ValidateCode::kOk)
      .value("SLOT_TOO_SMALL", ValidateCode::kSlotTooSmall)
      .value("BAD_MAGIC", ValidateCode::kBadMagic)
      .value("BAD_VERSION", ValidateCode::kBadVersion)
      .value("BAD_KIND", ValidateCode::kBadKind)
      .value("BAD_ENCODING", ValidateCode::kBadEncoding)
      .value("QUANTIZED_RESPONSE", ValidateCode::kQuantizedResponse)
      .value("ZERO_TOKENS", ValidateCode::kZeroTokens)
      .value("TOO_MANY_TOKENS", ValidateCode::kTooManyTokens)
      .value("HIDDEN_MISMATCH", ValidateCode::kHiddenMismatch)
      .value("BAD_TOPK", ValidateCode::kBadTopk)
      .value("PAYLOAD_SIZE_MISMATCH", ValidateCode::kPayloadSizeMismatch)
      .value("PAYLOAD_EXCEEDS_SLOT", ValidateCode::kPayloadExceedsSlot)
      .value("CLIENT_MISMATCH", ValidateCode::kClientMismatch)
      .value("SEQ_MISMATCH", ValidateCode::kSeqMismatch)
      .value("BAD_STATUS", ValidateCode::kBadStatus)
      .value("RESERVED_NONZERO", ValidateCode::kReservedNonzero)
      .value("BAD_ARRIVAL_TARGET", ValidateCode::kBadArrivalTarget);
  m.def("validate_reason", [](ValidateCode c) { return std::string(validate_reason(c)); });

  m.attr("MAGIC") = kMagic;
  m.attr("VERSION") = kVersion;
  m.attr("MAX_SEQ") = kMaxSeq;
  m.attr("SCALE_BLOCK") = kScaleBlock;
  m.attr("SLOT_ALIGN") = kSlotAlign;
  m.attr("HEADER_OFFSET") = kHeaderOffset;
  m.attr("HEADER_BYTES") = sizeof(SlotHeader);
  m.attr("PAYLOAD_OFFSET") = kPayloadOffset;
  m.attr("DOORBELL_BYTES") = kDoorbellBytes;
  m.attr("ARRIVAL_OFFSET") = kArrivalOffset;

  m.def("make_signal", &make_signal, py::arg("state"), py::arg("seq"));
  m.def("signal_state", [](uint64_t w) {
    MC_CHECK(signal_state_known(w), "signal word ", w, " has unknown state ", (w & kStateMask));
    return signal_state(w);
  });
  m.def("signal_seq", &signal_seq);
  m.def("encoding_elem_bytes", &encoding_elem_bytes);
  m.def("encoding_scales_per_token", &encoding_scales_per_token);
  m.def("encoding_quantized", &encoding_quantized);

  py::class_<SlotConfig>(m, "SlotConfig")
      .def(py::init([](uint32_t max_tokens, uint32_t hidden, uint32_t topk, Encoding enc,
                       Encoding out_enc, uint32_t max_response_tokens) {
             MC_CHECK(max_tokens >= 1, "max_tokens must be >= 1, got ", max_tokens);
             MC_CHECK(hidden >= 1, "hidden must be >= 1, got ", hidden);
             MC_CHECK(topk >= 1, "topk must be >= 1, got ", topk);
             MC_CHECK(!encoding_quantized(out_enc), "the response encoding cannot be quantized");
             return SlotConfig{max_tokens, hidden, topk, enc, out_enc, max_response_tokens};
           }),
           py::arg("max_tokens"), py::arg("hidden"), py::arg("topk"),
           py::arg("encoding") = Encoding::kBF16, py::arg("out_encoding") = Encoding::kBF16,
           py::arg("max_response_tokens") = 0)
      .def_readonly("max_tokens", &SlotConfig::max_tokens)
      .def_property_readonly("max_response_tokens",
                             [](const SlotConfig& c) { return response_max_tokens(c); })
      .def_readonly("hidden", &SlotConfig::hidden)
      .def_readonly("topk", &SlotConfig::topk)
      .def_readonly("encoding", &SlotConfig::encoding)
      .def_readonly("out_encoding", &SlotConfig::out_encoding)
      .def_property_readonly("request_slot_bytes",
                             [](const SlotConfig& c) { return request_slot_bytes(c); })
      .def_property_readonly("response_slot_bytes",
                             [](const SlotConfig& c) { return response_slot_bytes(c); });

  m.def("request_payload_layout", [](uint64_t t, uint64_t h, uint64_t k, Encoding e) {
    return layout_dict(request_payload_layout(t, h, k, e));
  });
  m.def("response_payload_layout", [](uint64_t t, uint64_t h, Encoding e) {
    return layout_dict(response_payload_layout(t, h, e));
  });
  m.def("slot_offset", &slot_offset);
  m.def("region_bytes", &region_bytes);
  m.def(
      "stamp_message",
      [](uint64_t arrival_sent, uint64_t payload_bytes, uint64_t bytes_put, bool peer_alive) {
        const MessageStamp s = stamp_message(arrival_sent, payload_bytes, bytes_put, peer_alive);
        py::dict d;
        d["put_header"] = s.put_header;
        d["arrival_sent"] = s.arrival_sent;
        d["arrival_target"] = s.arrival_target;
        return d;
      },
      py::arg("arrival_sent"), py::arg("payload_bytes"), py::arg("bytes_put"),
      py::arg("peer_alive"),
      "a device writer's decision for one chunked message (layout.h): whether its header goes "
      "out, the writer's new arrival total and the header's arrival_target; what the kernels' "
      "finish_message runs, for host stand-ins of a device writer");

  py::class_<SlotHeader>(m, "SlotHeader")
      .def(py::init([]() {
        SlotHeader h{};
        h.magic = kMagic;
        h.version = kVersion;
        return h;
      }))
      .def_readwrite("magic", &SlotHeader::magic)
      .def_readwrite("version", &SlotHeader::version)
      .def_readwrite("kind", &SlotHeader::kind)
      .def_readwrite("encoding", &SlotHeader::encoding)
      .def_readwrite("layer_id", &SlotHeader::layer_id)
      .def_readwrite("num_tokens", &SlotHeader::num_tokens)
      .def_readwrite("hidden", &SlotHeader::hidden)
      .def_readwrite("topk", &SlotHeader::topk)
      .def_readwrite("payload_bytes", &SlotHeader::payload_bytes)
      .def_readwrite("client_id", &SlotHeader::client_id)
      .def_readwrite("seq", &SlotHeader::seq)
      .def_readwrite("status", &SlotHeader::status)
      .def_readwrite("reserved0", &SlotHeader::reserved0)
      .def_readwrite("arrival_target", &SlotHeader::arrival_target)
      .def("to_bytes",
           [](const SlotHeader& h) {
             return py::bytes(reinterpret_cast<const char*>(&h), sizeof(h));
           })
      .def_static("from_bytes", &header_from_bytes);

  py::class_<Expectation>(m, "Expectation")
      .def(py::init([](MessageKind kind, const SlotConfig& c, uint64_t slot_bytes,
                       uint64_t client_id, uint64_t seq, bool stage_ack) {
             return Expectation{kind, c, slot_bytes, client_id, seq, stage_ack};
           }),
           py::arg("kind"), py::arg("config"), py::arg("slot_bytes"), py::arg("client_id"),
           py::arg("seq"), py::arg("stage_ack") = false);

  m.def("validate_header",
        [](const SlotHeader& h, const Expectation& e) { return validate_header(h, e); });
  // Validates a slot image placed so that its last byte precedes an unmapped page: an
  // out-of-bounds read by the parser crashes instead of passing silently.
  m.def("validate_slot_guarded", [](const py::bytes& slot, Expectation e) {
    const std::string s = slot;
    GuardedBuffer buf(s.size());
    std::memcpy(buf.data(), s.data(), s.size());
    e.slot_bytes = s.size();
    SlotHeader out{};
    return read_and_validate(buf.data(), e, &out);
  });
}

}  // namespace moecomm::bindings
