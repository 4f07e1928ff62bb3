// Host launchers of the device data path: the client's dispatch and combine, the GPU expert
// server's gather (poll + concatenate + reorganize + group-shrink) and respond. Plain structs of
// device pointers; every launcher checks its arguments (throws moecomm::Error naming the bad
// one), enqueues on `stream` (a cudaStream_t) and returns: no host synchronisation, no host read
// of a device count, no allocation. A client step (dispatch + combine) can be captured in a CUDA
// graph; every replay sends new sequence numbers (they live in device memory).
//
// Peers: the client's peer p is server p; the server's peer p is client p. Two backends:
// CUDA IPC (peers' regions mapped into our address space) and NVSHMEM (symmetric heap). The
// NVSHMEM overloads are defined in csrc/transport/nvshmem/instantiate_kernels.cu and live in
// moecomm_nvshmem; with NVSHMEM, every workspace is a source of puts and must be in the
// symmetric heap or registered with nvshmemx_buffer_register.
//
// The grouped GEMM is not here: between gather and respond, the caller turns the reorganized
// rows (per-expert layout, ServerWorkspaceLayout::rows) into expert outputs already multiplied
// by their router score, one row per layout row, in f32/bf16/fp16.
#pragma once

#include <cstdint>

#include "kernels/cuda/dispatch_index.h"
#include "protocol/header.h"
#include "protocol/layout.h"
#include "transport/device/wait_trace.h"

