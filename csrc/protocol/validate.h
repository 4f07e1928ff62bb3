// Header validation: a specific code and reason for every way a header can be wrong. The reader
// copies the header out of the slot once (the writer may still be scribbling on it) and checks
// the copy; nothing here reads beyond the bytes it is told the slot has.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/macros.h"
#include "protocol/header.h"
#include "protocol/layout.h"
#include "protocol/signal.h"

namespace moecomm::protocol {

enum class ValidateCode : int32_t {
  kOk = 0,
  kSlotTooSmall = 1,
  kBadMagic = 2,
  kBadVersion = 3,
  kBadKind = 4,
  kBadEncoding = 5,
  kQuantizedResponse = 6,
  kZeroTokens = 7,
  kTooManyTokens = 8,
  kHiddenMismatch = 9,
  kBadTopk = 10,
  kPayloadSizeMismatch = 11,
  kPayloadExceedsSlot = 12,
  kClientMismatch = 13,
  kSeqMismatch = 14,
  kBadStatus = 15,
  kReservedNonzero = 16,
  kBadArrivalTarget = 17,
};
constexpr int32_t kNumValidateCodes = 18;

MC_HOST_DEVICE inline const char* validate_reason(ValidateCode c) {
  switch (c) {
    case ValidateCode::kOk:
      return "ok";
    case ValidateCode::kSlotTooSmall:
      return "slot too small to hold a signal word and a header";
    case ValidateCode::kBadMagic:
      return "bad magic: not a moecomm slot header";
    case ValidateCode::kBadVersion:
      return "unsupported protocol version";
    case ValidateCode::kBadKind:
      return "message kind is not the one expected in this slot";
    case ValidateCode::kBadEncoding:
      return "unknown activation encoding";
    case ValidateCode::kQuantizedResponse:
      return "response activations cannot be quantized";
    case ValidateCode::kZeroTokens:
      return "num_tokens is zero";
    case ValidateCode::kTooManyTokens:
      return "num_tokens exceeds the slot's max_tokens (max_response_tokens for a response)";
    case ValidateCode::kHiddenMismatch:
      return "hidden size differs from the connection's";
    case ValidateCode::kBadTopk:
      return "topk is zero or exceeds the connection's topk";
    case ValidateCode::kPayloadSizeMismatch:
      return "payload_bytes disagrees with the header sizes";
    case ValidateCode::kPayloadExceedsSlot:
      return "payload does not fit in the slot";
    case ValidateCode::kClientMismatch:
      return "client id is not the owner of this slot";
    case ValidateCode::kSeqMismatch:
      return "header sequence number differs from the signal's";
    case ValidateCode::kBadStatus:
      return "status field invalid for this message kind";
    case ValidateCode::kReservedNonzero:
      return "reserved header fields are not zero";
    case ValidateCode::kBadArrivalTarget:
      return "arrival_target is below payload_bytes (it counts this message's bytes too)";
  }
  return "unknown validation code";
}

// What the reader expects of a header in a given slot.
struct Expectation {
  MessageKind kind = MessageKind::kRequest;
  SlotConfig config;
  uint64_t slot_bytes = 0;  // bytes actually available from the start of the slot
  uint64_t client_id = 0;
  uint64_t seq = 0;  // from the signal word the reader acquired
  // kStage only: the header is an acknowledgement in the sender's ack ring, not a chunk.
  bool stage_ack = false;
};

MC_HOST_DEVICE inline bool response_status_known(int32_t s) {
  return s == 0 || (s > 0 && s < kNumValidateCodes) ||
         (s >= kFirstServerStatus && s <= kLastServerStatus);
}

// The kind-specific part of a stage header (see MessageKind::kStage); the common fields are
// checked by validate_header. A chunk carries 1..capacity bytes; an ack carries none, a refusal
// only its reason. Quantized encodings are refused: a package has no per-token scales.
MC_HOST_DEVICE inline ValidateCode validate_stage(const SlotHeader& h, const Expectation& e) {
  const uint64_t capacity = e.slot_bytes - kPayloadOffset;
  if (e.stage_ack) {
    if (!response_status_known(h.status)) return ValidateCode::kBadStatus;
    if (h.status != 0) {
      return h.payload_bytes > capacity ? ValidateCode::kPayloadExceedsSlot : ValidateCode::kOk;
    }
  } else if (h.status != 0) {
    return ValidateCode::kBadStatus;
  }
  if (!encoding_known(h.encoding) || encoding_quantized(static_cast<Encoding>(h.encoding))) {
    return ValidateCode::kBadEncoding;
  }
  if (h.hidden != e.config.hidden) return ValidateCode::kHiddenMismatch;
  if (h.topk == 0 || h.num_tokens >= h.topk) return ValidateCode::kBadTopk;
  if (e.stage_ack ? h.payload_bytes != 0 : h.payload_bytes == 0) {
    return ValidateCode::kPayloadSizeMismatch;
  }
  if (h.payload_bytes > capacity) return ValidateCode::kPayloadExceedsSlot;
  return ValidateCode::kOk;
}

// Checks a header copy. `h` must have been copied from a slot of at least kPayloadOffset bytes;
// use read_and_validate() to get both the copy and the check.
MC_HOST_DEVICE inline ValidateCode validate_header(const SlotHeader& h, const Expectation& e) {
  if (e.slot_bytes < kPayloadOffset) return ValidateCode::kSlotTooSmall;
  if (h.magic != kMagic) return ValidateCode::kBadMagic;
  if (h.version != kVersion) return ValidateCode::kBadVersion;
  if (h.kind != static_cast<uint8_t>(e.kind)) return ValidateCode::kBadKind;
  if (h.reserved0 != 0) return ValidateCode::kReservedNonzero;
  if (h.client_id != e.client_id) return ValidateCode::kClientMismatch;
  if (h.seq != e.seq) return ValidateCode::kSeqMismatch;
  // Cumulative: a non-zero target counts this message's bytes too.
  if (h.arrival_target != 0 && h.arrival_target < h.payload_bytes) {
    return ValidateCode::kBadArrivalTarget;
  }
  if (e.kind == MessageKind::kStage) return validate_stage(h, e);
  const bool request = e.kind == MessageKind::kRequest;
  if (request ? h.status != 0 : !response_status_known(h.status)) return ValidateCode::kBadStatus;

  const uint64_t capacity = e.slot_bytes - kPayloadOffset;
  if (!request && h.status != 0) {
    // Error response: the payload is a reason string; only its size needs to be sane.
    if (h.payload_bytes > capacity) return ValidateCode::kPayloadExceedsSlot;
    return ValidateCode::kOk;
  }
  if (!encoding_known(h.encoding)) return ValidateCode::kBadEncoding;
  const Encoding enc = static_cast<Encoding>(h.encoding);
  if (!request && encoding_quantized(enc)) return ValidateCode::kQuantizedResponse;
  if (h.num_tokens == 0) return ValidateCode::kZeroTokens;
  if (h.num_tokens > (request ? e.config.max_tokens : response_max_tokens(e.config))) {
    return ValidateCode::kTooManyTokens;
  }
  if (h.hidden != e.config.hidden) return ValidateCode::kHiddenMismatch;
  if (request ? (h.topk == 0 || h.topk > e.config.topk) : h.topk != 0) {
    return ValidateCode::kBadTopk;
  }
  // Bounded above: tokens <= the slot's rows and hidden/topk equal the connection's: no overflow.
  const PayloadLayout p = request ? request_payload_layout(h.num_tokens, h.hidden, h.topk, enc)
                                  : response_payload_layout(h.num_tokens, h.hidden, enc);
  if (h.payload_bytes != p.total) return ValidateCode::kPayloadSizeMismatch;
  if (p.total > capacity) return ValidateCode::kPayloadExceedsSlot;
  return ValidateCode::kOk;
}

// Copies the header out of `slot` (which has `e.slot_bytes` readable bytes) into `out` and
// validates the copy. Never touches memory past kPayloadOffset.
MC_HOST_DEVICE inline ValidateCode read_and_validate(const void* slot, const Expectation& e,
                                                     SlotHeader* out) {
  if (e.slot_bytes < kPayloadOffset) return ValidateCode::kSlotTooSmall;
  const auto* src = reinterpret_cast<const volatile uint64_t*>(
      static_cast<const unsigned char*>(slot) + kHeaderOffset);
  // Word-wise volatile loads (the writer may still be changing the slot), then memcpy into the
  // struct: writing the struct through a uint64_t* would break strict aliasing.
  constexpr uint32_t kWords = sizeof(SlotHeader) / sizeof(uint64_t);
  uint64_t words[kWords];
  for (uint32_t i = 0; i < kWords; ++i) words[i] = src[i];
  memcpy(out, words, sizeof(SlotHeader));
  return validate_header(*out, e);
}

}  // namespace moecomm::protocol
