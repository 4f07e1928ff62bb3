#include "transport/shm/process.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

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

}  // namespace moecomm::transport::shm
