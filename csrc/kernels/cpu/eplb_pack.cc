#include "kernels/cpu/eplb_pack.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <queue>
#include <utility>
#include <vector>

namespace moecomm::kernels::cpu {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Refinement pruning: a pack whose gap to the top pack is below kPruneFactor * best gain cannot
// reach that gain (which needs a gap of 2 * best, less at most one rounding of gap - d); the
// margin below 2 keeps the search's result identical to the exhaustive numpy one.
constexpr double kPruneFactor = 1.999;

// One row of a packing, with a per-(pack, label) count table standing in for the numpy
// "presence" array (count > 0 <=> the pack holds the label). The table is shared by all rows:
// all zero between rows, filled by the constructor and emptied again by the destructor, so a
// row costs O(packs * slots), not O(packs * labels).
class Row {
 public:
  Row(const EplbPacking& p, int64_t row, int64_t num_labels, std::vector<int32_t>& count)
      : packs_(p.packs),
        slots_(p.slots),
        labels_(num_labels),
        table_(p.table + row * p.packs * p.slots),
        w_(p.slot_w + row * p.packs * p.slots),
        l_(p.slot_l + row * p.packs * p.slots),
        loads_(p.loads + row * p.packs),
        count_(count) {
    for (int64_t q = 0; q < packs_; ++q) {
      for (int64_t k = 0; k < slots_; ++k) ++count_[q * labels_ + l_[q * slots_ + k]];
    }
  }
  ~Row() {
    for (int64_t q = 0; q < packs_; ++q) {
      for (int64_t k = 0; k < slots_; ++k) --count_[q * labels_ + l_[q * slots_ + k]];
    }
  }
  Row(const Row&) = delete;
  Row& operator=(const Row&) = delete;

  bool holds(int64_t pack, int64_t label) const { return count_[pack * labels_ + label] > 0; }

  double peak() const { return *std::max_element(loads_, loads_ + packs_); }

  // First pack with the largest load (numpy argmax).
  int64_t top() const { return std::max_element(loads_, loads_ + packs_) - loads_; }

  // First slot (pack-major) whose label repeats an earlier slot of its pack, or -1.
  int64_t first_duplicate() const {
    for (int64_t q = 0; q < packs_; ++q) {
      const int64_t* lab = l_ + q * slots_;
      for (int64_t k = 1; k < slots_; ++k) {
        if (count_[q * labels_ + lab[k]] < 2) continue;
        for (int64_t j = 0; j < k; ++j) {
          if (lab[j] == lab[k]) return q * slots_ + k;
        }
      }
    }
    return -1;
  }

  // Swap slot a with slot b (flat pack * slots + slot indices) in another pack.
  void swap(int64_t a, int64_t b) {
    const int64_t pa = a / slots_, pb = b / slots_;
    const double delta = w_[a] - w_[b];
    --count_[pa * labels_ + l_[a]];
    --count_[pb * labels_ + l_[b]];
    std::swap(table_[a], table_[b]);
    std::swap(w_[a], w_[b]);
    std::swap(l_[a], l_[b]);
    ++count_[pa * labels_ + l_[a]];
    ++count_[pb * labels_ + l_[b]];
    loads_[pa] -= delta;
    loads_[pb] += delta;
  }

  // dedup(): the allowed swap of slot a minimizing the larger of the two loads; returns its
  // cost (inf when none) and the other slot in *dst.
  double best_dedup_swap(int64_t a, int64_t* dst) const {
    const int64_t sp = a / slots_;
    const double wa = w_[a], src_load = loads_[sp];
    const int64_t la = l_[a];
    double best = kInf;
    for (int64_t q = 0; q < packs_; ++q) {
      if (q == sp || holds(q, la)) continue;
      for (int64_t k = 0; k < slots_; ++k) {
        const int64_t b = q * slots_ + k;
        if (holds(sp, l_[b])) continue;
        const double delta = wa - w_[b];
        const double cost = std::max(src_load - delta, loads_[q] + delta);
        if (cost < best) {
          best = cost;
          *dst = b;
        }
      }
    }
    return best;
  }

