// Process identity that survives pid reuse: (pid, start time in clock ticks since boot), and the
// process's life word, which the kernel itself marks the moment the process dies.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace moecomm::transport::shm {

struct ProcessId {
  int64_t pid = 0;
  uint64_t start_ticks = 0;
};

// The calling process.
ProcessId self_process();

// True while the process exists, is the same one (start time matches) and is not a zombie.
// Reads /proc: what a poll sees, only once the process is a zombie.
bool process_alive(const ProcessId& p);

// ---------------------------------------------------------------------------------------------
// Life words: death noticed by the kernel, not by a poll.
//
// Every process that owns shm regions keeps one small segment, moecomm_life-<pid>-<ticks>-0,
// whose word holds the id of a thread that lives as long as the process and registered the word
// as a robust futex (set_robust_list(2)). When that thread exits — the process is killed, exits
// or execs — the kernel walks its robust list in do_exit, before the address space is torn down
// and long before the process is a zombie: it sets FUTEX_OWNER_DIED in the word and wakes a
// waiter sleeping on it (one waiter: the woken one wakes the rest, see LifeWord::mark_seen).
// A waiter sleeps on its own signal word and its peer's life word at once (futex_waitv), so a
// peer's death ends the wait at once instead of at the next liveness poll.

// Prefix of life segments. Not kSegmentPrefix: they are no regions (list_segments leaves them
// out, and reaping counts regions only), but the reaper removes those of dead processes too.
constexpr const char* kLifePrefix = "moecomm_life-";

// Makes sure this process has its life word (creates the segment and the holder thread once per
// process; again in a forked child). False when the kernel refuses (no robust futexes): peers
// then notice this process's death by their poll only.
bool ensure_own_life();

// A peer's life word, mapped read-write (a waiter sets FUTEX_WAITERS in it so that the kernel
// wakes it). Unmapped when the last region of that peer attached here goes.
class LifeWord {
 public:
  LifeWord(void* base, uint64_t bytes);
  ~LifeWord();
  LifeWord(const LifeWord&) = delete;
  LifeWord& operator=(const LifeWord&) = delete;

  uint32_t* word() const { return word_; }
  // The kernel marked the owner dead.
  bool dead() const;
  // Before sleeping on the word: sets FUTEX_WAITERS (so that the dying owner's kernel path wakes
  // a sleeper) and returns the value to sleep on.
  uint32_t arm();
  // A waiter that saw the death wakes every other sleeper (the kernel woke only one).
  void wake_all() const;

 private:
  void* base_;
  uint64_t bytes_;
  uint32_t* word_;
};

// The life word of `owner`, shared by every region of that owner attached in this process;
// nullptr when the owner has none (it predates life words, or its kernel refused).
std::shared_ptr<LifeWord> attach_life(const ProcessId& owner);

// Name of the life segment of `owner` (without the leading '/').
std::string life_segment_name(const ProcessId& owner);

}  // namespace moecomm::transport::shm
