#include "transport/nixl/nixl_transport.h"

#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>
#include <unordered_set>

#include "common/error.h"

namespace moecomm::transport::nixl {

namespace {

// The first bytes of every staging buffer: the source of signal words and the target of small
// reads (loads, liveness probes), apart from the queued payload that follows them.
constexpr uint64_t kScratchBytes = 64;
// Queued puts start on a cache line, so a staged header is never split oddly.
constexpr uint64_t kStageAlign = 64;
// kAdd on a peer's word writes (tag << 32 | counter): a value no other writer can produce.
constexpr int kTagShift = 32;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

uint64_t page_round(uint64_t bytes) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return (std::max<uint64_t>(bytes, 1) + page - 1) / page * page;
}

uint8_t* map_zeroed(uint64_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  MC_CHECK_KIND(p != MAP_FAILED, ErrorKind::kSystem, "mmap of ", bytes,
                " bytes failed: ", std::strerror(errno));
  return static_cast<uint8_t*>(p);
}

void check_range(const Region& r, uint64_t offset, uint64_t bytes) {
  MC_CHECK(offset <= r.size() && bytes <= r.size() - offset, "access of ", bytes,
           " bytes at offset ", offset, " is outside ", r.describe());
}

void check_word(const Region& r, uint64_t offset) {
  MC_CHECK(offset % sizeof(uint64_t) == 0, "signal word offset ", offset, " is not 8-aligned");
  check_range(r, offset, sizeof(uint64_t));
}

std::string hex(uint64_t v) {
  std::ostringstream os;
  os << std::hex << v;
  return os.str();
}

struct Pending {
  std::string agent;
  Segment seg;
};

// Registered host memory a thread stages its puts in (see the header: the caller's memory may
// be reused as soon as put returns).
struct Staging {
  uint8_t* base = nullptr;
  uint64_t capacity = 0;
  uint64_t used = kScratchBytes;
  std::vector<Pending> pending;
};

}  // namespace

struct Shared {
  std::shared_ptr<Engine> engine;
  std::string agent;
  uint64_t tag = 0;
  std::atomic<uint32_t> counter{0};
  std::mutex mu;  // guards the maps below; never held across an engine call
  std::unordered_map<std::thread::id, std::unique_ptr<Staging>> staging;
  std::unordered_set<std::string> lost;
  std::unordered_map<uint64_t, std::weak_ptr<Region>> owned;  // by address: attaching to oneself
  std::unordered_map<std::string, uint32_t> peer_refs;        // for peers(); the engine counts too

  ~Shared() {
    for (auto& [id, s] : staging) {
      try {
        engine->deregister_memory(reinterpret_cast<uint64_t>(s->base), s->capacity);
      } catch (...) {  // the agent is going away with us: nothing left to undo
      }
      munmap(s->base, s->capacity);
    }
  }

