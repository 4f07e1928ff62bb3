#include "transport/shm/shm_transport.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <vector>

#include "common/align.h"
#include "common/error.h"
#include "transport/shm/futex.h"

namespace moecomm::transport::shm {
namespace {

constexpr uint32_t kSegmentMagic = 0x48534D4Du;  // "MMSH"
constexpr uint32_t kSegmentVersion = 1;
// The segment header takes one cache line so the user region stays 64-byte aligned.
constexpr uint64_t kSegmentHeaderBytes = kCacheLine;
constexpr const char* kShmDir = "/dev/shm";
constexpr uint64_t kHandlePrefixLen = 4;  // "shm:"
// Byte offset, inside a signal line, of the count of waiters asleep on that word.
constexpr uint64_t kSleepersOffset = 8;
// Items of one wait_any: each takes a word and at most a life word of futex_waitv's 128.
constexpr uint64_t kMaxWaitItems = FUTEX_WAITV_MAX / 2;
// Without futex_waitv (kernels before 5.16) a wait on several words naps this long on the first
// and then looks at all of them.
constexpr int64_t kNoWaitvNapNs = 200'000;

struct SegmentHeader {
  uint32_t magic;
  uint32_t version;
  int64_t owner_pid;
  uint64_t owner_start_ticks;
  uint64_t user_bytes;
};
static_assert(sizeof(SegmentHeader) <= kSegmentHeaderBytes);

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::string random_hex() {
  uint64_t r = 0;
  if (getrandom(&r, sizeof(r), 0) != static_cast<ssize_t>(sizeof(r))) {
    r = static_cast<uint64_t>(now_ns()) ^ (static_cast<uint64_t>(getpid()) << 32);
  }
  std::ostringstream os;
  os << std::hex << r;
  return os.str();
}

// Parses "<prefix><pid>-<ticks>-..." into the owner's identity.
bool parse_segment_name(const std::string& name, ProcessId* owner,
                        const char* segment_prefix = kSegmentPrefix) {
  const std::string prefix = segment_prefix;
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  const char* p = name.c_str() + prefix.size();
  char* end = nullptr;
  owner->pid = std::strtoll(p, &end, 10);
  if (end == p || *end != '-') return false;
  p = end + 1;
  owner->start_ticks = std::strtoull(p, &end, 10);
  return end != p && *end == '-';
}

// Names of the segments this process owns and has not closed yet. Python may never destroy a
// region object before the interpreter exits, so the registry unlinks the leftovers when the
// process exits normally; a killed process leaves them to the reaper.
class OwnedSegments {
 public:
  // Never destroyed: a region closed during static destruction must still find it alive.
  static OwnedSegments& instance() {
    static OwnedSegments* registry = [] {
      auto* r = new OwnedSegments();
      std::atexit([] { instance().unlink_all(); });
      return r;
    }();
    return *registry;
  }
  void add(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    names_.insert(name);
  }
  void remove(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    names_.erase(name);
  }
  void unlink_all() {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& name : names_) shm_unlink(("/" + name).c_str());
    names_.clear();
  }

 private:
  std::mutex mu_;
  std::set<std::string> names_;
};

class ShmRegion final : public Region {
 public:
  ShmRegion(std::string name, uint8_t* base, uint64_t mapped, bool owned, ProcessId owner,
            std::shared_ptr<LifeWord> life = nullptr)
      : name_(std::move(name)),
        base_(base),
        mapped_(mapped),
        owned_(owned),
        owner_(owner),
        life_(std::move(life)) {}

  ~ShmRegion() override {
    close();
    munmap(base_, mapped_);
  }

  uint8_t* data() override { return base_ + kSegmentHeaderBytes; }
  uint64_t size() const override { return mapped_ - kSegmentHeaderBytes; }
  std::string handle() const override { return "shm:" + name_; }
  bool owned() const override { return owned_; }
  bool closed() const override { return closed_.load(std::memory_order_acquire); }
  void close() override {
    if (closed_.exchange(true)) return;
    if (owned_) {
      shm_unlink(("/" + name_).c_str());
      OwnedSegments::instance().remove(name_);
    }
  }
  std::string describe() const override {
    std::ostringstream os;
    os << "shm segment " << name_ << " of pid " << owner_.pid;
    return os.str();
  }
  const ProcessId& owner() const { return owner_; }
  // The owner's life word (attached regions whose owner has one), else nullptr.
  LifeWord* life() const { return life_.get(); }

