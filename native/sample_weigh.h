// The sampler's weighing pass over a logits row (src/engine/sampler.ts, weighCandidates, is the same function in
// TypeScript, and the reference it is tested against bit for bit): each value read scaled (the float nearest
// x * scale, as a scaled copy of the row would hold it: 1 / temperature without making that copy); for each
// candidate (scaled value >= floor and above -inf) the weight exp(value - max) in double precision, 0 for the
// others; their total (by blocks, below); optionally the running total after each block (what a draw searches), and
// the top_p bins: zeroed, then each candidate's weight and count added into the bin of its distance below the max
// (mass_bin).
//
// exp_gap is not the C library's exp but one both languages compute with the same IEEE operations in the same
// order: Cody-Waite reduction by ln 2 (x = k ln 2 + r, |r| <= ln 2 / 2), the Taylor series of exp(r) to r^13
// (truncation under 1e-17 of the result) evaluated by Estrin's scheme (pairs of terms, then r^2, r^4, r^8: a chain
// of 8 operations instead of Horner's 26, the same accuracy here, within 2 units in the last place of exp), then
// the exact scaling by 2^k. Every product and sum is rounded on its own (no fused multiply-add: JavaScript has
// none), so a process without the addon draws the same tokens from the same seed. Gaps at or below -708 give 0
// (exp would be subnormal there: such a token cannot be drawn next to the max's weight of 1), NaN stays NaN,
// above 709 gives infinity.
//
// The total sums the weights by blocks of kWeighBlock ids, each block in a fixed tree ((w0 + w1) + (w2 + w3)) +
// ((w4 + w5) + (w6 + w7)) (ids past the row's end as 0), the blocks in id order: a SIMD loop sums a block in its
// registers (a running total in id order would be one long chain of additions). The weights and the blocks' sums
// (avx512: the bins' indices too) are computed per variant, in SIMD lanes of the same scalar arithmetic; the bins'
// sums are one scalar pass in id order, as the TypeScript loop adds them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace conduit {
namespace sample {

// GCC would otherwise fuse a * b + c into one rounding where the target has FMA (every AVX2/AVX-512 region, and
// aarch64): the results would then differ from JavaScript's in the last bits.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

constexpr double kInvLn2 = 1.4426950408889634;
// ln 2 split so that k * kLn2Hi is exact for |k| < 2^11 (the low 21 bits of its significand are zero) and
// kLn2Hi + kLn2Lo = ln 2 to about 1e-27.
constexpr double kLn2Hi = 6.93147180369123816490e-01;
constexpr double kLn2Lo = 1.90821492927058770002e-10;
constexpr double kExpLowest = -708.0;
constexpr double kExpHighest = 709.0;
// 1/n! for n = 2 .. 13, each the quotient rounded once, as `1 / n!` is in JavaScript.
constexpr double kC2 = 1.0 / 2.0, kC3 = 1.0 / 6.0, kC4 = 1.0 / 24.0, kC5 = 1.0 / 120.0, kC6 = 1.0 / 720.0;
constexpr double kC7 = 1.0 / 5040.0, kC8 = 1.0 / 40320.0, kC9 = 1.0 / 362880.0, kC10 = 1.0 / 3628800.0;
constexpr double kC11 = 1.0 / 39916800.0, kC12 = 1.0 / 479001600.0, kC13 = 1.0 / 6227020800.0;

// top_p's bins (sampler.ts MASS_BINS): 1/8 logit wide, the last one holding everything 64 logits or more below.
constexpr int kMassBinsPerLogit = 8;
constexpr int kMassBins = 64 * kMassBinsPerLogit;

// 2^k for an integral k in [-1022, 1023], from its bits.
inline double pow2(double k) {
  const uint64_t bits = static_cast<uint64_t>(static_cast<int64_t>(k) + 1023) << 52;
  double out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

inline double exp_gap(double d) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  if (!(d > kExpLowest)) return d != d ? d : 0.0;
  if (d > kExpHighest) return HUGE_VAL;
  const double k = std::floor(d * kInvLn2 + 0.5);
  const double r = (d - k * kLn2Hi) - k * kLn2Lo;
  const double r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;
  const double low = ((1.0 + r) + (kC2 + kC3 * r) * r2) + ((kC4 + kC5 * r) + (kC6 + kC7 * r) * r2) * r4;
  const double high = ((kC8 + kC9 * r) + (kC10 + kC11 * r) * r2) + (kC12 + kC13 * r) * r4;
  return (low + high * r8) * pow2(k);
}

inline bool is_candidate(double value, double floor) { return value >= floor && value > -HUGE_VAL; }

// x read at scale: x itself at 1 (which x * 1 rounded to float would give anyway), else x * scale rounded to float.
inline double scaled_value(float x, double scale) {
  return scale == 1.0 ? static_cast<double>(x) : static_cast<double>(static_cast<float>(static_cast<double>(x) * scale));
}

inline double candidate_weight(float x, double scale, double max, double floor) {
  const double v = scaled_value(x, scale);
  return is_candidate(v, floor) ? exp_gap(v - max) : 0.0;
}

// The bin of a token `gap` (>= 0) below the max, as sampler.ts massBin: truncation of gap * 8, the last bin beyond.
inline int mass_bin(double gap) {
  const double scaled = gap * kMassBinsPerLogit;
  return scaled < kMassBins - 1 ? static_cast<int>(scaled) : kMassBins - 1;
}

// The index weigh_totals bins a token under when it is not a candidate (past the last bin: skipped).
constexpr int32_t kNoBin = kMassBins;

// The bin of each value (kNoBin for the non-candidates) into bin_index[0, n): what weigh_totals reads when the SIMD
// loops computed them beside the weights.
inline int32_t bin_of(float x, double scale, double max, double floor) {
  const double v = scaled_value(x, scale);
  return is_candidate(v, floor) ? mass_bin(max - v) : kNoBin;
}

constexpr int64_t kWeighBlock = 8;

// One block's weights summed in the pass's tree.
inline double block_sum(const double* w) { return ((w[0] + w[1]) + (w[2] + w[3])) + ((w[4] + w[5]) + (w[6] + w[7])); }

// The rest of the pass once the weights of the whole blocks [0, whole) are in and `total` is their running total
// (block_totals filled for them): the weights after them and their partial block, the last id with a weight other
// than 0 (0 when none) into *last, and the bins when asked (their indices from bin_index below `whole` when given,
// else computed here). Returns the total.
inline double weigh_finish(const float* x, int64_t n, int64_t whole, double total, double scale, double max,
                           double floor, double* weights, double* block_totals, double* bin_mass, int32_t* bin_count,
                           const int32_t* bin_index, int64_t* last) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  if (whole < n) {
    double w[kWeighBlock] = {};
    for (int64_t i = whole; i < n; ++i) w[i - whole] = weights[i] = candidate_weight(x[i], scale, max, floor);
    total += block_sum(w);
    if (block_totals != nullptr) block_totals[whole / kWeighBlock] = total;
  }
  int64_t last_id = 0;
  for (int64_t i = n - 1; i >= 0; --i) {
    if (weights[i] != 0.0) {
      last_id = i;
      break;
    }
  }
  *last = last_id;
  if (bin_mass != nullptr) {
    std::memset(bin_mass, 0, sizeof(double) * kMassBins);
    std::memset(bin_count, 0, sizeof(int32_t) * kMassBins);
    for (int64_t i = 0; i < n; ++i) {
      const int32_t bin = bin_index != nullptr && i < whole ? bin_index[i] : bin_of(x[i], scale, max, floor);
      if (bin != kNoBin) {
        bin_mass[bin] += weights[i];
        ++bin_count[bin];
      }
    }
  }
  return total;
}

#pragma GCC pop_options

}  // namespace sample
}  // namespace conduit
