// GPU check of the device data path in one process over the CUDA-IPC backend: one client and S
// loopback servers whose regions are plain device buffers (peer_base points at them; no IPC
// handle is needed inside one process). Built and run by tests/ops/test_device_dispatch.py
// (marked gpu), which writes the case file with the host path's expectations.
//
//   device_dispatch_check roundtrip CASE  dispatch -> server gather -> stand-in expert ->
//                                         respond -> combine, eagerly; payloads, headers,
//                                         signals, statuses and y bit-exact
//   device_dispatch_check graph CASE      the same step captured once as a CUDA graph and
//                                         replayed for every step of CASE with new inputs
//   device_dispatch_check timeout CASE    no server runs: combine ends by its deadline with
//                                         TIMEOUT, the slot reused is SLOT_BUSY, dead peers
//                                         (on the other slot) end at once with PEER_LOST
// Prints OK and exits 0 when everything matches; the first mismatch goes to stderr.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/error.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/device_dispatch.h"
#include "protocol/signal.h"

namespace kc = moecomm::kernels::cuda;
namespace proto = moecomm::protocol;
using proto::Encoding;

namespace {

constexpr uint32_t kSlots = 2;
constexpr uint32_t kSlot = 1;  // the slot every step uses: not 0, to exercise slot offsets
constexpr uint64_t kClientId = 7;
constexpr uint32_t kLayer = 3;
constexpr int32_t kBlockM = 16;
constexpr uint64_t kArrivalTimeoutNs = 100'000'000;
constexpr uint64_t kCombineTimeoutNs = 5'000'000'000;
constexpr uint64_t kShortTimeoutNs = 100'000'000;

struct Step {
  std::vector<uint8_t> x, ids, weights, y;
  std::vector<uint32_t> count;
  std::vector<std::vector<uint8_t>> payload;
};

struct Case {
  uint32_t tokens, hidden, topk, servers, experts;
  Encoding enc, x_enc, out_enc;
  std::vector<int32_t> expert_server, expert_local;
  std::vector<Step> steps;
};

template <typename T>
void read(std::ifstream& in, T* dst, size_t n) {
  in.read(reinterpret_cast<char*>(dst), static_cast<std::streamsize>(n * sizeof(T)));
  if (!in) throw std::runtime_error("case file truncated");
}

Case load(const char* path) {
  std::ifstream in(path, std::ios::binary);
  uint32_t h[9];
  read(in, h, 9);
  Case c{h[0],
         h[1],
         h[2],
         h[3],
         h[4],
         static_cast<Encoding>(h[5]),
         static_cast<Encoding>(h[6]),
         static_cast<Encoding>(h[7]),
         {},
         {},
         {}};
  c.expert_server.resize(c.experts);
  c.expert_local.resize(c.experts);
  read(in, c.expert_server.data(), c.experts);
  read(in, c.expert_local.data(), c.experts);
  const uint64_t th = uint64_t{c.tokens} * c.hidden, tk = uint64_t{c.tokens} * c.topk;
  for (uint32_t i = 0; i < h[8]; ++i) {
    Step s;
    s.x.resize(th * proto::encoding_elem_bytes(c.x_enc));
    s.ids.resize(tk * 8);
    s.weights.resize(tk * 4);
    read(in, s.x.data(), s.x.size());
    read(in, s.ids.data(), s.ids.size());
    read(in, s.weights.data(), s.weights.size());
    for (uint32_t srv = 0; srv < c.servers; ++srv) {
      uint32_t n = 0;
      uint64_t bytes = 0;
      read(in, &n, 1);
      read(in, &bytes, 1);
      s.count.push_back(n);
      s.payload.emplace_back(bytes);
      read(in, s.payload.back().data(), bytes);
    }
    s.y.resize(th * proto::encoding_elem_bytes(c.out_enc));
    read(in, s.y.data(), s.y.size());
    c.steps.push_back(std::move(s));
  }
  return c;
}

// Every copy and every launch of this check runs on this one non-blocking stream. A copy on the
// legacy stream is not ordered against a launch on a non-blocking stream (and a cudaMemcpy
// from pageable memory may return before its DMA has landed), so mixing the two races.
cudaStream_t stream() {
  static cudaStream_t s = [] {
    cudaStream_t t = nullptr;
    MC_CUDA_CHECK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking));
    return t;
  }();
  return s;
}