namespace moecomm::kernels::cuda {

// Host-side descriptions of the two device backends (the device structs themselves need nvcc).
// `wait_trace`: the device debug mode's ring of wait records (transport/device/wait_trace.h,
// kWaitTraceBytes of zeroed device memory), or nullptr (the default): nothing is recorded.
struct IpcPeers {
  uint8_t* local_base = nullptr;        // our region (device memory)
  uint8_t* const* peer_base = nullptr;  // [max_peers] device array of mapped peer regions
  const uint32_t* alive = nullptr;      // [max_peers] device liveness mask
  uint32_t max_peers = 0;
  transport::device::WaitTrace* wait_trace = nullptr;
};

struct NvshmemPeers {
  uint8_t* local_base = nullptr;     // our region, symmetric
  const int32_t* peer_pe = nullptr;  // [max_peers] device array: NVSHMEM PE of each peer
  const uint32_t* alive = nullptr;   // [max_peers] device liveness mask
  uint32_t max_peers = 0;
  transport::device::WaitTrace* wait_trace = nullptr;
};

// What a client and all its servers agreed on, plus where the rings are.
struct ClientConfig {
  protocol::SlotConfig slot;  // max_tokens, hidden, topk, request and response encodings
  uint32_t num_servers = 0;   // servers = peers 0..num_servers-1
  uint32_t num_slots = 0;     // slots per ring
  uint64_t client_id = 0;
  const uint64_t* request_ring_offset = nullptr;   // [num_servers] our request ring in s's region
  const uint64_t* response_ring_offset = nullptr;  // [num_servers] s's response ring in ours
};

struct DispatchArgs {
  const void* x = nullptr;                                 // [num_tokens, hidden] device
  protocol::Encoding x_dtype = protocol::Encoding::kBF16;  // kBF16, kFP16, kF32, see x_scales
  uint64_t x_row_stride = 0;                               // elements between rows, >= hidden
  // Already quantized input, for a caller that owns the cast formula (the DeepEP adapter casts
  // as DeepEP does): with x_dtype == slot.encoding == kFP8E4M3B128, x holds the e4m3 bytes and
  // x_scales their scales, [num_tokens, encoding_scales_per_token] f32 contiguous; both are
  // sent as they are. Unused (null) for the float dtypes, which the pack kernel quantizes.
  const float* x_scales = nullptr;
  const void* topk_ids = nullptr;  // [num_tokens, topk] int32 or int64
  bool ids_int64 = false;
  const void* topk_weights = nullptr;  // [num_tokens, topk] in weights_dtype
  protocol::Encoding weights_dtype = protocol::Encoding::kF32;  // kBF16, kFP16 or kF32
  uint32_t num_tokens = 0;                                      // 0..max_tokens
  uint32_t topk = 0;                                            // 1..slot.topk
  // The host's replica choice: logical expert e goes to (expert_server[e], expert_local[e]).
  const int32_t* expert_server = nullptr;  // [num_experts] device
  const int32_t* expert_local = nullptr;   // [num_experts] device
  uint32_t num_experts = 0;
  uint32_t layer_id = 0;
  uint32_t slot = 0;
  uint64_t* next_seq = nullptr;  // [num_servers] last sequence used per server; zero at start
  void* workspace = nullptr;     // client_workspace_layout(...).total bytes, this slot's
};

struct CombineArgs {
  uint32_t num_tokens = 0;  // as dispatched
  uint32_t layer_id = 0;    // as dispatched: the response must carry it
  uint32_t slot = 0;        // as dispatched
  void* workspace = nullptr;
  void* out = nullptr;  // [num_tokens, hidden] contiguous, in out_dtype
  protocol::Encoding out_dtype = protocol::Encoding::kBF16;  // kBF16, kFP16 or kF32
  // Every server's wait ends by now_ns() at the start of the wait + timeout_ns.
  uint64_t timeout_ns = 0;
};

void launch_client_dispatch(const IpcPeers& peers, const ClientConfig& cfg,
                            const DispatchArgs& args, void* stream);
void launch_client_combine(const IpcPeers& peers, const ClientConfig& cfg, const CombineArgs& args,
                           void* stream);
void launch_client_dispatch(const NvshmemPeers& peers, const ClientConfig& cfg,
                            const DispatchArgs& args, void* stream);
void launch_client_combine(const NvshmemPeers& peers, const ClientConfig& cfg,
                           const CombineArgs& args, void* stream);

// One server step over every (client, slot) entry. All clients share one SlotConfig.
struct ServerConfig {
  protocol::SlotConfig slot;
  uint32_t num_clients = 0;  // clients = peers 0..num_clients-1
  uint32_t num_slots = 0;
  const uint64_t* client_ids = nullptr;            // [num_clients] id each client must send
  const uint64_t* request_ring_offset = nullptr;   // [num_clients] c's request ring in ours
  const uint64_t* response_ring_offset = nullptr;  // [num_clients] our response ring in c's
  uint32_t num_experts = 0;                        // local experts; ids outside are rejected
  uint32_t max_step_tokens = 0;                    // workspace capacity in tokens
};

struct ServerGatherArgs {
  uint32_t layer_id = 0;  // the layer this step serves
  // [num_layers] device bytes, 1 = hosted: requests of another hosted layer wait for its step,
  // requests of an unhosted layer are rejected (kUnknownLayer). nullptr: only layer_id.
  const uint8_t* layer_hosted = nullptr;
  uint32_t num_layers = 0;
  // How long the poll waits for the payload of a request whose header already arrived before
  // leaving it for the next step.
  uint64_t arrival_timeout_ns = 0;
  int32_t block_m = 0;  // group-shrink tile rows (the grouped GEMM's M tile)
  void* workspace = nullptr;
  // The server drains: every valid request of this layer is answered kDraining (the client
  // re-sends it to a replica at once), as the host server does.
  bool draining = false;
};

struct ServerRespondArgs {
  // [max_rows, hidden] expert outputs already times their score, in layout order.
  const void* expert_out = nullptr;
  protocol::Encoding expert_out_dtype = protocol::Encoding::kF32;  // kBF16, kFP16 or kF32
  void* workspace = nullptr;
};

void launch_server_gather(const IpcPeers& peers, const ServerConfig& cfg,
                          const ServerGatherArgs& args, void* stream);
void launch_server_respond(const IpcPeers& peers, const ServerConfig& cfg,
                           const ServerRespondArgs& args, void* stream);
void launch_server_gather(const NvshmemPeers& peers, const ServerConfig& cfg,
                          const ServerGatherArgs& args, void* stream);
void launch_server_respond(const NvshmemPeers& peers, const ServerConfig& cfg,
                           const ServerRespondArgs& args, void* stream);

}  // namespace moecomm::kernels::cuda
