#include "kernels/cpu/expert_mlp.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <exception>
#include <thread>
#include <utility>
#include <vector>

#include "common/error.h"

namespace moecomm::kernels::cpu {
namespace {

constexpr int kLanes = 8;  // floats per 256-bit vector
// Weight rows are streamed from memory once per expert. Each stream also asks for the line this
// far ahead into L1 (16 lines: covers DRAM latency at one line per ~10 ns per stream); what
// mattered most is the prefetch of the next tile into L2, see gemm_nt_avx2.
constexpr int kPrefetchBytes = 1024;

// Register tile: up to 4 activation rows x 3 weight rows = 12 accumulators, plus 3 weight
// vectors and 1 activation vector: all 16 ymm registers, 7 loads per 12 FMAs. (An 8x3 tile in
// the 32 registers of AVX-512VL was measured no faster once the weights were prefetched.)
constexpr int kMaxRows = 4;
constexpr int kMaxCols = 3;

// Summation order, what makes a row's result independent of the other rows of the call (batch
// invariance): every output keeps its own 8-lane accumulator; lane l adds x[k]·w[k] for
// k ≡ l (mod 8) in increasing k with one FMA each; the lanes are summed by hsum()'s fixed tree
// and the depth % 8 tail is added in order. Nothing depends on the tile an output falls in.

// ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// y[0:R, 0:C] = x[0:R, 0:depth] · w[0:C, 0:depth]^T. With prefetch_next, the C weight rows
// after these ones (the next tile) are requested into L2 at the pace this tile consumes its
// own, so the next tile starts on cached data instead of C cold streams.
template <int R, int C>
__attribute__((target("avx2,fma"))) void tile(const float* x, int64_t ldx, const float* w,
                                              int64_t ldw, float* y, int64_t ldy, int64_t depth,
                                              bool prefetch_next) {
  __m256 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  // Two vectors (one 64-byte line of each weight row) per iteration, so that one prefetch per
  // line and stream suffices. The FMAs into one accumulator keep their k order. Prefetches past
  // the end of the weights are harmless (they never fault).
  for (; k + 2 * kLanes <= depth; k += 2 * kLanes) {
    for (int j = 0; j < C; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + j * ldw + k) + kPrefetchBytes, _MM_HINT_T0);
      if (prefetch_next) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (C + j) * ldw + k), _MM_HINT_T1);
      }
    }
    for (int u = 0; u < 2; ++u) {
      const int64_t ku = k + u * kLanes;
      __m256 wv[C];
      for (int j = 0; j < C; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + ku);
      for (int i = 0; i < R; ++i) {
        const __m256 xv = _mm256_loadu_ps(x + i * ldx + ku);
        for (int j = 0; j < C; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
  }
  for (; k + kLanes <= depth; k += kLanes) {
    __m256 wv[C];
    for (int j = 0; j < C; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + k);
    for (int i = 0; i < R; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < C; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < C; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t t = k; t < depth; ++t) s += x[i * ldx + t] * w[j * ldw + t];
      y[i * ldy + j] = s;
    }
  }
}

// Table of tile<R, C> for R in 1..kMaxRows, C in 1..kMaxCols, indexed [R - 1][C - 1].
using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                        bool);

template <int R, int... Cs>
constexpr std::array<TileFn, kMaxCols> tile_row(std::integer_sequence<int, Cs...>) {
  return {&tile<R, Cs + 1>...};
}

template <int... Rs>
constexpr std::array<std::array<TileFn, kMaxCols>, kMaxRows> tile_table(
    std::integer_sequence<int, Rs...>) {
  return {tile_row<Rs + 1>(std::make_integer_sequence<int, kMaxCols>{})...};
}

constexpr auto kTiles = tile_table(std::make_integer_sequence<int, kMaxRows>{});