// Synchronous on return: the (pageable) host side may be reused or freed at once.
void copy_sync(void* dst, const void* src, size_t bytes) {
  MC_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream()));
  MC_CUDA_CHECK(cudaStreamSynchronize(stream()));
}

template <typename T>
T* dev_alloc(size_t n) {
  T* p = nullptr;
  MC_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T) + 1));
  MC_CUDA_CHECK(cudaMemsetAsync(p, 0, n * sizeof(T) + 1, stream()));
  MC_CUDA_CHECK(cudaStreamSynchronize(stream()));
  return p;
}

template <typename T>
T* dev_copy(const std::vector<T>& v) {
  T* p = dev_alloc<T>(v.size());
  copy_sync(p, v.data(), v.size() * sizeof(T));
  return p;
}

template <typename T>
std::vector<T> host_copy(const void* p, size_t n) {
  std::vector<T> v(n);
  copy_sync(v.data(), p, n * sizeof(T));
  return v;
}

// The stand-in expert: out[i] = (score * (local expert + 1)) * dequant(row i), f32, rounded
// exactly as the host expectation (moecomm.ops.quant.dequantize, then two multiplications).
__global__ void standin_expert(const uint8_t* rows, const float* scales, const int32_t* ids,
                               const int64_t* src_token, const int32_t* src_k,
                               const float* row_scores, const int64_t* offsets, uint32_t experts,
                               uint32_t hidden, uint32_t topk, Encoding enc, float* out) {
  const uint64_t i = blockIdx.x;
  if (static_cast<int64_t>(i) >= offsets[experts]) return;
  const int64_t t = src_token[i];
  const int32_t e = ids[t * topk + src_k[i]];
  const float factor = __fmul_rn(row_scores[i], static_cast<float>(e + 1));
  const uint64_t row_bytes = uint64_t{hidden} * proto::encoding_elem_bytes(enc);
  const uint64_t spt = proto::encoding_scales_per_token(enc, hidden);
  const uint8_t* row = rows + i * row_bytes;
  for (uint32_t c = threadIdx.x; c < hidden; c += blockDim.x) {
    float v;
    if (enc == Encoding::kInt8) {
      v = __fmul_rn(static_cast<float>(static_cast<int8_t>(row[c])), scales[t * spt]);
    } else if (enc == Encoding::kFP8E4M3 || enc == Encoding::kFP8E4M3B128) {
      const __half q = __nv_cvt_fp8_to_halfraw(row[c], __NV_E4M3);
      const uint64_t b = enc == Encoding::kFP8E4M3 ? 0 : c / proto::kScaleBlock;
      v = __fmul_rn(__half2float(q), scales[t * spt + b]);
    } else {
      v = kc::dev::load_f32(row, c, enc);
    }
    out[i * hidden + c] = __fmul_rn(factor, v);
  }
}

struct Server {
  uint8_t* region;
  kc::IpcPeers peers;
  kc::ServerConfig cfg;
  kc::ServerWorkspaceLayout lay;
  uint8_t* ws;
  float* expert_out;
};

struct World {
  Case c;
  proto::SlotConfig slot;
  uint64_t req_region, resp_region;
  uint8_t* client_region;
  kc::IpcPeers client_peers;
  uint32_t* client_alive;
  kc::ClientConfig ccfg;
  kc::DispatchArgs dispatch;
  kc::CombineArgs combine;
  std::vector<Server> servers;
  uint8_t *x, *ids, *weights, *y, *client_ws;
};

