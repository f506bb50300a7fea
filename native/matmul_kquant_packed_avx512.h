// Load-time packed Q4_K / Q5_K / Q6_K for AVX512-VNNI, included inside matmul_avx512.cc's target region after
// matmul_kquant_simd.h (whose activation format and arithmetic rule it shares).
//
// Layout: slabs of 32 weight rows (kPackedPanelRows), two halves of 16; per super-block of 256 columns, in order:
//   quants: for each pair p (0..3) of sub-blocks and each dword i (0..7) of the pair's 32 ggml nibble bytes, the
//           vector of rows 0-15 (lane r = dword i of row r: the low nibbles are elements 64p + 4i .. + 3 of
//           sub-block 2p, the high nibbles elements 64p + 32 + 4i .. + 3 of sub-block 2p + 1), then rows 16-31;
//           4096 bytes
//   Q5_K only, fifth bits: for each dword i of the 32 qh bytes, the vector of rows 0-15 then 16-31 (bit 2p / 2p + 1
//           of byte t of lane r: element 4i + t of sub-blocks 2p / 2p + 1); 1024 bytes
//   the 8 sub-block scales, one byte per row: [sub-block][row 0..31]; 256 bytes; then the 8 mins, one byte per row
//           and sub-block, by pairs of sub-blocks: [pair jp 0..3][row 0..31][min 2jp, min 2jp + 1]; 256 bytes
//   d then dmin of the 32 rows in f16; 128 bytes
// 148 bytes per row and super-block for Q4_K (ggml: 144), 180 for Q5_K (176).
// Q6_K, per super-block: for each half h2 (0, 1) of the 256 columns, each 32-byte run c (0, 1) of the half's 64 ql
// bytes and each dword i (0..7) of the run, the vector of rows 0-15 then 16-31 (low nibbles: elements 128 h2 + 32 c
// + 4i .. + 3, high nibbles: the same + 64), 4096 bytes; for each h2 and dword i of the half's 32 qh bytes, rows
// 0-15 then 16-31 (bit pair k of byte t: element 128 h2 + 32 k + 4i + t), 2048 bytes; the 16 int8 scales,
// [group][row 0..31], 512 bytes; d of the 32 rows in f16, 64 bytes: 210 bytes per row and super-block, as ggml.
// The kernels take one half's lines (rows 0-15) over a super-block, then the other's: the slab is one stream per
// thread in address order at the granularity of super-blocks, not of lines. (Kernels reading both halves' lines of
// a dword together, in strict address order, measured slower for Q5_K and Q6_K decode from DRAM, 10-11 GB/s against
// 13-16 on one thread, and within noise for Q4_K.)
//
// The microkernel takes MR activation rows x 32 weight rows: per dword of a sub-block pair, VPDPBUSD of the
// unsigned 4- or 5-bit quants of 16 rows with the broadcast 4 activation bytes advances 16 sub-block dot products
// by 4 multiply-adds (the ggml-row kernel's VPMADDUBSW + VPMADDWD take two instructions for 32 multiply-adds of one
// row); the sub-block dot products are multiplied by the rows' integer scales (VPMULLD) into the exact super-block
// sum S, and per super-block the float steps of the rule in matmul_kquant_simd.h run on 16 lanes at once: the bits
// of the ggml-row kernel for every output. The mins term Mn = sum over sub-blocks j of min_j x (activation sum of
// sub-block j) is one small dot product per super-block, half and activation row: four VPDPWSSD of the 16 rows'
// int16 pairs (min 2jp, min 2jp + 1), widened from the pair-interleaved bytes, against the broadcast int16 pair of
// the activation's sub-block sums (stored with the quantized activations, so they are computed once per row, not
// per weight slab). Mn <= 8 x 63 x 32 x 127 is exact in int32, the same integer as the ggml-row kernel's.