__attribute__((target("avx2,fma"))) void gemm_nt_avx2(const float* x, int64_t ldx, const float* w,
                                                      int64_t ldw, float* y, int64_t ldy,
                                                      int64_t rows, int64_t cols, int64_t depth) {
  if (rows <= 0 || cols <= 0) return;
  // Row blocks of near-equal size: a 5-row expert runs as 3 + 2, not 4 + 1, because a 1-row
  // tile has only C independent FMA chains and stalls on FMA latency.
  const int64_t blocks = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t block = (rows + blocks - 1) / blocks;
  // Outer loop over weight rows: each tile of weight rows comes from memory once, front to
  // back, and stays in cache while every block of activation rows passes over it. The first
  // block also prefetches the next tile into L2: without it each tile started with C cold
  // streams and a decode step streamed ~9 GB/s of weights; with it 14-21 GB/s (measured,
  // docs/ops-expert-compute.md).
  for (int64_t n = 0; n < cols; n += kMaxCols) {
    const int64_t c = std::min<int64_t>(kMaxCols, cols - n);
    const float* wn = w + n * ldw;
    for (int64_t m = 0; m < rows; m += block) {
      const int64_t r = std::min<int64_t>(block, rows - m);
      kTiles[r - 1][c - 1](x + m * ldx, ldx, wn, ldw, y + m * ldy + n, ldy, depth, m == 0);
    }
  }
}

void gemm_nt_portable(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                      int64_t ldy, int64_t rows, int64_t cols, int64_t depth) {
  for (int64_t n = 0; n < cols; ++n) {
    for (int64_t m = 0; m < rows; ++m) {
      float s = 0.0f;
      for (int64_t k = 0; k < depth; ++k) s += x[m * ldx + k] * w[n * ldw + k];
      y[m * ldy + n] = s;
    }
  }
}

bool detect_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

const bool kHasAvx2 = detect_avx2();

// One expert: h = x @ w13^T into h [rows, 2I]; gate = silu(gate) * up in place; then
// out = (gate @ w2^T) * score.
void run_expert(const ExpertMlpArgs& a, int32_t e, float* h) {
  const int64_t begin = a.row_begin[e];
  const int64_t rows = a.row_count[e];
  if (rows <= 0) return;
  const int64_t two_i = 2 * a.inter;
  const float* w13 = a.w13 + e * two_i * a.hidden;
  const float* w2 = a.w2 + e * a.hidden * a.inter;
  const float* x = a.x + begin * a.ldx;
  float* out = a.out + begin * a.ldo;
  gemm_nt_f32(x, a.ldx, w13, a.hidden, h, two_i, rows, two_i, a.hidden);
  for (int64_t m = 0; m < rows; ++m) {
    float* g = h + m * two_i;
    const float* u = g + a.inter;
    for (int64_t j = 0; j < a.inter; ++j) g[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  }
  gemm_nt_f32(h, two_i, w2, a.inter, out, a.ldo, rows, a.hidden, a.inter);
  if (a.scores != nullptr) {
    for (int64_t m = 0; m < rows; ++m) {
      const float s = a.scores[begin + m];
      float* o = out + m * a.ldo;
      for (int64_t j = 0; j < a.hidden; ++j) o[j] *= s;
    }
  }
}

}  // namespace

bool expert_mlp_has_avx2() {
  return kHasAvx2;
}

void gemm_nt_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
                 int64_t rows, int64_t cols, int64_t depth) {
  if (kHasAvx2) {
    gemm_nt_avx2(x, ldx, w, ldw, y, ldy, rows, cols, depth);
  } else {
    gemm_nt_portable(x, ldx, w, ldw, y, ldy, rows, cols, depth);
  }
}

