// GPU check of the CUDA reorganization and group-shrink kernels against a host reference.
// Built and run by tests/ops/test_reorg.py::test_cuda_reorg_and_scan (marked gpu). Exits 0 when
// every output matches bit-exactly, 1 (with the first mismatch on stderr) otherwise.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "common/error.h"
#include "kernels/cuda/reorg.h"
#include "kernels/cuda/scan.h"

namespace mk = moecomm::kernels::cuda;

namespace {

template <typename T>
T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  MC_CUDA_CHECK(cudaMalloc(&d, (v.size() + 1) * sizeof(T)));
  if (!v.empty()) MC_CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyDefault));
  return d;
}

template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> v(n);
  if (n) MC_CUDA_CHECK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDefault));
  return v;
}

template <typename T>
bool same(const char* what, const std::vector<T>& got, const std::vector<T>& want) {
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i]) {
      std::fprintf(stderr, "%s[%zu]: got %lld, want %lld\n", what, i,
                   static_cast<long long>(got[i]), static_cast<long long>(want[i]));
      return false;
    }
  }
  return true;
}

// One case: batch sizes, experts, topk, hidden (floats per row). Returns true when it matches.
bool run_case(const std::vector<int64_t>& sizes, int32_t experts, int32_t topk, int64_t hidden,
              unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int64_t> batch_offsets{0};
  for (int64_t n : sizes) batch_offsets.push_back(batch_offsets.back() + n);
  const int64_t tokens = batch_offsets.back();
  const int64_t copies = tokens * topk;
  std::vector<int32_t> ids(copies);
  std::vector<float> scores(copies);
  std::vector<float> x(tokens * hidden);
  for (auto& v : ids) v = static_cast<int32_t>(rng() % (experts + 1)) - 1;
  for (size_t i = 0; i < scores.size(); ++i) scores[i] = static_cast<float>(i);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);

  // Host reference: buckets in flat order.
  std::vector<std::vector<int64_t>> buckets(experts);
  for (int64_t i = 0; i < copies; ++i)
    if (ids[i] >= 0) buckets[ids[i]].push_back(i);
  std::vector<int32_t> counts(experts);
  std::vector<int64_t> offsets{0}, src_token, slot_of(copies, -1);
  std::vector<float> rows;
  for (int32_t e = 0; e < experts; ++e) {
    counts[e] = static_cast<int32_t>(buckets[e].size());
    offsets.push_back(offsets.back() + counts[e]);
    for (int64_t i : buckets[e]) {
      slot_of[i] = static_cast<int64_t>(src_token.size());
      src_token.push_back(i / topk);
      rows.insert(rows.end(), x.begin() + (i / topk) * hidden, x.begin() + (i / topk + 1) * hidden);
    }
  }
  const int64_t n = offsets.back();
  constexpr int32_t kBlockM = 16;
  std::vector<int32_t> tile_expert;
  for (int32_t e = 0; e < experts; ++e)
    for (int32_t t = 0; t < (counts[e] + kBlockM - 1) / kBlockM; ++t) tile_expert.push_back(e);
  const int32_t max_tiles = static_cast<int32_t>(tile_expert.size()) + 2;  // a loose bound
  tile_expert.resize(max_tiles, -1);

  mk::ReorgInputs in{to_device(ids),
                     to_device(scores),
                     to_device(batch_offsets),
                     static_cast<int32_t>(sizes.size()),
                     tokens,
                     topk,
                     experts};
  const int64_t tiles = mk::reorg_num_tiles(tokens, topk);
  auto* hist = to_device(std::vector<int32_t>(tiles * experts + 1));
  auto* prefix = to_device(std::vector<int32_t>(tiles * experts + 1));
  auto* d_counts = to_device(std::vector<int32_t>(experts));
  mk::ShrinkOutputs sh{
      to_device(std::vector<int64_t>(experts + 1)), to_device(std::vector<int32_t>(experts)),
      to_device(std::vector<int32_t>(experts)), to_device(std::vector<int32_t>(experts + 1)),
      to_device(std::vector<int32_t>(2))};
  mk::ReorgRows rr{to_device(x), hidden * static_cast<int64_t>(sizeof(float)),
                   hidden * static_cast<int64_t>(sizeof(float)),
                   to_device(std::vector<float>(n * hidden + 1))};
  mk::ReorgOutputs out{
      to_device(std::vector<int64_t>(n + 1)), to_device(std::vector<int32_t>(n + 1)),
      to_device(std::vector<int32_t>(n + 1)), to_device(std::vector<int32_t>(n + 1)),
      to_device(std::vector<float>(n + 1)),   to_device(std::vector<int64_t>(copies + 1))};
  mk::launch_reorg_histogram(in, hist, nullptr);
  mk::launch_reorg_column_scan(hist, tiles, experts, prefix, d_counts, nullptr);
  mk::launch_group_shrink(d_counts, experts, kBlockM, sh, nullptr);
  mk::launch_reorg_scatter(in, rr, sh.offsets, prefix, out, nullptr);
  auto* d_tile_expert = to_device(std::vector<int32_t>(max_tiles));
  auto* d_tile_mblock = to_device(std::vector<int32_t>(max_tiles));
  mk::launch_tile_map(sh.tile_offsets, sh.active, sh.totals, max_tiles, d_tile_expert,
                      d_tile_mblock, nullptr);
  MC_CUDA_CHECK(cudaDeviceSynchronize());

  return same("counts", to_host(d_counts, experts), counts) &&
         same("offsets", to_host(sh.offsets, experts + 1), offsets) &&
         same("src_token", to_host(out.src_token, n), src_token) &&
         same("slot_of", to_host(out.slot_of, copies), slot_of) &&
         same("rows", to_host(static_cast<float*>(rr.out), n * hidden), rows) &&
         same("tile_expert", to_host(d_tile_expert, max_tiles), tile_expert);
}

}  // namespace

int main() {
  // Device buffers are not freed: the process exits right after.
  const bool ok = run_case({3, 0, 50, 1}, 70, 3, 40, 1) && run_case({1}, 4, 1, 7, 2) &&
                  run_case({96, 64, 64, 32}, 32, 8, 256, 3) && run_case({0, 0, 9}, 5, 8, 64, 4);
  std::printf(ok ? "OK\n" : "MISMATCH\n");
  return ok ? 0 : 1;
}
