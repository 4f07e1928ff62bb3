// The device data path instantiated for the CUDA-IPC backend (moecomm_cuda). The NVSHMEM
// instantiation is csrc/transport/nvshmem/instantiate_kernels.cu (moecomm_nvshmem).
#include "kernels/cuda/client_combine.cuh"
#include "kernels/cuda/client_dispatch.cuh"
#include "kernels/cuda/device_dispatch.h"
#include "kernels/cuda/server_launch.cuh"
#include "transport/cuda_ipc/ipc_backend.cuh"

namespace moecomm::kernels::cuda {
namespace {

transport::cuda_ipc::IpcBackend backend_of(const IpcPeers& p) {
  return {transport::device::BackendBase::of(p, p.peer_base,
                                             "IPC peers: local_base, peer_base and alive"),
          p.peer_base};
}

}  // namespace

void launch_client_dispatch(const IpcPeers& peers, const ClientConfig& cfg,
                            const DispatchArgs& args, void* stream) {
  client::launch_dispatch(backend_of(peers), peers.max_peers, cfg, args, stream);
}

void launch_client_combine(const IpcPeers& peers, const ClientConfig& cfg, const CombineArgs& args,
                           void* stream) {
  client::launch_combine(backend_of(peers), peers.max_peers, cfg, args, stream);
}

void launch_server_gather(const IpcPeers& peers, const ServerConfig& cfg,
                          const ServerGatherArgs& args, void* stream) {
  server::launch_gather(backend_of(peers), peers.max_peers, cfg, args, stream);
}

void launch_server_respond(const IpcPeers& peers, const ServerConfig& cfg,
                           const ServerRespondArgs& args, void* stream) {
  server::launch_respond(backend_of(peers), peers.max_peers, cfg, args, stream);
}

}  // namespace moecomm::kernels::cuda
