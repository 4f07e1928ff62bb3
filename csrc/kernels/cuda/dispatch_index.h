// Index math of the device dispatch/combine and of the GPU expert server, shared by the kernels
// (nvcc) and by host code (g++: the bindings, and tests/ops/native/dispatch_index_check.cc, which
// replays a dispatch with these functions and compares it with moecomm.ops.pack_dispatch).
//
// Client step, per micro-batch slot:
//   route   a token t goes to server s if some k has expert_server[topk_ids[t, k]] == s;
//           its row in s's request is pos[t, s] = number of earlier tokens that also go to s
//           (rows keep batch order, exactly as pack_dispatch's index_select of nonzero rows);
//   pack    row pos[t, s] of s's staging payload, laid out by request_payload_layout(count[s]);
//   put     the payload in chunks that ADD their bytes to the slot's arrival counter, then the
//           header with signal SET REQUEST_READY|seq (the reader needs both, in any order);
//   combine y[t] = Σ over servers in increasing order of response_s[pos[t, s]] (f32), then cast.
// Servers that get no token are sent nothing (like AttentionClient, which packs only servers
// with at least one token) and combine does not wait for them: status kNotSent.
#pragma once

#include <cstdint>

#include "common/align.h"
#include "common/macros.h"
#include "kernels/cuda/reorg.h"
#include "protocol/header.h"
#include "protocol/layout.h"

