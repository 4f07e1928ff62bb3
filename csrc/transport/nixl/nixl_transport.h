// Backend `nixl`: peers on other hosts, reached through a NIXL agent (UCX underneath).
//
// Our own regions are plain host memory registered with the agent; a peer's region is a remote
// descriptor we can only reach through transfers. So, as on every backend, the receiver polls
// only its own memory (no wake-up crosses the network: waits spin, then poll with short sleeps
// that grow while it stays idle), and writes to a peer are one-sided NIXL WRITEs.
//
// Ordering (slot_io: payload, header, signal, doorbell): one message, one transfer. NIXL gives
// no order between two transfers, and none between the descriptors of one, but a transfer may
// carry a notification, and NIXL's UCX backend sends it only once the transfer is complete at the
// target: postXfer/checkXfer in src/plugins/ucx/ucx_backend.cpp post the notification's active
// message only after the request status, which includes the endpoint flush behind the WRITE,
// reports success (the Python API's `transfer(handle, notif_msg)` says "notification message to
// send after transfer is done"). So the notification is the signal word and the doorbell: the
// receiver learns of the arrival without a second transfer. The transport therefore:
//   put:    copies the bytes into a per-thread registered staging buffer and queues them (the
//           caller may reuse its memory at once, as with shm), unless they are our own
//           registered memory (see "Zero copy" below);
//   signal: writes this thread's queued puts to that peer as ONE transfer that carries the word
//           (address, value) as its notification; the receiver's transport stores the word into
//           its own memory when it drains its notifications (every wait drains them, and a
//           load of its own word at most every 10 µs), after the bytes, so a reader that sees
//           the word sees everything put before it. With nothing queued the notification goes
//           alone. The initiator still waits for the WRITE's completion: NIXL sends the
//           attached notification from the initiator's own status check (checkXfer), so without
//           that wait the word would not leave; this is one wait per message, not one per word.
//           Notifications from one agent arrive in the order sent: the UCX backend's default
//           of one worker gives one endpoint per peer, one active-message stream, so a doorbell
//           sent after a signal word is stored after it (with several workers this would need
//           a second look). A word sent alone is not tracked: the sender never learns it
//           arrived (liveness comes from the waiter's probes, as before). Queued puts to other
//           peers are written (and waited for) first.
//   fence:  writes the queue and waits.
// Zero copy: a put whose source lies inside our own registered host memory (a region of this
// transport: create_region, register_external) and is at least kBorrowMinBytes long is not
// staged: the transfer reads it in place, as put_region does, and as NIXL's own WRITE of a
// registered buffer does (bench/wire/cross_host.py, "NIXL itself"). A server answering from the
// request slot the bytes landed in, or a client sending from a registered tensor (TensorRegion),
// so sends every byte once, with no copy on the way. The bytes are read when this thread's
// next signal (or fence) writes its queue: they must not change before that returns. A write
// through this transport into our own memory overlapping such a source (a local put, signal or
// compare-exchange on the same thread: the slot protocol's poison mode overwrites the request
// slot before it signals the answer) writes the queue first, so the peer still gets the bytes
// as they were at put. `borrow = false` stages every put (the earlier path, kept to measure
// the difference).
// A message costs one payload transfer (one round trip at the initiator) plus one notification
// per word; the old path (`notify = false`: the word as its own WRITE, waited for) stays for
// comparison (bench/wire/cross_host.py, the row "moecomm-nixl (word per WRITE)").
//
// A peer's word cannot be added to (NIXL has no remote atomics), so SignalOp::kAdd on a peer's
// word writes a value that word never held before (this transport's random tag and a counter).
// Every kAdd in the protocol is a doorbell whose reader only compares with what it saw last.
//
// A region's memory is never unmapped: when it is destroyed its pages are dropped but its
// address range stays mapped (zero pages), because a peer may still hold its handle (see retire()
// in the .cc).
//
// The NIXL agent itself is reached through `Engine`: NIXL ships no C++ headers in its wheels, so
// the bindings implement Engine over NIXL's Python API (python/moecomm/nixl.py).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "transport/transport.h"

