// The sampler's random draw of one row (sample_draw.h). Each function names the TypeScript one it repeats.
#include "sample_draw.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "sample_weigh.h"

namespace conduit {
namespace sample {

// No fused multiply-add anywhere here (aarch64 would contract a * b + c): JavaScript rounds each operation.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

void DrawScratch::reserve(int64_t n) {
  const size_t size = static_cast<size_t>(n);
  if (weights.size() >= size) return;
  weights.resize(size);
  block_totals.resize((size + kWeighBlock - 1) / kWeighBlock);
  order.resize(size);
  scaled.resize(size);
  bin_mass.resize(kMassBins);
  bin_count.resize(kMassBins);
}

size_t DrawScratch::bytes() const {
  return weights.capacity() * sizeof(double) + block_totals.capacity() * sizeof(double) + bin_mass.capacity() * sizeof(double) +
         order.capacity() * sizeof(int32_t) + bin_count.capacity() * sizeof(int32_t) + scaled.capacity() * sizeof(float);
}

namespace {

// ranksBefore: higher value first, lower id on ties.
inline bool ranks_before(const float* values, int32_t a, int32_t b) {
  const float va = values[a], vb = values[b];
  return va > vb || (va == vb && a < b);
}

// medianOfThree
inline int32_t median_of_three(const float* values, int32_t a, int32_t b, int32_t c) {
  if (ranks_before(values, a, b)) {
    if (ranks_before(values, b, c)) return b;
    return ranks_before(values, a, c) ? c : a;
  }
  if (ranks_before(values, a, c)) return a;
  return ranks_before(values, b, c) ? c : b;
}

// partition: Hoare's around a median-of-three pivot; [*j, *i] as the TypeScript leaves in partitionBounds.
inline void partition(const float* values, int32_t* order, int64_t lo, int64_t hi, int64_t* j_out, int64_t* i_out) {
  const int32_t pivot = median_of_three(values, order[lo], order[static_cast<uint64_t>(lo + hi) >> 1], order[hi]);
  int64_t i = lo, j = hi;
  while (i <= j) {
    while (ranks_before(values, order[i], pivot)) ++i;
    while (ranks_before(values, pivot, order[j])) --j;
    if (i <= j) std::swap(order[i++], order[j--]);
  }
  *j_out = j;
  *i_out = i;
}

// selectTopByMass
int64_t select_top_by_mass(const float* values, const double* weights, int32_t* order, int64_t count, double mass) {
  int64_t lo = 0, hi = count - 1;
  double mass_before = 0;
  while (lo < hi) {
    int64_t j, i;
    partition(values, order, lo, hi, &j, &i);
    double left_mass = 0;
    for (int64_t k = lo; k <= j; ++k) left_mass += weights[order[k]];
    if (mass_before + left_mass >= mass) {
      hi = j;
      continue;
    }
    mass_before += left_mass;
    for (int64_t k = j + 1; k < i; ++k) {
      mass_before += weights[order[k]];
      if (mass_before >= mass) return k + 1;
    }
    lo = i;
  }
  return std::min(lo, hi) + 1;
}

// selectTopP (scale 1: `values` are the scaled row)
int64_t select_top_p(const KernelTable& kt, const float* values, int64_t n, double max, double floor, double top_p,
                     DrawScratch& s) {
  double* weights = s.weights.data();
  int32_t* order = s.order.data();
  const double* bin_mass = s.bin_mass.data();
  const int32_t* bin_count = s.bin_count.data();
  int64_t last = 0;
  const double total = kt.sample_weigh(values, n, 1.0, max, floor, weights, nullptr, s.bin_mass.data(),
                                       s.bin_count.data(), &last);
  const double target = top_p * total;
  int boundary = 0;
  double mass_before = 0;
  int64_t count_before = 0;
  while (boundary < kMassBins - 1 && mass_before + bin_mass[boundary] < target) {
    mass_before += bin_mass[boundary];
    count_before += bin_count[boundary];
    ++boundary;
  }
  const int64_t boundary_count = bin_count[boundary];
  const double edge = boundary == kMassBins - 1 ? -HUGE_VAL : max - (boundary + 1.5) / kMassBinsPerLogit;
  // Math.max(floor, edge); neither is NaN here.
  const double lowest = std::max(floor, edge);
  int64_t at_boundary = 0, at_before = boundary_count;
  for (int64_t i = 0; i < n; ++i) {
    const double value = values[i];
    if (value >= lowest && value > -HUGE_VAL) {
      const int bin = mass_bin(max - value);
      if (bin < boundary) order[at_before++] = static_cast<int32_t>(i);
      else if (bin == boundary) order[at_boundary++] = static_cast<int32_t>(i);
    }
  }
  const int64_t kept_at_boundary =
      boundary_count == 0 ? 0 : select_top_by_mass(values, weights, order, boundary_count, target - mass_before);
  std::memmove(order + kept_at_boundary, order + boundary_count, sizeof(int32_t) * static_cast<size_t>(count_before));
  return kept_at_boundary + count_before;
}

// heapSelectTop: the k best candidates (value >= floor, above -inf) into order[0, k) as a heap whose root is the
// worst kept, then every other id tied with the root, in id order (top_k keeps the ties with its k-th, as vLLM); the
// same layout as the TypeScript's, so a draw over it picks the same id. The row has no NaN (the caller's argmax
// said so).
int64_t heap_select_top(const float* values, int64_t n, int32_t* order, int64_t k, double floor) {
  int64_t size = 0, id = 0;
  for (; id < n && size < k; ++id) {
    const double value = values[id];
    if (!(value >= floor) || value == -HUGE_VAL) continue;
    int64_t at = size++;
    while (at > 0) {
      const int64_t parent = (at - 1) >> 1;
      if (!ranks_before(values, order[parent], static_cast<int32_t>(id))) break;
      order[at] = order[parent];
      at = parent;
    }
    order[at] = static_cast<int32_t>(id);
  }
  if (size < k) return size;
  // A value equal to the root's is left out on the rarely taken branch, as is a replaced root; the best value left
  // out never rises above the root, which only rises: the two are equal at the end exactly when a tie was left out.
  float root_value = values[order[0]];
  float best_left_out = -HUGE_VALF;
  for (; id < n; ++id) {
    if (!(values[id] < root_value)) {
      if (values[id] == root_value) {
        best_left_out = root_value;
        continue;
      }
      if (root_value > best_left_out) best_left_out = root_value;
      // siftDown: the root replaced by id, the worse-ranked child moving up.
      int64_t at = 0;
      for (;;) {
        const int64_t left = 2 * at + 1;
        if (left >= size) break;
        const int64_t right = left + 1;
        const int64_t worse = right < size && ranks_before(values, order[left], order[right]) ? right : left;
        if (!ranks_before(values, static_cast<int32_t>(id), order[worse])) break;
        order[at] = order[worse];
        at = worse;
      }
      order[at] = static_cast<int32_t>(id);
      root_value = values[order[0]];
    }
  }
  if (best_left_out != root_value) return size;
  // The ties left out are the ids of the root's value after the root (the heap keeps the lower ids of a tie).
  for (int64_t tie = order[0] + 1; tie < n; ++tie) {
    if (values[tie] == root_value) order[size++] = static_cast<int32_t>(tie);
  }
  return size;
}

// keptMass then drawFromKept
int64_t draw_from_kept(const double* weights, const int32_t* order, int64_t num_kept, double uniform) {
  double kept_mass = 0;
  for (int64_t j = 0; j < num_kept; ++j) kept_mass += weights[order[j]];
  const double target = uniform * kept_mass;
  double cumulative = 0;
  for (int64_t j = 0; j < num_kept; ++j) {
    cumulative += weights[order[j]];
    if (cumulative > target) return order[j];
  }
  return order[num_kept - 1];
}

// drawWeighed
int64_t draw_weighed(const double* weights, const double* block_totals, int64_t n, int64_t last, double total,
                     double uniform) {
  const double target = uniform * total;
  int64_t lo = 0, hi = last / kWeighBlock;
  if (!(block_totals[hi] > target)) return last;
  while (lo < hi) {
    const int64_t mid = static_cast<int64_t>(static_cast<uint64_t>(lo + hi) >> 1);
    if (block_totals[mid] > target) hi = mid;
    else lo = mid + 1;
  }
  double running = lo > 0 ? block_totals[lo - 1] : 0;
  const int64_t start = lo * kWeighBlock;
  int64_t last_in_block = start;
  for (int64_t i = start; i < std::min(start + kWeighBlock, n); ++i) {
    const double weight = weights[i];
    if (weight == 0) continue;
    running += weight;
    last_in_block = i;
    if (running > target) return i;
  }
  return last_in_block;
}

// drawTopP's cut of the weighed order[0, num_kept) by top_p (if below 1), then the draw over what is kept.
int64_t draw_top_p(const float* values, const double* weights, int32_t* order, int64_t num_kept, double top_p,
                   double uniform) {
  int64_t kept = num_kept;
  if (top_p < 1) {
    double kept_mass = 0;
    for (int64_t j = 0; j < kept; ++j) kept_mass += weights[order[j]];
    kept = select_top_by_mass(values, weights, order, kept, top_p * kept_mass);
  }
  return draw_from_kept(weights, order, kept, uniform);
}

}  // namespace

int64_t draw_row(const KernelTable& kt, const float* row, int64_t n, const double* spec, DrawScratch& s) {
  const double scale = spec[0], log_min_p = spec[1], top_p = spec[2], uniform = spec[3];
  const int64_t top_k = static_cast<int64_t>(spec[4]);
  // A greedy row: the sampler's pick is the argmax of the row as given (the lowest id among the largest).
  if (scale == 0) return kt.argmax(row, n);
  s.reserve(n);
  double* weights = s.weights.data();
  int32_t* order = s.order.data();
  if (top_k > 0 && log_min_p == -HUGE_VAL) {
    // drawTopK: the k best of the row as given, only they read at scale and weighed. The best of them (what the
    // TypeScript takes the max of) is the row's max.
    const int64_t max_id = kt.argmax(row, n);
    if (max_id < 0) return -1;
    const int64_t num_kept = heap_select_top(row, n, order, top_k, -HUGE_VAL);
    const double max = scaled_value(row[max_id], scale);
    for (int64_t j = 0; j < num_kept; ++j) weights[order[j]] = exp_gap(scaled_value(row[order[j]], scale) - max);
    return draw_top_p(row, weights, order, num_kept, top_p, uniform);
  }
  if (top_p >= 1 && top_k == 0) {
    // drawPlain: the row read at scale in the weighing pass.
    const int64_t max_id = kt.argmax(row, n);
    if (max_id < 0) return -1;
    const double max = scaled_value(row[max_id], scale);
    const double floor = log_min_p == -HUGE_VAL ? -HUGE_VAL : max + log_min_p;
    int64_t last = 0;
    const double total = kt.sample_weigh(row, n, scale, max, floor, s.weights.data(), s.block_totals.data(), nullptr,
                                         nullptr, &last);
    return draw_weighed(s.weights.data(), s.block_totals.data(), n, last, total, uniform);
  }
  // drawTruncated over the scaled copy of the row (the row itself at scale 1).
  const float* values = row;
  if (scale != 1.0) {
    kt.scale_row(row, s.scaled.data(), n, scale);
    values = s.scaled.data();
  }
  const int64_t max_id = kt.argmax(values, n);
  if (max_id < 0) return -1;
  const double max = values[max_id];
  const double floor = log_min_p == -HUGE_VAL ? -HUGE_VAL : max + log_min_p;
  if (top_k > 0) {
    // top_k with min_p: the k best at or above the floor, weighed, then top_p over them.
    const int64_t num_kept = heap_select_top(values, n, order, top_k, floor);
    for (int64_t j = 0; j < num_kept; ++j) weights[order[j]] = exp_gap(static_cast<double>(values[order[j]]) - max);
    return draw_top_p(values, weights, order, num_kept, top_p, uniform);
  }
  const int64_t num_kept = select_top_p(kt, values, n, max, floor, top_p, s);
  // None kept only when the weights are NaN (a +inf value): its first +inf id, as the TypeScript draw gives.
  if (num_kept == 0) return max_id;
  return draw_from_kept(s.weights.data(), s.order.data(), num_kept, uniform);
}

#pragma GCC pop_options

}  // namespace sample
}  // namespace conduit