namespace moecomm::kernels::cuda {

// Distinct servers one token can reach is at most topk; per-token server lists live in shared
// memory sized by this bound (DeepSeek-V3 and Qwen3 route top-8; 64 leaves ample room).
constexpr uint32_t kMaxTopk = 64;
// pos[t, s] of a token that does not go to server s.
constexpr int32_t kNoPosition = -1;
// Local expert index written for a (token, k) that is not for the server (wire convention).
constexpr int32_t kNoExpert = -1;

// What combine found for each server: one int32 per server in the client workspace, readable
// by the host after the step (no host read happens inside the step). Values 0-2 equal
// transport::WaitStatus so a wait result reads the same on both sides.
enum class ServerStatus : int32_t {
  kOk = 0,
  kTimeout = 1,         // no response signal before the deadline
  kPeerLost = 2,        // the liveness mask marked the server dead while we waited
  kNotSent = 3,         // the server got no token: nothing sent, nothing awaited
  kOffline = 4,         // the server marked the slot OFFLINE instead of answering
  kBadHeader = 5,       // detail: protocol::ValidateCode of the response header
  kRemoteError = 6,     // detail: the status the server answered with (ResponseStatus/Validate)
  kMismatch = 7,        // detail: MismatchField; the answer is not for what we sent
  kPayloadTimeout = 8,  // header arrived, payload bytes did not before the deadline
  // Not sent: this slot's previous request to the server is still unanswered (it timed out),
  // so the server may still be reading it. Fail over; the slot frees itself once the late
  // answer (or OFFLINE) arrives.
  kSlotBusy = 9,
};

enum class MismatchField : int32_t {
  kNumTokens = 1,
  kEncoding = 2,
  kLayer = 3,
};

// One routed (token, k): the server and its local expert index, or server -1 when the id is
// "no expert" (-1), outside [0, num_experts), or mapped to a server outside [0, num_servers)
// (the device cannot raise: such choices are dropped, the host checks inputs beforehand).
struct Route {
  int32_t server = -1;
  int32_t local = kNoExpert;
};

MC_HOST_DEVICE inline Route route_expert(int64_t id, const int32_t* expert_server,
                                         const int32_t* expert_local, uint32_t num_experts,
                                         uint32_t num_servers) {
  Route r;
  if (id < 0 || id >= static_cast<int64_t>(num_experts)) return r;
  const int32_t s = expert_server[id];
  const int32_t j = expert_local[id];
  if (s < 0 || s >= static_cast<int32_t>(num_servers) || j < 0) return r;
  r.server = s;
  r.local = j;
  return r;
}

// Reads element i of a topk_ids array of int32 or int64.
MC_HOST_DEVICE inline int64_t load_id(const void* ids, bool ids_int64, uint64_t i) {
  return ids_int64 ? static_cast<const int64_t*>(ids)[i]
                   : static_cast<int64_t>(static_cast<const int32_t*>(ids)[i]);
}

// Distinct servers of token t in first-seen k order; returns how many (<= topk <= kMaxTopk).
MC_HOST_DEVICE inline uint32_t token_servers(const void* ids, bool ids_int64, uint64_t t,
                                             uint32_t topk, const int32_t* expert_server,
                                             const int32_t* expert_local, uint32_t num_experts,
                                             uint32_t num_servers, int32_t* out) {
  uint32_t n = 0;
  for (uint32_t k = 0; k < topk; ++k) {
    const Route r = route_expert(load_id(ids, ids_int64, t * topk + k), expert_server, expert_local,
                                 num_experts, num_servers);
    if (r.server < 0) continue;
    bool seen = false;
    for (uint32_t i = 0; i < n; ++i) seen = seen || out[i] == r.server;
    if (!seen) out[n++] = r.server;
  }
  return n;
}

// Byte offsets, inside one request payload of `layout`, of packed row p's four parts.
struct RequestRow {
  uint64_t act = 0, scales = 0, ids = 0, scores = 0;
};

MC_HOST_DEVICE inline RequestRow request_row(const protocol::PayloadLayout& layout, uint64_t p,
                                             uint64_t hidden, uint64_t topk,
                                             protocol::Encoding enc) {
  RequestRow r;
  r.act = layout.act_offset + p * hidden * protocol::encoding_elem_bytes(enc);
  r.scales = layout.scale_offset + p * protocol::encoding_scales_per_token(enc, hidden) * 4;
  r.ids = layout.ids_offset + p * topk * sizeof(int32_t);
  r.scores = layout.scores_offset + p * topk * sizeof(float);
  return r;
}

// Slot s of a ring that starts `ring_offset` bytes into a region ([doorbell][slot 0]...).
MC_HOST_DEVICE inline uint64_t ring_slot_offset(uint64_t ring_offset, uint64_t slot_bytes,
                                                uint32_t slot) {
  return ring_offset + protocol::slot_offset(slot_bytes, slot);
}

// ---------------------------------------------------------------------------------------------
// Workspaces: one device allocation each, carved at these offsets (every part 64-byte aligned so
// puts from it move 16-byte vectors). The caller allocates them once; no kernel allocates.

// Client: one workspace per micro-batch slot in flight (dispatch writes it, combine reads it).
struct ClientWorkspaceLayout {
  uint64_t staging = 0;         // [num_servers][staging_stride] request payloads
  uint64_t staging_stride = 0;  // request payload bytes at max_tokens
  uint64_t headers = 0;         // [num_servers] SlotHeader, the source of the header puts
  uint64_t pos = 0;             // [max_tokens][num_servers] int32: row of t in s's request
  uint64_t count = 0;           // [num_servers] int32: tokens sent to s
  uint64_t sent_seq = 0;        // [num_servers] u64: sequence sent to s, 0 = nothing sent
  uint64_t status = 0;          // [num_servers] int32 ServerStatus, written by combine
  uint64_t detail = 0;          // [num_servers] int32, see ServerStatus
  // Kept across steps (zero at start; zero an entry when its server index gets a new server):
  uint64_t arrival_sent = 0;  // [num_servers] u64: bytes ever added to s's arrival counter
  uint64_t pending_seq = 0;   // [num_servers] u64: a request that timed out, 0 = none
  // [num_servers] u64: put warps finished (low 16 bits) and the payload bytes they put
  // (above); the last warp to finish signals and zeroes it (message_io.cuh finish_message).
  uint64_t done_warps = 0;
  uint64_t total = 0;
};

MC_HOST_DEVICE inline ClientWorkspaceLayout client_workspace_layout(uint32_t num_servers,
                                                                    const protocol::SlotConfig& c) {
  ClientWorkspaceLayout w;
  const uint64_t s = num_servers;
  w.staging_stride =
      protocol::request_payload_layout(c.max_tokens, c.hidden, c.topk, c.encoding).total;
  w.staging = 0;
  w.headers = align_up(w.staging + s * w.staging_stride, kCacheLine);
  w.pos = align_up(w.headers + s * sizeof(protocol::SlotHeader), kCacheLine);
  w.count = align_up(w.pos + uint64_t{c.max_tokens} * s * sizeof(int32_t), kCacheLine);
  w.sent_seq = align_up(w.count + s * sizeof(int32_t), kCacheLine);
  w.status = align_up(w.sent_seq + s * sizeof(uint64_t), kCacheLine);
  w.detail = align_up(w.status + s * sizeof(int32_t), kCacheLine);
  w.arrival_sent = align_up(w.detail + s * sizeof(int32_t), kCacheLine);
  w.pending_seq = align_up(w.arrival_sent + s * sizeof(uint64_t), kCacheLine);
  w.done_warps = align_up(w.pending_seq + s * sizeof(uint64_t), kCacheLine);
  w.total = align_up(w.done_warps + s * sizeof(uint64_t), kCacheLine);
  return w;
}

// Server: what the poll kernel decided for one (client, slot) entry.
enum class EntryAction : int32_t {
  kNone = 0,    // not REQUEST_READY, payload still arriving, or left for a later step
  kServe = 1,   // valid: its tokens are in this step's batch
  kReject = 2,  // answered with an error status (code), no payload
};

struct EntryState {
  int32_t action;       // EntryAction
  int32_t code;         // kReject: ValidateCode or ResponseStatus sent back
  uint32_t num_tokens;  // kServe: tokens of the request
  uint32_t topk;        // kServe: the request's topk (<= the connection's)
  uint32_t layer_id;
  uint32_t reserved;
  uint64_t seq;
};
static_assert(sizeof(EntryState) == 32, "entries are read by the host too: keep the layout fixed");

// Server: everything one step needs, for num_clients * num_slots entries (entry = client *
// num_slots + slot) and at most max_step_tokens tokens per step (entries that would overflow it
// wait for the next step, so memory is bounded by max_step_tokens, not by the client count).
struct ServerWorkspaceLayout {
  uint64_t entries = 0;        // [B] EntryState
  uint64_t batch_offsets = 0;  // [B + 1] int64: first step token of each entry
  uint64_t x = 0;              // [max_step_tokens][row_bytes] request activations, concatenated
  uint64_t row_bytes = 0;      // hidden * encoding_elem_bytes(encoding)
  uint64_t scales = 0;         // [max_step_tokens][scales_per_token] f32
  uint64_t ids = 0;            // [max_step_tokens][topk] int32 (-1 padded)
  uint64_t scores = 0;         // [max_step_tokens][topk] f32
  uint64_t tile_hist = 0;      // [num_tiles][num_experts] int32
  uint64_t tile_prefix = 0;    // [num_tiles][num_experts] int32
  uint64_t counts = 0;         // [num_experts] int32
  uint64_t src_token = 0;      // [max_rows] int64  (ReorgOutputs)
  uint64_t src_batch = 0;      // [max_rows] int32
  uint64_t src_row = 0;        // [max_rows] int32
  uint64_t src_k = 0;          // [max_rows] int32
  uint64_t row_scores = 0;     // [max_rows] f32
  uint64_t slot_of = 0;        // [max_step_tokens * topk] int64
  uint64_t rows = 0;           // [max_rows][row_bytes] activations in per-expert layout
  uint64_t offsets = 0;        // [num_experts + 1] int64   (ShrinkOutputs)
  uint64_t active = 0;         // [num_experts] int32
  uint64_t tile_counts = 0;    // [num_experts] int32
  uint64_t tile_offsets = 0;   // [num_experts + 1] int32
  uint64_t totals = 0;         // [2] int32
  uint64_t response = 0;       // [max_step_tokens][out row] + one line of slack (see below)
  uint64_t headers = 0;        // [B] SlotHeader, the source of the response header puts
  // Kept across steps (zero at start; zero a client's entries when its index gets a new one):
  uint64_t arrival_sent = 0;  // [B] u64: bytes ever added to the entry's response counter
  uint64_t done_warps = 0;    // [B] u64: put warps finished and bytes put (as the client's)
  uint64_t num_entries = 0;
  uint64_t max_rows = 0;  // max_step_tokens * topk: every copy of every token
  uint64_t num_tiles = 0;
  uint64_t total = 0;
};

MC_HOST_DEVICE inline ServerWorkspaceLayout server_workspace_layout(const protocol::SlotConfig& c,
                                                                    uint32_t num_clients,
                                                                    uint32_t num_slots,
                                                                    uint32_t max_step_tokens,
                                                                    uint32_t num_experts) {
  ServerWorkspaceLayout w;
  const uint64_t b = uint64_t{num_clients} * num_slots;
  const uint64_t t = max_step_tokens;
  const uint64_t e = num_experts;
  w.num_entries = b;
  w.max_rows = t * c.topk;
  w.num_tiles = ceil_div(w.max_rows, static_cast<uint64_t>(kReorgCopiesPerTile));
  w.row_bytes = uint64_t{c.hidden} * protocol::encoding_elem_bytes(c.encoding);
  const uint64_t spt = protocol::encoding_scales_per_token(c.encoding, c.hidden);
  const uint64_t out_row = uint64_t{c.hidden} * protocol::encoding_elem_bytes(c.out_encoding);
  uint64_t at = 0;
  auto part = [&at](uint64_t bytes) {
    const uint64_t off = at;
    at = align_up(at + bytes, kCacheLine);
    return off;
  };
  w.entries = part(b * sizeof(EntryState));
  w.batch_offsets = part((b + 1) * sizeof(int64_t));
  w.x = part(t * w.row_bytes);
  w.scales = part(t * spt * sizeof(float));
  w.ids = part(w.max_rows * sizeof(int32_t));
  w.scores = part(w.max_rows * sizeof(float));
  w.tile_hist = part(w.num_tiles * e * sizeof(int32_t));
  w.tile_prefix = part(w.num_tiles * e * sizeof(int32_t));
  w.counts = part(e * sizeof(int32_t));
  w.src_token = part(w.max_rows * sizeof(int64_t));
  w.src_batch = part(w.max_rows * sizeof(int32_t));
  w.src_row = part(w.max_rows * sizeof(int32_t));
  w.src_k = part(w.max_rows * sizeof(int32_t));
  w.row_scores = part(w.max_rows * sizeof(float));
  w.slot_of = part(w.max_rows * sizeof(int64_t));
  w.rows = part(w.max_rows * w.row_bytes);
  w.offsets = part((e + 1) * sizeof(int64_t));
  w.active = part(e * sizeof(int32_t));
  w.tile_counts = part(e * sizeof(int32_t));
  w.tile_offsets = part((e + 1) * sizeof(int32_t));
  w.totals = part(2 * sizeof(int32_t));
  // A response payload is its rows padded to kSlotAlign; the padding is put from the bytes
  // after the entry's rows, so the last entry needs one alignment unit of slack.
  w.response = part(t * out_row + protocol::kSlotAlign);
  w.headers = part(b * sizeof(protocol::SlotHeader));
  w.arrival_sent = part(b * sizeof(uint64_t));
  w.done_warps = part(b * sizeof(uint64_t));
  w.total = at;
  return w;
}

}  // namespace moecomm::kernels::cuda
