// LoRA q8 kernels for AVX2 (no VNNI): the arithmetic of lora_q8_avx512.h with VPMADDUBSW, which multiplies
// unsigned by signed bytes into 16-bit pair sums that saturate. The stored weights (offset by 128) are turned back
// into signed bytes, and the activations' signs moved onto them (VPSIGNB) so that the unsigned operand is a
// magnitude: a pair sum is then at most 2 * 127 * 127, no saturation, and the integer sums are exact as with VNNI
// (no offset to take off). Include inside an anonymous namespace of a translation unit compiled for avx2/fma, after
// simd_avx2.h.

// 32 activations [i0, i0 + 32) of v quantized (zeros past n) into q (the bits of lora_quantize_block); returns the
// block's scale.
inline float lora_q8_quantize32_avx2(const float* v, int64_t i0, int64_t n, int8_t* q) {
  __m256 x[4];
  for (int j = 0; j < 4; ++j) {
    const int64_t count = std::max<int64_t>(0, std::min<int64_t>(8, n - i0 - 8 * j));
    x[j] = count == 8 ? _mm256_loadu_ps(v + i0 + 8 * j) : count > 0 ? Avx2::load_partial(v + i0 + 8 * j, count) : _mm256_setzero_ps();
  }
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1])),
                           _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float absmax = _mm_cvtss_f32(h);
  const __m256 inv = _mm256_set1_ps(absmax > 0.0f ? 127.0f / absmax : 0.0f);
  __m256i i[4];
  for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(x[j], inv));
  // packs work within 128-bit lanes: the bytes come out in 4-element groups 0, 2, 4, 6, 1, 3, 5, 7.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return absmax / 127.0f;
}

void avx2_lora_down_q8(const LoraMatrixView& m, const float* x, int64_t ldx, const int32_t* rows, int64_t n, float* u) {
  const int64_t in = m.in, blocks = div_ceil(in, kLoraQ8Block), stride = lora_u_stride(kLoraQ8, m.rank);
  thread_local std::vector<int8_t> buffer;
  thread_local std::vector<float> scale;
  buffer.resize(static_cast<size_t>(blocks) * 64 + 32);
  scale.resize(static_cast<size_t>(blocks));
  int8_t* const quants = buffer.data();  // plain pointers from here: each thread_local use is a call to find it
  int8_t* const magnitudes = quants + blocks * 32;
  int8_t* const last = magnitudes + blocks * 32;  // the last block of a row of A, padded with zero weights
  float* const scales = scale.data();
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t full = in / kLoraQ8Block;
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + static_cast<int64_t>(rows[r]) * ldx;
    for (int64_t b = 0; b < blocks; ++b) {
      scales[b] = lora_q8_quantize32_avx2(xr, b * 32, in, quants + b * 32);
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + b * 32));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(magnitudes + b * 32), _mm256_abs_epi8(q));
    }
    for (int64_t k = 0; k < m.rank; ++k) {
      const uint8_t* a = m.a + k * in;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* src = a + b * 32;
        if (b == full) {  // past the row's end: stored zero weights (128), times activations of 0
          std::memset(last, static_cast<char>(0x80), 32);
          std::memcpy(last, src, static_cast<size_t>(in - b * 32));
          src = reinterpret_cast<const uint8_t*>(last);
        }
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + b * 32));
        const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)), flip);
        const __m256i magnitude = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(magnitudes + b * 32));
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w, q));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), _mm256_set1_ps(scales[b]), acc);
      }
      u[r * stride + k] = m.a_scale[k] * Avx2::reduce_add(acc);
    }
    lora_q8_prepare_row(m.bt_scale, m.rank, u + r * stride);
  }
}