  Staging& mine() {
    std::lock_guard<std::mutex> lock(mu);
    auto& s = staging[std::this_thread::get_id()];
    if (!s) s = std::make_unique<Staging>();
    return *s;
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
      munmap(s.base, s.capacity);
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

  // Writes every queued put of this thread (one transfer per peer) and waits for them.
  void flush(Staging& s, int64_t timeout_ns) {
    if (s.pending.empty()) return;
    std::vector<Pending> queued;
    queued.swap(s.pending);
    s.used = kScratchBytes;
    std::vector<std::string> order;
    std::unordered_map<std::string, std::vector<Segment>> by_peer;
    for (const Pending& p : queued) {
      auto [it, fresh] = by_peer.try_emplace(p.agent);
      if (fresh) order.push_back(p.agent);
      it->second.push_back(p.seg);
    }
    for (const std::string& peer : order) {
      check(engine->write(peer, by_peer[peer], timeout_ns), peer, "write");
    }
  }
};

namespace {

// Gives a region's pages back but keeps its address range mapped, for good. Over UCX's TCP
// transport a remote read or write is carried out by our own progress thread with a plain memcpy
// (deregistering revokes nothing), so a peer that still holds the handle — a server probing a
// client that just closed the channel — would otherwise fault this process; and a range that is
// never reused can never receive a late write meant for its previous region.
void retire(uint8_t* base, uint64_t bytes) {
  void* p = mmap(base, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) munmap(base, bytes);  // no way to keep it: at least free it
}

// Our memory: mapped by the transport (create_region), or the caller's (register_external).
class OwnedRegion final : public Region {
 public:
  OwnedRegion(std::shared_ptr<Shared> shared, uint8_t* base, uint64_t bytes, uint64_t mapped,
              std::string handle, MemKind kind, int32_t device, bool external)
      : shared_(std::move(shared)),
        base_(base),
        bytes_(bytes),
        mapped_(mapped),
        handle_(std::move(handle)),
        kind_(kind),
        device_(device),
        external_(external) {}
  ~OwnedRegion() override {
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->owned.erase(addr());
    }
    try {
      shared_->engine->deregister_memory(addr(), mapped_);
    } catch (...) {  // a destructor must not throw; the pages go anyway
    }
    if (!external_) retire(base_, mapped_);
  }
  // GPU memory has no host mapping: it is reached by transfers only.
  uint8_t* data() override { return kind_ == MemKind::kHost ? base_ : nullptr; }
  uint64_t size() const override { return bytes_; }
  std::string handle() const override { return handle_; }
  bool owned() const override { return true; }
  void close() override { closed_ = true; }
  bool closed() const override { return closed_; }
  std::string describe() const override {
    return "nixl region of " + shared_->agent + " at 0x" + hex(addr()) + " (" +
           std::to_string(bytes_) + " bytes" + (kind_ == MemKind::kCuda ? ", cuda" : "") + ")";
  }
  uint64_t addr() const { return reinterpret_cast<uint64_t>(base_); }
  MemKind kind() const { return kind_; }
  int32_t device() const { return device_; }

 private:
  std::shared_ptr<Shared> shared_;
  uint8_t* base_;
  uint64_t bytes_;
  uint64_t mapped_;
  std::string handle_;
  MemKind kind_;
  int32_t device_;
  bool external_;
  bool closed_ = false;
};

// A peer's region: reached by transfers only, unless the peer is this very transport (`alias`).
class PeerRegion final : public Region {
 public:
  PeerRegion(std::shared_ptr<Shared> shared, std::string agent, uint64_t addr, uint64_t bytes,
             std::string handle, std::shared_ptr<Region> alias, MemKind kind, int32_t device)
      : shared_(std::move(shared)),
        agent_(std::move(agent)),
        addr_(addr),
        bytes_(bytes),
        handle_(std::move(handle)),
        alias_(std::move(alias)),
        kind_(kind),
        device_(device) {}
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
  uint64_t size() const override { return bytes_; }
  std::string handle() const override { return handle_; }
  bool owned() const override { return false; }
  void close() override { closed_ = true; }
  bool closed() const override { return closed_; }
  std::string describe() const override {
    return "nixl region of " + agent_ + " at 0x" + hex(addr_) + " (" + std::to_string(bytes_) +
           " bytes)";
  }
  const std::string& agent() const { return agent_; }
  bool is_alias() const { return alias_ != nullptr; }
  MemKind kind() const { return kind_; }
  int32_t device() const { return device_; }
  uint64_t addr() const { return addr_; }

 private:
  std::shared_ptr<Shared> shared_;
  std::string agent_;
  uint64_t addr_;
  uint64_t bytes_;
  std::string handle_;
  std::shared_ptr<Region> alias_;
  MemKind kind_;
  int32_t device_;
  bool closed_ = false;
};

// Local memory of `r` (ours, or a peer that is ourselves), or nullptr for a remote region.
uint8_t* local_of(Region& r) {
  return r.data();
}

PeerRegion& remote_of(Region& r) {
  auto* p = dynamic_cast<PeerRegion*>(&r);
  MC_CHECK(p != nullptr, r.describe(), " does not belong to the nixl transport");
  return *p;
}

std::atomic_ref<uint64_t> word_at(uint8_t* base, uint64_t offset) {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(base + offset));
}

std::vector<std::string> split(const std::string& s, char sep) {
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

}  // namespace

