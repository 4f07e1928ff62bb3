#include "kernels/cpu/dispatch_route.h"

#include <algorithm>
#include <vector>

#include "common/error.h"

namespace moecomm::kernels::cpu {

void route_dispatch(const DispatchRoute& r) {
  const int64_t t_count = r.num_tokens, k_count = r.topk;
  std::fill(r.rows_per_server, r.rows_per_server + r.num_servers, 0);
  std::vector<int64_t> server(static_cast<size_t>(k_count));
  std::vector<int32_t> local(static_cast<size_t>(k_count));
  for (int64_t t = 0; t < t_count; ++t) {
    const int64_t* ids = r.topk_ids + t * k_count;
    for (int64_t k = 0; k < k_count; ++k) {
      const int64_t e = ids[k];
      MC_CHECK(e >= -1 && e < r.num_experts, "topk_ids must be in [-1, ", r.num_experts, "), got ",
               e);
      if (e < 0) {
        server[k] = -1;
        local[k] = -1;
        continue;
      }
      int64_t ordinal = 0;
      switch (r.rule) {
        case ReplicaRule::kRoundRobin:
          ordinal = t % r.num_replicas[e];
          break;
        case ReplicaRule::kPerExpert:
          ordinal = r.replica[e];
          break;
        case ReplicaRule::kPerChoice:
          ordinal = r.replica[t * k_count + k];
          break;
      }
      MC_CHECK(ordinal >= 0 && ordinal < r.num_replicas[e],
               "replica ordinals must be in [0, num_replicas[expert]) of their expert");
      const int64_t entry = r.offsets[e] + ordinal;
      server[k] = r.servers[entry];
      local[k] = r.locals[entry];
    }
    // One row per distinct server of this token, in k order of first appearance; the servers'
    // rows stay in token order because tokens are visited in order.
    for (int64_t k = 0; k < k_count; ++k) {
      const int64_t s = server[k];
      if (s < 0 || std::find(server.begin(), server.begin() + k, s) != server.begin() + k) {
        continue;
      }
      const int64_t row = r.rows_per_server[s]++;
      r.rows[s * t_count + row] = t;
      int32_t* out_ids = r.ids + (s * t_count + row) * k_count;
      float* out_scores = r.scores + (s * t_count + row) * k_count;
      const float* w = r.weights + t * k_count;
      for (int64_t j = 0; j < k_count; ++j) {
        const bool mine = server[j] == s;
        out_ids[j] = mine ? local[j] : -1;
        out_scores[j] = mine ? w[j] : 0.0f;
      }
    }
  }
}

}  // namespace moecomm::kernels::cpu