World build(const Case& c) {
  World w{};
  w.c = c;
  w.slot = proto::SlotConfig{c.tokens, c.hidden, c.topk, c.enc, c.out_enc};
  w.req_region = proto::region_bytes(proto::request_slot_bytes(w.slot), kSlots);
  w.resp_region = proto::region_bytes(proto::response_slot_bytes(w.slot), kSlots);
  w.client_region = dev_alloc<uint8_t>(c.servers * w.resp_region);
  std::vector<uint8_t*> server_bases;
  std::vector<uint64_t> zeros(c.servers, 0), resp_offsets;
  for (uint32_t s = 0; s < c.servers; ++s) {
    Server srv{};
    srv.region = dev_alloc<uint8_t>(w.req_region);
    server_bases.push_back(srv.region);
    resp_offsets.push_back(s * w.resp_region);
    srv.peers = kc::IpcPeers{srv.region, dev_copy(std::vector<uint8_t*>{w.client_region}),
                             dev_copy(std::vector<uint32_t>{1}), 1};
    uint32_t local_experts = 1;
    for (uint32_t e = 0; e < c.experts; ++e) {
      if (c.expert_server[e] == static_cast<int32_t>(s)) {
        local_experts = std::max<uint32_t>(local_experts, c.expert_local[e] + 1);
      }
    }
    srv.cfg = kc::ServerConfig{w.slot,
                               1,
                               kSlots,
                               dev_copy(std::vector<uint64_t>{kClientId}),
                               dev_copy(std::vector<uint64_t>{0}),
                               dev_copy(std::vector<uint64_t>{s * w.resp_region}),
                               local_experts,
                               c.tokens};
    srv.lay = kc::server_workspace_layout(w.slot, 1, kSlots, c.tokens, local_experts);
    srv.ws = dev_alloc<uint8_t>(srv.lay.total);
    srv.expert_out = dev_alloc<float>(srv.lay.max_rows * c.hidden);
    w.servers.push_back(srv);
  }
  w.client_alive = dev_copy(std::vector<uint32_t>(c.servers, 1));
  w.client_peers = kc::IpcPeers{w.client_region, dev_copy(server_bases), w.client_alive, c.servers};
  w.ccfg = kc::ClientConfig{w.slot,    c.servers,       kSlots,
                            kClientId, dev_copy(zeros), dev_copy(resp_offsets)};
  const Step& s0 = c.steps[0];
  w.x = dev_copy(s0.x);
  w.ids = dev_copy(s0.ids);
  w.weights = dev_copy(s0.weights);
  w.y = dev_alloc<uint8_t>(s0.y.size());
  w.client_ws = dev_alloc<uint8_t>(kc::client_workspace_layout(c.servers, w.slot).total);
  kc::DispatchArgs& d = w.dispatch;
  d.x = w.x;
  d.x_dtype = c.x_enc;
  d.x_row_stride = c.hidden;
  d.topk_ids = w.ids;
  d.ids_int64 = true;
  d.topk_weights = w.weights;
  d.weights_dtype = Encoding::kF32;
  d.num_tokens = c.tokens;
  d.topk = c.topk;
  d.expert_server = dev_copy(c.expert_server);
  d.expert_local = dev_copy(c.expert_local);
  d.num_experts = c.experts;
  d.layer_id = kLayer;
  d.slot = kSlot;
  d.next_seq = dev_alloc<uint64_t>(c.servers);
  d.workspace = w.client_ws;
  w.combine =
      kc::CombineArgs{c.tokens, kLayer, kSlot, w.client_ws, w.y, c.out_enc, kCombineTimeoutNs};
  return w;
}

void set_inputs(World& w, const Step& s) {
  copy_sync(w.x, s.x.data(), s.x.size());
  copy_sync(w.ids, s.ids.data(), s.ids.size());
  copy_sync(w.weights, s.weights.data(), s.weights.size());
}

void enqueue_servers(World& w, cudaStream_t st) {
  for (Server& srv : w.servers) {
    kc::ServerGatherArgs g{kLayer, nullptr, 0, kArrivalTimeoutNs, kBlockM, srv.ws};
    kc::launch_server_gather(srv.peers, srv.cfg, g, st);
    const kc::ServerWorkspaceLayout& l = srv.lay;
    standin_expert<<<static_cast<uint32_t>(l.max_rows), 128, 0, st>>>(
        srv.ws + l.rows, reinterpret_cast<float*>(srv.ws + l.scales),
        reinterpret_cast<int32_t*>(srv.ws + l.ids),
        reinterpret_cast<int64_t*>(srv.ws + l.src_token),
        reinterpret_cast<int32_t*>(srv.ws + l.src_k),
        reinterpret_cast<float*>(srv.ws + l.row_scores),
        reinterpret_cast<int64_t*>(srv.ws + l.offsets), srv.cfg.num_experts, w.c.hidden, w.c.topk,
        w.c.enc, srv.expert_out);
    MC_CUDA_CHECK(cudaGetLastError());
    kc::ServerRespondArgs r{srv.expert_out, Encoding::kF32, srv.ws};
    kc::launch_server_respond(srv.peers, srv.cfg, r, st);
  }
}