// Decode (one or two activation rows) is bound by the weights' arrival from DRAM, but a Q5_K / Q6_K super-block
// costs 10-12 instructions per cache line, so the out-of-order window covers too few lines to keep enough misses in
// flight (Q8_0's slabs cost ~3 per line). Their decode kernels therefore request, spread over a super-block's work
// in `parts` pieces, the lines of the super-block kKqPrefetchBlocks ahead into L2. Past a slab's end that is the
// next slab, which the same thread reads next within its tile range (and past the matrix, a harmless request).
// Q4_K, cheaper per line, streamed slower with the requests on an AMD EPYC (one thread from DRAM: 16-18 GB/s against
// 21) and faster on a Xeon (a Q4_K_M 110M model's decode step 10-22% shorter, quiet, one or two threads): it requests
// them where decode_prefetch_ahead() says so (cpu.h), else leaves them to the hardware prefetchers.
constexpr int kKqPrefetchBlocks = 2;
template <size_t kBlock, int parts>
inline void kq_prefetch_part(const uint8_t* block, int part) {
  constexpr size_t kPart = (kBlock / parts + 63) / 64 * 64;
  const char* p = reinterpret_cast<const char*>(block) + kKqPrefetchBlocks * kBlock + part * kPart;
  for (size_t off = 0; off < kPart; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

template <int Type>
constexpr size_t kq_slab_block_bytes() {
  return Type == kQ6_K ? 4096 + 2048 + 512 + 64 : (Type == kQ5_K ? 4096 + 1024 : 4096) + 256 + 256 + 128;
}
constexpr int kKqPrefetchMaxRows = 2;

// The loops every packed microkernel shares: MR activation rows against the 32 rows of one slab, super-block by
// super-block and, within one, the half of rows 0-15 then the half of rows 16-31. block(b, sb, h, rows, acc) adds
// super-block sb (its slab bytes at b) of half h to the 16 accumulators acc[i] of activation row i by the rule of
// matmul_kquant_simd.h. cols (<= 32) outputs of each activation row are stored.
template <int MR, size_t kBlock, class Block>
inline void kq_slab_rows(const uint8_t* act, size_t act_stride, int64_t K, const uint8_t* slab, float* y, int64_t ldy,
                         int64_t cols, Block&& block) {
  __m512 acc[2][MR];
  KqActRow rows[MR];
  for (int i = 0; i < MR; ++i) {
    rows[i] = KqActRow(act + i * act_stride, K);
    acc[0][i] = acc[1][i] = _mm512_setzero_ps();
  }
  for (int64_t sb = 0; sb < K / 256; ++sb, slab += kBlock) {
    for (int h = 0; h < 2; ++h) block(slab, sb, h, rows, acc[h]);
  }
  for (int i = 0; i < MR; ++i) {
    Avx512::store_partial(y + i * ldy, acc[0][i], cols);
    if (cols > 16) Avx512::store_partial(y + i * ldy + 16, acc[1][i], cols - 16);
  }
}

void q6k_pack(const uint8_t* w, int64_t N, int64_t K, int64_t slab_begin, int64_t slab_end, uint8_t* out) {
  constexpr size_t kBlock = kq_slab_block_bytes<kQ6_K>();
  const int64_t nsb = K / 256;
  const size_t row_bytes_ = static_cast<size_t>(nsb) * sizeof(BlockQ6_K);
  for (int64_t slab = slab_begin; slab < slab_end; ++slab) {
    uint8_t* dst = out + static_cast<size_t>(slab) * nsb * kBlock;
    for (int64_t sb = 0; sb < nsb; ++sb, dst += kBlock) {
      std::memset(dst, 0, kBlock);
      for (int r = 0; r < kPackedPanelRows; ++r) {
        const int64_t row = slab * kPackedPanelRows + r;
        if (row >= N) break;
        const BlockQ6_K* blk = reinterpret_cast<const BlockQ6_K*>(w + row * row_bytes_) + sb;
        const size_t lane = 64 * (r / 16) + 4 * (r % 16);
        for (int h2 = 0; h2 < 2; ++h2) {
          for (int c = 0; c < 2; ++c) {
            for (int i = 0; i < 8; ++i) {
              std::memcpy(dst + 128 * (16 * h2 + 8 * c + i) + lane, blk->ql + 64 * h2 + 32 * c + 4 * i, 4);
            }
          }
          for (int i = 0; i < 8; ++i) std::memcpy(dst + 4096 + 128 * (8 * h2 + i) + lane, blk->qh + 32 * h2 + 4 * i, 4);
        }
        for (int g = 0; g < 16; ++g) dst[6144 + 32 * g + r] = static_cast<uint8_t>(blk->scales[g]);
        std::memcpy(dst + 6656 + 2 * r, &blk->d, 2);
      }
    }
  }
}

// Q6_K unpacking. Bit pair k (0..3) of each high-bits byte moved to bits 4-5 of its byte and the rest cleared: one
// 16-bit shift (none for k = 2) and one AND, no bit crossing a byte on the way. (Shifting the pair down to bits
// 0-1, masking and shifting it back up took two shifts and, for the high quants, three.)
inline __m512i q6k_high_pair(__m512i bits, int k) {
  const __m512i pair = _mm512_set1_epi8(0x30);
  switch (k) {
    case 0: return _mm512_and_si512(_mm512_slli_epi16(bits, 4), pair);
    case 1: return _mm512_and_si512(_mm512_slli_epi16(bits, 2), pair);
    case 2: return _mm512_and_si512(bits, pair);
    default: return _mm512_and_si512(_mm512_srli_epi16(bits, 2), pair);
  }
}
// The 6-bit quants: bits 0-3 from nib (its low nibbles), bits 4-7 from high (bits 6-7 clear), one VPTERNLOGD
// (0xE4: C ? A : B with C = 0x0F in every byte).
inline __m512i q6k_join(__m512i nib, __m512i high, __m512i low4) {
  return _mm512_ternarylogic_epi32(nib, high, low4, 0xE4);
}

// Q6_K with up to 8 activation rows: the unpacking of a weight vector (6-7 instructions for its low and high
// quants) is shared by MR rows of VPDPBUSD, so more rows per pass cost fewer instructions per multiply-add. To keep
// 2 x MR dot products in registers, each sub-block pair's 8 dwords go in two passes of 4 (one 16-element group of
// the low quants and one of the high quants per pass) rather than one pass over four groups. S is the same exact
// int32 sum (integer additions in another order), so every output keeps its bits.
template <int MR>
inline void q6k_packed_microkernel_wide(const uint8_t* act, size_t act_stride, int64_t K, const uint8_t* slab,
                                        float* y, int64_t ldy, int64_t cols) {
  constexpr size_t kBlock = kq_slab_block_bytes<kQ6_K>();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  kq_slab_rows<MR, kBlock>(act, act_stride, K, slab, y, ldy, cols, [&](const uint8_t* blk, int64_t sb, int h,
                                                                       const KqActRow* rows, __m512* acc) {
    __m512i s[MR];
    for (int i = 0; i < MR; ++i) s[i] = _mm512_setzero_si512();
    for (int h2 = 0; h2 < 2; ++h2) {
      for (int c = 0; c < 2; ++c) {
        #pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          // Groups g (low quants, elements 128 h2 + 32 c + 16 half ..) and g + 4 (high quants, the same + 64).
          const int g = 8 * h2 + 2 * c + half;
          if (MR <= kKqPrefetchMaxRows) kq_prefetch_part<kBlock, 16>(blk, 8 * h + 4 * h2 + 2 * c + half);
          __m512i dot_lo[MR], dot_hi[MR];
          for (int i = 0; i < MR; ++i) {
            dot_lo[i] = _mm512_set1_epi32(-32 * rows[i].bsums[16 * sb + g]);
            dot_hi[i] = _mm512_set1_epi32(-32 * rows[i].bsums[16 * sb + g + 4]);
          }
          #pragma GCC unroll 4
          for (int q4 = 0; q4 < 4; ++q4) {
            const int q = 4 * half + q4;
            const __m512i x = _mm512_load_si512(blk + 128 * (16 * h2 + 8 * c + q) + 64 * h);
            const __m512i bits = _mm512_load_si512(blk + 4096 + 128 * (8 * h2 + q) + 64 * h);
            const __m512i lo = q6k_join(x, q6k_high_pair(bits, c), low4);
            const __m512i hi = q6k_join(_mm512_srli_epi16(x, 4), q6k_high_pair(bits, c + 2), low4);
            for (int i = 0; i < MR; ++i) {
              const int8_t* a = rows[i].q + 256 * sb + 128 * h2 + 32 * c + 4 * q;
              int32_t a_lo, a_hi;
              std::memcpy(&a_lo, a, 4);
              std::memcpy(&a_hi, a + 64, 4);
              dot_lo[i] = _mm512_dpbusd_epi32(dot_lo[i], lo, _mm512_set1_epi32(a_lo));
              dot_hi[i] = _mm512_dpbusd_epi32(dot_hi[i], hi, _mm512_set1_epi32(a_hi));
            }
          }
          const __m512i sc_lo =
              _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(blk + 6144 + 32 * g + 16 * h)));
          const __m512i sc_hi = _mm512_cvtepi8_epi32(
              _mm_load_si128(reinterpret_cast<const __m128i*>(blk + 6144 + 32 * (g + 4) + 16 * h)));
          for (int i = 0; i < MR; ++i) {
            s[i] = _mm512_add_epi32(s[i], _mm512_add_epi32(_mm512_mullo_epi32(dot_lo[i], sc_lo),
                                                           _mm512_mullo_epi32(dot_hi[i], sc_hi)));
          }
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(blk + 6656 + 32 * h)));
    for (int i = 0; i < MR; ++i) {
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(d, _mm512_set1_ps(rows[i].d[sb])), acc[i]);
    }
  });
}

