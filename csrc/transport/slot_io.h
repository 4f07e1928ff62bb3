// The slot protocol over any Transport: how a client writes a request, how a server finds,
// validates and answers requests, and how a client waits for its answer. Every ordering rule of
// the protocol lives here, once:
//   writer: payload, then header, then the signal word (release), then the doorbell;
//   server: copy what it needs, release its request slot (IDLE), then signal the response, so a
//           client that reuses the slot at once can never have its new request wiped;
//   reader: acquire the signal word before reading anything else; copy the header, validate it.
// Read once, own the copy: once a side releases a slot it never touches it again. With a ring's
// `poison` set (debug mode) the releasing side overwrites what it read first, so a late read
// fails loudly (protocol/poison.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "protocol/header.h"
#include "protocol/layout.h"
#include "protocol/signal.h"
#include "protocol/validate.h"
#include "transport/transport.h"

namespace moecomm::slots {

using protocol::Encoding;
using protocol::PayloadLayout;
using protocol::SlotConfig;
using protocol::SlotHeader;
using protocol::ValidateCode;
using transport::Region;
using transport::Transport;
using transport::WaitStatus;

// Where a region's slots live: the same shape on both sides (request slots in the server's
// memory, response slots in the client's).
struct SlotRing {
  SlotConfig config;
  uint32_t num_slots = 0;
  bool request = true;  // request slots (server side) or response slots (client side)
  bool poison = false;  // debug: poison a slot's header and payload when it is released

