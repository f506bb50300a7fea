// 16-lane float vector operations for AVX-512 (F, BW, VL). Include only from a file compiled under
// `#pragma GCC target` for AVX-512, after every standard header, and inside an anonymous namespace of that file:
// the kernels instantiated from these traits then get internal linkage and cannot be merged with the code of
// another variant.
struct Avx512 {
  using F = __m512;
  using I = __m512i;
  static constexpr int kWidth = 16;

  static inline __mmask16 tail_mask(int64_t n) {
    return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  }
  static inline F zero() { return _mm512_setzero_ps(); }
  static inline F set1(float v) { return _mm512_set1_ps(v); }
  static inline F load(const float* p) { return _mm512_loadu_ps(p); }
  static inline F load_partial(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(tail_mask(n), p); }
  static inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static inline void store_partial(float* p, F v, int64_t n) { _mm512_mask_storeu_ps(p, tail_mask(n), v); }
  static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  static inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static inline F div(F a, F b) { return _mm512_div_ps(a, b); }
  static inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static inline F max(F a, F b) { return _mm512_max_ps(a, b); }
  static inline F min(F a, F b) { return _mm512_min_ps(a, b); }
  // Sum of the lanes, added in the same order as reduce_add_lanes adds each of its vectors, so a sum is the same
  // bits whichever of the two produced it (the matmul kernels rely on this for batch invariance).
  static inline float reduce_add(F v) {
    const F x = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xEE));  // lanes 0, 1: v.l0 + v.l2, v.l1 + v.l3
    const F y = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x01));  // lane 0: (l0 + l2) + (l1 + l3)
    const __m128 y4 = _mm512_castps512_ps128(y);
    const __m128 c = _mm_add_ps(y4, _mm_movehl_ps(y4, y4));           // y0 + y2, y1 + y3
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
  }
  static inline float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  // Bit i set where lane i of a equals lane i of b / where lane i of a or b is NaN.
  static inline unsigned eq_bits(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static inline unsigned unordered_bits(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
  // -inf in the lanes past n, so a masked-off tail never wins a max.
  static inline F load_partial_or_neg_inf(const float* p, int64_t n) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(n), p);
  }

  // The first two stages of the lane reductions below, for N (8 or 16) vectors: y[i], 128-bit lane L, holds 4
  // partial sums of v[4i + L], each ((l0 + l2) + (l1 + l3)) of the vector's 128-bit lanes as in reduce_add.
  template <int N>
  static inline void reduce_lanes_by_128(const F* v, F* y) {
    F x[N / 2];
    for (int i = 0; i < N / 2; ++i) {
      x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                           _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    }
    for (int i = 0; i < N / 4; ++i) {
      y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    }
  }

  // Lane i of the result = sum of the lanes of v[i], for 16 vectors: pairwise 128-bit-lane shuffles halve the
  // count of vectors at each stage (46 instructions instead of 16 full reductions). Each sum is added in the
  // order ((e0 + e8) + (e4 + e12)) + ... of reduce_add.
  static inline F reduce_add_lanes(const F* v) {
    F y[4], z[2];
    reduce_lanes_by_128<16>(v, y);
    for (int i = 0; i < 2; ++i) {
      z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44),
                           _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
    }
    const F s = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
    // Element e of 128-bit lane L now holds the sum of v[4e + L]: transpose lanes and elements.
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), s);
  }

  // Lanes 0-7 of the result = sums of the lanes of v[0] .. v[7] (lanes 8-15 repeat them), each added in
  // reduce_add's order like reduce_add_lanes, whose last stages here run within each 128-bit lane.
  static inline F reduce_add_lanes8(const F* v) {
    F y[2];
    reduce_lanes_by_128<8>(v, y);
    // z, 128-bit lane L: two partial sums of v[L], then two of v[4 + L].
    const F z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x44), _mm512_shuffle_ps(y[0], y[1], 0xEE));
    // s, 128-bit lane L: the sum of v[L], then of v[4 + L] (twice over).
    const F s = _mm512_add_ps(_mm512_shuffle_ps(z, z, 0x88), _mm512_shuffle_ps(z, z, 0xDD));
    return _mm512_permutexvar_ps(_mm512_set_epi32(13, 9, 5, 1, 12, 8, 4, 0, 13, 9, 5, 1, 12, 8, 4, 0), s);
  }

  // Halves (IEEE f16) and bfloat16.
  static inline F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline F load_f16_partial(const uint16_t* p, int64_t n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail_mask(n), p));
  }
  static inline void store_f16(uint16_t* p, F v) {
    const __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static inline void store_f16_partial(uint16_t* p, F v, int64_t n) {
    _mm256_mask_storeu_epi16(p, tail_mask(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static inline F load_bf16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static inline F load_bf16_partial(const uint16_t* p, int64_t n) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(tail_mask(n), p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  // 16 int8 -> float.
  static inline F load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }

  // 32-bit integer lanes, for decoding quantized blocks.
  static inline I load_u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline I set1_i(int v) { return _mm512_set1_epi32(v); }
  static inline I and_i(I a, I b) { return _mm512_and_si512(a, b); }
  static inline I or_i(I a, I b) { return _mm512_or_si512(a, b); }
  static inline I sub_i(I a, I b) { return _mm512_sub_epi32(a, b); }
  static inline I mullo_i(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static inline I srli_i(I a, int n) { return _mm512_srli_epi32(a, static_cast<unsigned>(n)); }
  static inline I slli_i(I a, int n) { return _mm512_slli_epi32(a, static_cast<unsigned>(n)); }
  static inline F to_float(I a) { return _mm512_cvtepi32_ps(a); }

  // RoPE helpers: pairs (2i, 2i+1) of x; c = {cos[i], cos[i]} for each pair, from 8 values at p.
  static inline F dup_pairs(const float* p, int64_t pairs) {
    const __m512i idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(tail_mask(pairs < 8 ? pairs : 8), p));
  }
  static inline F swap_pairs(F v) { return _mm512_permute_ps(v, 0xB1); }
  // -1 in even lanes, +1 in odd lanes.
  static inline F even_negative() { return _mm512_set_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1); }

  // 2^n for integral float n in [-126, 127].
  static inline F pow2i(F n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static inline F round(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
};
