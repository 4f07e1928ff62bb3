// The writing half of the slot protocol (slot_io.h): requests, answers, errors, releases; the
// reading half (polls, waits, the arrival counter) is in slot_read.cc.
#include "transport/slot_io.h"

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "protocol/poison.h"

namespace moecomm::slots {

using protocol::kHeaderOffset;
using protocol::kPayloadOffset;
using protocol::kSignalOffset;
using protocol::make_signal;
using protocol::MessageKind;
using protocol::signal_seq;
using protocol::signal_state;
using protocol::SlotState;
using transport::SignalOp;
using transport::WaitOp;
using transport::WaitPredicate;

namespace {

constexpr uint64_t kDoorbellOffset = 0;

SlotHeader make_header(MessageKind kind, const SlotConfig& c, uint32_t layer_id,
                       uint32_t num_tokens, uint32_t topk, Encoding enc, uint64_t payload_bytes,
                       uint64_t client_id, uint64_t seq, int32_t status) {
  SlotHeader h{};
  h.magic = protocol::kMagic;
  h.version = protocol::kVersion;
  h.kind = static_cast<uint8_t>(kind);
  h.encoding = static_cast<uint8_t>(enc);
  h.layer_id = layer_id;
  h.num_tokens = num_tokens;
  h.hidden = c.hidden;
  h.topk = topk;
  h.payload_bytes = payload_bytes;
  h.client_id = client_id;
  h.seq = seq;
  h.status = status;
  return h;
}

void check_seq(uint64_t seq) {
  MC_CHECK(seq <= protocol::kMaxSeq, "sequence number ", seq, " exceeds 56 bits");
}

// Fills [offset, offset + n) of `r` with kPoisonByte, in bounded chunks through the transport.
void fill_poison(Transport& t, Region& r, uint64_t offset, uint64_t n) {
  constexpr uint64_t kChunk = 4096;  // one page per put: bounded stack, few calls
  uint8_t buf[kChunk];
  std::memset(buf, protocol::kPoisonByte, sizeof(buf));
  for (uint64_t done = 0; done < n; done += kChunk) {
    t.put(r, offset + done, buf, std::min(kChunk, n - done));
  }
}

// Poison mode: overwrites the request in `slot` before the server releases it — unless the
// client already wrote a newer request there (it gave up on this one), which must survive.
void poison_request(Transport& t, Region& local, const SlotRing& ring, uint32_t slot,
                    uint64_t seq) {
  const uint64_t off = ring.slot_offset(slot);
  if (t.load(local, off + kSignalOffset) != make_signal(SlotState::kRequestReady, seq)) return;
  SlotHeader h{};
  t.read(local, off + kHeaderOffset, &h, sizeof(h));
  const uint64_t capacity = ring.slot_bytes() - kPayloadOffset;
  if (h.magic == protocol::kMagic && h.kind == static_cast<uint8_t>(MessageKind::kStage)) {
    // A stage chunk is opaque bytes: poison what it declared (at most the slot).
    fill_poison(t, local, off + kPayloadOffset, std::min(h.payload_bytes, capacity));
    fill_poison(t, local, off + kHeaderOffset, sizeof(SlotHeader));
    return;
  }
  const bool sized = h.magic == protocol::kMagic && protocol::encoding_known(h.encoding) &&
                     h.num_tokens <= ring.config.max_tokens && h.hidden == ring.config.hidden &&
                     h.topk <= ring.config.topk;
  const PayloadLayout p = sized
                              ? protocol::request_payload_layout(h.num_tokens, h.hidden, h.topk,
                                                                 static_cast<Encoding>(h.encoding))
                              : PayloadLayout{};
  const uint64_t base = off + kPayloadOffset;
  if (!sized || p.total > capacity) {
    fill_poison(t, local, base, capacity);  // sizes unknown: the whole payload area
  } else {
    fill_poison(t, local, base, p.ids_offset);
    constexpr uint64_t kIdsPerPut = 1024;
    int32_t ids[kIdsPerPut];
    std::fill(ids, ids + kIdsPerPut, protocol::kPoisonExpertId);
    const uint64_t count = p.ids_bytes / sizeof(int32_t);
    for (uint64_t done = 0; done < count; done += kIdsPerPut) {
      const uint64_t n = std::min(kIdsPerPut, count - done);
      t.put(local, base + p.ids_offset + done * sizeof(int32_t), ids, n * sizeof(int32_t));
    }
    fill_poison(t, local, base + p.scores_offset, p.total - p.scores_offset);
  }
  fill_poison(t, local, off + kHeaderOffset, sizeof(SlotHeader));
}

// Response header + signal + doorbell, after the payload has been put. The request slot is
// released first: once the client sees the response it may reuse the slot at once. The release
// is a compare-exchange so that a client which gave up on this request and already wrote a newer
// one into the slot does not have it wiped; the late answer is then dropped by its sequence.
void finish_response(Transport& t, Region& local, const SlotRing& request_ring, Region& client,
                     const SlotRing& response_ring, uint32_t slot, uint64_t seq,
                     const SlotHeader& h) {
  const uint64_t off = response_ring.slot_offset(slot);
  t.put(client, off + kHeaderOffset, &h, sizeof(h));
  // The release: after this compare-exchange the slot is the client's again and the server never
  // reads or writes it (read once, own the copy); poison mode overwrites it just before.
  if (request_ring.poison) poison_request(t, local, request_ring, slot, seq);
  t.compare_exchange(local, request_ring.slot_offset(slot) + kSignalOffset,
                     make_signal(SlotState::kRequestReady, seq),
                     make_signal(SlotState::kIdle, seq));
  t.signal(client, off + kSignalOffset, make_signal(SlotState::kResponseReady, seq),
           SignalOp::kSet);
  t.signal(client, kDoorbellOffset, 1, SignalOp::kAdd);
}

}  // namespace

uint64_t SlotRing::slot_bytes() const {
  return request ? protocol::request_slot_bytes(config) : protocol::response_slot_bytes(config);
}

uint64_t SlotRing::region_bytes() const {
  return protocol::region_bytes(slot_bytes(), num_slots);
}

uint64_t SlotRing::slot_offset(uint32_t slot) const {
  return protocol::slot_offset(slot_bytes(), slot);
}

void SlotRing::check(const Region& r, uint32_t slot) const {
  MC_CHECK(slot < num_slots, "slot ", slot, " out of range: the ring has ", num_slots, " slots");
  MC_CHECK(r.size() >= region_bytes(), r.describe(), " holds ", r.size(),
           " bytes, the slot ring needs ", region_bytes());
}

void check_request_shape(const SlotRing& ring, const RequestShape& shape) {
  const SlotConfig& c = ring.config;
  MC_CHECK(ring.request, "requests go into a request ring");
  MC_CHECK(shape.num_tokens >= 1, "a request needs at least one token");
  MC_CHECK(shape.num_tokens <= c.max_tokens, "request of ", shape.num_tokens,
           " tokens exceeds the slot's max_tokens ", c.max_tokens);
  MC_CHECK(shape.topk >= 1 && shape.topk <= c.topk, "request topk ", shape.topk, " must be in [1, ",
           c.topk, "]");
  MC_CHECK(protocol::encoding_known(static_cast<uint8_t>(shape.encoding)), "unknown encoding ",
           static_cast<int>(shape.encoding));
  const PayloadLayout p =
      protocol::request_payload_layout(shape.num_tokens, c.hidden, shape.topk, shape.encoding);
  MC_CHECK(kPayloadOffset + p.total <= ring.slot_bytes(), "request payload of ", p.total,
           " bytes does not fit the slot (", ring.slot_bytes() - kPayloadOffset, " bytes)");
}

namespace {

RequestShape shape_of(const RequestData& req) {
  return {req.layer_id, req.num_tokens, req.topk, req.encoding};
}

// What check_request adds to check_request_shape: the payload's pointers.
void check_request_pointers(const RequestData& req) {
  const bool quantized = protocol::encoding_quantized(req.encoding);
  MC_CHECK(quantized == (req.scales != nullptr), quantized
                                                     ? "a quantized request needs scales"
                                                     : "scales given for an unquantized request");
  MC_CHECK(req.activations != nullptr && req.expert_ids != nullptr && req.scores != nullptr,
           "request activations, expert ids and scores are required");
}

// The checks of every request write (send_request, commit_request), made before its first
// byte, and the payload layout they admit.
PayloadLayout checked_request_layout(const Region& server, const SlotRing& ring, uint32_t slot,
                                     uint64_t seq, const RequestShape& shape) {
  ring.check(server, slot);
  check_request_shape(ring, shape);
  check_seq(seq);
  return protocol::request_payload_layout(shape.num_tokens, ring.config.hidden, shape.topk,
                                          shape.encoding);
}

// The payload is in place: the header, then REQUEST_READY|seq (a release: the payload and
// header are visible before it), then the doorbell.
void publish_request(Transport& t, Region& server, const SlotRing& ring, uint32_t slot,
                     uint64_t client_id, uint64_t seq, const RequestShape& shape,
                     const PayloadLayout& p, Region* doorbell, bool wake) {
  const SlotHeader h =
      make_header(MessageKind::kRequest, ring.config, shape.layer_id, shape.num_tokens, shape.topk,
                  shape.encoding, p.total, client_id, seq, 0);
  t.put(server, ring.slot_offset(slot) + kHeaderOffset, &h, sizeof(h));
  t.signal(server, ring.slot_offset(slot) + kSignalOffset,
           make_signal(SlotState::kRequestReady, seq), SignalOp::kSet);
  if (wake) ring_doorbell(t, doorbell != nullptr ? *doorbell : server);
}

}  // namespace

void check_request(const SlotRing& ring, const RequestData& req) {
  check_request_shape(ring, shape_of(req));
  check_request_pointers(req);
}

void send_request(Transport& t, Region& server, const SlotRing& ring, uint32_t slot,
                  uint64_t client_id, uint64_t seq, const RequestData& req, Region* doorbell,
                  bool wake) {
  const RequestShape shape = shape_of(req);
  const PayloadLayout p = checked_request_layout(server, ring, slot, seq, shape);
  check_request_pointers(req);
  const uint64_t base = ring.slot_offset(slot) + kPayloadOffset;
  t.put(server, base + p.act_offset, req.activations, p.act_bytes);
  if (p.scale_bytes > 0) t.put(server, base + p.scale_offset, req.scales, p.scale_bytes);
  t.put(server, base + p.ids_offset, req.expert_ids, p.ids_bytes);
  t.put(server, base + p.scores_offset, req.scores, p.scores_bytes);
  publish_request(t, server, ring, slot, client_id, seq, shape, p, doorbell, wake);
}

void commit_request(Transport& t, Region& server, const SlotRing& ring, uint32_t slot,
                    uint64_t client_id, uint64_t seq, const RequestShape& shape, Region* doorbell,
                    bool wake) {
  publish_request(t, server, ring, slot, client_id, seq, shape,
                  checked_request_layout(server, ring, slot, seq, shape), doorbell, wake);
}

void ring_doorbell(Transport& t, Region& doorbell) {
  t.signal(doorbell, kDoorbellOffset, 1, SignalOp::kAdd);
}

void send_stage(Transport& t, Region& receiver, const SlotRing& ring, uint32_t slot,
                uint64_t client_id, uint64_t seq, const StageChunk& c, Region* doorbell,
                bool wake) {
  MC_CHECK(ring.request, "stage chunks go into the receiver's data (request-shaped) ring");
  ring.check(receiver, slot);
  check_seq(seq);
  MC_CHECK(protocol::encoding_known(static_cast<uint8_t>(c.encoding)) &&
               !protocol::encoding_quantized(c.encoding),
           "a stage package needs an unquantized encoding, got ", static_cast<int>(c.encoding));
  MC_CHECK(c.num_chunks >= 1 && c.chunk < c.num_chunks, "chunk ", c.chunk, " of ", c.num_chunks);
  MC_CHECK(c.bytes != nullptr && c.num_bytes >= 1, "a stage chunk carries at least one byte");
  const uint64_t capacity = ring.slot_bytes() - kPayloadOffset;
  MC_CHECK(c.num_bytes <= capacity, "stage chunk of ", c.num_bytes,
           " bytes does not fit the slot (", capacity, " bytes)");
  const uint64_t off = ring.slot_offset(slot);
  t.put(receiver, off + kPayloadOffset, c.bytes, c.num_bytes);
  const SlotHeader h = make_header(MessageKind::kStage, ring.config, c.tag, c.chunk, c.num_chunks,
                                   c.encoding, c.num_bytes, client_id, seq, 0);
  t.put(receiver, off + kHeaderOffset, &h, sizeof(h));
  t.signal(receiver, off + kSignalOffset, make_signal(SlotState::kRequestReady, seq),
           SignalOp::kSet);
  if (wake) ring_doorbell(t, doorbell != nullptr ? *doorbell : receiver);
}

void send_stage_ack(Transport& t, Region& local, const SlotRing& data_ring, Region& sender,
                    const SlotRing& ack_ring, uint32_t slot, uint64_t client_id, uint64_t seq,
                    const SlotHeader& chunk, int32_t status, const std::string& reason) {
  data_ring.check(local, slot);
  ack_ring.check(sender, slot);
  check_seq(seq);
  MC_CHECK(!ack_ring.request, "stage acks go into the sender's ack (response-shaped) ring");
  MC_CHECK(protocol::response_status_known(status), "unknown ack status ", status);
  uint64_t n = 0;
  if (status != 0) {
    n = std::min<uint64_t>(reason.size(), ack_ring.slot_bytes() - kPayloadOffset);
    t.put(sender, ack_ring.slot_offset(slot) + kPayloadOffset, reason.data(), n);
  }
  // The ack echoes the chunk's numbering (the sender's check that it is the right chunk's).
  const SlotHeader h =
      make_header(MessageKind::kStage, ack_ring.config, chunk.layer_id, chunk.num_tokens,
                  chunk.topk == 0 ? 1 : chunk.topk, static_cast<Encoding>(chunk.encoding), n,
                  client_id, seq, status);
  finish_response(t, local, data_ring, sender, ack_ring, slot, seq, h);
}

namespace {

// Both ways of answering check the same things; returns the response's payload layout.
PayloadLayout check_response(Region& local, const SlotRing& request_ring, Region& client,
                             const SlotRing& response_ring, uint32_t slot, uint64_t seq,
                             uint32_t num_tokens, Encoding encoding) {
  request_ring.check(local, slot);
  response_ring.check(client, slot);
  check_seq(seq);
  MC_CHECK(!response_ring.request, "responses go into a response ring");
  MC_CHECK(!protocol::encoding_quantized(encoding), "responses are never quantized");
  const uint32_t max_rows = protocol::response_max_tokens(response_ring.config);
  MC_CHECK(num_tokens >= 1 && num_tokens <= max_rows, "response of ", num_tokens,
           " tokens outside [1, ", max_rows, "]");
  const PayloadLayout p =
      protocol::response_payload_layout(num_tokens, response_ring.config.hidden, encoding);
  MC_CHECK(kPayloadOffset + p.total <= response_ring.slot_bytes(), "response payload of ", p.total,
           " bytes does not fit the slot");
  return p;
}

}  // namespace

void send_response(Transport& t, Region& local, const SlotRing& request_ring, Region& client,
                   const SlotRing& response_ring, uint32_t slot, uint64_t client_id, uint64_t seq,
                   uint32_t layer_id, uint32_t num_tokens, Encoding encoding,
                   const void* activations) {
  const PayloadLayout p =
      check_response(local, request_ring, client, response_ring, slot, seq, num_tokens, encoding);
  t.put(client, response_ring.slot_offset(slot) + kPayloadOffset, activations, p.act_bytes);
  const SlotHeader h = make_header(MessageKind::kResponse, response_ring.config, layer_id,
                                   num_tokens, 0, encoding, p.total, client_id, seq, 0);
  finish_response(t, local, request_ring, client, response_ring, slot, seq, h);
}

void commit_response(Transport& t, Region& local, const SlotRing& request_ring, Region& client,
                     const SlotRing& response_ring, uint32_t slot, uint64_t client_id, uint64_t seq,
                     uint32_t layer_id, uint32_t num_tokens, Encoding encoding) {
  const PayloadLayout p =
      check_response(local, request_ring, client, response_ring, slot, seq, num_tokens, encoding);
  const SlotHeader h = make_header(MessageKind::kResponse, response_ring.config, layer_id,
                                   num_tokens, 0, encoding, p.total, client_id, seq, 0);
  finish_response(t, local, request_ring, client, response_ring, slot, seq, h);
}

void send_error(Transport& t, Region& local, const SlotRing& request_ring, Region& client,
                const SlotRing& response_ring, uint32_t slot, uint64_t client_id, uint64_t seq,
                uint32_t layer_id, int32_t status, const std::string& reason) {
  request_ring.check(local, slot);
  response_ring.check(client, slot);
  check_seq(seq);
  MC_CHECK(status != 0 && protocol::response_status_known(status), "error status ", status,
           " is not a known non-zero response status");
  const uint64_t capacity = response_ring.slot_bytes() - kPayloadOffset;
  const uint64_t n = std::min<uint64_t>(reason.size(), capacity);
  t.put(client, response_ring.slot_offset(slot) + kPayloadOffset, reason.data(), n);
  const SlotHeader h = make_header(MessageKind::kResponse, response_ring.config, layer_id, 0, 0,
                                   Encoding::kBF16, n, client_id, seq, status);
  finish_response(t, local, request_ring, client, response_ring, slot, seq, h);
}

void release_response(Transport& t, Region& local, const SlotRing& ring, uint32_t slot,
                      uint64_t payload_bytes) {
  MC_CHECK(!ring.request, "release_response releases a response slot");
  ring.check(local, slot);
  if (!ring.poison) return;
  const uint64_t off = ring.slot_offset(slot);
  const uint64_t capacity = ring.slot_bytes() - kPayloadOffset;
  fill_poison(t, local, off + kHeaderOffset, sizeof(SlotHeader));
  fill_poison(t, local, off + kPayloadOffset, std::min(payload_bytes, capacity));
}

void mark_offline(Transport& t, Region& local, const SlotRing& ring, uint32_t slot, uint64_t seq) {
  ring.check(local, slot);
  t.signal(local, ring.slot_offset(slot) + kSignalOffset, make_signal(SlotState::kOffline, seq),
           SignalOp::kSet);
}

}  // namespace moecomm::slots
