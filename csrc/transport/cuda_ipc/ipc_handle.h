// The string form of a CUDA-IPC region handle, as it travels in the HTTP connect handshake:
//
//   cuda_ipc:1:<boot id>:<owner pid>:<owner start ticks>:<GPU UUID, 32 hex>:<bytes>:<handle, 128
//   hex>
//
// The boot id (/proc/sys/kernel/random/boot_id) names the node: CUDA IPC only works between
// processes under one kernel, so a handle from another node is refused before any CUDA call.
// (pid, start ticks) name the owner across pid reuse, for liveness checks. The GPU UUID, not an
// ordinal, names the device: CUDA_VISIBLE_DEVICES may number devices differently per process.
// Parsing is plain C++ so malformed handles are rejected on machines without a GPU too.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace moecomm::transport::cuda_ipc {

constexpr const char* kHandlePrefix = "cuda_ipc:";
constexpr uint32_t kHandleVersion = 1;
// sizeof(cudaIpcMemHandle_t) (CUDA_IPC_HANDLE_SIZE); checked against the CUDA header in the .cu.
constexpr size_t kMemHandleBytes = 64;
// sizeof(cudaUUID_t).
constexpr size_t kUuidBytes = 16;
// Length of a boot id: a textual UUID, 8-4-4-4-12 hex digits with dashes.
constexpr size_t kBootIdChars = 36;
// Regions larger than this are certainly a corrupted handle (no GPU has 256 TiB).
constexpr uint64_t kMaxRegionBytes = uint64_t{1} << 48;

struct IpcHandle {
  std::string boot_id;
  int64_t pid = 0;
  uint64_t start_ticks = 0;
  std::array<uint8_t, kUuidBytes> device_uuid{};
  uint64_t bytes = 0;
  std::array<uint8_t, kMemHandleBytes> mem_handle{};
};

std::string format_handle(const IpcHandle& h);

// Throws moecomm::Error (kInvalidArgument) naming the first field that is wrong.
IpcHandle parse_handle(const std::string& text);

// Everything attach() checks before its first CUDA call: the handle parses, comes from this
// node (`our_boot_id`), not from this process (`our_pid`: CUDA forbids opening one's own
// handle), and its owner is alive. Throws kInvalidArgument, or kPeerLost for a dead owner.
IpcHandle check_attachable(const std::string& text, const std::string& our_boot_id,
                           int64_t our_pid);

// This node's boot id (lower-case textual UUID); all zeros when /proc does not provide one.
std::string node_boot_id();

std::string hex_encode(const uint8_t* data, size_t n);

}  // namespace moecomm::transport::cuda_ipc
