// Internals of the nixl transport shared by its translation units: per-thread staging, the
// state regions share with the transport, and the two region kinds. Not part of the interface.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/error.h"
#include "transport/nixl/nixl_transport.h"

namespace moecomm::transport::nixl::detail {

// The first bytes of every staging buffer: the source of signal words and the target of small
// reads (loads, liveness probes), apart from the queued payload that follows them.
constexpr uint64_t kScratchBytes = 64;
// Queued puts start on a cache line, so a staged header is never split oddly.
constexpr uint64_t kStageAlign = 64;
// kAdd on a peer's word writes (tag << 32 | counter): a value no other writer can produce.
constexpr int kTagShift = 32;
// load() of our own word drains notifications at most this often: a server scanning its slots
// loads many words in a row, and one drain (a call into the NIXL agent) serves them all.
constexpr int64_t kLoadDrainIntervalNs = 10'000;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline uint64_t page_round(uint64_t bytes) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return (std::max<uint64_t>(bytes, 1) + page - 1) / page * page;
}

inline uint8_t* map_zeroed(uint64_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  MC_CHECK_KIND(p != MAP_FAILED, ErrorKind::kSystem, "mmap of ", bytes,
                " bytes failed: ", std::strerror(errno));
  return static_cast<uint8_t*>(p);
}

inline void check_range(const Region& r, uint64_t offset, uint64_t bytes) {
  MC_CHECK(offset <= r.size() && bytes <= r.size() - offset, "access of ", bytes,
           " bytes at offset ", offset, " is outside ", r.describe());
}

inline void check_word(const Region& r, uint64_t offset) {
  MC_CHECK(offset % sizeof(uint64_t) == 0, "signal word offset ", offset, " is not 8-aligned");
  check_range(r, offset, sizeof(uint64_t));
}

inline std::string hex(uint64_t v) {
  std::ostringstream os;
  os << std::hex << v;
  return os.str();
}

struct Pending {
  std::string agent;
  Segment seg;
};

// Registered host memory a thread stages its puts in (see the header: the caller's memory may
// be reused as soon as put returns), and the span of the queued puts that read our own
// registered memory in place instead (the header, "Zero copy").
struct Staging {
  uint8_t* base = nullptr;
  uint64_t capacity = 0;
  uint64_t used = kScratchBytes;
  std::vector<Pending> pending;
  uint64_t borrowed_lo = UINT64_MAX;  // [lo, hi): every queued in-place source lies inside
  uint64_t borrowed_hi = 0;
  bool borrowing() const { return borrowed_lo < borrowed_hi; }
};

// Gives a region's pages back but keeps its address range mapped, for good. Over UCX's TCP
// transport a remote read or write is carried out by our own progress thread with a plain memcpy
// (deregistering revokes nothing), so a peer that still holds the handle — a server probing a
// client that just closed the channel — would otherwise fault this process; and a range that is
// never reused can never receive a late write meant for its previous region.
inline void retire(uint8_t* base, uint64_t bytes) {
  void* p = mmap(base, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) munmap(base, bytes);  // no way to keep it: at least free it
}

struct Shared {
  std::shared_ptr<Engine> engine;
  std::string agent;
  uint64_t tag = 0;
  std::atomic<uint32_t> counter{0};
  std::mutex mu;  // guards the maps below; never held across an engine call
  std::unordered_map<std::thread::id, std::unique_ptr<Staging>> staging;
  std::unordered_set<std::string> lost;
  std::unordered_map<uint64_t, std::weak_ptr<Region>> owned;  // by address: attaching to oneself
  // Our registered host memory, base -> bytes: a put from inside it is sent in place.
  std::map<uint64_t, uint64_t> host_ranges;
  // Threads whose queue holds an in-place source: a local write checks for overlap only then.
  std::atomic<int> borrowing_threads{0};
  // Puts sent in place and their bytes (NixlTransport::zero_copy_stats).
  std::atomic<uint64_t> borrowed_puts{0}, borrowed_bytes{0};
  std::unordered_map<std::string, uint32_t> peer_refs;  // for peers(); the engine counts too
  // Held by the one thread draining notifications, across the engine call, so words are stored
  // in the order they came; others only try it (a waiter holding the GIL must never block on a
  // thread that needs the GIL).
  std::mutex drain_mu;
  std::atomic<int64_t> last_drain_ns{0};