  uint64_t slot_bytes() const;
  uint64_t region_bytes() const;
  uint64_t slot_offset(uint32_t slot) const;
  // Throws unless `r` is large enough for this ring and `slot` is in range.
  void check(const Region& r, uint32_t slot) const;
};

// A request as the client hands it over: pointers into host memory, laid out densely.
struct RequestData {
  uint32_t layer_id = 0;
  uint32_t num_tokens = 0;
  uint32_t topk = 0;
  Encoding encoding = Encoding::kBF16;
  const void* activations = nullptr;    // [num_tokens, hidden] in `encoding`
  const float* scales = nullptr;        // [num_tokens, scales_per_token] when quantized
  const int32_t* expert_ids = nullptr;  // [num_tokens, topk], -1 = not for this server
  const float* scores = nullptr;        // [num_tokens, topk]
};

// Checks everything about a request before a single byte is written. Throws with a reason.
void check_request(const SlotRing& ring, const RequestData& req);

// What a request's header says about its payload; `check_request` checks these and its pointers.
struct RequestShape {
  uint32_t layer_id = 0;
  uint32_t num_tokens = 0;
  uint32_t topk = 0;
  Encoding encoding = Encoding::kBF16;
};
void check_request_shape(const SlotRing& ring, const RequestShape& shape);

// Client: writes `req` into `slot` of the server's request region and signals REQUEST_READY|seq.
// Then bumps the doorbell: the line at offset 0 of `doorbell` when given (a server that serves
// many clients sleeps on one shared doorbell), else the one at offset 0 of `server`.
void send_request(Transport& t, Region& server, const SlotRing& ring, uint32_t slot,
                  uint64_t client_id, uint64_t seq, const RequestData& req,
                  Region* doorbell = nullptr, bool wake = true);

// Client, zero copy: the payload of `shape` was written straight into `slot` of the server's
// mapped request region (at the offsets of protocol::request_payload_layout); writes the header,
// signals REQUEST_READY|seq (a release: the payload is visible before it) and rings as
// send_request does. The shape is checked before the header is written.
void commit_request(Transport& t, Region& server, const SlotRing& ring, uint32_t slot,
                    uint64_t client_id, uint64_t seq, const RequestShape& shape,
                    Region* doorbell = nullptr, bool wake = true);

// Client: bumps the doorbell at offset 0 of `doorbell` (a server's shared doorbell, or its
// request region). To reach several servers, write every request with wake = false first, then
// ring each doorbell: waking a server can preempt the writer on a busy core.
void ring_doorbell(Transport& t, Region& doorbell);

struct Incoming {
  uint32_t slot = 0;
  uint64_t seq = 0;
  bool offline = false;  // the slot was marked OFFLINE (its client is gone)
  SlotHeader header{};
  ValidateCode code = ValidateCode::kOk;
  uint64_t payload_offset = 0;  // region offset of the payload
  PayloadLayout layout{};       // meaningful when code == kOk
};

// Server: every slot of `local` whose signal is REQUEST_READY, header copied and validated, and
// (valid headers) whose payload has fully arrived; a slot still receiving is left for a later
// poll.
std::vector<Incoming> poll_requests(Transport& t, Region& local, const SlotRing& ring,
                                    uint64_t client_id);

// Server: sleeps until the doorbell of `local` differs from `seen` (the value read before the
// last poll), the deadline passes or `peer` dies. Returns the wait result.
transport::WaitResult wait_doorbell(Transport& t, Region& local, uint64_t seen, int64_t timeout_ns,
                                    const Region* peer);

// Server: answers the request in `slot`: writes the response payload and header into the
// client's region, marks its own request slot IDLE, then signals RESPONSE_READY|seq.
void send_response(Transport& t, Region& local, const SlotRing& request_ring, Region& client,
                   const SlotRing& response_ring, uint32_t slot, uint64_t client_id, uint64_t seq,
                   uint32_t layer_id, uint32_t num_tokens, Encoding encoding,
                   const void* activations);

// Server, zero copy: the response payload of `num_tokens` rows was written straight into
// `slot` of the client's mapped response region; writes the header, releases the request slot
// and signals, as send_response does after its put.
void commit_response(Transport& t, Region& local, const SlotRing& request_ring, Region& client,
                     const SlotRing& response_ring, uint32_t slot, uint64_t client_id, uint64_t seq,
                     uint32_t layer_id, uint32_t num_tokens, Encoding encoding);

// Server: answers with an error `status` and a reason string (truncated to fit the slot).
void send_error(Transport& t, Region& local, const SlotRing& request_ring, Region& client,
                const SlotRing& response_ring, uint32_t slot, uint64_t client_id, uint64_t seq,
                uint32_t layer_id, int32_t status, const std::string& reason);

// Client: releases response `slot` of its own region once every byte it needs from it was copied
// or consumed; with ring.poison, overwrites the header and the first `payload_bytes` of payload.
void release_response(Transport& t, Region& local, const SlotRing& ring, uint32_t slot,
                      uint64_t payload_bytes);

// Server: marks `slot` of its own request region OFFLINE (its client is gone).
void mark_offline(Transport& t, Region& local, const SlotRing& ring, uint32_t slot, uint64_t seq);

// One chunk of a stage package (MessageKind::kStage) as the sender hands it over.
struct StageChunk {
  uint32_t tag = 0;         // the package's tag: a step, a layer
  uint32_t chunk = 0;       // index of this chunk in the package
  uint32_t num_chunks = 1;  // chunks in the package
  Encoding encoding = Encoding::kF32;
  const void* bytes = nullptr;
  uint64_t num_bytes = 0;  // 1 .. the slot's payload capacity
};

// Stage sender: writes `c` into `slot` of the receiver's data ring (a request-shaped ring in the
// receiver's memory) and signals REQUEST_READY|seq, then rings `doorbell` (or the receiver's
// region) unless `wake` is false. Throws, before writing, when the chunk does not fit.
void send_stage(Transport& t, Region& receiver, const SlotRing& ring, uint32_t slot,
                uint64_t client_id, uint64_t seq, const StageChunk& c, Region* doorbell = nullptr,
                bool wake = true);

// Stage receiver: every slot of its data ring holding a chunk, header copied and validated as a
// stage chunk (a request or anything else there is refused with kBadKind).
std::vector<Incoming> poll_stage(Transport& t, Region& local, const SlotRing& ring,
                                 uint64_t client_id);

// Stage receiver: acknowledges the chunk `chunk` (its validated header) read from `slot` once it
// was copied out: releases the data slot, then writes a header-only ack (status 0) or a refusal
// (status != 0 with `reason`) into the sender's ack ring and signals RESPONSE_READY|seq.
void send_stage_ack(Transport& t, Region& local, const SlotRing& data_ring, Region& sender,
                    const SlotRing& ack_ring, uint32_t slot, uint64_t client_id, uint64_t seq,
                    const SlotHeader& chunk, int32_t status, const std::string& reason);

struct Outcome {
  WaitStatus status = WaitStatus::kOk;
  bool offline = false;  // the peer marked the slot OFFLINE instead of answering
  // The signal and the header came, the payload did not reach the header's arrival_target
  // before the deadline (status says why).
  bool payload_late = false;
  uint64_t word = 0;
  uint64_t stale_dropped = 0;  // late answers to older sequence numbers that were ignored
  SlotHeader header{};
  ValidateCode code = ValidateCode::kOk;
  uint64_t payload_offset = 0;
};

// Client: waits for RESPONSE_READY with sequence `seq` in `slot` of its own response region.
// Answers carrying an older sequence number are dropped (counted in stale_dropped).
Outcome wait_response(Transport& t, Region& local, const SlotRing& ring, uint32_t slot,
                      uint64_t client_id, uint64_t seq, int64_t timeout_ns, const Region* peer);

// One answer a client waits for in wait_any_response: `seq` in `slot` of `ring` in its own
// region `local`, sent to the owner of `peer`.
struct AnswerWait {
  Region* local = nullptr;
  const SlotRing* ring = nullptr;
  uint32_t slot = 0;
  uint64_t seq = 0;
  const Region* peer = nullptr;
};

struct AnyOutcome {
  int64_t index = -1;  // which wait ended (its answer came, or its peer died); -1: the deadline
  Outcome outcome;     // that wait's outcome, as wait_response gives it
};

// Client: waits for the first of several answers (each in its own slot, from its own peer) —
// the answer, or the death of its peer, whichever comes first — with one deadline for all. One
// sleep on every word at once where the transport can (shm), so the order of `waits` does not
// decide which server is heard first.
AnyOutcome wait_any_response(Transport& t, const std::vector<AnswerWait>& waits, uint64_t client_id,
                             int64_t timeout_ns);

// Stage sender: waits for the ack of chunk `seq` in `slot` of its own ack ring (as
// wait_response, the header validated as a stage ack).
Outcome wait_stage_ack(Transport& t, Region& local, const SlotRing& ring, uint32_t slot,
                       uint64_t client_id, uint64_t seq, int64_t timeout_ns, const Region* peer);

}  // namespace moecomm::slots
