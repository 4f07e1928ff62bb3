// CPU expert MLP for the few rows per expert of a decode step.
//
// With 1-16 rows per expert, a general GEMM (which packs the weight matrix into panels before
// using it) spends more on packing than on arithmetic. These kernels stream each weight row
// once, straight from memory, and reuse it for every activation row held in registers.
// float32 only; AVX2+FMA is chosen at run time, with a portable fallback.
#pragma once

#include <cstdint>

namespace moecomm::kernels::cpu {

// y[m, n] = Σ_k x[m, k] · w[n, k] for m < rows, n < cols ("NT": w is [cols, depth] row-major,
// like nn.Linear.weight). Strides are in elements.
void gemm_nt_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
                 int64_t rows, int64_t cols, int64_t depth);

// The grouped expert MLP for a list of experts. Expert e owns rows row_begin[e] ..
// row_begin[e] + row_count[e] of x, scores and out: the contiguous layout passes its offsets,
// the masked layout [E, M_max, H] passes row_begin[e] = e * M_max.
struct ExpertMlpArgs {
  const float* x;  // [rows, hidden], row stride ldx
  int64_t ldx;
  const int64_t* row_begin;  // [E]
  const int64_t* row_count;  // [E]
  const int32_t* experts;    // experts to run (each in [0, E))
  int64_t num_run;
  const float* w13;     // [E, 2*inter, hidden] gate rows then up rows, dense
  const float* w2;      // [E, hidden, inter], dense
  const float* scores;  // [N] router scores, or nullptr for 1
  float* out;           // [N, hidden], row stride ldo
  int64_t ldo;
  int64_t hidden;
  int64_t inter;
  // Caller-owned room for the [rows, 2*inter] gate|up product of every expert (a warm
  // workspace: no allocation per call), or nullptr to allocate it per call. Threads take
  // disjoint parts; 2*inter * (rows of the listed experts) floats always suffice.
  float* scratch = nullptr;
  int64_t scratch_floats = 0;
};

// out[rows of e] = scores · w2[e] @ (silu(w1[e] @ x) ⊙ (w3[e] @ x)) for every listed expert.
// Experts are split over `threads` threads (1 = the calling thread only).
void expert_mlp_f32(const ExpertMlpArgs& args, int threads);

// The per-expert layout of a server step's token copies (EaaS Algorithm 1), a stable counting
// sort: copy j of the flat (batch, row, k) list with ids[j] = e >= 0 becomes layout row
// offsets[e] + (copies of e before j). Every output is caller-owned; nothing is allocated.
struct ExpertLayoutArgs {
  const int32_t* ids;            // [num_copies] local expert id or -1
  const float* scores;           // [num_copies] router score of each copy
  int64_t num_copies;            // tokens * topk
  int64_t topk;                  // >= 1
  const int64_t* batch_offsets;  // [num_batches + 1], first token of each batch
  int64_t num_batches;
  int64_t num_experts;
  int32_t* counts;     // [E] copies per expert
  int64_t* offsets;    // [E + 1] exclusive prefix sum of counts
  int64_t* cursor;     // [E] scratch
  int32_t* active;     // [E] experts with copies, ascending (first *num_active valid)
  int64_t* src_token;  // [num_copies] per layout row (first N valid)
  int32_t* src_batch;  // [num_copies]
  int32_t* src_row;    // [num_copies]
  int32_t* src_k;      // [num_copies]
  float* row_scores;   // [num_copies]
  int64_t* slot_of;    // [num_copies] layout row of each copy, or -1
};

// Fills the layout; returns N, the rows routed here, and the active-expert count in num_active.
// Throws on an id outside [-1, E).
int64_t expert_layout(const ExpertLayoutArgs& args, int64_t* num_active);

// True when the AVX2+FMA kernels run on this CPU (otherwise the portable loop does).
bool expert_mlp_has_avx2();

}  // namespace moecomm::kernels::cpu
