// The slot header: everything a reader needs to check a message before trusting its payload.
// Fixed 64-byte little-endian layout; the same struct is read by host and device code.
#pragma once

#include <cstdint>

#include "common/align.h"
#include "common/macros.h"

namespace moecomm::protocol {

// "MCSL" read as a little-endian u32.
constexpr uint32_t kMagic = 0x4C53434Du;
// Bumped whenever the header or payload layout changes; peers of another version are refused.
constexpr uint16_t kVersion = 2;

enum class MessageKind : uint8_t {
  kRequest = 1,
  kResponse = 2,
  // Pipeline stage to stage (activations, KV blocks): one chunk of an opaque byte package, and
  // in the sender's ack ring a header-only acknowledgement of that chunk. Fields reused:
  // layer_id = the package's tag (a step, a layer), num_tokens = chunk index, topk = chunk
  // count, encoding = element type of the package; payload_bytes = this chunk's bytes (0 in an
  // ack, a reason string in a refusal).
  kStage = 3,
};

// Activation encodings. Zero is deliberately invalid so that never-written memory is rejected.
enum class Encoding : uint8_t {
  kBF16 = 1,
  kFP16 = 2,
  kF32 = 3,
  kInt8 = 4,         // symmetric int8, one f32 scale per token
  kFP8E4M3 = 5,      // fp8 e4m3, one f32 scale per token
  kFP8E4M3B128 = 6,  // fp8 e4m3, one f32 scale per 128-channel block of each token
};
constexpr uint8_t kMinEncoding = 1;
constexpr uint8_t kMaxEncoding = 6;

// Channels that share one scale in the block-scaled fp8 encoding (DeepSeek-V3's choice, which
// matches the K tile of fp8 grouped GEMMs).
constexpr uint32_t kScaleBlock = 128;

MC_HOST_DEVICE constexpr bool encoding_known(uint8_t e) {
  return e >= kMinEncoding && e <= kMaxEncoding;
}

MC_HOST_DEVICE constexpr bool encoding_quantized(Encoding e) {
  return e == Encoding::kInt8 || e == Encoding::kFP8E4M3 || e == Encoding::kFP8E4M3B128;
}

MC_HOST_DEVICE constexpr uint32_t encoding_elem_bytes(Encoding e) {
  switch (e) {
    case Encoding::kBF16:
    case Encoding::kFP16:
      return 2;
    case Encoding::kF32:
      return 4;
    case Encoding::kInt8:
    case Encoding::kFP8E4M3:
    case Encoding::kFP8E4M3B128:
      return 1;
  }
  return 0;
}

// f32 scales carried per token for this encoding (0 for unquantized ones).
MC_HOST_DEVICE constexpr uint64_t encoding_scales_per_token(Encoding e, uint64_t hidden) {
  switch (e) {
    case Encoding::kInt8:
    case Encoding::kFP8E4M3:
      return 1;
    case Encoding::kFP8E4M3B128:
      return ceil_div(hidden, kScaleBlock);
    default:
      return 0;
  }
}

// Status carried by a response. 1..99 mirror ValidateCode (the request was rejected and why);
// 100 and up are failures of the server while handling a valid request.
enum class ResponseStatus : int32_t {
  kOk = 0,
  kUnknownLayer = 100,
  kUnknownExpert = 101,
  kServerError = 102,
  kDraining = 103,
  // The request named a local expert index the server no longer hosts: the client's expert map
  // is older than the server's placement. Not a failure: refresh the map and re-send.
  kStaleMap = 104,
};
constexpr int32_t kFirstServerStatus = 100;
constexpr int32_t kLastServerStatus = 104;

struct alignas(8) SlotHeader {
  uint32_t magic;
  uint16_t version;
  uint8_t kind;      // MessageKind
  uint8_t encoding;  // Encoding of the activations in the payload
  uint32_t layer_id;
  uint32_t num_tokens;
  uint32_t hidden;
  uint32_t topk;  // request: expert ids/scores per token; response: 0
  uint64_t payload_bytes;
  uint64_t client_id;
  uint64_t seq;    // must equal the sequence number of the slot's signal word
  int32_t status;  // request: 0; response: ResponseStatus or a ValidateCode
  uint32_t reserved0;
  // When the message is complete (layout.h, kArrivalOffset): 0 = at the signal (the writer put
  // every byte before it: host writers); else the slot's arrival counter reaches this value
  // once every payload byte has landed (device writers, whose warps put chunks that land in
  // any order). Cumulative over the slot's life, so it is >= payload_bytes.
  uint64_t arrival_target;
};
static_assert(sizeof(SlotHeader) == 64, "the wire header is exactly one cache line");

}  // namespace moecomm::protocol
