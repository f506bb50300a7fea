// Row kernels for AVX512: the templates of ops_simd.h instantiated over the Avx512 vector traits.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "sample_weigh.h"

namespace conduit {
namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include "simd_avx512.h"
#include "ops_simd.h"
#include "lora_simd.h"

#pragma GCC optimize("fp-contract=off")
// Doubles in __m512d registers, for sample_weigh_simd.h.
struct Avx512d {
  using V = __m512d;
  static V set1(double x) { return _mm512_set1_pd(x); }
  static V add(V a, V b) { return _mm512_add_pd(a, b); }
  static V mul(V a, V b) { return _mm512_mul_pd(a, b); }
};
#include "sample_weigh_simd.h"

// sample_weigh.h's weights a block (eight) at a time: the same operations as sample::exp_gap in each lane (no fused
// multiply-add; the scaling by 2^k with VSCALEFPD, exact as the scalar multiplication by 2^k is), the block's sum
// in the registers by the pass's tree, and with the bins their indices; then weigh_finish.
double avx512_sample_weigh(const float* x, int64_t n, double scale, double max, double floor, double* weights,
                           double* block_totals, double* bin_mass, int32_t* bin_count, int64_t* last) {
  const __m512d vscale = _mm512_set1_pd(scale), vmax = _mm512_set1_pd(max), vfloor = _mm512_set1_pd(floor);
  const __m512d minus_inf = _mm512_set1_pd(-HUGE_VAL), infinity = _mm512_set1_pd(HUGE_VAL);
  const __m512d lowest = _mm512_set1_pd(sample::kExpLowest), highest = _mm512_set1_pd(sample::kExpHighest);
  const __m512d inv_ln2 = _mm512_set1_pd(sample::kInvLn2), half = _mm512_set1_pd(0.5);
  const __m512d ln2_hi = _mm512_set1_pd(sample::kLn2Hi), ln2_lo = _mm512_set1_pd(sample::kLn2Lo);
  const __m512d per_logit = _mm512_set1_pd(sample::kMassBinsPerLogit), last_bin = _mm512_set1_pd(sample::kMassBins - 1);
  const __m256i last_bin_index = _mm256_set1_epi32(sample::kMassBins - 1), no_bin = _mm256_set1_epi32(sample::kNoBin);
  const bool scaled = scale != 1.0;
  const bool bins = bin_mass != nullptr;
  thread_local std::vector<int32_t> bin_index;
  if (bins && bin_index.size() < static_cast<size_t>(n)) bin_index.resize(static_cast<size_t>(n));
  const int64_t whole = n - n % sample::kWeighBlock;
  double total = 0.0;
  for (int64_t i = 0; i < whole; i += 8) {
    __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
    if (scaled) v = _mm512_cvtps_pd(_mm512_cvtpd_ps(_mm512_mul_pd(v, vscale)));
    const __mmask8 candidate = _mm512_cmp_pd_mask(v, vfloor, _CMP_GE_OQ) & _mm512_cmp_pd_mask(v, minus_inf, _CMP_GT_OQ);
    const __m512d d = _mm512_sub_pd(v, vmax);
    const __m512d k = _mm512_roundscale_pd(_mm512_add_pd(_mm512_mul_pd(d, inv_ln2), half),
                                           _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512d r = _mm512_sub_pd(_mm512_sub_pd(d, _mm512_mul_pd(k, ln2_hi)), _mm512_mul_pd(k, ln2_lo));
    const __m512d p = sample_estrin<Avx512d>(r);
    __m512d w = _mm512_maskz_mov_pd(_mm512_cmp_pd_mask(d, lowest, _CMP_GT_OQ), _mm512_scalef_pd(p, k));
    w = _mm512_mask_mov_pd(w, _mm512_cmp_pd_mask(d, highest, _CMP_GT_OQ), infinity);
    w = _mm512_mask_mov_pd(w, _mm512_cmp_pd_mask(d, d, _CMP_UNORD_Q), d);
    w = _mm512_maskz_mov_pd(candidate, w);
    _mm512_storeu_pd(weights + i, w);
    // ((w0 + w1) + (w2 + w3)) + ((w4 + w5) + (w6 + w7)) in lane 0 (each addition's operands in either order: the
    // same sum).
    const __m512d pairs = _mm512_add_pd(w, _mm512_permute_pd(w, 0x55));
    const __m512d quads = _mm512_add_pd(pairs, _mm512_permutex_pd(pairs, _MM_SHUFFLE(1, 0, 3, 2)));
    total += _mm512_cvtsd_f64(_mm512_add_pd(quads, _mm512_shuffle_f64x2(quads, quads, _MM_SHUFFLE(1, 0, 3, 2))));
    if (block_totals != nullptr) block_totals[i / sample::kWeighBlock] = total;
    if (bins) {
      // sample::bin_of: truncation of (max - v) * 8 below the last bin, the last bin otherwise (NaN included).
      const __m512d gap = _mm512_mul_pd(_mm512_sub_pd(vmax, v), per_logit);
      const __mmask8 inside = _mm512_cmp_pd_mask(gap, last_bin, _CMP_LT_OQ);
      __m256i index = _mm256_mask_mov_epi32(last_bin_index, inside, _mm512_cvttpd_epi32(gap));
      index = _mm256_mask_mov_epi32(no_bin, candidate, index);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bin_index.data() + i), index);
    }
  }
  return sample::weigh_finish(x, n, whole, total, scale, max, floor, weights, block_totals, bin_mass, bin_count,
                              bins ? bin_index.data() : nullptr, last);
}
#pragma GCC pop_options

