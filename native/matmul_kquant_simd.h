// Q4_K, Q5_K and Q6_K integer-dot matmul, written once over 256-bit integer intrinsics and included inside the target
// region of matmul_avx2.cc and matmul_avx512.cc (inside their anonymous namespace). The including file defines
// KQ_DOT16(acc, pairs, scales): acc (8 x int32) += the int16 pairs of `pairs` times the int16 `scales`, summed by
// pairs; avx2 with VPMADDWD + VPADDD, avx512 with AVX512-VNNI's VPDPWSSD (one instruction, the same exact int32).
//
// Activations: one f32 scale per super-block of 256 (amax / 127, round to nearest even, as ggml's Q8_K), 256
// signed bytes, the 16 sums of its 16-element groups and the 8 sums of its 32-element sub-blocks (int16; Q6_K's
// scales cover 16 elements, Q4_K's and Q5_K's mins 32, and a packed kernel takes each min's activation sum as it is
// stored instead of adding two group sums per sub-block, output row and weight slab). A K-quant weight is (super-block scale) x (small
// integer sub-block scale) x (small integer quant) [- (super-block min scale) x (integer min), Q4_K and Q5_K], so with one
// activation scale per super-block the whole super-block's dot product is integer arithmetic: per 32 bytes
// VPMADDUBSW (unsigned 4-, 5- or 6-bit weight x signed activation, pair sums at most 2 * 63 * 127, never saturating),
// then KQ_DOT16 with the sub-blocks' scales. A scale per 32 activations (the Q8_0 path's format) would cost a float
// conversion and multiply per sub-block instead of one per super-block and lane.
//
// The arithmetic of one output (the rule every Q4_K / Q5_K / Q6_K kernel follows, the load-time packed ones of
// matmul_kquant_packed_avx512.h included): per super-block, the exact int32 S = sum over sub-blocks of (integer
// scale x integer dot product) and, for Q4_K / Q5_K, Mn = sum over sub-blocks of (integer min x activation sum of
// the sub-block); for Q6_K S already has the offset taken off (quants are stored as 0..63 = value + 32, so 32 x
// scale x group sum is subtracted). Then, super-block by super-block from zero, acc = fma(f32(S), d x da, acc) and
// acc = fnma(f32(Mn), dmin x da, acc), each one rounding. S needs no more than 2^31 (Q6_K's largest is 256 x 63 x
// 127 x 127 < 2^28); its conversion rounds only beyond 2^24, a relative 2^-24. Here the 8 int32 lanes of a
// super-block are summed exactly (integers: order-free) and the float steps are scalar; a packed kernel keeps 16
// outputs in the lanes of a vector and does the same float steps per lane. Every output is one (weight row,
// activation row) pair computed by that rule whatever M, so the kernels are batch invariant, and the avx2 and
// avx512 builds (and the packed layout) give the same bits.

// ---------------------------------------------------------------------------------------------------------------
// Activations: [K int8][K/16 int16 group sums][K/32 int16 sub-block sums][K/256 f32 scales] (K a multiple of 256:
// every part starts 16-byte aligned in a 64-byte aligned row).

size_t kq_act_row_bytes(int64_t K) {
  return static_cast<size_t>(K) + static_cast<size_t>(K / 16) * 2 + static_cast<size_t>(K / 32) * 2 +
         static_cast<size_t>(K / 256) * 4;
}

struct KqActRow {
  const int8_t* q = nullptr;
  const int16_t* bsums = nullptr;  // [K/16]: group g of 16 elements
  const int16_t* ssums = nullptr;  // [K/32]: sub-block j of 32 elements (groups 2j and 2j + 1)
  const float* d = nullptr;
  KqActRow() = default;
  KqActRow(const uint8_t* row, int64_t K)
      : q(reinterpret_cast<const int8_t*>(row)),
        bsums(reinterpret_cast<const int16_t*>(row + K)),
        ssums(reinterpret_cast<const int16_t*>(row + K + K / 16 * 2)),
        d(reinterpret_cast<const float*>(row + K + K / 16 * 2 + K / 32 * 2)) {}
};

