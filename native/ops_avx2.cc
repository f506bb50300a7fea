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

#pragma GCC optimize("fp-contract=off")
// Doubles in __m256d registers, for sample_weigh_simd.h.
struct Avx2d {
  using V = __m256d;
  static V set1(double x) { return _mm256_set1_pd(x); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
  static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
};
#include "sample_weigh_simd.h"

// The weights of x[i, i + 4) into weights (sample::candidate_weight in each lane); returns (w0 + w1) + (w2 + w3).
inline double avx2_weigh_four(const float* x, int64_t i, double scale, double max, double floor, double* weights) {
  __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
  if (scale != 1.0) v = _mm256_cvtps_pd(_mm256_cvtpd_ps(_mm256_mul_pd(v, _mm256_set1_pd(scale))));
  const __m256d candidate = _mm256_and_pd(_mm256_cmp_pd(v, _mm256_set1_pd(floor), _CMP_GE_OQ),
                                          _mm256_cmp_pd(v, _mm256_set1_pd(-HUGE_VAL), _CMP_GT_OQ));
  const __m256d d = _mm256_sub_pd(v, _mm256_set1_pd(max));
  const __m256d scaled = _mm256_add_pd(_mm256_mul_pd(d, _mm256_set1_pd(sample::kInvLn2)), _mm256_set1_pd(0.5));
  const __m256d k = _mm256_round_pd(scaled, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256d r = _mm256_sub_pd(_mm256_sub_pd(d, _mm256_mul_pd(k, _mm256_set1_pd(sample::kLn2Hi))),
                                  _mm256_mul_pd(k, _mm256_set1_pd(sample::kLn2Lo)));
  const __m256d p = sample_estrin<Avx2d>(r);
  // k is integral; in the lanes that are kept it lies in [-1021, 1023], so k + 1023 is a valid biased exponent.
  const __m256i exponent =
      _mm256_slli_epi64(_mm256_cvtepi32_epi64(_mm_add_epi32(_mm256_cvtpd_epi32(k), _mm_set1_epi32(1023))), 52);
  __m256d w = _mm256_and_pd(_mm256_mul_pd(p, _mm256_castsi256_pd(exponent)),
                            _mm256_cmp_pd(d, _mm256_set1_pd(sample::kExpLowest), _CMP_GT_OQ));
  w = _mm256_blendv_pd(w, _mm256_set1_pd(HUGE_VAL), _mm256_cmp_pd(d, _mm256_set1_pd(sample::kExpHighest), _CMP_GT_OQ));
  w = _mm256_blendv_pd(w, d, _mm256_cmp_pd(d, d, _CMP_UNORD_Q));
  w = _mm256_and_pd(w, candidate);
  _mm256_storeu_pd(weights + i, w);
  const __m256d pairs = _mm256_add_pd(w, _mm256_permute_pd(w, 0x5));
  return _mm_cvtsd_f64(_mm_add_pd(_mm256_castpd256_pd128(pairs), _mm256_extractf128_pd(pairs, 1)));
}

// sample_weigh.h's weights a block (eight) at a time, four per vector: the same operations as sample::exp_gap in
// each lane (no fused multiply-add; 2^k built from its bits, as the scalar pow2), the block's sum by the pass's
// tree; then weigh_finish (the bins' indices computed there).
double avx2_sample_weigh(const float* x, int64_t n, double scale, double max, double floor, double* weights,
                         double* block_totals, double* bin_mass, int32_t* bin_count, int64_t* last) {
  const int64_t whole = n - n % sample::kWeighBlock;
  double total = 0.0;
  for (int64_t i = 0; i < whole; i += 8) {
    const double left = avx2_weigh_four(x, i, scale, max, floor, weights);
    total += left + avx2_weigh_four(x, i + 4, scale, max, floor, weights);
    if (block_totals != nullptr) block_totals[i / sample::kWeighBlock] = total;
  }
  return sample::weigh_finish(x, n, whole, total, scale, max, floor, weights, block_totals, bin_mass, bin_count,
                              nullptr, last);
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
  t.scale_row = simd_scale_row<Avx2>;
  t.rope = simd_rope<Avx2>;
  t.kv_store = simd_kv_store<Avx2>;
  t.dequantize_row[kF16] = simd_dequantize_f16<Avx2>;
  t.dequantize_row[kBF16] = simd_dequantize_bf16<Avx2>;
  t.dequantize_row[kQ8_0] = simd_dequantize_q8_0<Avx2>;
  t.dequantize_row[kQ4_0] = simd_dequantize_q4_0<Avx2>;
  t.dequantize_row[kQ4_K] = simd_dequantize_q4_q5_k<Avx2, BlockQ4_K>;
  t.dequantize_row[kQ5_K] = simd_dequantize_q4_q5_k<Avx2, BlockQ5_K>;
  t.dequantize_row[kQ6_K] = simd_dequantize_q6_k<Avx2>;
  for (const char* kind : {"rmsnorm", "add", "swiglu", "geglu", "softmax", "argmax", "sample_weigh", "scale_row", "rope", "kv_store", "dequantize_f16",
                           "dequantize_bf16", "dequantize_q8_0", "dequantize_q4_0", "dequantize_q4_k",
                           "dequantize_q5_k", "dequantize_q6_k"}) {
    t.names[kind] = "avx2";
  }
}

}  // namespace conduit
