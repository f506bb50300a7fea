// 8-lane float vector operations for AVX2 + FMA + F16C. Same contract as simd_avx512.h: include under the
// matching `#pragma GCC target`, after the standard headers, inside an anonymous namespace.
struct Avx2 {
  using F = __m256;
  using I = __m256i;
  static constexpr int kWidth = 8;

  // Lane i is active when i < n (maskload/maskstore look at the sign bit of each 32-bit lane).
  static inline __m256i tail_mask(int64_t n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 8 ? n : 8)), lanes);
  }
  static inline F zero() { return _mm256_setzero_ps(); }
  static inline F set1(float v) { return _mm256_set1_ps(v); }
  static inline F load(const float* p) { return _mm256_loadu_ps(p); }
  static inline F load_partial(const float* p, int64_t n) { return _mm256_maskload_ps(p, tail_mask(n)); }
  static inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static inline void store_partial(float* p, F v, int64_t n) { _mm256_maskstore_ps(p, tail_mask(n), v); }
  static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  static inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static inline F div(F a, F b) { return _mm256_div_ps(a, b); }
  static inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static inline F max(F a, F b) { return _mm256_max_ps(a, b); }
  static inline F min(F a, F b) { return _mm256_min_ps(a, b); }
  // Sum of the lanes, ((e0 + e1) + (e2 + e3)) + ((e4 + e5) + (e6 + e7)): the order reduce_add_lanes adds each of
  // its vectors in, so a sum is the same bits whichever of the two produced it (batch invariance of the matmuls).
  static inline float reduce_add(F v) {
    const F h = _mm256_hadd_ps(v, v);
    const F h2 = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
  }
  // Bit i set where lane i of a equals lane i of b / where lane i of a or b is NaN.
  static inline unsigned eq_bits(F a, F b) {
    return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)));
  }
  static inline unsigned unordered_bits(F a, F b) {
    return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q)));
  }
  static inline float reduce_max(F v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // Lane i of the result = sum of the lanes of v[i], for 8 vectors (horizontal adds pair them up).
  static inline F reduce_add_lanes(const F* v) {
    const F h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
    const F h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
    const F q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
    // q0: lanes 0..3 = low-half sums of v[0..3], lanes 4..7 = high-half sums; likewise q1 for v[4..7].
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
  }
  static inline F load_partial_or_neg_inf(const float* p, int64_t n) {
    const __m256i m = tail_mask(n);
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
  }

  // Halves and bfloat16; partial forms copy through a small buffer (AVX2 has no 16-bit masked moves).
  static inline F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline F load_f16_partial(const uint16_t* p, int64_t n) {
    uint16_t buf[8] = {};
    std::memcpy(buf, p, static_cast<size_t>(n < 8 ? n : 8) * 2);
    return load_f16(buf);
  }
  static inline void store_f16(uint16_t* p, F v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static inline void store_f16_partial(uint16_t* p, F v, int64_t n) {
    uint16_t buf[8];
    store_f16(buf, v);
    std::memcpy(p, buf, static_cast<size_t>(n < 8 ? n : 8) * 2);
  }
  static inline F load_bf16(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static inline F load_bf16_partial(const uint16_t* p, int64_t n) {
    uint16_t buf[8] = {};
    std::memcpy(buf, p, static_cast<size_t>(n < 8 ? n : 8) * 2);
    return load_bf16(buf);
  }
  static inline F load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }

  // 32-bit integer lanes, for decoding quantized blocks.
  static inline I load_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static inline I set1_i(int v) { return _mm256_set1_epi32(v); }
  static inline I and_i(I a, I b) { return _mm256_and_si256(a, b); }
  static inline I or_i(I a, I b) { return _mm256_or_si256(a, b); }
  static inline I sub_i(I a, I b) { return _mm256_sub_epi32(a, b); }
  static inline I mullo_i(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static inline I srli_i(I a, int n) { return _mm256_srli_epi32(a, n); }
  static inline I slli_i(I a, int n) { return _mm256_slli_epi32(a, n); }
  static inline F to_float(I a) { return _mm256_cvtepi32_ps(a); }

  static inline F dup_pairs(const float* p, int64_t pairs) {
    const __m256i idx = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    const __m128 half = _mm_maskload_ps(p, _mm256_castsi256_si128(tail_mask(pairs)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(half), idx);
  }
  static inline F swap_pairs(F v) { return _mm256_permute_ps(v, 0xB1); }
  static inline F even_negative() { return _mm256_setr_ps(-1, 1, -1, 1, -1, 1, -1, 1); }

  static inline F pow2i(F n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static inline F round(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
};
