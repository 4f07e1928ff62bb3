// A buffer whose last byte sits right before an inaccessible page: reading one byte past its end
// faults. Tests use it to prove that parsers of untrusted slots never read outside the slot.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "common/align.h"
#include "common/error.h"

namespace moecomm {

class GuardedBuffer {
 public:
  explicit GuardedBuffer(uint64_t bytes) : bytes_(bytes) {
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    data_pages_ = align_up(bytes == 0 ? 1 : bytes, page);
    mapped_ = data_pages_ + page;
    void* base = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    MC_CHECK_KIND(base != MAP_FAILED, ErrorKind::kSystem, "mmap of a guarded buffer failed");
    base_ = static_cast<uint8_t*>(base);
    MC_SYSCALL_CHECK(mprotect(base_ + data_pages_, page, PROT_NONE), "mprotect of guard page");
  }
  ~GuardedBuffer() { munmap(base_, mapped_); }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;

  // The data ends exactly at the guard page.
  uint8_t* data() { return base_ + data_pages_ - bytes_; }
  uint64_t size() const { return bytes_; }

 private:
  uint64_t bytes_;
  uint64_t data_pages_ = 0;
  uint64_t mapped_ = 0;
  uint8_t* base_ = nullptr;
};

}  // namespace moecomm
