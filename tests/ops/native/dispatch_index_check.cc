// Host replay of the device dispatch/combine index math (csrc/kernels/cuda/dispatch_index.h):
// the same route_expert / token_servers / request_row / request_payload_layout calls the
// kernels make, run sequentially. Built with g++ and driven by
// tests/ops/test_device_dispatch.py, which compares the payloads and the combine with
// moecomm.ops.pack_dispatch / combine bit for bit.
//
//   dispatch_index_check IN OUT   replays the dispatch (and combine) described by IN
//   dispatch_index_check layouts  checks the workspace layouts; prints OK
//
// IN (little-endian): u32 T, H, K, S, E, encoding, ids_int64; i32 expert_server[E],
// expert_local[E]; ids[T*K] (i32 or i64); f32 weights[T*K]; wire rows [T * H * elem] bytes;
// f32 scales [T * scales_per_token]; then per server s (in order) its partial rows
// [count_s * H] f32, count_s as the replay finds it.
// OUT: i32 pos[T*S]; per server: u32 count, u64 payload_bytes, payload bytes (unused bytes 0);
// then f32 y[T*H] = Σ over servers in order of partial_s[pos[t, s]].
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <vector>

#include "kernels/cuda/dispatch_index.h"

namespace kc = moecomm::kernels::cuda;
namespace proto = moecomm::protocol;

namespace {

template <typename T>
void read(std::istream& in, T* dst, size_t n) {
  in.read(reinterpret_cast<char*>(dst), static_cast<std::streamsize>(n * sizeof(T)));
  if (!in) throw std::runtime_error("input truncated");
}

template <typename T>
void write(std::ostream& out, const T* src, size_t n) {
  out.write(reinterpret_cast<const char*>(src), static_cast<std::streamsize>(n * sizeof(T)));
}

int replay(const char* in_path, const char* out_path) {
  std::ifstream in(in_path, std::ios::binary);
  uint32_t hdr[7];
  read(in, hdr, 7);
  const uint32_t t_n = hdr[0], hidden = hdr[1], topk = hdr[2], servers = hdr[3], experts = hdr[4];
  const auto enc = static_cast<proto::Encoding>(hdr[5]);
  const bool ids_int64 = hdr[6] != 0;
  std::vector<int32_t> expert_server(experts), expert_local(experts);
  read(in, expert_server.data(), experts);
  read(in, expert_local.data(), experts);
  std::vector<uint8_t> ids(uint64_t{t_n} * topk * (ids_int64 ? 8 : 4));
  read(in, ids.data(), ids.size());
  std::vector<float> weights(uint64_t{t_n} * topk);
  read(in, weights.data(), weights.size());
  const uint64_t elem = proto::encoding_elem_bytes(enc);
  const uint64_t spt = proto::encoding_scales_per_token(enc, hidden);
  std::vector<uint8_t> wire(uint64_t{t_n} * hidden * elem);
  read(in, wire.data(), wire.size());
  std::vector<float> scales(t_n * spt);
  read(in, scales.data(), scales.size());

  // route kernel, one server at a time: pos by a running count, then the ids/scores rows.
  std::vector<int32_t> pos(uint64_t{t_n} * servers, kc::kNoPosition);
  std::vector<uint32_t> count(servers, 0);
  std::vector<std::vector<uint8_t>> payload(servers);
  for (uint32_t s = 0; s < servers; ++s) {
    for (uint32_t t = 0; t < t_n; ++t) {
      bool mine = false;
      for (uint32_t k = 0; k < topk && !mine; ++k) {
        const kc::Route r =
            kc::route_expert(kc::load_id(ids.data(), ids_int64, t * topk + k), expert_server.data(),
                             expert_local.data(), experts, servers);
        mine = r.server == static_cast<int32_t>(s);
      }
      if (mine) pos[uint64_t{t} * servers + s] = static_cast<int32_t>(count[s]++);
    }
    const proto::PayloadLayout l = proto::request_payload_layout(count[s], hidden, topk, enc);
    payload[s].assign(l.total, 0);
    for (uint32_t t = 0; t < t_n; ++t) {
      const int32_t row = pos[uint64_t{t} * servers + s];
      if (row < 0) continue;
      const kc::RequestRow off = kc::request_row(l, row, hidden, topk, enc);
      for (uint32_t k = 0; k < topk; ++k) {
        const uint64_t i = uint64_t{t} * topk + k;
        const kc::Route r =
            kc::route_expert(kc::load_id(ids.data(), ids_int64, i), expert_server.data(),
                             expert_local.data(), experts, servers);
        const bool here = r.server == static_cast<int32_t>(s);
        const int32_t id = here ? r.local : kc::kNoExpert;
        const float score = here ? weights[i] : 0.0f;
        std::memcpy(&payload[s][off.ids + k * 4], &id, 4);
        std::memcpy(&payload[s][off.scores + k * 4], &score, 4);
      }
    }
  }
  // pack kernel, one token at a time: its row and scales into each of its servers' payloads.
  for (uint32_t t = 0; t < t_n; ++t) {
    int32_t dst[kc::kMaxTopk];
    const uint32_t n = kc::token_servers(ids.data(), ids_int64, t, topk, expert_server.data(),
                                         expert_local.data(), experts, servers, dst);
    for (uint32_t i = 0; i < n; ++i) {
      const int32_t s = dst[i];
      const proto::PayloadLayout l = proto::request_payload_layout(count[s], hidden, topk, enc);
      const kc::RequestRow off =
          kc::request_row(l, pos[uint64_t{t} * servers + s], hidden, topk, enc);
      std::memcpy(&payload[s][off.act], &wire[t * hidden * elem], hidden * elem);
      if (spt) std::memcpy(&payload[s][off.scales], &scales[t * spt], spt * 4);
    }
  }
  // combine: y[t] = Σ over servers in order of partial_s[pos[t, s]], f32.
  std::vector<std::vector<float>> partial(servers);
  for (uint32_t s = 0; s < servers; ++s) {
    partial[s].resize(uint64_t{count[s]} * hidden);
    read(in, partial[s].data(), partial[s].size());
  }
  std::vector<float> y(uint64_t{t_n} * hidden, 0.0f);
  for (uint32_t t = 0; t < t_n; ++t) {
    for (uint32_t c = 0; c < hidden; ++c) {
      float acc = 0.0f;
      for (uint32_t s = 0; s < servers; ++s) {
        const int32_t row = pos[uint64_t{t} * servers + s];
        if (row >= 0) acc += partial[s][uint64_t(row) * hidden + c];
      }
      y[uint64_t{t} * hidden + c] = acc;
    }
  }
  std::ofstream out(out_path, std::ios::binary);
  write(out, pos.data(), pos.size());
  for (uint32_t s = 0; s < servers; ++s) {
    const uint64_t bytes = payload[s].size();
    write(out, &count[s], 1);
    write(out, &bytes, 1);
    write(out, payload[s].data(), bytes);
  }
  write(out, y.data(), y.size());
  return out ? 0 : 1;
}

// Parts of a workspace: offsets in increasing order, 64-byte aligned, each ending before the
// next begins, the total covering the last.
bool ordered(const char* what, const std::vector<std::pair<uint64_t, uint64_t>>& parts,
             uint64_t total) {
  uint64_t end = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto [off, bytes] = parts[i];
    if (off % moecomm::kCacheLine != 0 || off < end) {
      std::fprintf(stderr, "%s: part %zu at %llu overlaps or is unaligned (previous end %llu)\n",
                   what, i, static_cast<unsigned long long>(off),
                   static_cast<unsigned long long>(end));
      return false;
    }
    end = off + bytes;
  }
  if (total < end || total % moecomm::kCacheLine != 0) {
    std::fprintf(stderr, "%s: total %llu does not cover the parts\n", what,
                 static_cast<unsigned long long>(total));
    return false;
  }
  return true;
}