template <int Type>
size_t kq_packed_bytes(int64_t N, int64_t K) {
  return static_cast<size_t>(packed_panel_count(N)) * static_cast<size_t>(K / 256) * kq_slab_block_bytes<Type>();
}

template <int Type>
void kq_pack(const uint8_t* w, int64_t N, int64_t K, int64_t slab_begin, int64_t slab_end, uint8_t* out) {
  if (Type == kQ6_K) return q6k_pack(w, N, K, slab_begin, slab_end, out);
  using Block = typename std::conditional<Type == kQ5_K, BlockQ5_K, BlockQ4_K>::type;
  constexpr size_t kBlock = kq_slab_block_bytes<Type>();
  constexpr size_t kScales = Type == kQ5_K ? 5120 : 4096;
  const int64_t nsb = K / 256;
  const size_t row_bytes_ = static_cast<size_t>(nsb) * sizeof(Block);
  for (int64_t slab = slab_begin; slab < slab_end; ++slab) {
    uint8_t* dst = out + static_cast<size_t>(slab) * nsb * kBlock;
    for (int64_t sb = 0; sb < nsb; ++sb, dst += kBlock) {
      std::memset(dst, 0, kBlock);  // rows past the matrix stay zero (scales 0)
      for (int r = 0; r < kPackedPanelRows; ++r) {
        const int64_t row = slab * kPackedPanelRows + r;
        if (row >= N) break;
        const Block* blk = reinterpret_cast<const Block*>(w + row * row_bytes_) + sb;
        const size_t lane = 64 * (r / 16) + 4 * (r % 16);
        for (int p = 0; p < 4; ++p) {
          for (int i = 0; i < 8; ++i) std::memcpy(dst + 128 * (8 * p + i) + lane, blk->qs + 32 * p + 4 * i, 4);
        }
        if (Type == kQ5_K) {
          const BlockQ5_K* b5 = reinterpret_cast<const BlockQ5_K*>(blk);
          for (int i = 0; i < 8; ++i) std::memcpy(dst + 4096 + 128 * i + lane, b5->qh + 4 * i, 4);
        }
        for (int j = 0; j < 8; ++j) {
          uint8_t sc, mn;
          q4k_scale_min(j, blk->scales, &sc, &mn);
          dst[kScales + 32 * j + r] = sc;
          dst[kScales + 256 + 64 * (j / 2) + 2 * r + j % 2] = mn;
        }
        std::memcpy(dst + kScales + 512 + 2 * r, &blk->d, 2);
        std::memcpy(dst + kScales + 576 + 2 * r, &blk->dmin, 2);
      }
    }
  }
}