void kq_quantize_act(const float* x, int64_t K, uint8_t* out) {
  int8_t* q = reinterpret_cast<int8_t*>(out);
  int16_t* bsums = reinterpret_cast<int16_t*>(out + K);
  int16_t* ssums = reinterpret_cast<int16_t*>(out + K + K / 16 * 2);
  float* scales = reinterpret_cast<float*>(out + K + K / 16 * 2 + K / 32 * 2);
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const float* xs = x + 256 * sb;
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 32; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(xs + 8 * i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    for (int c = 0; c < 8; ++c) {  // 32 values at a time
      __m256i v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + 32 * c + 8 * i), id));
      // Group sums of 16: lanes of v[0] + v[1] and v[2] + v[3], reduced.
      const __m256i s01 = _mm256_add_epi32(v[0], v[1]), s23 = _mm256_add_epi32(v[2], v[3]);
      __m128i h = _mm_hadd_epi32(_mm_add_epi32(_mm256_castsi256_si128(s01), _mm256_extracti128_si256(s01, 1)),
                                 _mm_add_epi32(_mm256_castsi256_si128(s23), _mm256_extracti128_si256(s23, 1)));
      h = _mm_hadd_epi32(h, h);
      const int32_t g0 = _mm_cvtsi128_si32(h), g1 = _mm_extract_epi32(h, 1);
      bsums[16 * sb + 2 * c] = static_cast<int16_t>(g0);
      bsums[16 * sb + 2 * c + 1] = static_cast<int16_t>(g1);
      ssums[8 * sb + c] = static_cast<int16_t>(g0 + g1);  // |sum| <= 32 x 127
      const __m256i q16a = _mm256_packs_epi32(v[0], v[1]), q16b = _mm256_packs_epi32(v[2], v[3]);
      const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 256 * sb + 32 * c), q8);
    }
    scales[sb] = d;
  }
}

// The exact sums of the 8 lanes of a and of b.
inline void kq_hsum2(__m256i a, __m256i b, int32_t* sa, int32_t* sb) {
  const __m256i h = _mm256_hadd_epi32(a, b);  // a01 a23 b01 b23 | a45 a67 b45 b67
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  s = _mm_hadd_epi32(s, s);
  *sa = _mm_cvtsi128_si32(s);
  *sb = _mm_extract_epi32(s, 1);
}

// acc + f32(s) x scale, one rounding.
inline __m128 kq_fma(int32_t s, float scale, __m128 acc) {
  return _mm_fmadd_ss(_mm_cvtsi32_ss(_mm_setzero_ps(), s), _mm_set_ss(scale), acc);
}
inline __m128 kq_fnma(int32_t s, float scale, __m128 acc) {
  return _mm_fnmadd_ss(_mm_cvtsi32_ss(_mm_setzero_ps(), s), _mm_set_ss(scale), acc);
}

inline __m256i kq_load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Two int16 scales, each over 8 lanes (the 16 pair sums of 32 bytes whose halves have different scales).
inline __m256i kq_scale_pair(int lo, int hi) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(hi)), _mm_set1_epi16(static_cast<int16_t>(lo)));
}

// ---------------------------------------------------------------------------------------------------------------
// Q4_K and Q5_K (Block = BlockQ5_K: the fifth bit of element l of sub-block s is bit s of qh[l], added as 16 to the
// nibble): one weight row against MR activation rows.

