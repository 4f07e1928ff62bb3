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
};

// out[rows of e] = scores · w2[e] @ (silu(w1[e] @ x) ⊙ (w3[e] @ x)) for every listed expert.
// Experts are split over `threads` threads (1 = the calling thread only).
void expert_mlp_f32(const ExpertMlpArgs& args, int threads);

// True when the AVX2+FMA kernels run on this CPU (otherwise the portable loop does).
bool expert_mlp_has_avx2();

}  // namespace moecomm::kernels::cpu