 private:
  std::string name_;
  uint8_t* base_;
  uint64_t mapped_;
  bool owned_;
  ProcessId owner_;
  std::shared_ptr<LifeWord> life_;
  std::atomic<bool> closed_{false};
};

ShmRegion& as_shm(Region& r) {
  auto* s = dynamic_cast<ShmRegion*>(&r);
  MC_CHECK(s != nullptr, "region does not belong to the shm transport");
  return *s;
}

const ShmRegion& as_shm(const Region& r) {
  const auto* s = dynamic_cast<const ShmRegion*>(&r);
  MC_CHECK(s != nullptr, "region does not belong to the shm transport");
  return *s;
}

void check_range(const Region& r, uint64_t offset, uint64_t bytes, const char* what) {
  MC_CHECK(offset <= r.size() && bytes <= r.size() - offset, what, " of ", bytes,
           " bytes at offset ", offset, " is outside ", r.describe(), " (", r.size(), " bytes)");
}

void check_word(const Region& r, uint64_t offset) {
  MC_CHECK(offset % kSignalWordAlign == 0, "signal word offset ", offset, " is not aligned to ",
           kSignalWordAlign, " bytes");
  check_range(r, offset, kSignalWordAlign, "signal line");
}

std::atomic_ref<uint64_t> word_at(Region& r, uint64_t offset) {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(r.data() + offset));
}

std::atomic_ref<uint32_t> sleepers_at(Region& r, uint64_t offset) {
  return std::atomic_ref<uint32_t>(
      *reinterpret_cast<uint32_t*>(r.data() + offset + kSleepersOffset));
}

// The futex sleeps on the low half of the signal word (little-endian): state changes always
// change it; a change confined to the high half still wakes us through futex_wake_all.
const uint32_t* futex_word(Region& r, uint64_t offset) {
  return reinterpret_cast<const uint32_t*>(r.data() + offset);
}

}  // namespace

namespace {
std::atomic<bool> g_watch_death{true};
}  // namespace

void set_default_watch_death(bool on) {
  g_watch_death.store(on);
}
bool default_watch_death() {
  return g_watch_death.load();
}

ShmTransport::ShmTransport(ShmOptions options) : options_(options), self_(self_process()) {
  MC_CHECK(options_.spin_ns >= 0, "spin_ns must be >= 0, got ", options_.spin_ns);
  if (options_.reap_on_start) reap_stale_segments();
}

std::shared_ptr<Region> ShmTransport::create_region(uint64_t bytes) {
  MC_CHECK(bytes > 0, "cannot create an empty shm region");
  // Peers that attach this region watch our death through our life word (process.h).
  ensure_own_life();
  static std::atomic<uint64_t> counter{0};
  std::ostringstream os;
  os << kSegmentPrefix << self_.pid << "-" << self_.start_ticks << "-" << counter.fetch_add(1)
     << "-" << random_hex();
  const std::string name = os.str();
  const std::string path = "/" + name;
  const uint64_t mapped = kSegmentHeaderBytes + align_up(bytes, kCacheLine);

  const int fd = shm_open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  MC_SYSCALL_CHECK(fd, "shm_open(", path, ") failed");
  if (ftruncate(fd, static_cast<off_t>(mapped)) != 0) {
    const int err = errno;
    ::close(fd);
    shm_unlink(path.c_str());
    MC_THROW(ErrorKind::kSystem, "ftruncate of ", path, " to ", mapped,
             " bytes failed: ", std::strerror(err));
  }
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(path.c_str());
    MC_THROW(ErrorKind::kSystem, "mmap of ", path, " failed: ", std::strerror(err));
  }
  auto* hdr = static_cast<SegmentHeader*>(base);
  hdr->version = kSegmentVersion;
  hdr->owner_pid = self_.pid;
  hdr->owner_start_ticks = self_.start_ticks;
  hdr->user_bytes = mapped - kSegmentHeaderBytes;
  // The magic goes last so an attacher never sees a half-written segment header as valid.
  std::atomic_ref<uint32_t>(hdr->magic).store(kSegmentMagic, std::memory_order_release);
  OwnedSegments::instance().add(name);
  return std::make_shared<ShmRegion>(name, static_cast<uint8_t*>(base), mapped, true, self_);
}