NixlTransport::NixlTransport(std::shared_ptr<Engine> engine, NixlOptions options)
    : options_(options), shared_(std::make_shared<Shared>()) {
  MC_CHECK(engine != nullptr, "the nixl transport needs an engine");
  MC_CHECK(options.spin_ns >= 0 && options.poll_ns > 0 && options.xfer_timeout_ns > 0,
           "nixl options: spin_ns >= 0, poll_ns > 0 and xfer_timeout_ns > 0");
  shared_->engine = std::move(engine);
  shared_->agent = shared_->engine->agent_name();
  MC_CHECK(!shared_->agent.empty() && shared_->agent.find(kHandleSep) == std::string::npos,
           "a nixl agent name must be non-empty and free of '", kHandleSep, "'");
  uint32_t tag = 0;
  MC_CHECK_KIND(getrandom(&tag, sizeof(tag), 0) == sizeof(tag), ErrorKind::kSystem,
                "getrandom failed");
  shared_->tag = uint64_t{tag | 1u} << kTagShift;  // never 0: a fresh word is never a doorbell
}

NixlTransport::~NixlTransport() = default;

std::string NixlTransport::agent_name() const {
  return shared_->agent;
}

std::vector<std::string> NixlTransport::peers() const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  std::vector<std::string> out;
  for (const auto& [agent, refs] : shared_->peer_refs) out.push_back(agent);
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

std::string mem_field(MemKind kind, int32_t device) {
  return kind == MemKind::kHost ? std::string("host") : "cuda:" + std::to_string(device);
}

// Parses a handle's memory field ("host" or "cuda:N"); false when it is neither.
bool parse_mem(const std::string& f, MemKind* kind, int32_t* device) {
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

}  // namespace

std::shared_ptr<Region> NixlTransport::publish(uint8_t* base, uint64_t bytes, uint64_t mapped,
                                               MemKind kind, int32_t device, bool external) {
  const std::string blob =
      shared_->engine->register_memory(reinterpret_cast<uint64_t>(base), mapped, kind, device);
  MC_CHECK_KIND(blob.find(kHandleSep) == std::string::npos, ErrorKind::kInternal,
                "the engine's memory blob contains '", kHandleSep, "'");
  const std::string handle = std::string(kHandlePrefix) + kHandleSep + shared_->agent + kHandleSep +
                             hex(reinterpret_cast<uint64_t>(base)) + kHandleSep +
                             std::to_string(bytes) + kHandleSep + mem_field(kind, device) +
                             kHandleSep + blob;
  auto region =
      std::make_shared<OwnedRegion>(shared_, base, bytes, mapped, handle, kind, device, external);
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->owned[reinterpret_cast<uint64_t>(base)] = region;
  return region;
}

std::shared_ptr<Region> NixlTransport::create_region(uint64_t bytes) {
  MC_CHECK(bytes > 0, "a region needs at least one byte");
  const uint64_t mapped = page_round(bytes);
  uint8_t* base = map_zeroed(mapped);
  try {
    return publish(base, bytes, mapped, MemKind::kHost, 0, false);
  } catch (...) {
    munmap(base, mapped);
    throw;
  }
}

std::shared_ptr<Region> NixlTransport::register_external(uint64_t addr, uint64_t bytes,
                                                         MemKind kind, int32_t device) {
  MC_CHECK(addr != 0 && bytes > 0, "register_external needs an address and a size");
  MC_CHECK(device >= 0, "device must be >= 0, got ", device);
  return publish(reinterpret_cast<uint8_t*>(addr), bytes, bytes, kind, device, true);
}