int layouts() {
  bool ok = true;
  for (uint32_t enc = proto::kMinEncoding; enc <= proto::kMaxEncoding; ++enc) {
    for (const uint32_t hidden : {1u, 7u, 128u, 130u, 7168u}) {
      proto::SlotConfig c;
      c.max_tokens = 37;
      c.hidden = hidden;
      c.topk = 5;
      c.encoding = static_cast<proto::Encoding>(enc);
      c.out_encoding = proto::Encoding::kBF16;
      const uint32_t s = 3;
      const kc::ClientWorkspaceLayout w = kc::client_workspace_layout(s, c);
      ok = ok && ordered("client",
                         {{w.staging, s * w.staging_stride},
                          {w.headers, s * 64},
                          {w.pos, uint64_t{c.max_tokens} * s * 4},
                          {w.count, s * 4},
                          {w.sent_seq, s * 8},
                          {w.status, s * 4},
                          {w.detail, s * 4}},
                         w.total);
      const uint32_t step = 2 * c.max_tokens, experts = 9, clients = 4, slots = 2;
      const kc::ServerWorkspaceLayout v =
          kc::server_workspace_layout(c, clients, slots, step, experts);
      const uint64_t b = clients * slots, rows = uint64_t{step} * c.topk;
      ok = ok && v.max_rows == rows && v.num_entries == b;
      ok = ok && ordered("server",
                         {{v.entries, b * sizeof(kc::EntryState)},
                          {v.batch_offsets, (b + 1) * 8},
                          {v.x, step * v.row_bytes},
                          {v.ids, rows * 4},
                          {v.scores, rows * 4},
                          {v.tile_hist, v.num_tiles * experts * 4},
                          {v.tile_prefix, v.num_tiles * experts * 4},
                          {v.src_token, rows * 8},
                          {v.slot_of, rows * 8},
                          {v.rows, rows * v.row_bytes},
                          {v.response, uint64_t{step} * hidden * 2 + 64},
                          {v.headers, b * 64}},
                         v.total);
    }
  }
  std::puts(ok ? "OK" : "FAIL");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 2 && std::strcmp(argv[1], "layouts") == 0) return layouts();
    if (argc == 3) return replay(argv[1], argv[2]);
    std::fprintf(stderr, "usage: %s IN OUT | %s layouts\n", argv[0], argv[0]);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