std::shared_ptr<Region> ShmTransport::attach(const std::string& handle) {
  MC_CHECK(handle.compare(0, kHandlePrefixLen, "shm:") == 0, "not a shm handle: '", handle,
           "' (expected 'shm:<segment name>')");
  const std::string name = handle.substr(kHandlePrefixLen);
  MC_CHECK(!name.empty() && name.find('/') == std::string::npos &&
               name.compare(0, std::strlen(kSegmentPrefix), kSegmentPrefix) == 0,
           "malformed shm handle '", handle, "'");
  const std::string path = "/" + name;
  const int fd = shm_open(path.c_str(), O_RDWR, 0);
  if (fd == -1 && errno == ENOENT) {
    MC_THROW(ErrorKind::kNotFound, "shm segment ", name,
             " does not exist: its owner closed it or died, or the handle is wrong");
  }
  MC_SYSCALL_CHECK(fd, "shm_open(", path, ") failed");
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < kSegmentHeaderBytes) {
    ::close(fd);
    MC_THROW(ErrorKind::kProtocol, "shm segment ", name, " is too small to be a moecomm region");
  }
  const uint64_t mapped = static_cast<uint64_t>(st.st_size);
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  MC_CHECK_KIND(base != MAP_FAILED, ErrorKind::kSystem, "mmap of ", path,
                " failed: ", std::strerror(err));
  const auto* hdr = static_cast<const SegmentHeader*>(base);
  const uint32_t magic =
      std::atomic_ref<const uint32_t>(hdr->magic).load(std::memory_order_acquire);
  if (magic != kSegmentMagic || hdr->version != kSegmentVersion ||
      hdr->user_bytes != mapped - kSegmentHeaderBytes) {
    munmap(base, mapped);
    MC_THROW(ErrorKind::kProtocol, "shm segment ", name,
             " has no valid moecomm segment header (not ready, or not ours)");
  }
  ProcessId owner{hdr->owner_pid, hdr->owner_start_ticks};
  return std::make_shared<ShmRegion>(name, static_cast<uint8_t*>(base), mapped, false, owner,
                                     attach_life(owner));
}

void ShmTransport::put(Region& dst, uint64_t offset, const void* src, uint64_t bytes) {
  ShmRegion& r = as_shm(dst);
  MC_CHECK(!r.closed(), "put into closed ", r.describe());
  check_range(r, offset, bytes, "put");
  if (bytes > 0) std::memcpy(r.data() + offset, src, bytes);
}

void ShmTransport::signal(Region& dst, uint64_t offset, uint64_t value, SignalOp op) {
  ShmRegion& r = as_shm(dst);
  MC_CHECK(!r.closed(), "signal into closed ", r.describe());
  check_word(r, offset);
  auto word = word_at(r, offset);
  // seq_cst on the store and on the sleeper load below: with the waiter's seq_cst increment
  // before its final re-check, either we see the sleeper or it sees our value (no lost wake-up).
  if (op == SignalOp::kSet) {
    word.store(value, std::memory_order_seq_cst);
  } else {
    word.fetch_add(value, std::memory_order_seq_cst);
  }
  if (sleepers_at(r, offset).load(std::memory_order_seq_cst) != 0) {
    futex_wake_all(futex_word(r, offset));
  }
}

uint64_t ShmTransport::load(Region& local, uint64_t offset) {
  check_word(local, offset);
  return word_at(local, offset).load(std::memory_order_acquire);
}

WaitResult ShmTransport::wait(Region& local, uint64_t offset, const WaitPredicate& pred,
                              int64_t timeout_ns, const Region* peer) {
  const WaitItem item{&local, offset, pred, peer};
  const WaitAnyResult r = wait_any(&item, 1, timeout_ns);
  return {r.status, r.value};
}

