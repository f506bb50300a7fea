// LoRA q8 kernels for AVX512-VNNI: 8-bit weights times 8-bit activations (kernels.h kLoraQ8Block), 64 products per
// VPDPBUSD. VPDPBUSD multiplies unsigned by signed bytes: q8 stores the weights offset by 128 (lora.h), so each dot
// product comes out 128 * (the sum of its activations) too large, and starts from minus that instead. Include
// inside an anonymous namespace of a translation unit compiled for avx512f/bw/vl/vnni, after simd_avx512.h.
//
// Down: per row, x quantized once per block of 32 (the bits of lora_quantize_block: the same absmax, the same
// 127 / absmax, products rounded to nearest even); per k and 64-element chunk, one integer dot product whose lanes
// 0-7 belong to the chunk's first block and 8-15 to its second, scaled by their block's scale into a float
// accumulator, whose lanes are summed by reduce_add at the end; then the row prepared for the up-projection
// (kernels.h lora_q8_prepare_row). Up: per 16 outputs and block of 32 k, the k in groups of four (Bt's q8 layout)
// through one VPDPBUSD each, the block's sum scaled into y by one fused multiply-add, blocks in ascending order.
// Each row alone, in a fixed order: batch invariant.

// 64 activations [i0, i0 + 64) of v quantized (zeros past n), the scales of their two blocks into s[0], s[1].
inline __m512i lora_q8_quantize64(const float* v, int64_t i0, int64_t n, float* s) {
  __m512 x[4];
  if (i0 + 64 <= n) {
    for (int j = 0; j < 4; ++j) x[j] = _mm512_loadu_ps(v + i0 + 16 * j);
  } else {
    for (int j = 0; j < 4; ++j) x[j] = Avx512::load_partial(v + i0 + 16 * j, std::max<int64_t>(0, std::min<int64_t>(16, n - i0 - 16 * j)));
  }
  // Both blocks' largest magnitudes in one reduction: block 0's in the low 256 bits, block 1's in the high.
  const __m512 m0 = _mm512_max_ps(_mm512_abs_ps(x[0]), _mm512_abs_ps(x[1]));
  const __m512 m1 = _mm512_max_ps(_mm512_abs_ps(x[2]), _mm512_abs_ps(x[3]));
  __m512 m = _mm512_max_ps(_mm512_shuffle_f32x4(m0, m1, 0x44), _mm512_shuffle_f32x4(m0, m1, 0xEE));  // 128-bit lanes
  m = _mm512_max_ps(m, _mm512_shuffle_f32x4(m, m, 0xB1));  // (m0 lanes 0-1 | m1 lanes 0-1) -> each pair's max
  m = _mm512_max_ps(m, _mm512_permute_ps(m, 0x4E));
  m = _mm512_max_ps(m, _mm512_permute_ps(m, 0xB1));
  const float absmax[2] = {_mm512_cvtss_f32(m), _mm512_cvtss_f32(_mm512_shuffle_f32x4(m, m, 0xAA))};
  __m128i q[4];
  for (int h = 0; h < 2; ++h) {
    const __m512 inv = _mm512_set1_ps(absmax[h] > 0.0f ? 127.0f / absmax[h] : 0.0f);
    s[h] = absmax[h] / 127.0f;
    q[2 * h] = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x[2 * h], inv)));
    q[2 * h + 1] = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x[2 * h + 1], inv)));
  }
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(q[0]), q[1], 1)),
                            _mm256_inserti128_si256(_mm256_castsi128_si256(q[2]), q[3], 1), 1);
}

void avx512_lora_down_q8(const LoraMatrixView& m, const float* x, int64_t ldx, const int32_t* rows, int64_t n, float* u) {
  const int64_t in = m.in, chunks = div_ceil(in, 64), stride = lora_u_stride(kLoraQ8, m.rank);
  const __mmask64 tail = in % 64 == 0 ? ~__mmask64{0} : (__mmask64{1} << (in % 64)) - 1;
  // Per chunk: the quantized activations, minus 128 times their sums (per 32-bit lane), and the block scales
  // (the first block's 8 times, then the second's). Bytes, not __m512i: a vector's storage need not be aligned.
  thread_local std::vector<uint8_t> buffer;
  buffer.resize(static_cast<size_t>(chunks) * 192);
  uint8_t* const quants = buffer.data();  // plain pointers from here: each thread_local use is a call to find it
  uint8_t* const offsets = quants + chunks * 64;
  float* const scales = reinterpret_cast<float*>(offsets + chunks * 64);
  const __m512i k128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + static_cast<int64_t>(rows[r]) * ldx;
    for (int64_t c = 0; c < chunks; ++c) {
      float s[2];
      const __m512i q = lora_q8_quantize64(xr, c * 64, in, s);
      _mm512_storeu_si512(quants + c * 64, q);
      _mm512_storeu_si512(offsets + c * 64, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, q)));
      _mm512_storeu_ps(scales + c * 16, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s[0]), _mm512_set1_ps(s[1])));
    }
    for (int64_t k0 = 0; k0 < m.rank; k0 += 4) {
      const int kb = static_cast<int>(std::min<int64_t>(4, m.rank - k0));
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      const uint8_t* a = m.a + k0 * in;
      for (int64_t c = 0; c < chunks; ++c) {
        const __mmask64 load = c + 1 == chunks ? tail : ~__mmask64{0};
        const __m512i q = _mm512_loadu_si512(quants + c * 64);
        const __m512i offset = _mm512_loadu_si512(offsets + c * 64);
        const __m512 sc = _mm512_loadu_ps(scales + c * 16);
        for (int j = 0; j < kb; ++j) {
          // Past the row's end the load gives zeros: weight -128 times an activation of 0 (and no offset for it).
          const __m512i dot = _mm512_dpbusd_epi32(offset, _mm512_maskz_loadu_epi8(load, a + j * in + c * 64), q);
          acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[j]);
        }
      }
      for (int j = 0; j < kb; ++j) u[r * stride + k0 + j] = m.a_scale[k0 + j] * Avx512::reduce_add(acc[j]);
    }
    lora_q8_prepare_row(m.bt_scale, m.rank, u + r * stride);
  }
}