// MR activation rows x the 32 rows of one slab, all super-blocks; cols (<= 32) outputs of each row are stored.
template <int Type, int MR>
inline void kq_packed_microkernel(const uint8_t* act, size_t act_stride, int64_t K, const uint8_t* slab, float* y,
                                  int64_t ldy, int64_t cols) {
  constexpr size_t kBlock = kq_slab_block_bytes<Type>();
  constexpr size_t kScales = Type == kQ5_K ? 5120 : 4096;
  const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  const bool prefetch = MR <= kKqPrefetchMaxRows && (Type != kQ4_K || decode_prefetch_ahead());
  kq_slab_rows<MR, kBlock>(act, act_stride, K, slab, y, ldy, cols, [&](const uint8_t* blk, int64_t sb, int h,
                                                                       const KqActRow* rows, __m512* acc) {
    __m512i s[MR];
    for (int i = 0; i < MR; ++i) s[i] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      if (prefetch) kq_prefetch_part<kBlock, 8>(blk, 4 * h + p);
      __m512i lo_dot[MR], hi_dot[MR];
      for (int i = 0; i < MR; ++i) lo_dot[i] = hi_dot[i] = _mm512_setzero_si512();
      for (int q = 0; q < 8; ++q) {
        const __m512i x = _mm512_load_si512(blk + 128 * (8 * p + q) + 64 * h);
        __m512i lo = _mm512_and_si512(x, low4), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), low4);
        if (Type == kQ5_K) {
          const __m512i bits = _mm512_srli_epi16(_mm512_load_si512(blk + 4096 + 128 * q + 64 * h), 2 * p);
          lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(bits, 4), bit4));
          hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi16(bits, 3), bit4));
        }
        for (int i = 0; i < MR; ++i) {
          int32_t a_lo, a_hi;
          std::memcpy(&a_lo, rows[i].q + 256 * sb + 64 * p + 4 * q, 4);
          std::memcpy(&a_hi, rows[i].q + 256 * sb + 64 * p + 32 + 4 * q, 4);
          lo_dot[i] = _mm512_dpbusd_epi32(lo_dot[i], lo, _mm512_set1_epi32(a_lo));
          hi_dot[i] = _mm512_dpbusd_epi32(hi_dot[i], hi, _mm512_set1_epi32(a_hi));
        }
      }
      const __m512i sc_lo = _mm512_cvtepu8_epi32(
          _mm_load_si128(reinterpret_cast<const __m128i*>(blk + kScales + 32 * (2 * p) + 16 * h)));
      const __m512i sc_hi = _mm512_cvtepu8_epi32(
          _mm_load_si128(reinterpret_cast<const __m128i*>(blk + kScales + 32 * (2 * p + 1) + 16 * h)));
      for (int i = 0; i < MR; ++i) {
        s[i] = _mm512_add_epi32(s[i], _mm512_add_epi32(_mm512_mullo_epi32(lo_dot[i], sc_lo),
                                                       _mm512_mullo_epi32(hi_dot[i], sc_hi)));
      }
    }
    // Mn: per pair jp of sub-blocks, the 16 rows' int16 (min 2jp, min 2jp + 1) against the activation's int16
    // (sum 2jp, sum 2jp + 1), one VPDPWSSD per activation row.
    __m512i mn[MR];
    for (int i = 0; i < MR; ++i) mn[i] = _mm512_setzero_si512();
    for (int jp = 0; jp < 4; ++jp) {
      const __m512i m = _mm512_cvtepu8_epi16(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + kScales + 256 + 64 * jp + 32 * h)));
      for (int i = 0; i < MR; ++i) {
        int32_t sums;
        std::memcpy(&sums, rows[i].ssums + 8 * sb + 2 * jp, 4);
        mn[i] = _mm512_dpwssd_epi32(mn[i], m, _mm512_set1_epi32(sums));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(blk + kScales + 512 + 32 * h)));
    const __m512 dmin =
        _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(blk + kScales + 576 + 32 * h)));
    for (int i = 0; i < MR; ++i) {
      const __m512 da = _mm512_set1_ps(rows[i].d[sb]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(d, da), acc[i]);
      acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mn[i]), _mm512_mul_ps(dmin, da), acc[i]);
    }
  });
}