// One row's outputs [o0, o1) for a rank of at most 32 (one block) in G groups of four: the row's quantized values
// and their magnitudes held in registers across the columns.
template <int G>
inline void avx2_lora_up_q8_row(const uint8_t* bt, int64_t block_bytes, const uint8_t* prepared, float factor, float* yr,
                                int64_t o0, int64_t o1) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i q[G], magnitude[G];
  for (int g = 0; g < G; ++g) {
    int32_t quad;
    std::memcpy(&quad, prepared + g * 4, 4);
    q[g] = _mm256_set1_epi32(quad);
    magnitude[g] = _mm256_abs_epi8(q[g]);
  }
  const __m256 vfactor = _mm256_set1_ps(factor);
  for (int64_t o = o0; o < o1; o += 8) {
    const uint8_t* column = bt + (o / kLoraBtBlock) * block_bytes + (o % kLoraBtBlock) * 4;
    __m256i dot = _mm256_setzero_si256();
    for (int g = 0; g < G; ++g) {
      const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(column + g * 4 * kLoraBtBlock)), flip);
      dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[g], _mm256_sign_epi8(w, q[g])), ones));
    }
    const int64_t lanes = std::min<int64_t>(8, o1 - o);
    const __m256 yv = lanes == 8 ? _mm256_loadu_ps(yr + o) : Avx2::load_partial(yr + o, lanes);
    const __m256 out = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), vfactor, yv);
    if (lanes == 8) _mm256_storeu_ps(yr + o, out);
    else Avx2::store_partial(yr + o, out, lanes);
  }
}

void avx2_lora_up_q8(const LoraMatrixView& m, const float* u, const int32_t* rows, int64_t n, float scale, float* y,
                     int64_t ldy, int64_t o0, int64_t o1, float* scratch) {
  const int64_t rank = m.rank, stride = lora_u_stride(kLoraQ8, rank);
  const int64_t groups = div_ceil(rank, 4), blocks = div_ceil(rank, kLoraQ8Block);
  constexpr int64_t kGroupsPerBlock = kLoraQ8Block / 4;
  const int64_t block_bytes = lora_bt_rows(kLoraQ8, rank) * kLoraBtBlock;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t r = 0; r < n; ++r) {
    // The row as its down-projection prepared it (lora_q8_prepare_row); its offsets are for VNNI's unsigned
    // weights and unused here.
    const uint8_t* prepared = reinterpret_cast<const uint8_t*>(u + r * stride + rank);
    float* yr = y + static_cast<int64_t>(rows[r]) * ldy;
    if (blocks == 1) {
      float block_scale;
      std::memcpy(&block_scale, prepared + (groups + 1) * 4, 4);
      const float factor = scale * block_scale;
      switch (groups) {
        case 1: avx2_lora_up_q8_row<1>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
        case 2: avx2_lora_up_q8_row<2>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
        case 3: avx2_lora_up_q8_row<3>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
        case 4: avx2_lora_up_q8_row<4>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
        case 5: avx2_lora_up_q8_row<5>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
        case 6: avx2_lora_up_q8_row<6>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
        case 7: avx2_lora_up_q8_row<7>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
        default: avx2_lora_up_q8_row<8>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
      }
      continue;
    }
    for (int64_t o = o0; o < o1; o += 8) {
      const uint8_t* column = m.bt + (o / kLoraBtBlock) * block_bytes + (o % kLoraBtBlock) * 4;
      const int64_t lanes = std::min<int64_t>(8, o1 - o);
      __m256 yv = Avx2::load_partial(yr + o, lanes);
      for (int64_t b = 0; b < blocks; ++b) {
        float block_scale;
        std::memcpy(&block_scale, prepared + (groups + blocks + b) * 4, 4);
        __m256i dot = _mm256_setzero_si256();
        for (int64_t g = b * kGroupsPerBlock; g < std::min(groups, (b + 1) * kGroupsPerBlock); ++g) {
          int32_t quad;
          std::memcpy(&quad, prepared + g * 4, 4);
          const __m256i q = _mm256_set1_epi32(quad);
          const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(column + g * 4 * kLoraBtBlock)), flip);
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(w, q)), ones));
        }
        yv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale * block_scale), yv);
      }
      Avx2::store_partial(yr + o, yv, lanes);
    }
  }
}