std::shared_ptr<Region> NixlTransport::attach(const std::string& handle) {
  constexpr size_t kFields = 6;
  const std::vector<std::string> f = split(handle, kHandleSep);
  MC_CHECK(f.size() == kFields && f[0] == kHandlePrefix && !f[1].empty() && !f[5].empty(),
           "not a nixl region handle: '", handle.substr(0, 64), "'");
  uint64_t addr = 0, bytes = 0;
  MemKind kind = MemKind::kHost;
  int32_t device = 0;
  try {
    size_t used = 0;
    addr = std::stoull(f[2], &used, 16);
    MC_CHECK(used == f[2].size(), "bad address");
    bytes = std::stoull(f[3], &used, 10);
    MC_CHECK(used == f[3].size() && bytes > 0, "bad size");
  } catch (const std::logic_error&) {
    MC_THROW(ErrorKind::kInvalidArgument, "nixl region handle with a bad address or size: '",
             handle.substr(0, 64), "'");
  }
  MC_CHECK(parse_mem(f[4], &kind, &device), "nixl region handle with an unknown memory '",
           f[4].substr(0, 16), "' (host or cuda:N)");
  if (f[1] == shared_->agent) {  // our own region: reach it through its memory
    std::shared_ptr<Region> mine;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      auto it = shared_->owned.find(addr);
      if (it != shared_->owned.end()) mine = it->second.lock();
    }
    MC_CHECK_KIND(mine != nullptr && mine->size() == bytes, ErrorKind::kNotFound,
                  "no region of ours at 0x", hex(addr), " with ", bytes, " bytes");
    MC_CHECK(kind == MemKind::kHost, "attaching to our own GPU region: use its tensor");
    return std::make_shared<PeerRegion>(shared_, f[1], addr, bytes, handle, std::move(mine), kind,
                                        device);
  }
  const std::string loaded = shared_->engine->add_peer(f[5]);
  MC_CHECK(loaded == f[1], "the region handle names agent ", f[1], " but its blob is ", loaded);
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    ++shared_->peer_refs[f[1]];
  }
  return std::make_shared<PeerRegion>(shared_, f[1], addr, bytes, handle, nullptr, kind, device);
}

void NixlTransport::put(Region& dst, uint64_t offset, const void* src, uint64_t bytes) {
  check_range(dst, offset, bytes);
  if (bytes == 0) return;
  if (uint8_t* local = local_of(dst)) {
    std::memcpy(local + offset, src, bytes);
    return;
  }
  PeerRegion& peer = remote_of(dst);
  Staging& s = shared_->mine();
  const uint64_t slot = (bytes + kStageAlign - 1) / kStageAlign * kStageAlign;
  if (s.used + slot > s.capacity) {
    shared_->flush(s, options_.xfer_timeout_ns);
    shared_->grow(s, slot);
  }
  uint8_t* at = s.base + s.used;
  std::memcpy(at, src, bytes);
  s.pending.push_back({peer.agent(),
                       {reinterpret_cast<uint64_t>(at), peer.addr() + offset, bytes, MemKind::kHost,
                        0, peer.kind(), peer.device()}});
  s.used += slot;
}

void NixlTransport::put_region(Region& dst, uint64_t offset, Region& src, uint64_t src_offset,
                               uint64_t bytes) {
  check_range(dst, offset, bytes);
  check_range(src, src_offset, bytes);
  auto* from = dynamic_cast<OwnedRegion*>(&src);
  MC_CHECK(from != nullptr, "put_region reads from a region of ours, not ", src.describe());
  if (bytes == 0) return;
  if (uint8_t* local = local_of(dst)) {
    MC_CHECK(from->kind() == MemKind::kHost,
             "a GPU region into our own memory is a local copy: ", "use the tensors");
    std::memmove(local + offset, from->data() + src_offset, bytes);
    return;
  }
  PeerRegion& peer = remote_of(dst);
  shared_->mine().pending.push_back({peer.agent(),
                                     {from->addr() + src_offset, peer.addr() + offset, bytes,
                                      from->kind(), from->device(), peer.kind(), peer.device()}});
}

void NixlTransport::signal(Region& dst, uint64_t offset, uint64_t value, SignalOp op) {
  check_word(dst, offset);
  if (uint8_t* local = local_of(dst)) {
    auto w = word_at(local, offset);
    if (op == SignalOp::kAdd) {
      w.fetch_add(value, std::memory_order_acq_rel);
    } else {
      w.store(value, std::memory_order_release);
    }
    return;
  }
  PeerRegion& peer = remote_of(dst);
  MC_CHECK(peer.kind() == MemKind::kHost, "signal words live in host memory, not in ",
           peer.describe());
  Staging& s = shared_->mine();
  shared_->flush(s, options_.xfer_timeout_ns);  // everything put before lands first
  if (s.base == nullptr) shared_->grow(s, 0);
  const uint64_t word =
      op == SignalOp::kAdd ? (shared_->tag | (shared_->counter.fetch_add(1) + 1)) : value;
  std::memcpy(s.base, &word, sizeof(word));
  shared_->check(
      shared_->engine->write(
          peer.agent(), {{reinterpret_cast<uint64_t>(s.base), peer.addr() + offset, sizeof(word)}},
          options_.xfer_timeout_ns),
      peer.agent(), "signal");
}