  // refine(): the swap between the top pack and another lowering the pair's larger load most:
  // gain min(d, gap - d), d = w_a - w_b, gap = top load - other load. Returns the gain (-inf
  // when none is allowed) and the slots in *src, *dst.
  double best_refine_swap(int64_t top, int64_t* src, int64_t* dst) {
    const double top_load = loads_[top];
    // b may leave its pack for the top one only if the top pack lacks its label.
    blocked_.resize(static_cast<size_t>(packs_ * slots_));
    for (int64_t b = 0; b < packs_ * slots_; ++b) blocked_[b] = holds(top, l_[b]);
    double best = -kInf;
    for (int64_t i = 0; i < slots_; ++i) {
      const int64_t a = top * slots_ + i;
      const double wa = w_[a];
      const int64_t la = l_[a];
      for (int64_t q = 0; q < packs_; ++q) {
        if (q == top || holds(q, la)) continue;
        const double gap = top_load - loads_[q];
        // A gain >= best needs d >= best and gap - d >= best (up to one rounding), so
        // gap >= 2 * best up to rounding: packs well below that can neither beat nor tie it.
        if (best > 0 && gap < best * kPruneFactor) continue;
        for (int64_t k = 0; k < slots_; ++k) {
          const int64_t b = q * slots_ + k;
          if (blocked_[b]) continue;
          const double delta = wa - w_[b];
          const double gain = std::min(delta, gap - delta);
          if (gain > best) {
            best = gain;
            *src = a;
            *dst = b;
          }
        }
      }
    }
    return best;
  }

 private:
  int64_t packs_, slots_, labels_;
  int64_t* table_;
  double* w_;
  int64_t* l_;
  double* loads_;
  std::vector<int32_t>& count_;
  std::vector<char> blocked_;
};

int64_t num_labels(const EplbPacking& p) {
  const int64_t n = p.rows * p.packs * p.slots;
  return n == 0 ? 1 : *std::max_element(p.slot_l, p.slot_l + n) + 1;
}

// Rows of each group, ascending (counting sort on the group ids).
std::vector<std::vector<int64_t>> groups_of(const EplbPacking& p) {
  std::vector<std::vector<int64_t>> groups;
  if (p.row_group == nullptr) {
    groups.resize(static_cast<size_t>(p.rows));
    for (int64_t r = 0; r < p.rows; ++r) groups[r].push_back(r);
    return groups;
  }
  int64_t num = 0;
  for (int64_t r = 0; r < p.rows; ++r) num = std::max(num, p.row_group[r] + 1);
  groups.resize(static_cast<size_t>(num));
  for (int64_t r = 0; r < p.rows; ++r) groups[p.row_group[r]].push_back(r);
  return groups;
}

double row_peak(const EplbPacking& p, int64_t row) {
  const double* loads = p.loads + row * p.packs;
  return *std::max_element(loads, loads + p.packs);
}

double group_peak(const EplbPacking& p, const std::vector<int64_t>& rows) {
  double peak = -kInf;
  for (int64_t r : rows) peak = std::max(peak, row_peak(p, r));
  return peak;
}

}  // namespace

void eplb_rounds(const EplbPacking& p, const double* weights, const int64_t* labels) {
  const int64_t n = p.packs * p.slots;
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::vector<int64_t> pack_order(static_cast<size_t>(p.packs));
  std::vector<std::pair<double, int64_t>> keyed(static_cast<size_t>(n));
  for (int64_t r = 0; r < p.rows; ++r) {
    const double* w = weights + r * n;
    const int64_t* lab = labels + r * n;
    int64_t* table = p.table + r * n;
    double* slot_w = p.slot_w + r * n;
    int64_t* slot_l = p.slot_l + r * n;
    double* loads = p.loads + r * p.packs;
    // Heaviest first, ties by index: the order of numpy's stable argsort of -w.
    for (int64_t i = 0; i < n; ++i) keyed[i] = {w[i], i};
    std::sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    for (int64_t i = 0; i < n; ++i) order[i] = keyed[i].second;
    std::fill(loads, loads + p.packs, 0.0);
    std::iota(pack_order.begin(), pack_order.end(), 0);  // round 0: every pack empty
    for (int64_t k = 0; k < p.slots; ++k) {
      if (k > 0) {
        std::iota(pack_order.begin(), pack_order.end(), 0);
        std::sort(pack_order.begin(), pack_order.end(), [loads](int64_t a, int64_t b) {
          return loads[a] < loads[b] || (loads[a] == loads[b] && a < b);
        });
      }
      for (int64_t j = 0; j < p.packs; ++j) {
        const int64_t item = order[k * p.packs + j];
        const int64_t q = pack_order[j];
        table[q * p.slots + k] = item;
        slot_w[q * p.slots + k] = w[item];
        slot_l[q * p.slots + k] = lab[item];
        loads[q] += w[item];
      }
    }
  }
}