void enqueue_step(World& w, cudaStream_t st) {
  kc::launch_client_dispatch(w.client_peers, w.ccfg, w.dispatch, st);
  enqueue_servers(w, st);
  kc::launch_client_combine(w.client_peers, w.ccfg, w.combine, st);
}

bool fail(const std::string& what) {
  std::fprintf(stderr, "%s\n", what.c_str());
  return false;
}

// Everything one step left behind, against the host path. `seq` = sequence numbers expected per
// server (0 = nothing sent); kept by the caller across steps.
bool check_step(World& w, const Step& s, const std::vector<uint64_t>& seq, int step) {
  const std::string at = "step " + std::to_string(step) + ": ";
  const kc::ClientWorkspaceLayout cl = kc::client_workspace_layout(w.c.servers, w.slot);
  auto count = host_copy<int32_t>(w.client_ws + cl.count, w.c.servers);
  auto status = host_copy<int32_t>(w.client_ws + cl.status, w.c.servers);
  auto detail = host_copy<int32_t>(w.client_ws + cl.detail, w.c.servers);
  const uint64_t req_slot = proto::slot_offset(proto::request_slot_bytes(w.slot), kSlot);
  for (uint32_t srv = 0; srv < w.c.servers; ++srv) {
    const std::string who = at + "server " + std::to_string(srv) + ": ";
    if (count[srv] != static_cast<int32_t>(s.count[srv])) return fail(who + "count differs");
    const int32_t want = s.count[srv] ? 0 : static_cast<int32_t>(kc::ServerStatus::kNotSent);
    if (status[srv] != want) {
      return fail(who + "status " + std::to_string(status[srv]) + " detail " +
                  std::to_string(detail[srv]) + ", want " + std::to_string(want));
    }
    if (s.count[srv] == 0) continue;
    const uint8_t* slot = w.servers[srv].region + req_slot;
    const auto sig = host_copy<uint64_t>(slot + proto::kSignalOffset, 2);
    if (sig[0] != proto::make_signal(proto::SlotState::kIdle, seq[srv])) {
      return fail(who + "request slot not released to IDLE|seq");
    }
    const auto hdr = host_copy<proto::SlotHeader>(slot + proto::kHeaderOffset, 1)[0];
    const proto::PayloadLayout l =
        proto::request_payload_layout(s.count[srv], w.c.hidden, w.c.topk, w.c.enc);
    if (hdr.num_tokens != s.count[srv] || hdr.payload_bytes != l.total || hdr.seq != seq[srv] ||
        hdr.client_id != kClientId || hdr.layer_id != kLayer || hdr.topk != w.c.topk) {
      return fail(who + "request header differs");
    }
    const auto got = host_copy<uint8_t>(slot + proto::kPayloadOffset, l.total);
    const std::vector<std::pair<uint64_t, uint64_t>> parts = {{l.act_offset, l.act_bytes},
                                                              {l.scale_offset, l.scale_bytes},
                                                              {l.ids_offset, l.ids_bytes},
                                                              {l.scores_offset, l.scores_bytes}};
    for (const auto& [off, bytes] : parts) {
      if (std::memcmp(got.data() + off, s.payload[srv].data() + off, bytes) != 0) {
        return fail(who + "payload differs at part offset " + std::to_string(off));
      }
    }
  }
  const auto y = host_copy<uint8_t>(w.y, s.y.size());
  if (std::memcmp(y.data(), s.y.data(), y.size()) != 0) return fail(at + "combine differs");
  return true;
}

void bump(std::vector<uint64_t>& seq, const Step& s) {
  for (size_t i = 0; i < seq.size(); ++i) seq[i] += s.count[i] ? 1 : 0;
}

bool roundtrip(World& w, cudaStream_t st) {
  std::vector<uint64_t> seq(w.c.servers, 0);
  bool ok = true;
  for (size_t i = 0; i < w.c.steps.size() && ok; ++i) {
    set_inputs(w, w.c.steps[i]);
    enqueue_step(w, st);
    MC_CUDA_CHECK(cudaStreamSynchronize(st));
    bump(seq, w.c.steps[i]);
    ok = check_step(w, w.c.steps[i], seq, static_cast<int>(i));
  }
  return ok;
}