template <int MR, class Block>
inline void q4k_row_dots(const uint8_t* w, const KqActRow* act, int64_t K, float* y, int64_t ldy) {
  constexpr bool kFive = sizeof(Block) == sizeof(BlockQ5_K);
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  __m128 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm_setzero_ps();
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const Block* blk = reinterpret_cast<const Block*>(w) + sb;
    // The 8 scales and 8 mins (6 bits each) of the 12 packed bytes, 4 at a time (q4k_scale_min, bytewise).
    uint32_t words[3];
    std::memcpy(words, blk->scales, 12);
    const uint32_t sc_lo = words[0] & 0x3F3F3F3Fu, mn_lo = words[1] & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (words[2] & 0x0F0F0F0Fu) | (((words[0] >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((words[2] >> 4) & 0x0F0F0F0Fu) | (((words[1] >> 6) & 0x03030303u) << 4);
    uint8_t sc[8];
    std::memcpy(sc, &sc_lo, 4);
    std::memcpy(sc + 4, &sc_hi, 4);
    // Each min twice (it covers two groups of 16), against the 16 group sums.
    const __m128i mn8 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, static_cast<int>(mn_hi), static_cast<int>(mn_lo)));
    const __m256i mins = _mm256_set_m128i(_mm_unpackhi_epi16(mn8, mn8), _mm_unpacklo_epi16(mn8, mn8));
    __m256i isum[MR];
    for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {  // 64 values: low nibbles are sub-block 2g, high nibbles 2g + 1
      const __m256i packed = kq_load(blk->qs + 32 * g);
      __m256i lo = _mm256_and_si256(packed, low4), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
      if (kFive) {
        // Bits 2g and 2g + 1 of each qh byte, moved to bit 4 (16-bit shifts: the bits taken stay in their byte).
        const __m256i h = _mm256_srli_epi16(kq_load(reinterpret_cast<const BlockQ5_K*>(blk)->qh), 2 * g);
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(h, 3), bit4));
      }
      const __m256i s_lo = _mm256_set1_epi16(sc[2 * g]), s_hi = _mm256_set1_epi16(sc[2 * g + 1]);
      for (int i = 0; i < MR; ++i) {
        const int8_t* a = act[i].q + 256 * sb + 64 * g;
        isum[i] = KQ_DOT16(isum[i], _mm256_maddubs_epi16(lo, kq_load(a)), s_lo);
        isum[i] = KQ_DOT16(isum[i], _mm256_maddubs_epi16(hi, kq_load(a + 32)), s_hi);
      }
    }
    uint16_t dh, dminh;
    std::memcpy(&dh, &blk->d, 2);
    std::memcpy(&dminh, &blk->dmin, 2);
    const float d = _cvtsh_ss(dh), dmin = _cvtsh_ss(dminh);  // F16C: the bits of fp16_to_fp32
    for (int i = 0; i < MR; ++i) {
      const float da = act[i].d[sb];
      int32_t s, mn;
      kq_hsum2(isum[i], _mm256_madd_epi16(kq_load(act[i].bsums + 16 * sb), mins), &s, &mn);
      acc[i] = kq_fnma(mn, dmin * da, kq_fma(s, d * da, acc[i]));
    }
  }
  for (int i = 0; i < MR; ++i) y[i * ldy] = _mm_cvtss_f32(acc[i]);
}

// ---------------------------------------------------------------------------------------------------------------
// Q6_K: one weight row against MR activation rows.

