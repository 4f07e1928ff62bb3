// The device data path instantiated for the NVSHMEM backend (moecomm_nvshmem): the same kernels
// as csrc/kernels/cuda/device_dispatch.cu, with puts that are nvshmemx_putmem_signal_nbi_warp.
// The workspaces of dispatch and respond are the sources of their puts, so they must be
// symmetric: allocate each as an NvshmemRegion of the layout's total and pass its device_ptr;
// the launchers below refuse anything else (a clear error instead of a remote-access fault).
#include "kernels/cuda/client_combine.cuh"
#include "kernels/cuda/client_dispatch.cuh"
#include "kernels/cuda/device_dispatch.h"
#include "kernels/cuda/server_launch.cuh"
#include "transport/nvshmem/nvshmem_backend.cuh"
#include "transport/nvshmem/nvshmem_runtime.h"

namespace moecomm::kernels::cuda {
namespace {

transport::nvshmem::NvshmemBackend backend_of(const NvshmemPeers& p) {
  return {transport::device::BackendBase::of(p, p.peer_pe,
                                             "NVSHMEM peers: local_base, peer_pe and alive"),
          p.peer_pe};
}

}  // namespace

void launch_client_dispatch(const NvshmemPeers& peers, const ClientConfig& cfg,
                            const DispatchArgs& args, void* stream) {
  transport::nvshmem::require_symmetric(args.workspace,
                                        client_workspace_layout(cfg.num_servers, cfg.slot).total,
                                        "the client workspace");
  client::launch_dispatch(backend_of(peers), peers.max_peers, cfg, args, stream);
}

void launch_client_combine(const NvshmemPeers& peers, const ClientConfig& cfg,
                           const CombineArgs& args, void* stream) {
  client::launch_combine(backend_of(peers), peers.max_peers, cfg, args, stream);
}

void launch_server_gather(const NvshmemPeers& peers, const ServerConfig& cfg,
                          const ServerGatherArgs& args, void* stream) {
  server::launch_gather(backend_of(peers), peers.max_peers, cfg, args, stream);
}

void launch_server_respond(const NvshmemPeers& peers, const ServerConfig& cfg,
                           const ServerRespondArgs& args, void* stream) {
  transport::nvshmem::require_symmetric(
      args.workspace,
      server_workspace_layout(cfg.slot, cfg.num_clients, cfg.num_slots, cfg.max_step_tokens,
                              cfg.num_experts)
          .total,
      "the server workspace");
  server::launch_respond(backend_of(peers), peers.max_peers, cfg, args, stream);
}

}  // namespace moecomm::kernels::cuda