  ~Shared() {
    for (auto& [id, s] : staging) {
      try {
        engine->deregister_memory(reinterpret_cast<uint64_t>(s->base), s->capacity);
      } catch (...) {  // the agent is going away with us: nothing left to undo
      }
      retire(s->base, s->capacity);  // a timed-out transfer may still land in it
    }
  }

  Staging& mine() {
    std::lock_guard<std::mutex> lock(mu);
    auto& s = staging[std::this_thread::get_id()];
    if (!s) s = std::make_unique<Staging>();
    return *s;
  }

  // Whether [addr, addr + bytes) lies inside one of our registered host regions.
  bool owned_host(uint64_t addr, uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = host_ranges.upper_bound(addr);
    if (it == host_ranges.begin()) return false;
    --it;
    return addr - it->first <= it->second && bytes <= it->second - (addr - it->first);
  }

  // Forgets this thread's in-place sources (its queue was taken for a transfer).
  void end_borrow(Staging& s) {
    if (!s.borrowing()) return;
    s.borrowed_lo = UINT64_MAX;
    s.borrowed_hi = 0;
    borrowing_threads.fetch_sub(1, std::memory_order_relaxed);
  }

  bool is_lost(const std::string& peer) {
    std::lock_guard<std::mutex> lock(mu);
    return lost.count(peer) > 0;
  }

  void mark_lost(const std::string& peer) {
    std::lock_guard<std::mutex> lock(mu);
    lost.insert(peer);
  }

  // Makes `s` hold at least `bytes` of payload after its scratch (queued puts must be written
  // before, since the old buffer goes).
  void grow(Staging& s, uint64_t bytes) {
    const uint64_t want = page_round(std::max(kInitialStagingBytes, kScratchBytes + bytes));
    if (s.capacity >= want) return;
    MC_CHECK_KIND(s.pending.empty(), ErrorKind::kInternal, "staging grows with puts queued");
    uint8_t* fresh = map_zeroed(want);
    try {
      engine->register_memory(reinterpret_cast<uint64_t>(fresh), want, MemKind::kHost, 0);
    } catch (...) {
      munmap(fresh, want);
      throw;
    }
    if (s.base != nullptr) {
      engine->deregister_memory(reinterpret_cast<uint64_t>(s.base), s.capacity);
      retire(s.base, s.capacity);  // a timed-out transfer may still land in it
    }
    s.base = fresh;
    s.capacity = want;
    s.used = kScratchBytes;
  }

  void check(XferStatus st, const std::string& peer, const char* what) {
    if (st == XferStatus::kDone) return;
    if (st == XferStatus::kPeerLost) {
      mark_lost(peer);
      MC_THROW(ErrorKind::kPeerLost, "nixl ", what, " to ", peer, " failed: the peer is gone");
    }
    MC_THROW(ErrorKind::kTimeout, "nixl ", what, " to ", peer,
             " did not complete in time: the peer is stopped or unreachable");
  }

