// The reading half of the slot protocol (slot_io.h): polling request slots, waiting for answers,
// the arrival counter of device writers. The writing half is in slot_io.cc.
#include <algorithm>
#include <chrono>
#include <thread>

#include "common/error.h"
#include "transport/slot_io.h"

namespace moecomm::slots {

using protocol::kArrivalOffset;
using protocol::kHeaderOffset;
using protocol::kPayloadOffset;
using protocol::kSignalOffset;
using protocol::MessageKind;
using protocol::signal_seq;
using protocol::signal_state;
using protocol::SlotState;
using transport::WaitOp;
using transport::WaitPredicate;

namespace {

// The doorbell word: the first line of a region (slot_io.cc rings it).
constexpr uint64_t kDoorbellOffset = 0;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The slot's arrival counter (layout.h). Read through Transport::read, not load: the word sits
// inside the signal line, not at its start, and host transports only wait on line-aligned words.
// Any header may claim a target, so this must work on every transport.
uint64_t arrival_count(Transport& t, Region& local, uint64_t slot_off) {
  uint64_t v = 0;
  t.read(local, slot_off + kArrivalOffset, &v, sizeof(v));
  std::atomic_thread_fence(std::memory_order_acquire);  // payload reads come after this one
  return v;
}

// Whether every payload byte of the message whose header is `h` has landed (layout.h).
bool arrived(Transport& t, Region& local, uint64_t slot_off, const SlotHeader& h) {
  return h.arrival_target == 0 || arrival_count(t, local, slot_off) >= h.arrival_target;
}

// Polls the arrival counter until `h`'s target, the deadline or the peer's death. Device writers
// do not wake host sleepers, so this polls, backing off to kArrivalPollMaxNs.
WaitStatus wait_arrival(Transport& t, Region& local, uint64_t slot_off, const SlotHeader& h,
                        int64_t deadline, const Region* peer) {
  constexpr int64_t kArrivalPollMaxNs = 50'000;     // a chunk in flight lands within microseconds
  constexpr int64_t kLivenessEveryNs = 20'000'000;  // as the transports' own waits
  int64_t nap = 1'000;
  int64_t next_liveness = now_ns() + kLivenessEveryNs;
  while (!arrived(t, local, slot_off, h)) {
    const int64_t now = now_ns();
    if (now >= deadline) return WaitStatus::kTimeout;
    if (peer != nullptr && now >= next_liveness) {
      if (!t.peer_alive(*peer)) return WaitStatus::kPeerLost;
      next_liveness = now + kLivenessEveryNs;
    }
    std::this_thread::sleep_for(std::chrono::nanoseconds(std::min(nap, deadline - now)));
    nap = std::min(nap * 2, kArrivalPollMaxNs);
  }
  return WaitStatus::kOk;
}

// Copies the header of the slot at `slot_off` through the transport (device memory has no host
// mapping), then validates the copy.
ValidateCode read_header(Transport& t, Region& local, uint64_t slot_off,
                         const protocol::Expectation& e, SlotHeader* out) {
  if (e.slot_bytes < kPayloadOffset) return ValidateCode::kSlotTooSmall;
  alignas(uint64_t) uint8_t slot_start[kPayloadOffset] = {};
  t.read(local, slot_off + kHeaderOffset, slot_start + kHeaderOffset, sizeof(SlotHeader));
  return protocol::read_and_validate(slot_start, e, out);
}

}  // namespace

namespace {

// Every slot of a request-shaped ring in REQUEST_READY, header copied and validated as `kind`.
std::vector<Incoming> poll_ready(Transport& t, Region& local, const SlotRing& ring,
                                 uint64_t client_id, MessageKind kind) {
  MC_CHECK(ring.request, "polling reads a request ring");
  ring.check(local, 0);
  std::vector<Incoming> ready;
  protocol::Expectation e;
  e.kind = kind;
  e.config = ring.config;
  e.slot_bytes = ring.slot_bytes();
  e.client_id = client_id;
  for (uint32_t s = 0; s < ring.num_slots; ++s) {
    const uint64_t off = ring.slot_offset(s);
    const uint64_t w = t.load(local, off + kSignalOffset);
    if (signal_state(w) != SlotState::kRequestReady) continue;
    Incoming in;
    in.slot = s;
    in.seq = signal_seq(w);
    e.seq = in.seq;
    in.code = read_header(t, local, off, e, &in.header);
    // A device writer's chunks may still be landing: leave the slot for a later poll until the
    // arrival counter says every byte is there (a rejected header is answered at once: its
    // late bytes are counted by the writer and hurt nothing).
    if (in.code == ValidateCode::kOk && !arrived(t, local, off, in.header)) continue;
    in.payload_offset = off + kPayloadOffset;
    if (in.code == ValidateCode::kOk && kind == MessageKind::kRequest) {
      in.layout =
          protocol::request_payload_layout(in.header.num_tokens, in.header.hidden, in.header.topk,
                                           static_cast<Encoding>(in.header.encoding));
    }
    ready.push_back(in);
  }
  return ready;
}

}  // namespace

std::vector<Incoming> poll_requests(Transport& t, Region& local, const SlotRing& ring,
                                    uint64_t client_id) {
  return poll_ready(t, local, ring, client_id, MessageKind::kRequest);
}

std::vector<Incoming> poll_stage(Transport& t, Region& local, const SlotRing& ring,
                                 uint64_t client_id) {
  return poll_ready(t, local, ring, client_id, MessageKind::kStage);
}

transport::WaitResult wait_doorbell(Transport& t, Region& local, uint64_t seen, int64_t timeout_ns,
                                    const Region* peer) {
  WaitPredicate pred{WaitOp::kNotEqual, ~uint64_t{0}, seen};
  return t.wait(local, kDoorbellOffset, pred, timeout_ns, peer);
}

namespace {

// Waits for RESPONSE_READY|seq in `slot` of a response-shaped ring and validates the header as
// a response (or, with `stage`, as a stage ack).
Outcome wait_answer(Transport& t, Region& local, const SlotRing& ring, uint32_t slot,
                    uint64_t client_id, uint64_t seq, int64_t timeout_ns, const Region* peer,
                    bool stage) {
  MC_CHECK(!ring.request, "answers are read from a response ring");
  ring.check(local, slot);
  const uint64_t off = ring.slot_offset(slot);
  const int64_t deadline = timeout_ns < 0 ? INT64_MAX : now_ns() + timeout_ns;
  Outcome out;
  // The word left by the previous round trip on this slot is expected, not a late answer;
  // only older answers that arrive while we wait are counted as dropped.
  uint64_t last_seen = t.load(local, off + kSignalOffset);
  for (;;) {
    const uint64_t w = t.load(local, off + kSignalOffset);
    const SlotState state = signal_state(w);
    if (state == SlotState::kOffline) {
      out.offline = true;
      out.word = w;
      return out;
    }
    if (state == SlotState::kResponseReady && signal_seq(w) == seq) break;
    if (state == SlotState::kResponseReady && signal_seq(w) < seq && w != last_seen) {
      ++out.stale_dropped;
    }
    last_seen = w;
    const int64_t remaining =
        deadline == INT64_MAX ? -1 : std::max<int64_t>(0, deadline - now_ns());
    const transport::WaitResult r =
        t.wait(local, off + kSignalOffset, WaitPredicate{WaitOp::kNotEqual, ~uint64_t{0}, w},
               remaining, peer);
    if (r.status != WaitStatus::kOk) {
      out.status = r.status;
      out.word = r.value;
      return out;
    }
  }
  out.word = t.load(local, off + kSignalOffset);
  protocol::Expectation e;
  e.kind = stage ? MessageKind::kStage : MessageKind::kResponse;
  e.config = ring.config;
  e.slot_bytes = ring.slot_bytes();
  e.client_id = client_id;
  e.seq = seq;
  e.stage_ack = stage;
  out.code = read_header(t, local, off, e, &out.header);
  out.payload_offset = off + kPayloadOffset;
  // Signal and header seen; a device writer's chunks may still be landing (layout.h).
  if (out.code == ValidateCode::kOk && out.header.arrival_target != 0) {
    const WaitStatus st = wait_arrival(t, local, off, out.header, deadline, peer);
    if (st != WaitStatus::kOk) {
      out.status = st;
      out.payload_late = true;
    }
  }
  return out;
}

}  // namespace

Outcome wait_response(Transport& t, Region& local, const SlotRing& ring, uint32_t slot,
                      uint64_t client_id, uint64_t seq, int64_t timeout_ns, const Region* peer) {
  return wait_answer(t, local, ring, slot, client_id, seq, timeout_ns, peer, false);
}

AnyOutcome wait_any_response(Transport& t, const std::vector<AnswerWait>& waits, uint64_t client_id,
                             int64_t timeout_ns) {
  MC_CHECK(!waits.empty(), "wait_any_response needs at least one answer to wait for");
  const int64_t deadline = timeout_ns < 0 ? INT64_MAX : now_ns() + timeout_ns;
  std::vector<transport::WaitItem> items(waits.size());
  for (;;) {
    // Anything but an older answer still in the slot ends the wait on that slot: its own answer
    // (validated by wait_answer below), OFFLINE, or a newer word wait_answer reports.
    for (size_t i = 0; i < waits.size(); ++i) {
      const AnswerWait& a = waits[i];
      MC_CHECK(a.local != nullptr && a.ring != nullptr, "wait_any_response: wait ", i,
               " has no region or ring");
      MC_CHECK(!a.ring->request, "answers are read from a response ring");
      a.ring->check(*a.local, a.slot);
      const uint64_t off = a.ring->slot_offset(a.slot) + kSignalOffset;
      const uint64_t w = t.load(*a.local, off);
      const SlotState state = signal_state(w);
      if (state == SlotState::kOffline ||
          (state == SlotState::kResponseReady && signal_seq(w) == a.seq)) {
        const int64_t left = deadline == INT64_MAX ? -1 : std::max<int64_t>(0, deadline - now_ns());
        return {static_cast<int64_t>(i),
                wait_answer(t, *a.local, *a.ring, a.slot, client_id, a.seq, left, a.peer, false)};
      }
      items[i] = {a.local, off, WaitPredicate{WaitOp::kNotEqual, ~uint64_t{0}, w}, a.peer};
    }
    const int64_t left = deadline == INT64_MAX ? -1 : std::max<int64_t>(0, deadline - now_ns());
    const transport::WaitAnyResult r = t.wait_any(items.data(), items.size(), left);
    if (r.status == WaitStatus::kTimeout) {
      AnyOutcome out;
      out.outcome.status = WaitStatus::kTimeout;
      return out;
    }
    if (r.status != WaitStatus::kOk) {
      AnyOutcome out{r.index, {}};
      out.outcome.status = r.status;
      out.outcome.word = r.value;
      return out;
    }
  }
}

Outcome wait_stage_ack(Transport& t, Region& local, const SlotRing& ring, uint32_t slot,
                       uint64_t client_id, uint64_t seq, int64_t timeout_ns, const Region* peer) {
  return wait_answer(t, local, ring, slot, client_id, seq, timeout_ns, peer, true);
}

}  // namespace moecomm::slots
