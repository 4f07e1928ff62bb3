// Balanced packing steps of moecomm.eplb (python/moecomm/eplb/packing.py), for equal packs.
//
// A batch of `rows` independent problems; each packs packs * slots weighted, labelled items into
// `packs` packs of exactly `slots` items. The layout is the Python Packing's: table, slot_w and
// slot_l are [rows, packs, slots] row-major (item index, weight, label), loads is [rows, packs].
// Every function reproduces the numpy version step for step (same float operations in the same
// order, same tie-breaking), so results are bit-identical; the numpy code stays the reference
// and tests/eplb compare the two. Equal pack capacities and full packs only: the unequal-server
// extension (place_experts with slots or capacities that differ) stays in numpy.
#pragma once

#include <cstdint>

namespace moecomm::kernels::cpu {

struct EplbPacking {
  int64_t rows;
  int64_t packs;
  int64_t slots;
  int64_t* table;   // [rows, packs, slots] item index in the row
  double* slot_w;   // [rows, packs, slots] item weight
  int64_t* slot_l;  // [rows, packs, slots] item label (>= 0)
  double* loads;    // [rows, packs] sum of slot_w over the pack
  // Rows judged together by their heaviest pack (a layer's nodes): group id per row, ids in
  // [0, rows); nullptr means every row is its own group.
  const int64_t* row_group;
};

// Greedy rounds: items heaviest first (stable), one per pack per round, the lightest packs
// (stable) taking the heaviest remaining items. weights and labels are [rows, packs * slots].
void eplb_rounds(const EplbPacking& p, const double* weights, const int64_t* labels);

// De-duplication: the first item repeating a label in its pack swaps with the item of another
// pack that minimizes the larger of the two loads, when neither pack then holds a label twice
// and that load stays at or below the group's heaviest pack; repeated up to max_steps per row.
void eplb_dedup(const EplbPacking& p, int64_t max_steps);

// Refinement: per group, the rows at the group's heaviest load swap one item of their heaviest
// pack with one item of another pack, the swap that lowers the pair's larger load most (never
// creating a duplicate label); a group stops once such a row finds no improving swap.
void eplb_refine(const EplbPacking& p, int64_t max_steps, double min_relative_gain);

// Replica counts (python/moecomm/eplb/replicas.py replica_counts): one per expert, then each
// redundant slot to the largest priority w / (j + offset) for an expert's j-th extra replica
// (zero loads: -j, below every positive load), ties to the lower expert id; at most
// max_count replicas per expert (max_count < 0: no cap), raised to ceil(num_slots / experts)
// when that could not fill the slots. weights [rows, experts] -> counts [rows, experts].
void eplb_replica_counts(const double* weights, int64_t rows, int64_t experts, int64_t num_slots,
                         int64_t max_count, double offset, int64_t* counts);

// Published outputs from phy2log [rows, slots] (every expert id in [0, experts) at least once):
// logcnt [rows, experts] replica counts, log2phy [rows, experts, slots - experts + 1] each
// expert's slots ascending, padded with -1. False (outputs partial) on an id out of range or an
// expert with more than slots - experts + 1 replicas.
bool eplb_log2phy(const int64_t* phy2log, int64_t rows, int64_t slots, int64_t experts,
                  int64_t* log2phy, int64_t* logcnt);

}  // namespace moecomm::kernels::cpu