  // Writes every queued put of this thread (one transfer per peer) and waits for them; the puts
  // to `keep` (an agent) are not written but returned, for the caller's own transfer.
  std::vector<Segment> flush(Staging& s, int64_t timeout_ns, const std::string* keep = nullptr) {
    std::vector<Segment> kept;
    if (s.pending.empty()) return kept;
    std::vector<Pending> queued;
    queued.swap(s.pending);
    s.used = kScratchBytes;  // the caller's transfer is complete before this thread puts again
    end_borrow(s);           // likewise: in-place sources are read by then
    std::vector<std::string> order;
    std::unordered_map<std::string, std::vector<Segment>> by_peer;
    for (const Pending& p : queued) {
      if (keep != nullptr && p.agent == *keep) {
        kept.push_back(p.seg);
        continue;
      }
      auto [it, fresh] = by_peer.try_emplace(p.agent);
      if (fresh) order.push_back(p.agent);
      it->second.push_back(p.seg);
    }
    for (const std::string& peer : order) {
      check(engine->write(peer, by_peer[peer], timeout_ns), peer, "write");
    }
    return kept;
  }

  // Our host memory holding the 8-aligned word at `addr`, or null: a notification may name only
  // a word of a region we own (the region is returned to keep it alive while the word is stored).
  std::shared_ptr<Region> host_region_of(uint64_t addr, uint8_t** at) {
    if (addr % sizeof(uint64_t) != 0) return nullptr;
    std::vector<std::pair<uint64_t, std::weak_ptr<Region>>> regions;
    {
      std::lock_guard<std::mutex> lock(mu);        // copied out: a region's last reference may go
      regions.assign(owned.begin(), owned.end());  // below, and its destructor takes `mu`
    }
    for (auto& [base, weak] : regions) {
      if (addr < base) continue;
      std::shared_ptr<Region> r = weak.lock();
      if (r == nullptr || r->data() == nullptr || addr - base + sizeof(uint64_t) > r->size()) {
        continue;
      }
      *at = reinterpret_cast<uint8_t*>(addr);
      return r;
    }
    return nullptr;
  }
};

// What both region kinds hold alike: the transport's shared state, the size, the handle a peer
// attaches with, the memory kind and device, and the closed mark (closing gives up the name;
// the region stays usable until destroyed, transport.h).
class NixlRegion : public Region {
 public:
  uint64_t size() const final { return bytes_; }
  std::string handle() const final { return handle_; }
  void close() final { closed_ = true; }
  bool closed() const final { return closed_; }
  MemKind kind() const { return kind_; }
  int32_t device() const { return device_; }

 protected:
  NixlRegion(std::shared_ptr<Shared> shared, uint64_t bytes, std::string handle, MemKind kind,
             int32_t device)
      : shared_(std::move(shared)),
        bytes_(bytes),
        handle_(std::move(handle)),
        kind_(kind),
        device_(device) {}

  // "nixl region of <agent> at 0x<addr> (<bytes> bytes<note>)".
  std::string describe_at(const std::string& agent, uint64_t addr, const char* note) const {
    return "nixl region of " + agent + " at 0x" + hex(addr) + " (" + std::to_string(bytes_) +
           " bytes" + note + ")";
  }

  std::shared_ptr<Shared> shared_;

 private:
  uint64_t bytes_;
  std::string handle_;
  MemKind kind_;
  int32_t device_;
  bool closed_ = false;
};

// Our memory: mapped by the transport (create_region), or the caller's (register_external).
class OwnedRegion final : public NixlRegion {
 public:
  OwnedRegion(std::shared_ptr<Shared> shared, uint8_t* base, uint64_t bytes, uint64_t mapped,
              std::string handle, MemKind kind, int32_t device, bool external)
      : NixlRegion(std::move(shared), bytes, std::move(handle), kind, device),
        base_(base),
        mapped_(mapped),
        external_(external) {}
  ~OwnedRegion() override {
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->owned.erase(addr());
      shared_->host_ranges.erase(addr());
    }
    try {
      shared_->engine->deregister_memory(addr(), mapped_);
    } catch (...) {  // a destructor must not throw; the pages go anyway
    }
    if (!external_) retire(base_, mapped_);
  }
  // GPU memory has no host mapping: it is reached by transfers only.
  uint8_t* data() override { return kind() == MemKind::kHost ? base_ : nullptr; }
  bool owned() const override { return true; }
  std::string describe() const override {
    return describe_at(shared_->agent, addr(), kind() == MemKind::kCuda ? ", cuda" : "");
  }
  uint64_t addr() const { return reinterpret_cast<uint64_t>(base_); }

 private:
  uint8_t* base_;
  uint64_t mapped_;
  bool external_;
};