// Activation rows per pass. Q6_K's unpacking (11 instructions per weight vector when this was measured; 6-7 now) and Q5_K's (7) are shared by
// 8 rows of VPDPBUSD; Q4_K's (3) costs little next to the compiler's spills around 2 x 8 dot products, so it takes
// 4 (512 x 768 x 8192 on one thread, CPU ms: Q4_K 21.6-22.5 with 4 rows, 22.8-24.0 with 6, 26.8-27.3 with 8;
// Q5_K 28.2-30.0 with 8, 29.6-31.6 with 4).
template <int Type>
constexpr int kq_packed_mr() {
  return Type == kQ4_K ? 4 : 8;
}

// Q6_K's passes, one function per row count: inlined into the tile loop together (one function of ~3000
// instructions), the decode pass streamed a few percent slower from DRAM (docs/benchmarks.md). Q4_K's passes are
// faster inlined.
template <int MR>
__attribute__((noinline)) void q6k_packed_pass(const uint8_t* act, size_t act_stride, int64_t K, const uint8_t* slab,
                                               float* y, int64_t ldy, int64_t cols) {
  q6k_packed_microkernel_wide<MR>(act, act_stride, K, slab, y, ldy, cols);
}

template <int Type, int MR>
inline void kq_packed_pass(const MatmulTile& t, const uint8_t* slab, int64_t m, int64_t c0, int64_t cols) {
  const uint8_t* act = t.act + m * t.act_stride;
  float* y = t.y + m * t.ldy + c0;
  if constexpr (Type == kQ6_K) {
    q6k_packed_pass<MR>(act, t.act_stride, t.K, slab, y, t.ldy, cols);
  } else {
    kq_packed_microkernel<Type, MR>(act, t.act_stride, t.K, slab, y, t.ldy, cols);
  }
}