// The avx512 variant requires VNNI (cpu.cc), which only the q8 LoRA kernels here use.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include "lora_q8_avx512.h"
#pragma GCC pop_options

}  // namespace

// Registration runs on every CPU, so it stays outside the target region.
void register_ops_avx512(KernelTable& t) {
  t.lora_down[kLoraF32] = simd_lora_down<Avx512, kLoraF32>;
  t.lora_down[kLoraBF16] = simd_lora_down<Avx512, kLoraBF16>;
  t.lora_down[kLoraQ8] = avx512_lora_down_q8;
  t.lora_up[kLoraF32] = simd_lora_up<Avx512, kLoraF32>;
  t.lora_up[kLoraBF16] = simd_lora_up<Avx512, kLoraBF16>;
  t.lora_up[kLoraQ8] = avx512_lora_up_q8;
  for (const char* kind : {"lora_f32", "lora_bf16", "lora_q8"}) t.names[kind] = "avx512";
  t.rmsnorm = simd_rmsnorm<Avx512>;
  t.add = simd_add<Avx512>;
  t.swiglu = simd_swiglu<Avx512>;
  t.geglu = simd_geglu<Avx512>;
  t.softmax = simd_softmax<Avx512>;
  t.argmax = simd_argmax<Avx512>;
  t.sample_weigh = avx512_sample_weigh;
  t.scale_row = simd_scale_row<Avx512>;
  t.rope = simd_rope<Avx512>;
  t.kv_store = simd_kv_store<Avx512>;
  t.dequantize_row[kF16] = simd_dequantize_f16<Avx512>;
  t.dequantize_row[kBF16] = simd_dequantize_bf16<Avx512>;
  t.dequantize_row[kQ8_0] = simd_dequantize_q8_0<Avx512>;
  t.dequantize_row[kQ4_0] = simd_dequantize_q4_0<Avx512>;
  t.dequantize_row[kQ4_K] = simd_dequantize_q4_q5_k<Avx512, BlockQ4_K>;
  t.dequantize_row[kQ5_K] = simd_dequantize_q4_q5_k<Avx512, BlockQ5_K>;
  t.dequantize_row[kQ6_K] = simd_dequantize_q6_k<Avx512>;
  for (const char* kind : {"rmsnorm", "add", "swiglu", "geglu", "softmax", "argmax", "sample_weigh", "scale_row", "rope", "kv_store", "dequantize_f16",
                           "dequantize_bf16", "dequantize_q8_0", "dequantize_q4_0", "dequantize_q4_k",
                           "dequantize_q5_k", "dequantize_q6_k"}) {
    t.names[kind] = "avx512";
  }
}

}  // namespace conduit
