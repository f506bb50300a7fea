// AVX2 matmul. Float weights use the shared GEMV/GEMM of matmul_float_simd.h (8-wide). Q8_0 and the 32-blocks take
// 8-bit dot products without VNNI: VPMADDUBSW multiplies unsigned by signed bytes into saturating 16-bit pair
// sums, so each weight block is split into |w| (unsigned) and its sign, which is moved onto the activation
// (VPSIGNB); |w| * sign(a, w) <= 128 * 127 per product, so a pair sum never saturates. VPMADDWD then widens to
// 32 bits, and each block's sum is added scaled by (weight scale x activation scale). A weight block is loaded
// and split once and reused by up to 4 activation rows, which is the blocking for many rows.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kernels.h"

namespace conduit {
namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "simd_avx2.h"
#include "ops_simd.h"
#include "matmul_float_simd.h"

// ---------------------------------------------------------------------------------------------------------------
// Activation quantization: [K signed bytes][K/32 f32 scales]

size_t int8_act_row_bytes(int64_t K) { return static_cast<size_t>(K) + static_cast<size_t>(K / 32) * 4; }

void int8_quantize_act(const float* x, int64_t K, uint8_t* out) {
  float* scales = reinterpret_cast<float*>(out + K);
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
    }
    const float d = Avx2::reduce_max(amax) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
    // Narrow 32 -> 16 -> 8 bits; the packs interleave 128-bit lanes, which the final permute undoes.
    const __m256i q16a = _mm256_packs_epi32(q[0], q[1]), q16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * b), q8);
    scales[b] = d;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Dot products

// The 32 fifth bits of a Q5_0 / Q5_1 block as 0x10 in the byte of their element (bit i of the little-endian qh:
// byte i).
inline __m256i q5_high_bits(const uint8_t* qh_bytes) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                            _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                               0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

// The quants of one weight block: signed for Q8_0, Q4_0, Q5_0; for Q4_1 / Q5_1 their unsigned levels (0..15 / 0..31),
// the offset m being added apart.
inline __m256i block_quants(int type, const uint8_t* block) {
  if (type == kQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  const int nibbles = type == kQ4_0 ? 2 : type == kQ4_1 ? 4 : type == kQ5_0 ? 6 : 8;
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + nibbles));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(packed, mask), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  const __m256i q = _mm256_set_m128i(hi, lo);
  if (type == kQ4_1) return q;
  if (type == kQ5_1) return _mm256_or_si256(q, q5_high_bits(block + 4));
  if (type == kQ5_0) return _mm256_sub_epi8(_mm256_or_si256(q, q5_high_bits(block + 2)), _mm256_set1_epi8(16));
  return _mm256_sub_epi8(q, _mm256_set1_epi8(8));
}

template <int Type>
constexpr size_t int8_block_bytes() {
  return Type == kQ8_0   ? sizeof(BlockQ8_0)
         : Type == kQ4_1 ? sizeof(BlockQ4_1)
         : Type == kQ5_0 ? sizeof(BlockQ5_0)
         : Type == kQ5_1 ? sizeof(BlockQ5_1)
                         : sizeof(BlockQ4_0);
}

// One weight row against MR activation rows.
template <int Type, int MR>
inline void int8_row_dots(const uint8_t* w, const uint8_t* act, size_t act_stride, int64_t K, float* y,
                          int64_t ldy) {
  constexpr size_t block_bytes = int8_block_bytes<Type>();
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i ones8 = _mm256_set1_epi8(1);
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* block = w + b * block_bytes;
    const __m256i q = block_quants(Type, block);
    const __m256i q_abs = _mm256_sign_epi8(q, q);
    uint16_t dh;
    std::memcpy(&dh, block, 2);
    const float dw = _cvtsh_ss(dh);
    for (int i = 0; i < MR; ++i) {
      const uint8_t* a = act + i * act_stride;
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * b));
      const __m256i pairs = _mm256_maddubs_epi16(q_abs, _mm256_sign_epi8(av, q));
      const __m256i sums = _mm256_madd_epi16(pairs, ones);
      const float da = reinterpret_cast<const float*>(a + K)[b];
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(dw * da), acc[i]);
      if (Type == kQ4_1 || Type == kQ5_1) {  // + (sum of the block's activations) x m x da
        uint16_t mh;
        std::memcpy(&mh, block + 2, 2);
        const __m256i asums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, av), ones);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(asums), _mm256_set1_ps(_cvtsh_ss(mh) * da), acc[i]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) y[i * ldy] = Avx2::reduce_add(acc[i]);
}