// A peer's region: reached by transfers only, unless the peer is this very transport (`alias`).
class PeerRegion final : public NixlRegion {
 public:
  PeerRegion(std::shared_ptr<Shared> shared, std::string agent, uint64_t addr, uint64_t bytes,
             std::string handle, std::shared_ptr<Region> alias, MemKind kind, int32_t device)
      : NixlRegion(std::move(shared), bytes, std::move(handle), kind, device),
        agent_(std::move(agent)),
        addr_(addr),
        alias_(std::move(alias)) {}
  ~PeerRegion() override {
    if (alias_) return;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      auto it = shared_->peer_refs.find(agent_);
      if (it != shared_->peer_refs.end() && --it->second == 0) shared_->peer_refs.erase(it);
    }
    try {
      shared_->engine->release_peer(agent_);
    } catch (...) {  // the peer is gone already; nothing to disconnect from
    }
  }
  uint8_t* data() override { return alias_ ? alias_->data() : nullptr; }
  bool owned() const override { return false; }
  std::string describe() const override { return describe_at(agent_, addr_, ""); }
  const std::string& agent() const { return agent_; }
  bool is_alias() const { return alias_ != nullptr; }
  uint64_t addr() const { return addr_; }

 private:
  std::string agent_;
  uint64_t addr_;
  std::shared_ptr<Region> alias_;
};

// Local memory of `r` (ours, or a peer that is ourselves), or nullptr for a remote region.
inline uint8_t* local_of(Region& r) {
  return r.data();
}

inline PeerRegion& remote_of(Region& r) {
  auto* p = dynamic_cast<PeerRegion*>(&r);
  MC_CHECK(p != nullptr, r.describe(), " does not belong to the nixl transport");
  return *p;
}

inline std::atomic_ref<uint64_t> word_at(uint8_t* base, uint64_t offset) {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(base + offset));
}

inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); ++i) {
    if (i == s.size() || s[i] == sep) {
      out.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  }
  return out;
}

inline std::string mem_field(MemKind kind, int32_t device) {
  return kind == MemKind::kHost ? std::string("host") : "cuda:" + std::to_string(device);
}

// Parses a handle's memory field ("host" or "cuda:N"); false when it is neither.
inline bool parse_mem(const std::string& f, MemKind* kind, int32_t* device) {
  if (f == "host") {
    *kind = MemKind::kHost;
    *device = 0;
    return true;
  }
  constexpr const char* kCuda = "cuda:";
  if (f.rfind(kCuda, 0) != 0 || f.size() == std::strlen(kCuda)) return false;
  const std::string digits = f.substr(std::strlen(kCuda));
  if (digits.size() > 4 || digits.find_first_not_of("0123456789") != std::string::npos) {
    return false;
  }
  *kind = MemKind::kCuda;
  *device = std::stoi(digits);
  return true;
}

// Digits only (no sign, no blanks, no prefix), at most what fits 64 bits.
inline bool parse_number(const std::string& f, int base, uint64_t* out) {
  const size_t max_digits = base == 16 ? 16 : 19;
  const char* digits = base == 16 ? "0123456789abcdefABCDEF" : "0123456789";
  if (f.empty() || f.size() > max_digits || f.find_first_not_of(digits) != std::string::npos) {
    return false;
  }
  *out = std::stoull(f, nullptr, base);
  return true;
}

inline bool is_base64(const std::string& f) {
  constexpr const char* kAlphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=";
  return !f.empty() && f.size() % 4 == 0 && f.find_first_not_of(kAlphabet) == std::string::npos;
}

}  // namespace moecomm::transport::nixl::detail
