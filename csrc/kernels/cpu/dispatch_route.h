// Routing of a dispatched batch to expert servers on the CPU (moecomm.ops.dispatch): picks the
// replica of every (token, k) choice and lays out each server's request rows in one pass, where
// the torch version takes a dozen small tensor ops — at decode sizes their fixed cost, not the
// data, is what a dispatch pays. Results are the torch version's exactly (tests/ops compare).
#pragma once

#include <cstdint>

namespace moecomm::kernels::cpu {

// How the replica of a choice is picked (ExpertMap.resolve): round robin by token row, one
// ordinal per expert, or one per choice.
enum class ReplicaRule : int { kRoundRobin = 0, kPerExpert = 1, kPerChoice = 2 };

struct DispatchRoute {
  int64_t num_tokens;
  int64_t topk;
  const int64_t* topk_ids;  // [T, K] logical expert or -1
  const float* weights;     // [T, K]
  int64_t num_experts;
  const int64_t* num_replicas;  // [E]
  const int64_t* offsets;       // [E] first replica entry of each expert
  const int64_t* servers;       // [R] server of each replica entry
  const int32_t* locals;        // [R] local expert index of each replica entry
  ReplicaRule rule;
  const int64_t* replica;  // [E] or [T, K] ordinals per `rule`; nullptr for round robin
  int64_t num_servers;
  // Outputs, per server s: rows_per_server[s] rows; rows[s, :n] the batch rows in increasing
  // order; ids[s, :n, :] the local index of each choice for s, else -1; scores likewise, else 0.
  int64_t* rows_per_server;  // [S]
  int64_t* rows;             // [S, T]
  int32_t* ids;              // [S, T, K]
  float* scores;             // [S, T, K]
};

// Fills the outputs. Throws (std::invalid_argument) on an expert id outside [-1, E) or a
// replica ordinal outside [0, num_replicas[e]) before writing a row of the offending token.
void route_dispatch(const DispatchRoute& r);

}  // namespace moecomm::kernels::cpu