WaitAnyResult ShmTransport::wait_any(const WaitItem* items, uint64_t count, int64_t timeout_ns) {
  MC_CHECK(count > 0, "wait_any needs at least one item");
  // More words than one futex_waitv takes: each in turn, a slice at a time.
  if (count > kMaxWaitItems) return Transport::wait_any(items, count, timeout_ns);
  // Resolved once: the word, the peer and its life word of every item.
  std::array<uint64_t*, kMaxWaitItems> words;
  std::array<const ShmRegion*, kMaxWaitItems> peers;
  std::array<LifeWord*, kMaxWaitItems> lives;
  std::array<uint64_t, kMaxWaitItems> seen;
  for (uint64_t i = 0; i < count; ++i) {
    ShmRegion& r = as_shm(*items[i].local);
    check_word(r, items[i].offset);
    words[i] = reinterpret_cast<uint64_t*>(r.data() + items[i].offset);
    peers[i] = items[i].peer != nullptr ? &as_shm(*items[i].peer) : nullptr;
    lives[i] = peers[i] != nullptr && options_.watch_death ? peers[i]->life() : nullptr;
  }
  auto word = [&](uint64_t i) { return std::atomic_ref<uint64_t>(*words[i]); };
  // Loads every word; the first satisfied one ends the wait.
  auto ready = [&](std::memory_order order) -> int64_t {
    for (uint64_t i = 0; i < count; ++i) {
      seen[i] = word(i).load(order);
      if (items[i].pred.satisfied(seen[i])) return static_cast<int64_t>(i);
    }
    return -1;
  };
  auto ok = [&](int64_t i) { return WaitAnyResult{WaitStatus::kOk, i, seen[i]}; };
  auto timeout = [&] { return WaitAnyResult{WaitStatus::kTimeout, -1, seen[0]}; };
  // The hot path finds a word already there: check before paying for a clock read.
  if (const int64_t i = ready(std::memory_order_acquire); i >= 0) return ok(i);
  const int64_t start = now_ns();
  const int64_t deadline = timeout_ns < 0 ? INT64_MAX : start + timeout_ns;
  const int64_t spin_until = std::min(deadline, start + options_.spin_ns);
  // Spin phase: check the clock only every few rounds; it costs more than the loads.
  constexpr int kSpinsPerClockRead = 64;
  for (int64_t now = start; now < spin_until; now = now_ns()) {
    for (int k = 0; k < kSpinsPerClockRead; ++k) {
      if (const int64_t i = ready(std::memory_order_acquire); i >= 0) return ok(i);
      cpu_relax();
    }
  }
  // Sleep phase: on every word at once, and on the life word of every watched peer, so that
  // an answer or a death wakes us, whichever comes first.
  bool waitv = true;  // false once the kernel turns out to lack futex_waitv
  bool watching = false;
  for (uint64_t i = 0; i < count; ++i) watching = watching || lives[i] != nullptr;
  int64_t next_peer_check = now_ns();
  std::array<struct futex_waitv, 2 * kMaxWaitItems> waiters;
  for (;;) {
    if (const int64_t i = ready(std::memory_order_acquire); i >= 0) return ok(i);
    const int64_t now = now_ns();
    if (now >= deadline) return timeout();
    for (uint64_t i = 0; i < count; ++i) {
      if (lives[i] != nullptr && lives[i]->dead()) {
        lives[i]->wake_all();  // the kernel woke one sleeper of that word: pass it on
        return {WaitStatus::kPeerLost, static_cast<int64_t>(i), seen[i]};
      }
    }
    const int64_t check_every =
        watching && waitv ? kWatchedPeerCheckIntervalNs : kPeerCheckIntervalNs;
    bool any_peer = false;
    for (uint64_t i = 0; i < count; ++i) {
      if (peers[i] == nullptr) continue;
      any_peer = true;
      if (now >= next_peer_check && !process_alive(peers[i]->owner())) {
        return {WaitStatus::kPeerLost, static_cast<int64_t>(i), seen[i]};
      }
    }
    if (now >= next_peer_check) next_peer_check = now + check_every;
    int64_t nap = deadline - now;
    if (any_peer) nap = std::min(nap, check_every);
    const bool many = count > 1 || (watching && waitv);
    // Without futex_waitv several words can only be polled: nap briefly on the first one.
    if (count > 1 && !waitv) nap = std::min(nap, kNoWaitvNapNs);
    unsigned n = 0;
    if (many && waitv) {
      for (uint64_t i = 0; i < count; ++i) {
        if (lives[i] == nullptr) continue;
        const uint32_t lv = lives[i]->arm();
        if (lv & FUTEX_OWNER_DIED) nap = 0;  // died just now: the check above sees it
        waiters[n++] = futex_waiter(lives[i]->word(), lv);
      }
    }
    for (uint64_t i = 0; i < count; ++i) {
      sleepers_at(*items[i].local, items[i].offset).fetch_add(1, std::memory_order_seq_cst);
    }
    // seq_cst re-check after announcing ourselves: a signal() either sees a sleeper or we see
    // its value (no lost wake-up).
    if (ready(std::memory_order_seq_cst) < 0 && nap > 0) {
      if (many && waitv) {
        for (uint64_t i = 0; i < count; ++i) {
          waiters[n++] = futex_waiter(futex_word(*items[i].local, items[i].offset),
                                      static_cast<uint32_t>(seen[i]));
        }
        waitv = futex_wait_any(waiters.data(), n, nap);
      } else {
        futex_wait(futex_word(*items[0].local, items[0].offset), static_cast<uint32_t>(seen[0]),
                   nap);
      }
    }
    for (uint64_t i = 0; i < count; ++i) {
      sleepers_at(*items[i].local, items[i].offset).fetch_sub(1, std::memory_order_seq_cst);
    }
  }
}