// A tile of a packed matrix: t.w is the packed layout, [n0, n1) starts on a slab. Per slab, the activation rows
// kq_packed_mr at a time, then 4, then the remainder.
template <int Type>
void kq_packed_tile(const MatmulTile& t) {
  constexpr int kMR = kq_packed_mr<Type>();
  const size_t slab_bytes = static_cast<size_t>(t.K / 256) * kq_slab_block_bytes<Type>();
  for (int64_t c0 = t.n0; c0 < t.n1; c0 += kPackedPanelRows) {
    const uint8_t* slab = t.w + (c0 / kPackedPanelRows) * slab_bytes;
    const int64_t cols = t.n1 - c0 < kPackedPanelRows ? t.n1 - c0 : kPackedPanelRows;
    int64_t m = 0;
    for (; t.M - m >= kMR; m += kMR) kq_packed_pass<Type, kMR>(t, slab, m, c0, cols);
    if (kMR > 4 && t.M - m >= 4) {
      kq_packed_pass<Type, 4>(t, slab, m, c0, cols);
      m += 4;
    }
    switch (t.M - m) {
      case 3: kq_packed_pass<Type, 3>(t, slab, m, c0, cols); break;
      case 2: kq_packed_pass<Type, 2>(t, slab, m, c0, cols); break;
      case 1: kq_packed_pass<Type, 1>(t, slab, m, c0, cols); break;
      default: break;
    }
  }
}
