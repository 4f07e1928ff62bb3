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
#include "transport/nixl/nixl_detail.h"

namespace moecomm::transport::nixl {

using namespace detail;

NixlTransport::NixlTransport(std::shared_ptr<Engine> engine, NixlOptions options)
    : options_(options), shared_(std::make_shared<Shared>()) {
  MC_CHECK(engine != nullptr, "the nixl transport needs an engine");
  MC_CHECK(options.spin_ns >= 0 && options.poll_ns > 0 && options.xfer_timeout_ns > 0 &&
               options.max_poll_ns >= options.poll_ns,
           "nixl options: spin_ns >= 0, poll_ns > 0, max_poll_ns >= poll_ns and ",
           "xfer_timeout_ns > 0");
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
  if (kind == MemKind::kHost) shared_->host_ranges[reinterpret_cast<uint64_t>(base)] = bytes;
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
  MC_CHECK(parse_number(f[2], 16, &addr) && parse_number(f[3], 10, &bytes) && bytes > 0,
           "nixl region handle with a bad address or size: '", handle.substr(0, 64), "'");
  MC_CHECK(is_base64(f[5]), "nixl region handle whose metadata is not base64: '",
           handle.substr(0, 64), "'");
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

ZeroCopyStats NixlTransport::zero_copy_stats() const {
  return {shared_->borrowed_puts.load(std::memory_order_relaxed),
          shared_->borrowed_bytes.load(std::memory_order_relaxed)};
}

void NixlTransport::before_local_write(const uint8_t* addr, uint64_t bytes) {
  if (shared_->borrowing_threads.load(std::memory_order_relaxed) == 0) return;
  Staging& s = shared_->mine();
  const auto lo = reinterpret_cast<uint64_t>(addr);
  if (!s.borrowing() || lo >= s.borrowed_hi || lo + bytes <= s.borrowed_lo) return;
  shared_->flush(s, options_.xfer_timeout_ns);  // the peer gets the bytes as they were at put
}

void NixlTransport::put(Region& dst, uint64_t offset, const void* src, uint64_t bytes) {
  check_range(dst, offset, bytes);
  if (bytes == 0) return;
  if (uint8_t* local = local_of(dst)) {
    before_local_write(local + offset, bytes);
    std::memcpy(local + offset, src, bytes);
    return;
  }
  PeerRegion& peer = remote_of(dst);
  Staging& s = shared_->mine();
  const auto from = reinterpret_cast<uint64_t>(src);
  if (options_.borrow && bytes >= kBorrowMinBytes && shared_->owned_host(from, bytes)) {
    // Our registered memory: the transfer reads it in place (the header, "Zero copy").
    s.pending.push_back(
        {peer.agent(),
         {from, peer.addr() + offset, bytes, MemKind::kHost, 0, peer.kind(), peer.device()}});
    if (!s.borrowing()) shared_->borrowing_threads.fetch_add(1, std::memory_order_relaxed);
    s.borrowed_lo = std::min(s.borrowed_lo, from);
    s.borrowed_hi = std::max(s.borrowed_hi, from + bytes);
    shared_->borrowed_puts.fetch_add(1, std::memory_order_relaxed);
    shared_->borrowed_bytes.fetch_add(bytes, std::memory_order_relaxed);
    return;
  }
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
    before_local_write(local + offset, bytes);
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
    before_local_write(local + offset, sizeof(uint64_t));
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
  const uint64_t word =
      op == SignalOp::kAdd ? (shared_->tag | (shared_->counter.fetch_add(1) + 1)) : value;
  if (options_.notify) {
    // One transfer: this thread's puts to the peer, with the word as its notification (the
    // header, "Ordering"); puts queued for other peers go first, each waited for.
    const std::vector<Segment> segs = shared_->flush(s, options_.xfer_timeout_ns, &peer.agent());
    shared_->check(shared_->engine->write_notify(peer.agent(), segs, {{peer.addr() + offset, word}},
                                                 options_.xfer_timeout_ns),
                   peer.agent(), "signal");
    // A notification sent alone is not tracked by NIXL: if UCX could not put it on the wire at
    // once, it leaves at the next progress of our worker, which a drain makes now (instead of
    // the progress thread's next pass, up to its delay later). Words that came meanwhile are
    // stored as usual.
    if (segs.empty()) drain();
    return;
  }
  shared_->flush(s, options_.xfer_timeout_ns);  // everything put before lands first
  if (s.base == nullptr) shared_->grow(s, 0);
  std::memcpy(s.base, &word, sizeof(word));
  shared_->check(
      shared_->engine->write(
          peer.agent(), {{reinterpret_cast<uint64_t>(s.base), peer.addr() + offset, sizeof(word)}},
          options_.xfer_timeout_ns),
      peer.agent(), "signal");
}

size_t NixlTransport::drain() {
  std::unique_lock<std::mutex> lock(shared_->drain_mu, std::try_to_lock);
  if (!lock.owns_lock()) return 0;  // another thread drains, and stores in order
  shared_->last_drain_ns.store(now_ns(), std::memory_order_relaxed);
  const std::vector<Word> words = shared_->engine->drain_notifs();
  size_t stored = 0;
  for (const Word& w : words) {
    uint8_t* at = nullptr;
    const std::shared_ptr<Region> keep = shared_->host_region_of(w.addr, &at);
    if (keep == nullptr) continue;  // not a word of ours (a region closed since): dropped
    // Release: the notification came after the bytes (the header), and so does the word.
    word_at(at, 0).store(w.value, std::memory_order_release);
    ++stored;
  }
  return stored;
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
  int64_t nap = options_.poll_ns;
  for (;;) {
    const uint64_t v = w.load(std::memory_order_acquire);
    if (pred.satisfied(v)) return {WaitStatus::kOk, v};
    if (drain() > 0) {  // words came by notification: look again at once, awake
      nap = options_.poll_ns;
      continue;
    }
    const int64_t now = now_ns();
    if (now >= deadline) return {WaitStatus::kTimeout, v};
    if (peer != nullptr && now >= next_peer_check) {
      if (!probe(*peer, std::min(kProbeTimeoutNs, deadline - now))) {
        return {WaitStatus::kPeerLost, w.load(std::memory_order_acquire)};
      }
      next_peer_check = now_ns() + kPeerCheckIntervalNs;
    }
    if (now - start >= options_.spin_ns) {
      std::this_thread::sleep_for(std::chrono::nanoseconds(std::min(nap, deadline - now)));
      if (now - start >= kBackoffAfterNs) nap = std::min(nap * 2, options_.max_poll_ns);
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
  if (uint8_t* base = local_of(local)) {
    if (now_ns() - shared_->last_drain_ns.load(std::memory_order_relaxed) >= kLoadDrainIntervalNs) {
      drain();
    }
    return word_at(base, offset).load(std::memory_order_acquire);
  }
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
  before_local_write(base + offset, sizeof(uint64_t));
  return word_at(base, offset)
      .compare_exchange_strong(expected, desired, std::memory_order_acq_rel);
}

void NixlTransport::fence() {
  shared_->flush(shared_->mine(), options_.xfer_timeout_ns);
}

bool NixlTransport::peer_alive(const Region& peer) {
  return probe(peer, kProbeTimeoutNs);
}

bool NixlTransport::probe(const Region& peer, int64_t timeout_ns) {
  auto* p = dynamic_cast<const PeerRegion*>(&peer);
  if (p == nullptr || p->is_alias()) return true;  // ours: alive while we are
  if (shared_->is_lost(p->agent())) return false;
  // A small read of the peer's memory: a dead peer's connection fails it at once. A stopped or
  // unreachable one leaves it in flight: that is no proof of death (the waiter's own deadline
  // decides), so the peer stays alive. The read lands in the scratch line, which is never
  // unmapped, should it complete later.
  Staging& s = shared_->mine();
  if (s.base == nullptr) shared_->grow(s, 0);
  const XferStatus st = shared_->engine->read(
      p->agent(), {{reinterpret_cast<uint64_t>(s.base) + sizeof(uint64_t), p->addr(), 8}},
      std::max<int64_t>(timeout_ns, 1));
  if (st != XferStatus::kPeerLost) return true;
  shared_->mark_lost(p->agent());
  return false;
}

}  // namespace moecomm::transport::nixl