WaitResult NixlTransport::wait(Region& local, uint64_t offset, const WaitPredicate& pred,
                               int64_t timeout_ns, const Region* peer) {
  check_word(local, offset);
  uint8_t* base = local_of(local);
  MC_CHECK(base != nullptr, "wait on ", local.describe(), ": a waiter polls its own memory only");
  auto w = word_at(base, offset);
  const int64_t start = now_ns();
  const int64_t deadline = timeout_ns < 0 ? INT64_MAX : start + timeout_ns;
  int64_t next_peer_check = start + kPeerCheckIntervalNs;
  for (;;) {
    const uint64_t v = w.load(std::memory_order_acquire);
    if (pred.satisfied(v)) return {WaitStatus::kOk, v};
    const int64_t now = now_ns();
    if (now >= deadline) return {WaitStatus::kTimeout, v};
    if (peer != nullptr && now >= next_peer_check) {
      if (!peer_alive(*peer)) return {WaitStatus::kPeerLost, w.load(std::memory_order_acquire)};
      next_peer_check = now_ns() + kPeerCheckIntervalNs;
    }
    if (now - start >= options_.spin_ns) {
      const int64_t nap = std::min(options_.poll_ns, deadline - now);
      std::this_thread::sleep_for(std::chrono::nanoseconds(nap));
    }
  }
}

void NixlTransport::read(Region& region, uint64_t offset, void* dst, uint64_t bytes) {
  if (local_of(region) != nullptr) {
    Transport::read(region, offset, dst, bytes);
    return;
  }
  check_range(region, offset, bytes);
  PeerRegion& peer = remote_of(region);
  Staging& s = shared_->mine();
  shared_->flush(s, options_.xfer_timeout_ns);
  if (s.base == nullptr) shared_->grow(s, 0);
  auto* out = static_cast<uint8_t*>(dst);
  const uint64_t chunk = s.capacity - kScratchBytes;
  for (uint64_t done = 0; done < bytes;) {
    const uint64_t n = std::min(chunk, bytes - done);
    uint8_t* at = s.base + kScratchBytes;
    shared_->check(
        shared_->engine->read(peer.agent(),
                              {{reinterpret_cast<uint64_t>(at), peer.addr() + offset + done, n,
                                MemKind::kHost, 0, peer.kind(), peer.device()}},
                              options_.xfer_timeout_ns),
        peer.agent(), "read");
    std::memcpy(out + done, at, n);
    done += n;
  }
}

uint64_t NixlTransport::load(Region& local, uint64_t offset) {
  check_word(local, offset);
  if (uint8_t* base = local_of(local)) return word_at(base, offset).load(std::memory_order_acquire);
  uint64_t v = 0;
  read(local, offset, &v, sizeof(v));  // a peer's word: one small read across the network
  return v;
}

bool NixlTransport::compare_exchange(Region& local, uint64_t offset, uint64_t expected,
                                     uint64_t desired) {
  check_word(local, offset);
  uint8_t* base = local_of(local);
  MC_CHECK(base != nullptr, "compare-exchange on ", local.describe(),
           ": only our own memory can be changed atomically");
  return word_at(base, offset)
      .compare_exchange_strong(expected, desired, std::memory_order_acq_rel);
}

void NixlTransport::fence() {
  shared_->flush(shared_->mine(), options_.xfer_timeout_ns);
}

bool NixlTransport::peer_alive(const Region& peer) {
  auto* p = dynamic_cast<const PeerRegion*>(&peer);
  if (p == nullptr || p->is_alias()) return true;  // ours: alive while we are
  if (shared_->is_lost(p->agent())) return false;
  // A small read of the peer's memory: a dead peer's connection fails it at once, a stopped or
  // unreachable one leaves it in flight until the probe's deadline.
  Staging& s = shared_->mine();
  if (s.base == nullptr) shared_->grow(s, 0);
  const XferStatus st = shared_->engine->read(
      p->agent(), {{reinterpret_cast<uint64_t>(s.base) + sizeof(uint64_t), p->addr(), 8}},
      kProbeTimeoutNs);
  if (st == XferStatus::kDone) return true;
  shared_->mark_lost(p->agent());
  return false;
}

}  // namespace moecomm::transport::nixl
