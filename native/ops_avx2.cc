// Row kernels for AVX2: the templates of ops_simd.h instantiated over the Avx2 vector traits.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "sample_weigh.h"

namespace conduit {
namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "simd_avx2.h"
#include "ops_simd.h"
#include "lora_simd.h"
#include "lora_q8_avx2.h"

// sample_weigh.h's weights, four at a time: the same operations as sample::exp_gap in each lane (no fused
// multiply-add; 2^k built from its bits, as the scalar pow2), then its scalar pass for the sums (the bins' indices
// computed there).
#pragma GCC optimize("fp-contract=off")
// sample::exp_gap's polynomial in each lane, the same operations in the same order.
inline __m256d estrin(__m256d r) {
  const auto c = [](double value) { return _mm256_set1_pd(value); };
  const auto add = [](auto a, auto b) { return _mm256_add_pd(a, b); };
  const auto mul = [](auto a, auto b) { return _mm256_mul_pd(a, b); };
  const __m256d r2 = mul(r, r), r4 = mul(r2, r2), r8 = mul(r4, r4);
  const __m256d low = add(add(add(c(1.0), r), mul(add(c(sample::kC2), mul(c(sample::kC3), r)), r2)),
                      mul(add(add(c(sample::kC4), mul(c(sample::kC5), r)), mul(add(c(sample::kC6), mul(c(sample::kC7), r)), r2)), r4));
  const __m256d high = add(add(add(c(sample::kC8), mul(c(sample::kC9), r)), mul(add(c(sample::kC10), mul(c(sample::kC11), r)), r2)),
                       mul(add(c(sample::kC12), mul(c(sample::kC13), r)), r4));
  return add(low, mul(high, r8));
}

double avx2_sample_weigh(const float* x, int64_t n, double scale, double max, double floor, double* weights,
                         double* cumulative, double* bin_mass, int32_t* bin_count, int64_t* last) {
  const __m256d vscale = _mm256_set1_pd(scale), vmax = _mm256_set1_pd(max), vfloor = _mm256_set1_pd(floor);
  const __m256d minus_inf = _mm256_set1_pd(-HUGE_VAL), infinity = _mm256_set1_pd(HUGE_VAL);
  const __m256d lowest = _mm256_set1_pd(sample::kExpLowest), highest = _mm256_set1_pd(sample::kExpHighest);
  const __m256d inv_ln2 = _mm256_set1_pd(sample::kInvLn2), half = _mm256_set1_pd(0.5);
  const __m256d ln2_hi = _mm256_set1_pd(sample::kLn2Hi), ln2_lo = _mm256_set1_pd(sample::kLn2Lo);
  const __m128i bias = _mm_set1_epi32(1023);
  const bool scaled = scale != 1.0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
    if (scaled) v = _mm256_cvtps_pd(_mm256_cvtpd_ps(_mm256_mul_pd(v, vscale)));
    const __m256d candidate = _mm256_and_pd(_mm256_cmp_pd(v, vfloor, _CMP_GE_OQ), _mm256_cmp_pd(v, minus_inf, _CMP_GT_OQ));
    const __m256d d = _mm256_sub_pd(v, vmax);
    const __m256d k = _mm256_round_pd(_mm256_add_pd(_mm256_mul_pd(d, inv_ln2), half), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256d r = _mm256_sub_pd(_mm256_sub_pd(d, _mm256_mul_pd(k, ln2_hi)), _mm256_mul_pd(k, ln2_lo));
    const __m256d p = estrin(r);
    // k is integral; in the lanes that are kept it lies in [-1021, 1023], so k + 1023 is a valid biased exponent.
    const __m256i exponent = _mm256_slli_epi64(_mm256_cvtepi32_epi64(_mm_add_epi32(_mm256_cvtpd_epi32(k), bias)), 52);
    __m256d w = _mm256_and_pd(_mm256_mul_pd(p, _mm256_castsi256_pd(exponent)), _mm256_cmp_pd(d, lowest, _CMP_GT_OQ));
    w = _mm256_blendv_pd(w, infinity, _mm256_cmp_pd(d, highest, _CMP_GT_OQ));
    w = _mm256_blendv_pd(w, d, _mm256_cmp_pd(d, d, _CMP_UNORD_Q));
    _mm256_storeu_pd(weights + i, _mm256_and_pd(w, candidate));
  }
  for (; i < n; ++i) weights[i] = sample::candidate_weight(x[i], scale, max, floor);
  return sample::weigh_totals(x, n, scale, max, floor, weights, cumulative, bin_mass, bin_count, nullptr, last);
}
#pragma GCC pop_options

}  // namespace

// Registration runs on every CPU, so it stays outside the target region.
void register_ops_avx2(KernelTable& t) {
  t.lora_down[kLoraF32] = simd_lora_down<Avx2, kLoraF32>;
  t.lora_down[kLoraBF16] = simd_lora_down<Avx2, kLoraBF16>;
  t.lora_up[kLoraF32] = simd_lora_up<Avx2, kLoraF32>;
  t.lora_up[kLoraBF16] = simd_lora_up<Avx2, kLoraBF16>;
  t.lora_down[kLoraQ8] = avx2_lora_down_q8;
  t.lora_up[kLoraQ8] = avx2_lora_up_q8;
  for (const char* kind : {"lora_f32", "lora_bf16", "lora_q8"}) t.names[kind] = "avx2";
  t.rmsnorm = simd_rmsnorm<Avx2>;
  t.add = simd_add<Avx2>;
  t.swiglu = simd_swiglu<Avx2>;
  t.geglu = simd_geglu<Avx2>;
  t.softmax = simd_softmax<Avx2>;
  t.argmax = simd_argmax<Avx2>;
  t.sample_weigh = avx2_sample_weigh;
  t.rope = simd_rope<Avx2>;
  t.kv_store = simd_kv_store<Avx2>;
  t.dequantize_row[kF16] = simd_dequantize_f16<Avx2>;
  t.dequantize_row[kBF16] = simd_dequantize_bf16<Avx2>;
  t.dequantize_row[kQ8_0] = simd_dequantize_q8_0<Avx2>;
  t.dequantize_row[kQ4_0] = simd_dequantize_q4_0<Avx2>;
  t.dequantize_row[kQ4_K] = simd_dequantize_q4_q5_k<Avx2, BlockQ4_K>;
  t.dequantize_row[kQ5_K] = simd_dequantize_q4_q5_k<Avx2, BlockQ5_K>;
  t.dequantize_row[kQ6_K] = simd_dequantize_q6_k<Avx2>;
  for (const char* kind : {"rmsnorm", "add", "swiglu", "geglu", "softmax", "argmax", "sample_weigh", "rope", "kv_store", "dequantize_f16",
                           "dequantize_bf16", "dequantize_q8_0", "dequantize_q4_0", "dequantize_q4_k",
                           "dequantize_q5_k", "dequantize_q6_k"}) {
    t.names[kind] = "avx2";
  }
}

}  // namespace conduit