// One row's outputs [o0, o1) for a rank of at most 32 (one block) in G groups of four: the row's quantized values
// held in registers across the columns.
template <int G>
inline void avx512_lora_up_q8_row(const uint8_t* bt, int64_t block_bytes, const uint8_t* prepared, float factor,
                                  float* yr, int64_t o0, int64_t o1) {
  __m512i q[G];
  for (int g = 0; g < G; ++g) {
    int32_t quad;
    std::memcpy(&quad, prepared + g * 4, 4);
    q[g] = _mm512_set1_epi32(quad);
  }
  int32_t offset;
  std::memcpy(&offset, prepared + G * 4, 4);
  const __m512i start = _mm512_set1_epi32(offset);
  const __m512 vfactor = _mm512_set1_ps(factor);
  for (int64_t o = o0; o < o1; o += 16) {
    const uint8_t* column = bt + (o / kLoraBtBlock) * block_bytes + (o % kLoraBtBlock) * 4;
    __m512i dot = start;
    for (int g = 0; g < G; ++g) dot = _mm512_dpbusd_epi32(dot, _mm512_loadu_si512(column + g * 4 * kLoraBtBlock), q[g]);
    const __mmask16 lanes = Avx512::tail_mask(o1 - o);
    _mm512_mask_storeu_ps(yr + o, lanes, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), vfactor, _mm512_maskz_loadu_ps(lanes, yr + o)));
  }
}

void avx512_lora_up_q8(const LoraMatrixView& m, const float* u, const int32_t* rows, int64_t n, float scale, float* y,
                       int64_t ldy, int64_t o0, int64_t o1, float* scratch) {
  const int64_t rank = m.rank, stride = lora_u_stride(kLoraQ8, rank);
  const int64_t groups = div_ceil(rank, 4), blocks = div_ceil(rank, kLoraQ8Block);
  constexpr int64_t kGroupsPerBlock = kLoraQ8Block / 4;
  const int64_t block_bytes = lora_bt_rows(kLoraQ8, rank) * kLoraBtBlock;
  // Rows outer: the rows of y may lie a multiple of 4 KiB apart, and 16 of them at once would contend for one L1
  // set; the columns of Bt they all read (at most kLoraUpChunk) stay in L1.
  for (int64_t r = 0; r < n; ++r) {
    // The row as its down-projection prepared it (lora_q8_prepare_row).
    const uint8_t* prepared = reinterpret_cast<const uint8_t*>(u + r * stride + rank);
    float* yr = y + static_cast<int64_t>(rows[r]) * ldy;
    if (blocks == 1) {
      float block_scale;
      std::memcpy(&block_scale, prepared + (groups + 1) * 4, 4);
      const float factor = scale * block_scale;
      switch (groups) {
        case 1: avx512_lora_up_q8_row<1>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
        case 2: avx512_lora_up_q8_row<2>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
        case 3: avx512_lora_up_q8_row<3>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
        case 4: avx512_lora_up_q8_row<4>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
        case 5: avx512_lora_up_q8_row<5>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
        case 6: avx512_lora_up_q8_row<6>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
        case 7: avx512_lora_up_q8_row<7>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
        default: avx512_lora_up_q8_row<8>(m.bt, block_bytes, prepared, factor, yr, o0, o1); break;
      }
      continue;
    }
    for (int64_t o = o0; o < o1; o += 16) {
      const uint8_t* column = m.bt + (o / kLoraBtBlock) * block_bytes + (o % kLoraBtBlock) * 4;
      const __mmask16 lanes = Avx512::tail_mask(o1 - o);
      __m512 yv = _mm512_maskz_loadu_ps(lanes, yr + o);
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t offset;
        float block_scale;
        std::memcpy(&offset, prepared + (groups + b) * 4, 4);
        std::memcpy(&block_scale, prepared + (groups + blocks + b) * 4, 4);
        __m512i dot = _mm512_set1_epi32(offset);
        for (int64_t g = b * kGroupsPerBlock; g < std::min(groups, (b + 1) * kGroupsPerBlock); ++g) {
          int32_t quad;
          std::memcpy(&quad, prepared + g * 4, 4);
          dot = _mm512_dpbusd_epi32(dot, _mm512_loadu_si512(column + g * 4 * kLoraBtBlock), _mm512_set1_epi32(quad));
        }
        yv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(scale * block_scale), yv);
      }
      _mm512_mask_storeu_ps(yr + o, lanes, yv);
    }
  }
}