void eplb_dedup(const EplbPacking& p, int64_t max_steps) {
  const int64_t labels = num_labels(p);
  std::vector<int32_t> count(static_cast<size_t>(p.packs * labels), 0);
  std::vector<int64_t> active, next;
  for (const auto& rows : groups_of(p)) {
    if (rows.empty()) continue;
    active.clear();
    for (int64_t r : rows) {
      if (Row(p, r, labels, count).first_duplicate() >= 0) active.push_back(r);
    }
    for (int64_t step = 0; step < max_steps && !active.empty(); ++step) {
      // The bound is the group's heaviest pack before this step's swaps (numpy computes every
      // active row's swap from the same state).
      const double bound = group_peak(p, rows);
      next.clear();
      for (int64_t r : active) {
        Row row(p, r, labels, count);
        const int64_t a = row.first_duplicate();
        if (a < 0) continue;
        int64_t b = -1;
        if (row.best_dedup_swap(a, &b) <= bound) {
          row.swap(a, b);
          next.push_back(r);
        }
      }
      active.swap(next);
    }
  }
}

void eplb_refine(const EplbPacking& p, int64_t max_steps, double min_relative_gain) {
  const int64_t labels = num_labels(p);
  const double keep = 1.0 - min_relative_gain;
  std::vector<int32_t> count(static_cast<size_t>(p.packs * labels), 0);
  for (const auto& rows : groups_of(p)) {
    if (rows.empty()) continue;
    for (int64_t step = 0; step < max_steps; ++step) {
      const double threshold = group_peak(p, rows) * keep;
      bool stuck = false;
      for (int64_t r : rows) {
        if (!(row_peak(p, r) >= threshold)) continue;  // only rows at the group's peak
        Row row(p, r, labels, count);
        const int64_t top = row.top();
        int64_t a = -1, b = -1;
        const double gain = row.best_refine_swap(top, &a, &b);
        if (gain > p.loads[r * p.packs + top] * min_relative_gain) {
          row.swap(a, b);
        } else {
          stuck = true;  // this peak row cannot improve: neither can the group's peak
        }
      }
      if (stuck) break;
    }
  }
}

void eplb_replica_counts(const double* weights, int64_t rows, int64_t experts, int64_t num_slots,
                         int64_t max_count, double offset, int64_t* counts) {
  const int64_t redundant = num_slots - experts;
  const int64_t floor_cap = (num_slots + experts - 1) / experts;
  const int64_t cap = max_count < 0 ? redundant + 1 : std::max(max_count, floor_cap);
  const int64_t extra = std::min(redundant, cap - 1);  // most extra replicas of one expert
  // A candidate: (priority, expert) of an expert's next extra replica. Within an expert the
  // priorities fall with every replica, so popping the best candidate and pushing the expert's
  // next one takes the same `redundant` candidates as numpy's top-k over all of them.
  using Candidate = std::pair<double, int64_t>;
  const auto worse = [](const Candidate& a, const Candidate& b) {
    return a.first < b.first || (a.first == b.first && a.second > b.second);
  };
  std::vector<Candidate> heap;
  heap.reserve(static_cast<size_t>(experts));
  for (int64_t r = 0; r < rows; ++r) {
    const double* w = weights + r * experts;
    int64_t* c = counts + r * experts;
    const auto priority = [&](int64_t e, int64_t j) {
      const double value = w[e] / (static_cast<double>(j) + offset);
      return value > 0 ? value : -static_cast<double>(j);  // zero loads: fewer replicas first
    };
    heap.clear();
    for (int64_t e = 0; e < experts; ++e) {
      c[e] = 1;
      if (extra > 0) heap.push_back({priority(e, 1), e});
    }
    std::make_heap(heap.begin(), heap.end(), worse);
    for (int64_t s = 0; s < redundant && !heap.empty(); ++s) {
      std::pop_heap(heap.begin(), heap.end(), worse);
      const int64_t e = heap.back().second;
      heap.pop_back();
      const int64_t j = c[e]++;  // extras so far + 1 = this extra's index
      if (j < extra) {
        heap.push_back({priority(e, j + 1), e});
        std::push_heap(heap.begin(), heap.end(), worse);
      }
    }
  }
}

bool eplb_log2phy(const int64_t* phy2log, int64_t rows, int64_t slots, int64_t experts,
                  int64_t* log2phy, int64_t* logcnt) {
  const int64_t width = slots - experts + 1;
  std::fill(log2phy, log2phy + rows * experts * width, int64_t{-1});
  std::fill(logcnt, logcnt + rows * experts, int64_t{0});
  for (int64_t r = 0; r < rows; ++r) {
    int64_t* table = log2phy + r * experts * width;
    int64_t* cnt = logcnt + r * experts;
    for (int64_t s = 0; s < slots; ++s) {
      const int64_t e = phy2log[r * slots + s];
      if (e < 0 || e >= experts || cnt[e] >= width) return false;
      table[e * width + cnt[e]++] = s;
    }
  }
  return true;
}

}  // namespace moecomm::kernels::cpu
