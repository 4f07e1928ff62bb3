// Where every byte of a slot lives. Offsets depend only on (num_tokens, hidden, topk, encoding),
// so both sides compute them independently and nothing but the header crosses the wire.
//
//   slot    = [signal line: 64 B][header: 64 B][payload]
//   request = [activations T*H*elem][scales T*S f32][expert ids T*K i32][scores T*K f32]
//   response= [activations T*H*elem]            (error responses: a UTF-8 reason instead)
//   region  = [doorbell line: 64 B][slot 0][slot 1]...[slot n-1]
//
// Each part starts on a 64-byte boundary. A message of T tokens is packed with the layout of T
// (not of max_tokens), so the payload is one contiguous range of `payload_bytes`.
#pragma once

#include <cstdint>

#include "common/align.h"
#include "common/macros.h"
#include "protocol/header.h"

namespace moecomm::protocol {

constexpr uint64_t kSlotAlign = kCacheLine;
// The signal word plus room reserved for the transport (shm keeps its sleeper count there), so
// the header written by the peer never shares a cache line with the polled word.
constexpr uint64_t kSignalLineBytes = kCacheLine;
constexpr uint64_t kSignalOffset = 0;
// The slot's arrival counter, in its signal line: bytes added by device writers, never reset.
// A device writer's warps put payload chunks that each ADD their byte count here (NVSHMEM signal
// ADD, or a release add over CUDA IPC), so chunks may land in any order with no grid barrier;
// the writer keeps, per slot, the total it ever added and puts `total after this message` into
// the header's arrival_target. A reader that saw the signal and the header waits until the
// counter reaches arrival_target. Nobody resets it: a late ADD of a message the reader gave up
// on (timeout, rejection) is still counted in the writer's total, so it can never make a later
// message look complete early or keep it from completing. Host writers put every byte before
// the signal and send arrival_target 0. (shm uses bytes 8-11 for its sleeper count; this word
// stays clear of them.)
//
// The writer's total counts the bytes it ADDed, not the messages it signalled (stamp_message
// below): a warp that found the peer dead puts no chunk, another warp of the same message that
// found it alive may have put its chunks already, and the peer index may be marked alive again
// later without either side being reset. So every chunk put is counted whether or not its
// message's header follows; the header (and signal) goes out only for a message whose every
// chunk was put, to a peer found alive when the last warp decides, once, for the whole message.
// Counting a message that was not sent would leave every later target out of reach (the reader
// times out); not counting chunks that did land would let them complete a later message early.
constexpr uint64_t kArrivalOffset = 16;

// The last warp's decision for one message of a device writer (message_io.cuh finish_message;
// host stand-ins in tests call the same function): `arrival_sent` is the writer's total before
// this message, `bytes_put` what this message's warps ADDed to the peer's counter (every chunk,
// or fewer when some warp found the peer dead), `peer_alive` the liveness read once, now.
struct MessageStamp {
  bool put_header = false;      // put the header and raise the signal
  uint64_t arrival_sent = 0;    // the writer's new total: + bytes_put, header or not
  uint64_t arrival_target = 0;  // the header's arrival_target (0: no payload)
};

MC_HOST_DEVICE inline MessageStamp stamp_message(uint64_t arrival_sent, uint64_t payload_bytes,
                                                 uint64_t bytes_put, bool peer_alive) {
  MessageStamp m;
  m.arrival_sent = arrival_sent + bytes_put;
  m.put_header = peer_alive && bytes_put == payload_bytes;
  m.arrival_target = m.put_header && payload_bytes != 0 ? m.arrival_sent : 0;
  return m;
}
constexpr uint64_t kHeaderOffset = kSignalLineBytes;
constexpr uint64_t kPayloadOffset = kHeaderOffset + align_up(sizeof(SlotHeader), kSlotAlign);
// A region-wide arrival counter: writers bump it after signalling a slot, so a reader that
// serves many slots sleeps on one word instead of one per slot.
constexpr uint64_t kDoorbellBytes = kCacheLine;
// Room for the reason string of an error response when the slot is tiny.
constexpr uint64_t kMinErrorPayloadBytes = 256;

struct PayloadLayout {
  uint64_t act_offset = 0, act_bytes = 0;
  uint64_t scale_offset = 0, scale_bytes = 0;
  uint64_t ids_offset = 0, ids_bytes = 0;
  uint64_t scores_offset = 0, scores_bytes = 0;
  uint64_t total = 0;  // payload bytes, a multiple of kSlotAlign
};

MC_HOST_DEVICE inline PayloadLayout request_payload_layout(uint64_t tokens, uint64_t hidden,
                                                           uint64_t topk, Encoding enc) {
  PayloadLayout p;
  p.act_offset = 0;
  p.act_bytes = tokens * hidden * encoding_elem_bytes(enc);
  p.scale_offset = align_up(p.act_offset + p.act_bytes, kSlotAlign);
  p.scale_bytes = tokens * encoding_scales_per_token(enc, hidden) * sizeof(float);
  p.ids_offset = align_up(p.scale_offset + p.scale_bytes, kSlotAlign);
  p.ids_bytes = tokens * topk * sizeof(int32_t);
  p.scores_offset = align_up(p.ids_offset + p.ids_bytes, kSlotAlign);
  p.scores_bytes = tokens * topk * sizeof(float);
  p.total = align_up(p.scores_offset + p.scores_bytes, kSlotAlign);
  return p;
}

MC_HOST_DEVICE inline PayloadLayout response_payload_layout(uint64_t tokens, uint64_t hidden,
                                                            Encoding enc) {
  PayloadLayout p;
  p.act_bytes = tokens * hidden * encoding_elem_bytes(enc);
  p.scale_offset = p.ids_offset = p.scores_offset = align_up(p.act_bytes, kSlotAlign);
  p.total = p.scale_offset;
  return p;
}

// What a client and a server agree on at connect time. The slot is sized for max_tokens.
struct SlotConfig {
  uint32_t max_tokens = 0;
  uint32_t hidden = 0;
  uint32_t topk = 0;
  Encoding encoding = Encoding::kBF16;      // request activations
  Encoding out_encoding = Encoding::kBF16;  // response activations; never quantized
  // Rows a response may carry; 0 means max_tokens. Larger when a peer answers one row per
  // (token, k) copy (the DeepEP adapter): sizing the request slots for those rows too would
  // over-provision them K times.
  uint32_t max_response_tokens = 0;
};

MC_HOST_DEVICE inline uint32_t response_max_tokens(const SlotConfig& c) {
  return c.max_response_tokens != 0 ? c.max_response_tokens : c.max_tokens;
}

MC_HOST_DEVICE inline uint64_t request_slot_bytes(const SlotConfig& c) {
  return kPayloadOffset + request_payload_layout(c.max_tokens, c.hidden, c.topk, c.encoding).total;
}

MC_HOST_DEVICE inline uint64_t response_slot_bytes(const SlotConfig& c) {
  const uint64_t payload =
      response_payload_layout(response_max_tokens(c), c.hidden, c.out_encoding).total;
  return kPayloadOffset + (payload < kMinErrorPayloadBytes ? kMinErrorPayloadBytes : payload);
}

MC_HOST_DEVICE inline uint64_t slot_offset(uint64_t slot_bytes, uint32_t index) {
  return kDoorbellBytes + uint64_t{index} * slot_bytes;
}

MC_HOST_DEVICE inline uint64_t region_bytes(uint64_t slot_bytes, uint32_t num_slots) {
  return kDoorbellBytes + uint64_t{num_slots} * slot_bytes;
}

}  // namespace moecomm::protocol