template <int MR>
inline void q6k_row_dots(const uint8_t* w, const KqActRow* act, int64_t K, float* y, int64_t ldy) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03);
  __m128 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm_setzero_ps();
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const BlockQ6_K* blk = reinterpret_cast<const BlockQ6_K*>(w) + sb;
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk->scales)));
    __m256i isum[MR];
    for (int i = 0; i < MR; ++i) {
      // -32 x sum over groups of scale x group sum: the stored quants are value + 32.
      isum[i] = _mm256_slli_epi32(_mm256_madd_epi16(kq_load(act[i].bsums + 16 * sb), scales16), 5);
      isum[i] = _mm256_sub_epi32(_mm256_setzero_si256(), isum[i]);
    }
    for (int half = 0; half < 2; ++half) {
      // Element l + 32 k of a half (k = 0..3): low 4 bits from nibble (k / 2) of ql[l + 32 (k % 2)], high 2 bits
      // from bit pair k of qh[l]; groups of 16 have scales 2k and 2k + 1 of the half.
      const uint8_t* ql = blk->ql + 64 * half;
      const __m256i qa = kq_load(ql), qb = kq_load(ql + 32), qh = kq_load(blk->qh + 32 * half);
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(qa, low4), _mm256_slli_epi16(_mm256_and_si256(qh, low2), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(qb, low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), low2), 4));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), low2), 4));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), low2), 4));
      const int8_t* sc = blk->scales + 8 * half;
      for (int k = 0; k < 4; ++k) {
        const __m256i s = kq_scale_pair(sc[2 * k], sc[2 * k + 1]);
        for (int i = 0; i < MR; ++i) {
          const int8_t* a = act[i].q + 256 * sb + 128 * half + 32 * k;
          isum[i] = KQ_DOT16(isum[i], _mm256_maddubs_epi16(q[k], kq_load(a)), s);
        }
      }
    }
    uint16_t dh;
    std::memcpy(&dh, &blk->d, 2);
    const float d = _cvtsh_ss(dh);
    for (int i = 0; i < MR; ++i) {
      int32_t s, unused;
      kq_hsum2(isum[i], _mm256_setzero_si256(), &s, &unused);
      acc[i] = kq_fma(s, d * act[i].d[sb], acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) y[i * ldy] = _mm_cvtss_f32(acc[i]);
}

// ---------------------------------------------------------------------------------------------------------------
// Tiles: activation rows in blocks of kKqRowBlock (their bytes stay in L1 while the tile's weight rows pass), each
// weight row against 4 activation rows at a time, then the remaining 1..3.

constexpr int64_t kKqRowBlock = 16;

template <int MR, int Type>
inline void kq_row_dots(const uint8_t* w, const KqActRow* act, int64_t K, float* y, int64_t ldy) {
  if (Type == kQ4_K) {
    q4k_row_dots<MR, BlockQ4_K>(w, act, K, y, ldy);
  } else if (Type == kQ5_K) {
    q4k_row_dots<MR, BlockQ5_K>(w, act, K, y, ldy);
  } else {
    q6k_row_dots<MR>(w, act, K, y, ldy);
  }
}

template <int Type>
void kq_tile(const MatmulTile& t) {
  for (int64_t m0 = 0; m0 < t.M; m0 += kKqRowBlock) {
    const int64_t m1 = min64(t.M, m0 + kKqRowBlock);
    for (int64_t n = t.n0; n < t.n1; ++n) {
      const uint8_t* w = t.w + n * t.w_row_bytes;
      int64_t m = m0;
      for (; m < m1; m += 4) {
        const int rows = static_cast<int>(min64(4, m1 - m));
        const KqActRow act[4] = {
            KqActRow(t.act + m * t.act_stride, t.K),
            KqActRow(t.act + min64(m + 1, m1 - 1) * t.act_stride, t.K),
            KqActRow(t.act + min64(m + 2, m1 - 1) * t.act_stride, t.K),
            KqActRow(t.act + min64(m + 3, m1 - 1) * t.act_stride, t.K),
        };
        float* y = t.y + m * t.ldy + n;
        switch (rows) {
          case 4: kq_row_dots<4, Type>(w, act, t.K, y, t.ldy); break;
          case 3: kq_row_dots<3, Type>(w, act, t.K, y, t.ldy); break;
          case 2: kq_row_dots<2, Type>(w, act, t.K, y, t.ldy); break;
          default: kq_row_dots<1, Type>(w, act, t.K, y, t.ldy); break;
        }
      }
    }
  }
}

size_t kq_scratch_bytes(int64_t) { return 64; }
