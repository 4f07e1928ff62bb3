// The transport interface: register memory a peer can write, attach to a peer's memory, write
// into it one-sided, raise signal words with release semantics and wait on one's own words with
// acquire semantics and a deadline. The slot protocol (protocol/) is written against this
// interface only, so it runs unchanged over every backend.
#pragma once

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "common/error.h"

namespace moecomm::transport {

enum class SignalOp : uint8_t {
  kSet = 0,  // store the value (slot state words)
  kAdd = 1,  // add the value (arrival counters, doorbells)
};

enum class WaitOp : uint8_t {
  kEqual = 0,     // (word & mask) == value
  kNotEqual = 1,  // (word & mask) != value
};

struct WaitPredicate {
  WaitOp op = WaitOp::kNotEqual;
  uint64_t mask = ~uint64_t{0};
  uint64_t value = 0;

  bool satisfied(uint64_t word) const {
    const bool eq = (word & mask) == value;
    return op == WaitOp::kEqual ? eq : !eq;
  }
};

enum class WaitStatus : uint8_t {
  kOk = 0,
  kTimeout = 1,
  kPeerLost = 2,
};

struct WaitResult {
  WaitStatus status = WaitStatus::kOk;
  uint64_t value = 0;  // the last word observed
};

class Region;

// One word of a wait_any: a word of our own region, what ends the wait on it, and the peer
// whose death ends it too (optional).
struct WaitItem {
  Region* local = nullptr;
  uint64_t offset = 0;
  WaitPredicate pred;
  const Region* peer = nullptr;
};

struct WaitAnyResult {
  WaitStatus status = WaitStatus::kOk;
  int64_t index = -1;  // the item whose word is satisfied or whose peer died; -1 on a timeout
  uint64_t value = 0;  // that item's last word observed
};

// Memory registered with a transport: either our own (owned) or a peer's we attached to.
class Region {
 public:
  virtual ~Region() = default;
  // Local mapping of the region. Backends that cannot map a peer's memory return nullptr for
  // attached regions; shm maps both.
  virtual uint8_t* data() = 0;
  virtual uint64_t size() const = 0;
  // The string a peer passes to Transport::attach().
  virtual std::string handle() const = 0;
  virtual bool owned() const = 0;
  // Gives up the region's name (an owned region can no longer be attached to). The mapping
  // itself lives until the object is destroyed, so views handed out earlier stay valid.
  virtual void close() = 0;
  virtual bool closed() const = 0;
  // Human-readable identity of the region's owner, for error messages.
  virtual std::string describe() const = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;
  // A new zero-filled region of `bytes` that peers can attach to.
  virtual std::shared_ptr<Region> create_region(uint64_t bytes) = 0;
  virtual std::shared_ptr<Region> attach(const std::string& handle) = 0;
  // One-sided write of `bytes` from local memory into a peer's region.
  virtual void put(Region& dst, uint64_t offset, const void* src, uint64_t bytes) = 0;
  // Raises the 64-bit word at `offset` in `dst`; everything put before it is visible to a reader
  // that observes the new value (release). Wakes a reader sleeping on that word.
  virtual void signal(Region& dst, uint64_t offset, uint64_t value, SignalOp op) = 0;
  // Waits until the word at `offset` of our own region satisfies `pred` (acquire), the deadline
  // passes, or `peer` (optional) is found dead. Never blocks past the deadline.
  virtual WaitResult wait(Region& local, uint64_t offset, const WaitPredicate& pred,
                          int64_t timeout_ns, const Region* peer) = 0;
  // Copies `bytes` at `offset` of a region (ours or a peer's) into host memory `dst`, word by
  // word where aligned, as a reader that may race a writer must. The default reads through
  // data(); backends whose memory the host cannot map (device memory) override it.
  virtual void read(Region& region, uint64_t offset, void* dst, uint64_t bytes);
  // Reads the word at `offset` of our own region with acquire semantics.
  virtual uint64_t load(Region& local, uint64_t offset) = 0;
  // Atomically replaces the word at `offset` of our own region with `desired` if it still holds
  // `expected` (acq_rel). Returns whether it did.
  virtual bool compare_exchange(Region& local, uint64_t offset, uint64_t expected,
                                uint64_t desired) = 0;
  // Orders all earlier puts before all later ones.
  virtual void fence() = 0;
  // False once the owner of `peer` is known to be gone.
  virtual bool peer_alive(const Region& peer) = 0;
  // Waits until the word of any item satisfies its predicate or any item's peer is found dead,
  // or the deadline passes. The default waits on the items in turn, a short slice each (the
  // backend's own wait drives its progress); shm sleeps on every word at once.
  virtual WaitAnyResult wait_any(const WaitItem* items, uint64_t count, int64_t timeout_ns);
};

inline void Transport::read(Region& region, uint64_t offset, void* dst, uint64_t bytes) {
  MC_CHECK(region.data() != nullptr, region.describe(), " has no host mapping: its transport (",
           name(), ") must override read()");
  MC_CHECK(offset <= region.size() && bytes <= region.size() - offset, "read of ", bytes,
           " bytes at offset ", offset, " is outside ", region.describe());
  const uint8_t* src = region.data() + offset;
  auto* out = static_cast<uint8_t*>(dst);
  uint64_t i = 0;
  if (reinterpret_cast<uintptr_t>(src) % sizeof(uint64_t) == 0) {
    // Word-wise volatile loads (the writer may still be changing the range), then memcpy out:
    // writing through a uint64_t* into `dst` would break strict aliasing.
    for (; i + sizeof(uint64_t) <= bytes; i += sizeof(uint64_t)) {
      const uint64_t w = *reinterpret_cast<const volatile uint64_t*>(src + i);
      std::memcpy(out + i, &w, sizeof(w));
    }
  }
  for (; i < bytes; ++i) out[i] = *reinterpret_cast<const volatile uint8_t*>(src + i);
}

inline WaitAnyResult Transport::wait_any(const WaitItem* items, uint64_t count,
                                         int64_t timeout_ns) {
  MC_CHECK(count > 0, "wait_any needs at least one item");
  // Each item's turn: short enough that an answer on another item waits little for its turn.
  constexpr int64_t kSliceNs = 200'000;
  const auto now = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  const int64_t deadline = timeout_ns < 0 ? INT64_MAX : now() + timeout_ns;
  for (;;) {
    for (uint64_t i = 0; i < count; ++i) {
      const int64_t left = deadline == INT64_MAX ? kSliceNs : deadline - now();
      const WaitItem& it = items[i];
      const WaitResult r = wait(*it.local, it.offset, it.pred,
                                std::max<int64_t>(0, std::min(left, kSliceNs)), it.peer);
      if (r.status != WaitStatus::kTimeout) {
        return {r.status, static_cast<int64_t>(i), r.value};
      }
    }
    if (now() >= deadline) return {WaitStatus::kTimeout, -1, 0};
  }
}

// Signal words live at the start of a cache line: backends keep per-word state (shm: the count
// of sleeping waiters) in the rest of the line.
constexpr uint64_t kSignalWordAlign = 64;

}  // namespace moecomm::transport