namespace moecomm::transport::nixl {

// Where registered memory lives. NIXL moves host and GPU memory alike; for GPU memory UCX uses
// NVLink, RDMA (GPUDirect) or staging through the host, whatever the machine has.
enum class MemKind : uint8_t {
  kHost = 0,
  kCuda = 1,
};

// One contiguous piece of a transfer: local (registered) address, remote address, length, and
// the kind and device of each side's memory.
struct Segment {
  uint64_t local = 0;
  uint64_t remote = 0;
  uint64_t bytes = 0;
  MemKind local_kind = MemKind::kHost;
  int32_t local_device = 0;
  MemKind remote_kind = MemKind::kHost;
  int32_t remote_device = 0;
};

// A signal word for a peer to store into its own memory, carried by a notification.
struct Word {
  uint64_t addr = 0;
  uint64_t value = 0;
};

enum class XferStatus : uint8_t {
  kDone = 0,      // complete at the target
  kPeerLost = 1,  // the peer disconnected or its agent is unknown
  kTimeout = 2,   // still in flight at the deadline (the peer is stopped or unreachable)
};

// The NIXL agent operations the transport needs. Implementations block until the transfer is
// complete at the target, it failed, or `timeout_ns` passed; they must be callable from any
// thread and never while the transport holds a lock of its own.
class Engine {
 public:
  virtual ~Engine() = default;
  virtual std::string agent_name() = 0;
  // Registers host memory for remote access; returns the blob a peer loads to reach it (the
  // agent's connection info and this memory's remote key, printable, no '|').
  virtual std::string register_memory(uint64_t addr, uint64_t bytes, MemKind kind,
                                      int32_t device) = 0;
  virtual void deregister_memory(uint64_t addr, uint64_t bytes) = 0;
  // Loads a peer's blob (adds the peer, or adds the memory to a known peer) and takes a
  // reference on it; returns its name. Each add is undone by one release_peer; the engine
  // disconnects from the peer when the last reference goes (it counts under its own lock, so
  // an attach racing the last release never loses its peer).
  virtual std::string add_peer(const std::string& blob) = 0;
  virtual void release_peer(const std::string& agent) = 0;
  virtual XferStatus write(const std::string& agent, const std::vector<Segment>& segs,
                           int64_t timeout_ns) = 0;
  virtual XferStatus read(const std::string& agent, const std::vector<Segment>& segs,
                          int64_t timeout_ns) = 0;
  // Writes `segs` (waiting for them as write() does), then has `words` delivered to the peer as
  // one notification that NIXL sends only after the bytes are complete at the target. With no
  // segments the notification goes at once and nothing is waited for.
  virtual XferStatus write_notify(const std::string& agent, const std::vector<Segment>& segs,
                                  const std::vector<Word>& words, int64_t timeout_ns) = 0;
  // The words peers sent this agent since the last call, in the order each peer sent them.
  virtual std::vector<Word> drain_notifs() = 0;
};

// How long a waiter spins on its word before it polls with sleeps: a round trip over a fast
// network lands within it; an idle waiter stops burning its core soon after.
constexpr int64_t kDefaultSpinNs = 50'000;
// Sleep between two polls once the spin is over: remote writes cannot wake a sleeper, so this
// bounds the latency an idle receiver adds (a Linux sleep overshoots by its timer slack).
constexpr int64_t kDefaultPollNs = 20'000;
// An idle waiter backs off: once it has waited kBackoffAfterNs, each sleep doubles, up to
// max_poll_ns. NIXL gives no fd to block on (its notifications land in the agent's own list),
// so a waiter must poll; polling every 20 µs costs an idle process ~25 % of a core (each poll
// drains notifications through the agent), every 1 ms a few %. A round trip in flight (a decode
// step over a TCP link takes a few ms) is answered before the back-off starts, so only a waiter
// that has been idle pays the bounded extra wake latency (max_poll_ns plus timer slack).
constexpr int64_t kBackoffAfterNs = 10'000'000;
constexpr int64_t kDefaultMaxPollNs = 1'000'000;
// A waiter checks its peer this often (each check is a small read across the network).
constexpr int64_t kPeerCheckIntervalNs = 50'000'000;
// A transfer still in flight after this long means the peer is stopped or unreachable.
constexpr int64_t kDefaultXferTimeoutNs = 10'000'000'000;
// A liveness probe still unanswered after this long counts as a lost peer.
constexpr int64_t kProbeTimeoutNs = 2'000'000'000;
// A put from our own registered memory is sent in place from this size on; a smaller one is
// copied: a copy of 64 KiB (a few µs) costs less than one more descriptor in the transfer, and
// a header or an expert-id list stays in the staged run beside its neighbours.
constexpr uint64_t kBorrowMinBytes = 64ull << 10;
// Initial per-thread staging: a decode-size request (128 x 7168 bf16) fits with room to spare.
constexpr uint64_t kInitialStagingBytes = 4ull << 20;
// Region handles: "nixl|<agent>|<address hex>|<bytes>|<memory: host or cuda:N>|<blob>".
constexpr char kHandleSep = '|';
constexpr const char* kHandlePrefix = "nixl";

struct NixlOptions {
  int64_t spin_ns = kDefaultSpinNs;
  int64_t poll_ns = kDefaultPollNs;
  int64_t xfer_timeout_ns = kDefaultXferTimeoutNs;
  // Signal words ride on the payload's notification (one transfer per message); false: each
  // word is its own WRITE, waited for (two dependent transfers per message, plus the doorbell).
  bool notify = true;
  // The longest sleep of an idle waiter (the back-off's bound: see kBackoffAfterNs).
  int64_t max_poll_ns = kDefaultMaxPollNs;
  // A large put from our own registered memory is sent in place (the header, "Zero copy");
  // false: every put is staged (copied), as before.
  bool borrow = true;
};

// Puts sent in place from our own registered memory (no staging copy) and their bytes.
struct ZeroCopyStats {
  uint64_t puts = 0;
  uint64_t bytes = 0;
};

namespace detail {
struct Shared;  // engine, peer reference counts and staging, shared with the regions
}  // namespace detail

class NixlTransport final : public Transport {
 public:
  NixlTransport(std::shared_ptr<Engine> engine, NixlOptions options = {});
  ~NixlTransport() override;
  std::string name() const override { return "nixl"; }
  std::shared_ptr<Region> create_region(uint64_t bytes) override;
  std::shared_ptr<Region> attach(const std::string& handle) override;
  void put(Region& dst, uint64_t offset, const void* src, uint64_t bytes) override;
  void signal(Region& dst, uint64_t offset, uint64_t value, SignalOp op) override;
  WaitResult wait(Region& local, uint64_t offset, const WaitPredicate& pred, int64_t timeout_ns,
                  const Region* peer) override;
  void read(Region& region, uint64_t offset, void* dst, uint64_t bytes) override;
  uint64_t load(Region& local, uint64_t offset) override;
  bool compare_exchange(Region& local, uint64_t offset, uint64_t expected,
                        uint64_t desired) override;
  void fence() override;
  bool peer_alive(const Region& peer) override;
  // Stores the signal words peers sent by notification into our memory; returns how many.
  // wait() and load() call it; a caller polling memory some other way calls it itself.
  size_t drain();

