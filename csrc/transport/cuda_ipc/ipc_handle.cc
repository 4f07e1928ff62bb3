#include "transport/cuda_ipc/ipc_handle.h"

#include <cstdio>
#include <sstream>
#include <vector>

#include "common/error.h"
#include "transport/shm/process.h"

namespace moecomm::transport::cuda_ipc {
namespace {

// Fields after the prefix: version, boot id, pid, start ticks, uuid, bytes, handle.
constexpr size_t kNumFields = 7;

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t pos = s.find(sep, start);
    out.push_back(s.substr(start, pos == std::string::npos ? std::string::npos : pos - start));
    if (pos == std::string::npos) return out;
    start = pos + 1;
  }
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

template <size_t N>
std::array<uint8_t, N> hex_decode(const std::string& field, const char* what,
                                  const std::string& text) {
  MC_CHECK(field.size() == 2 * N, "malformed cuda_ipc handle '", text, "': ", what, " must be ",
           2 * N, " hex digits, got ", field.size(), " characters");
  std::array<uint8_t, N> out{};
  for (size_t i = 0; i < N; ++i) {
    const int hi = hex_value(field[2 * i]);
    const int lo = hex_value(field[2 * i + 1]);
    MC_CHECK(hi >= 0 && lo >= 0, "malformed cuda_ipc handle '", text, "': ", what,
             " has a non-hex character");
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return out;
}

// Strict decimal: digits only, no sign, no overflow.
uint64_t parse_u64(const std::string& field, const char* what, const std::string& text) {
  MC_CHECK(!field.empty() && field.size() <= 20, "malformed cuda_ipc handle '", text, "': ", what,
           " must be a decimal number");
  uint64_t v = 0;
  for (char c : field) {
    MC_CHECK(c >= '0' && c <= '9', "malformed cuda_ipc handle '", text, "': ", what,
             " must be a decimal number, got '", field, "'");
    const uint64_t d = static_cast<uint64_t>(c - '0');
    MC_CHECK(v <= (UINT64_MAX - d) / 10, "malformed cuda_ipc handle '", text, "': ", what,
             " overflows 64 bits");
    v = v * 10 + d;
  }
  return v;
}

// Stands for "no boot id available" (a /proc without it): such handles still parse, but two
// nodes without a boot id are not told apart.
constexpr const char* kUnknownBootId = "00000000-0000-0000-0000-000000000000";

bool valid_boot_id(const std::string& id) {
  if (id.size() != kBootIdChars) return false;
  for (size_t i = 0; i < id.size(); ++i) {
    const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash ? id[i] != '-' : hex_value(id[i]) < 0) return false;
  }
  return true;
}

}  // namespace

std::string hex_encode(const uint8_t* data, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = kDigits[data[i] >> 4];
    out[2 * i + 1] = kDigits[data[i] & 0xf];
  }
  return out;
}

std::string format_handle(const IpcHandle& h) {
  std::ostringstream os;
  os << kHandlePrefix << kHandleVersion << ':' << h.boot_id << ':' << h.pid << ':' << h.start_ticks
     << ':' << hex_encode(h.device_uuid.data(), h.device_uuid.size()) << ':' << h.bytes << ':'
     << hex_encode(h.mem_handle.data(), h.mem_handle.size());
  return os.str();
}

IpcHandle parse_handle(const std::string& text) {
  const std::string prefix = kHandlePrefix;
  MC_CHECK(text.compare(0, prefix.size(), prefix) == 0, "not a cuda_ipc handle: '", text,
           "' (expected '", prefix, "...'; shm handles start with 'shm:')");
  const std::vector<std::string> f = split(text.substr(prefix.size()), ':');
  MC_CHECK(f.size() == kNumFields, "malformed cuda_ipc handle '", text, "': expected ", kNumFields,
           " ':'-separated fields after the prefix, got ", f.size());
  const uint64_t version = parse_u64(f[0], "version", text);
  MC_CHECK(version == kHandleVersion, "cuda_ipc handle version ", version,
           " is not supported (this build speaks version ", kHandleVersion, ")");
  IpcHandle h;
  h.boot_id = f[1];
  MC_CHECK(valid_boot_id(h.boot_id), "malformed cuda_ipc handle '", text,
           "': boot id must be a textual UUID");
  const uint64_t pid = parse_u64(f[2], "pid", text);
  MC_CHECK(pid > 0 && pid <= INT32_MAX, "malformed cuda_ipc handle '", text, "': pid ", pid,
           " out of range");
  h.pid = static_cast<int64_t>(pid);
  h.start_ticks = parse_u64(f[3], "start ticks", text);
  h.device_uuid = hex_decode<kUuidBytes>(f[4], "GPU UUID", text);
  h.bytes = parse_u64(f[5], "size", text);
  MC_CHECK(h.bytes > 0 && h.bytes <= kMaxRegionBytes, "malformed cuda_ipc handle '", text,
           "': region size ", h.bytes, " outside [1, ", kMaxRegionBytes, "]");
  h.mem_handle = hex_decode<kMemHandleBytes>(f[6], "memory handle", text);
  return h;
}

IpcHandle check_attachable(const std::string& text, const std::string& our_boot_id,
                           int64_t our_pid) {
  IpcHandle h = parse_handle(text);
  MC_CHECK(h.boot_id == our_boot_id, "cuda_ipc handle comes from another node (boot id ", h.boot_id,
           ", ours ", our_boot_id,
           "): CUDA IPC only connects processes on one node; use the NVSHMEM transport across "
           "nodes");
  MC_CHECK(h.pid != our_pid, "cuda_ipc handle was exported by this same process (pid ", h.pid,
           "): CUDA forbids opening one's own IPC handle; use the region object directly");
  MC_CHECK_KIND(shm::process_alive({h.pid, h.start_ticks}), ErrorKind::kPeerLost,
                "the owner of the cuda_ipc handle (pid ", h.pid, ") is gone");
  return h;
}

std::string node_boot_id() {
  FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f == nullptr) return kUnknownBootId;
  char buf[64] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  std::string id(buf, n);
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  for (char& c : id) {
    if (c >= 'A' && c <= 'F') c = static_cast<char>(c - 'A' + 'a');
  }
  return valid_boot_id(id) ? id : kUnknownBootId;
}

}  // namespace moecomm::transport::cuda_ipc
