#include "transport/shm/process.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "transport/shm/futex.h"

namespace moecomm::transport::shm {
namespace {

// /proc/<pid>/stat: "pid (comm) state ppid ... starttime(22) ...". comm may contain spaces and
// parentheses, so fields are counted from the last ')'.
constexpr int kStartTimeField = 22;
constexpr int kFirstFieldAfterComm = 3;  // the state

bool read_stat(int64_t pid, char* state, uint64_t* start_ticks) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return false;
  ++p;
  int field = kFirstFieldAfterComm;
  while (*p == ' ') ++p;
  *state = *p;
  while (field < kStartTimeField && *p != '\0') {
    if (*p == ' ') {
      ++field;
      while (*p == ' ') ++p;
      continue;
    }
    ++p;
  }
  if (field != kStartTimeField) return false;
  *start_ticks = std::strtoull(p, nullptr, 10);
  return true;
}

}  // namespace

ProcessId self_process() {
  ProcessId id;
  id.pid = static_cast<int64_t>(getpid());
  char state = 0;
  if (!read_stat(id.pid, &state, &id.start_ticks)) id.start_ticks = 0;
  return id;
}

bool process_alive(const ProcessId& p) {
  char state = 0;
  uint64_t start = 0;
  if (!read_stat(p.pid, &state, &start)) return false;
  if (state == 'Z' || state == 'X') return false;
  return p.start_ticks == 0 || start == p.start_ticks;
}

// ---------------------------------------------------------------------------------------------
// Life words
namespace {

// One page: the list node the kernel walks at offset 0, the word on a cache line of its own.
constexpr uint64_t kLifeBytes = 4096;
constexpr uint64_t kLifeWordOffset = 64;
// How long ensure_own_life waits for the holder thread to register its word: thread creation
// takes microseconds; this long means the process is wedged, and peers fall back to polling.
constexpr auto kHolderStartTimeout = std::chrono::seconds(5);

// "/<name>": built by appending (GCC 12 warns falsely, -Wrestrict, on "/" + std::string).
std::string shm_path(const std::string& name) {
  std::string path = "/";
  path += name;
  return path;
}

struct OwnLife {
  int64_t pid = 0;  // the process that made it (a forked child makes its own)
  bool ok = false;
  std::string name;
};

std::mutex& own_life_mu() {
  static auto* mu = new std::mutex();  // never destroyed: used from atexit
  return *mu;
}

OwnLife& own_life() {
  static auto* life = new OwnLife();
  return *life;
}

void unlink_own_life() {
  std::lock_guard<std::mutex> lock(own_life_mu());
  OwnLife& life = own_life();
  if (life.pid == static_cast<int64_t>(getpid()) && !life.name.empty()) {
    shm_unlink(shm_path(life.name).c_str());
  }
}

// The holder: registers the word as its robust futex and then sleeps for the life of the
// process. Its exit is the process's death (it never returns on its own).
void hold_life(uint8_t* base, std::promise<bool>* ready) {
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);  // signals are for the process's other threads
  auto* node = reinterpret_cast<robust_list*>(base);
  auto* word = reinterpret_cast<uint32_t*>(base + kLifeWordOffset);
  // Leaked on purpose: the kernel reads it when this thread exits, i.e. when the process dies.
  auto* head = new robust_list_head();
  head->list.next = node;
  node->next = &head->list;
  head->futex_offset = static_cast<long>(kLifeWordOffset);
  head->list_op_pending = nullptr;
  __atomic_store_n(word, static_cast<uint32_t>(syscall(SYS_gettid)), __ATOMIC_SEQ_CST);
  // Replaces glibc's list of this thread, which holds no glibc robust mutex ever.
  if (syscall(SYS_set_robust_list, head, sizeof(*head)) != 0) {
    __atomic_store_n(word, 0u, __ATOMIC_SEQ_CST);  // 0: attachers treat it as "no life word"
    ready->set_value(false);
    return;
  }
  ready->set_value(true);
  for (;;) pause();  // every signal is blocked: sleeps until the process ends
}

}  // namespace