bool graph(World& w, cudaStream_t st) {
  cudaGraph_t g;
  cudaGraphExec_t exec;
  MC_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  enqueue_step(w, st);
  MC_CUDA_CHECK(cudaStreamEndCapture(st, &g));
  MC_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  std::vector<uint64_t> seq(w.c.servers, 0);
  for (size_t i = 0; i < w.c.steps.size(); ++i) {
    set_inputs(w, w.c.steps[i]);
    MC_CUDA_CHECK(cudaGraphLaunch(exec, st));
    MC_CUDA_CHECK(cudaStreamSynchronize(st));
    bump(seq, w.c.steps[i]);
    if (!check_step(w, w.c.steps[i], seq, static_cast<int>(i))) return false;
  }
  return true;
}

// Dispatch + combine with no server step: every server with tokens must time out by the
// deadline; the same slot used again is not sent (its request may still be read: SLOT_BUSY,
// protocol v2); then, on the other slot with every peer marked dead, they are reported lost at
// once.
bool timeout(World& w, cudaStream_t st) {
  const Step& s = w.c.steps[0];
  const kc::ClientWorkspaceLayout cl = kc::client_workspace_layout(w.c.servers, w.slot);
  struct Trial {
    uint32_t slot;
    uint64_t timeout_ns;
    kc::ServerStatus want;
    double max_s;  // generous: launch overhead and a busy machine
  };
  static_assert(kSlots >= 2, "the dead-peer trial needs a slot the timed-out one is not");
  const uint32_t other_slot = kSlot == 0 ? 1 : 0;
  // A client workspace is one slot's (its pending sequence numbers say which requests are
  // unanswered), so the other slot gets its own.
  uint8_t* other_ws = dev_alloc<uint8_t>(cl.total);
  const std::vector<uint32_t> dead(w.c.servers, 0);
  for (const Trial trial :
       {Trial{kSlot, kShortTimeoutNs, kc::ServerStatus::kTimeout, 3.0},
        Trial{kSlot, kShortTimeoutNs, kc::ServerStatus::kSlotBusy, 3.0},
        Trial{other_slot, kCombineTimeoutNs, kc::ServerStatus::kPeerLost, 2.0}}) {
    if (trial.want == kc::ServerStatus::kPeerLost) {
      copy_sync(w.client_alive, dead.data(), dead.size() * sizeof(uint32_t));
    }
    uint8_t* ws = trial.slot == kSlot ? w.client_ws : other_ws;
    kc::DispatchArgs d = w.dispatch;
    d.slot = trial.slot;
    d.workspace = ws;
    kc::CombineArgs a = w.combine;
    a.slot = trial.slot;
    a.workspace = ws;
    a.timeout_ns = trial.timeout_ns;
    const auto start = std::chrono::steady_clock::now();
    kc::launch_client_dispatch(w.client_peers, w.ccfg, d, st);
    kc::launch_client_combine(w.client_peers, w.ccfg, a, st);
    MC_CUDA_CHECK(cudaStreamSynchronize(st));
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (took > trial.max_s) return fail("combine took " + std::to_string(took) + " s");
    const auto status = host_copy<int32_t>(ws + cl.status, w.c.servers);
    for (uint32_t srv = 0; srv < w.c.servers; ++srv) {
      const auto want = s.count[srv] ? trial.want : kc::ServerStatus::kNotSent;
      if (status[srv] != static_cast<int32_t>(want)) {
        return fail("slot " + std::to_string(trial.slot) + ", server " + std::to_string(srv) +
                    ": status " + std::to_string(status[srv]) + ", want " +
                    std::to_string(static_cast<int>(want)));
      }
    }
    const auto y = host_copy<uint8_t>(w.y, s.y.size());
    for (uint8_t b : y) {
      if (b != 0) return fail("a combine without answers must be all zeros");
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s roundtrip|graph|timeout CASE\n", argv[0]);
    return 2;
  }
  try {
    World w = build(load(argv[2]));
    cudaStream_t st = stream();
    const std::string mode = argv[1];
    bool ok = false;
    if (mode == "roundtrip") ok = roundtrip(w, st);
    if (mode == "graph") ok = graph(w, st);
    if (mode == "timeout") ok = timeout(w, st);
    if (!ok) return 1;
    std::puts("OK");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