  // Registers memory the caller owns (a host buffer, or a CUDA allocation: kind kCuda) as a region
  // peers can attach to. The caller keeps it alive until the region and every peer holding its
  // handle are done with it. A CUDA region carries payload only: signal words live in host
  // regions (the host cannot poll GPU memory).
  std::shared_ptr<Region> register_external(uint64_t addr, uint64_t bytes, MemKind kind,
                                            int32_t device);
  // Zero-copy put: `bytes` at `src_offset` of our registered region `src` (host or CUDA) into a
  // peer's region, queued like put() and ordered by the next signal. `src` must not change until
  // that signal (or fence) returns.
  void put_region(Region& dst, uint64_t offset, Region& src, uint64_t src_offset, uint64_t bytes);

  const NixlOptions& options() const { return options_; }
  ZeroCopyStats zero_copy_stats() const;
  std::string agent_name() const;
  // Peers this transport holds regions of (their agents are loaded in the NIXL agent).
  std::vector<std::string> peers() const;

 private:
  // Whether `peer` is alive, as far as a read within `timeout_ns` can tell: false only when
  // its connection is known to be gone.
  bool probe(const Region& peer, int64_t timeout_ns);
  // Before a write into our own memory at [addr, addr + bytes): writes this thread's queue
  // first when one of its in-place sources overlaps it (the header, "Zero copy").
  void before_local_write(const uint8_t* addr, uint64_t bytes);
  std::shared_ptr<Region> publish(uint8_t* base, uint64_t bytes, uint64_t mapped, MemKind kind,
                                  int32_t device, bool external);

  NixlOptions options_;
  std::shared_ptr<detail::Shared> shared_;
};

}  // namespace moecomm::transport::nixl