std::string life_segment_name(const ProcessId& owner) {
  return std::string(kLifePrefix) + std::to_string(owner.pid) + "-" +
         std::to_string(owner.start_ticks) + "-0";
}

bool ensure_own_life() {
  std::lock_guard<std::mutex> lock(own_life_mu());
  OwnLife& life = own_life();
  const auto pid = static_cast<int64_t>(getpid());
  if (life.pid == pid) return life.ok;
  static const bool registered = [] { return std::atexit(unlink_own_life) == 0; }();
  (void)registered;
  life = OwnLife{pid, false, life_segment_name(self_process())};
  const std::string path = shm_path(life.name);
  // A segment of this very identity can only be our own from before an exec: its word is
  // already marked dead (exec ends the holder thread). Replace it.
  shm_unlink(path.c_str());
  const int fd = shm_open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd == -1) return false;
  void* base = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(kLifeBytes)) == 0) {
    base = mmap(nullptr, kLifeBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  ::close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(path.c_str());
    return false;
  }
  // Never unmapped: the holder's robust list points into it until the process ends.
  auto* ready = new std::promise<bool>();  // leaked if the thread never reports (wedged)
  auto started = ready->get_future();
  try {
    std::thread(hold_life, static_cast<uint8_t*>(base), ready).detach();
  } catch (const std::system_error&) {
    delete ready;
    shm_unlink(path.c_str());
    return false;
  }
  if (started.wait_for(kHolderStartTimeout) != std::future_status::ready) return false;
  life.ok = started.get();
  delete ready;
  if (!life.ok) shm_unlink(path.c_str());
  return life.ok;
}

LifeWord::LifeWord(void* base, uint64_t bytes)
    : base_(base),
      bytes_(bytes),
      word_(reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(base) + kLifeWordOffset)) {}

LifeWord::~LifeWord() {
  munmap(base_, bytes_);
}

bool LifeWord::dead() const {
  return (__atomic_load_n(word_, __ATOMIC_ACQUIRE) & FUTEX_OWNER_DIED) != 0;
}

uint32_t LifeWord::arm() {
  return __atomic_or_fetch(word_, static_cast<uint32_t>(FUTEX_WAITERS), __ATOMIC_SEQ_CST);
}

void LifeWord::wake_all() const {
  futex_wake_all(word_);
}

std::shared_ptr<LifeWord> attach_life(const ProcessId& owner) {
  static auto* mu = new std::mutex();
  static auto* cache = new std::map<std::pair<int64_t, uint64_t>, std::weak_ptr<LifeWord>>();
  std::lock_guard<std::mutex> lock(*mu);
  const auto key = std::make_pair(owner.pid, owner.start_ticks);
  if (auto it = cache->find(key); it != cache->end()) {
    if (auto lw = it->second.lock()) return lw;
  }
  for (auto it = cache->begin(); it != cache->end();) {  // forget owners no region refers to
    it = it->second.expired() ? cache->erase(it) : std::next(it);
  }
  const int fd = shm_open(shm_path(life_segment_name(owner)).c_str(), O_RDWR, 0);
  if (fd == -1) return nullptr;
  struct stat st;
  void* base = MAP_FAILED;
  if (fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= kLifeBytes) {
    base = mmap(nullptr, kLifeBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  ::close(fd);
  if (base == MAP_FAILED) return nullptr;
  auto lw = std::make_shared<LifeWord>(base, kLifeBytes);
  // 0: the owner's kernel refused the robust list (or it is not set up yet): poll instead.
  if (__atomic_load_n(lw->word(), __ATOMIC_ACQUIRE) == 0) return nullptr;
  (*cache)[key] = lw;
  return lw;
}

}  // namespace moecomm::transport::shm
