// The device debug mode's wait trace (MOECOMM_DEVICE_DEBUG=1): every device wait (wait_word,
// and read_signal / wait_at_least through it) appends one record of what it waited for and how
// it ended to a fixed-size ring in device memory. After a failed step the host copies the ring
// back and prints it (moecomm.runtime.device_debug), so a first hang names the word that never
// changed, the peer that never wrote it and the call site that gave up.
//
// The ring's address travels in the backend struct (IpcBackend / NvshmemBackend::wait_trace,
// set from IpcPeers / NvshmemPeers): null, the default, turns recording off at the cost of one
// predictable branch per wait.
//
// Plain structs, compiled by the host compiler too: the bindings export the layout
// (moecomm._cuda.WAIT_TRACE) and the Python decoder is checked against it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moecomm::transport::device {

// Records the ring holds: enough for every wait of several client steps (two or three per
// server each) or of a few server gather passes (one per (client, slot) entry each), small
// enough (40 KiB) to copy back and print in one go.
constexpr uint32_t kWaitTraceRecords = 512;

// Who waited. Stable numbers: the host decoder names them (device_debug.WAIT_SITES).
enum class WaitSite : uint32_t {
  kUnknown = 0,
  kProbe = 1,           // a transport's wait probe (tests, diagnostics)
  kCombineSignal = 2,   // client combine: the response slot's signal word (RESPONSE_READY|seq)
  kCombineArrival = 3,  // client combine: the response's arrival counter (payload bytes)
  kGatherSignal = 4,    // server gather: a request slot's signal word (read_signal, no wait)
  kGatherArrival = 5,   // server gather: the request's arrival counter (payload bytes)
};

// A record's op beyond transport::WaitOp (0 equal, 1 not equal): wait_at_least, the word (an
// arrival counter) must reach `value`.
constexpr uint32_t kWaitOpAtLeast = 2;

// status of a record: DeviceWait (0 ok, 1 timeout, 2 peer lost).
struct WaitRecord {
  uint64_t index;   // 1 + the record's number in the trace; 0 = never written. Written last.
  uint64_t offset;  // the word waited on, in our own region
  uint64_t mask;    // the predicate: (word & mask) == value (op 0) or != value (op 1)
  uint64_t value;
  uint64_t observed;    // the last word read
  uint64_t start_ns;    // %globaltimer when the wait began
  uint64_t elapsed_ns;  // until its verdict
  uint32_t op;          // transport::WaitOp, or kWaitOpAtLeast
  uint32_t status;      // DeviceWait
  uint32_t peer;        // the peer index whose write was awaited
  uint32_t site;        // WaitSite
  uint32_t block;       // blockIdx.x of the waiting thread
  uint32_t thread;      // threadIdx.x
};
static_assert(sizeof(WaitRecord) == 80, "the host decoder reads this layout: keep it fixed");

// [header line][kWaitTraceRecords records]. The header's `next` counts records ever started
// (more than kWaitTraceRecords: the oldest were overwritten).
struct WaitTraceHeader {
  uint64_t next;
  uint64_t reserved[7];
};
static_assert(sizeof(WaitTraceHeader) == 64, "one cache line before the records");

struct WaitTrace {
  WaitTraceHeader header;
  WaitRecord records[kWaitTraceRecords];
};

constexpr uint64_t kWaitTraceBytes = sizeof(WaitTrace);
static_assert(offsetof(WaitTrace, records) == sizeof(WaitTraceHeader), "no padding in between");

}  // namespace moecomm::transport::device
