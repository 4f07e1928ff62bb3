// Backend `shm`: processes on one host, POSIX shared memory, spin-then-futex waits.
//
// Segments are created 0600 under /dev/shm with names that carry the owner's pid and start time:
//   moecomm-<pid>-<start_ticks>-<counter>-<random>
// The owner unlinks its segments on close. A process killed with SIGKILL cannot, so stale
// segments are reaped by whoever notices: every new ShmTransport scans /dev/shm once, and a
// waiter that finds its peer dead reaps that peer's segments. A segment is stale when the process
// named in it no longer exists, is a zombie, or has another start time (pid reused).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/shm/process.h"
#include "transport/transport.h"

namespace moecomm::transport::shm {

// How long a waiter spins before it sleeps. Long enough to cover a round trip through an
// expert server that answers at once (a few µs), short enough that an idle waiter goes to sleep
// before it costs measurable CPU.
constexpr int64_t kDefaultSpinNs = 50'000;
// A sleeping waiter wakes this often to check that its peer is still alive, when the peer has no
// life word (process.h) or death watching is off.
constexpr int64_t kPeerCheckIntervalNs = 20'000'000;
// With a life word the kernel wakes the waiter at the peer's death; the poll stays as a safety
// net at this interval. It bounds the one case the wake misses: the kernel wakes a single
// sleeper of a dead peer's word and that one passes the wake on — unless it is itself stopped.
constexpr int64_t kWatchedPeerCheckIntervalNs = 100'000'000;
// Prefix of every segment name, also the pattern the reaper looks for.
constexpr const char* kSegmentPrefix = "moecomm-";

// Whether waits of new transports sleep on their peer's life word (process.h), unless their
// options say otherwise: on by default; off reproduces the poll-only detection (benchmarks
// compare the two).
void set_default_watch_death(bool on);
bool default_watch_death();

struct ShmOptions {
  int64_t spin_ns = kDefaultSpinNs;
  bool reap_on_start = true;
  bool watch_death = default_watch_death();
};

class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(ShmOptions options = {});
  std::string name() const override { return "shm"; }
  std::shared_ptr<Region> create_region(uint64_t bytes) override;
  std::shared_ptr<Region> attach(const std::string& handle) override;
  void put(Region& dst, uint64_t offset, const void* src, uint64_t bytes) override;
  void signal(Region& dst, uint64_t offset, uint64_t value, SignalOp op) override;
  WaitResult wait(Region& local, uint64_t offset, const WaitPredicate& pred, int64_t timeout_ns,
                  const Region* peer) override;
  uint64_t load(Region& local, uint64_t offset) override;
  bool compare_exchange(Region& local, uint64_t offset, uint64_t expected,
                        uint64_t desired) override;
  void fence() override;
  bool peer_alive(const Region& peer) override;
  WaitAnyResult wait_any(const WaitItem* items, uint64_t count, int64_t timeout_ns) override;

  const ShmOptions& options() const { return options_; }

 private:
  ShmOptions options_;
  ProcessId self_;
};

// Removes segments whose owner is gone (life segments too). Returns how many region segments
// were removed. `only_pid` > 0 limits
// the scan to segments of that pid.
int reap_stale_segments(int64_t only_pid = 0);

// Names (without the leading '/') of moecomm segments currently in /dev/shm owned by `pid`
// (all moecomm segments when pid is 0). For tests and diagnostics.
std::vector<std::string> list_segments(int64_t pid = 0);

}  // namespace moecomm::transport::shm