bool ShmTransport::compare_exchange(Region& local, uint64_t offset, uint64_t expected,
                                    uint64_t desired) {
  check_word(local, offset);
  return word_at(local, offset)
      .compare_exchange_strong(expected, desired, std::memory_order_acq_rel);
}

void ShmTransport::fence() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

bool ShmTransport::peer_alive(const Region& peer) {
  const ShmRegion& r = as_shm(peer);
  if (options_.watch_death && r.life() != nullptr && r.life()->dead()) return false;
  return process_alive(r.owner());
}

namespace {

// Gone by /proc, or marked dead by the kernel in its life word: a waiter that heard of a death
// through the life word reaps at once, while the process may still be tearing down (it runs no
// user code any more).
bool owner_alive(const ProcessId& owner) {
  if (!process_alive(owner)) return false;
  const std::shared_ptr<LifeWord> life = attach_life(owner);
  return life == nullptr || !life->dead();
}

}  // namespace

int reap_stale_segments(int64_t only_pid) {
  DIR* dir = opendir(kShmDir);
  if (dir == nullptr) return 0;
  std::vector<std::string> stale;
  std::vector<std::string> stale_lives;
  while (const dirent* e = readdir(dir)) {
    ProcessId owner;
    const std::string name = e->d_name;
    const bool region = parse_segment_name(name, &owner);
    if (!region && !parse_segment_name(name, &owner, kLifePrefix)) continue;
    if (only_pid > 0 && owner.pid != only_pid) continue;
    if (!owner_alive(owner)) (region ? stale : stale_lives).push_back(name);
  }
  closedir(dir);
  int removed = 0;
  for (const auto& name : stale) {
    if (shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  for (const auto& name : stale_lives) shm_unlink(("/" + name).c_str());
  return removed;
}

std::vector<std::string> list_segments(int64_t pid) {
  std::vector<std::string> names;
  DIR* dir = opendir(kShmDir);
  if (dir == nullptr) return names;
  while (const dirent* e = readdir(dir)) {
    ProcessId owner;
    const std::string name = e->d_name;
    if (!parse_segment_name(name, &owner)) continue;
    if (pid > 0 && owner.pid != pid) continue;
    names.push_back(name);
  }
  closedir(dir);
  return names;
}

}  // namespace moecomm::transport::shm