template <int Type>
void int8_tile(const MatmulTile& t) {
  for (int64_t n = t.n0; n < t.n1; ++n) {
    const uint8_t* w = t.w + n * t.w_row_bytes;
    int64_t m = 0;
    for (; m + 4 <= t.M; m += 4) {
      int8_row_dots<Type, 4>(w, t.act + m * t.act_stride, t.act_stride, t.K, t.y + m * t.ldy + n, t.ldy);
    }
    const uint8_t* act = t.act + m * t.act_stride;
    float* y = t.y + m * t.ldy + n;
    switch (t.M - m) {
      case 3: int8_row_dots<Type, 3>(w, act, t.act_stride, t.K, y, t.ldy); break;
      case 2: int8_row_dots<Type, 2>(w, act, t.act_stride, t.K, y, t.ldy); break;
      case 1: int8_row_dots<Type, 1>(w, act, t.act_stride, t.K, y, t.ldy); break;
      default: break;
    }
  }
}

size_t int8_scratch_bytes(int64_t) { return 64; }

// Q4_K / Q5_K / Q6_K: VPMADDUBSW pair sums times the sub-block scales with VPMADDWD.
#define KQ_DOT16(acc, pairs, scales) _mm256_add_epi32((acc), _mm256_madd_epi16((pairs), (scales)))
#include "matmul_kquant_simd.h"
#undef KQ_DOT16

#pragma GCC pop_options

template <int Type>
MatmulKernel float_kernel() {
  MatmulKernel k;
  k.scratch_bytes = float_scratch_bytes;
  k.tile = float_tile<Avx2, Type, 2, 4>;
  return k;
}

template <int Type>
MatmulKernel int8_kernel() {
  MatmulKernel k;
  k.act_row_bytes = int8_act_row_bytes;
  k.quantize_act = int8_quantize_act;
  k.scratch_bytes = int8_scratch_bytes;
  k.tile = int8_tile<Type>;
  return k;
}

template <int Type>
MatmulKernel kq_kernel() {
  MatmulKernel k;
  k.act_row_bytes = kq_act_row_bytes;
  k.quantize_act = kq_quantize_act;
  k.scratch_bytes = kq_scratch_bytes;
  k.tile = kq_tile<Type>;
  return k;
}

}  // namespace

void register_matmul_avx2(KernelTable& t) {
  t.matmul[kF32] = float_kernel<kF32>();
  t.matmul[kF16] = float_kernel<kF16>();
  t.matmul[kBF16] = float_kernel<kBF16>();
  t.matmul[kQ4_K] = kquant_dot_enabled() ? kq_kernel<kQ4_K>() : float_kernel<kQ4_K>();
  t.matmul[kQ5_K] = kquant_dot_enabled() ? kq_kernel<kQ5_K>() : float_kernel<kQ5_K>();
  t.matmul[kQ6_K] = kquant_dot_enabled() ? kq_kernel<kQ6_K>() : float_kernel<kQ6_K>();
  t.matmul[kQ8_0] = int8_kernel<kQ8_0>();
  t.matmul[kQ4_0] = int8_kernel<kQ4_0>();
  // Q4_1, Q5_0, Q5_1 (Q5_0 / Q5_1: llama-quantize's fallback from Q4_K / Q5_K for rows that are not whole
  // super-blocks): this kernel on every x86 variant; the avx512 table inherits it.
  t.matmul[kQ4_1] = int8_kernel<kQ4_1>();
  t.matmul[kQ5_0] = int8_kernel<kQ5_0>();
  t.matmul[kQ5_1] = int8_kernel<kQ5_1>();
  for (int type : {kF32, kF16, kBF16, kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K}) {
    t.names[std::string("matmul_") + type_name(type)] = "avx2";
  }
  if (kquant_dot_enabled()) {
    t.names["matmul_q4_k"] = "avx2_int8";
    t.names["matmul_q5_k"] = "avx2_int8";
    t.names["matmul_q6_k"] = "avx2_int8";
  }
}

}  // namespace conduit