void expert_mlp_f32(const ExpertMlpArgs& a, int threads) {
  MC_CHECK(a.hidden > 0 && a.inter > 0, "expert_mlp: expected hidden, inter > 0, got ", a.hidden,
           ", ", a.inter);
  MC_CHECK(threads >= 1, "expert_mlp: expected threads >= 1, got ", threads);
  MC_CHECK(a.num_run >= 0, "expert_mlp: expected num_run >= 0, got ", a.num_run);
  const int t_count = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(a.num_run, 1)));
  // Greedy balance by rows: each expert goes to the thread with the fewest rows so far.
  std::vector<std::vector<int32_t>> plan(t_count);
  std::vector<int64_t> load(t_count, 0);
  for (int64_t i = 0; i < a.num_run; ++i) {
    const int32_t e = a.experts[i];
    const auto t = std::min_element(load.begin(), load.end()) - load.begin();
    plan[t].push_back(e);
    load[t] += a.row_count[e];
  }
  // A failure on a helper thread (scratch allocation) must reach the caller, not terminate.
  std::vector<std::exception_ptr> errors(t_count);
  // Thread t's part of a caller-owned scratch: room for its largest expert.
  const int64_t two_i = 2 * a.inter;
  std::vector<int64_t> part(t_count + 1, 0);
  for (int t = 0; t < t_count; ++t) {
    int64_t most = 0;
    for (int32_t e : plan[t]) most = std::max(most, a.row_count[e]);
    part[t + 1] = part[t] + most * two_i;
  }
  MC_CHECK(a.scratch == nullptr || part[t_count] <= a.scratch_floats, "expert_mlp: scratch holds ",
           a.scratch_floats, " floats, the call needs ", part[t_count]);
  auto work = [&a, &plan, &errors, &part, two_i](int t) {
    try {
      std::vector<float> own;  // only without a caller-owned scratch
      for (int32_t e : plan[t]) {
        float* h = nullptr;
        if (a.scratch != nullptr) {
          h = a.scratch + part[t];
        } else {
          own.resize(static_cast<size_t>(std::max<int64_t>(a.row_count[e], 0) * two_i));
          h = own.data();
        }
        run_expert(a, e, h);
      }
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < t_count; ++t) helpers.emplace_back(work, t);
  work(0);
  for (auto& th : helpers) th.join();
  for (const auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
}

int64_t expert_layout(const ExpertLayoutArgs& a, int64_t* num_active) {
  MC_CHECK(a.topk >= 1, "expert_layout: expected topk >= 1, got ", a.topk);
  MC_CHECK(a.num_experts >= 1, "expert_layout: expected num_experts >= 1, got ", a.num_experts);
  const int64_t num_experts = a.num_experts;
  std::fill(a.counts, a.counts + num_experts, 0);
  for (int64_t j = 0; j < a.num_copies; ++j) {
    const int32_t e = a.ids[j];
    MC_CHECK(e >= -1 && e < num_experts, "expert_layout: expected ids in [-1, ", num_experts,
             "), got ", e, " at copy ", j);
    if (e >= 0) ++a.counts[e];
  }
  int64_t active = 0;
  a.offsets[0] = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    a.offsets[e + 1] = a.offsets[e] + a.counts[e];
    a.cursor[e] = a.offsets[e];
    if (a.counts[e] > 0) a.active[active++] = static_cast<int32_t>(e);
  }
  // One pass in flat order: the batch of the current token only moves forward.
  int64_t batch = 0;
  for (int64_t j = 0; j < a.num_copies; ++j) {
    const int32_t e = a.ids[j];
    if (e < 0) {
      a.slot_of[j] = -1;
      continue;
    }
    const int64_t token = j / a.topk;
    while (batch + 1 < a.num_batches && token >= a.batch_offsets[batch + 1]) ++batch;
    const int64_t row = a.cursor[e]++;
    a.slot_of[j] = row;
    a.src_token[row] = token;
    a.src_batch[row] = static_cast<int32_t>(batch);
    a.src_row[row] = static_cast<int32_t>(token - a.batch_offsets[batch]);
    a.src_k[row] = static_cast<int32_t>(j - token * a.topk);
    a.row_scores[row] = a.scores[j];
  }
  *num_active = active;
  return a.offsets[num_experts];
}

}  // namespace moecomm::kernels::cpu
