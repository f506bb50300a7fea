// The AMX-INT8 Q8_0 / Q4_0 matmul, written once over a tile-operations type and built twice: with the real tile
// instructions (matmul_amx.cc, variant `amx`) and with the software model of them (matmul_amx_model.cc, variant
// `amx-model`, which runs on any AVX-512 CPU so the kernel can be checked where there is no AMX).
//
// Include only from those files: inside an anonymous namespace and a `#pragma GCC target` region that enables
// AVX-512 F/BW/VL/VNNI, F16C and FMA, after <immintrin.h>, kernels.h and amx_tile_model.h. The Tiles type provides
//   load_config(const AmxTileConfig&)           LDTILECFG
//   zero<T>(), load<T>(base, stride),           TILEZERO, TILELOADD, TILESTORED on tile T
//   store<T>(base, stride)
//   dpbsud<C, A, B>()                           TDPBSUD: C += A (signed bytes) . B (unsigned bytes)
//   release()                                   TILERELEASE
//
// The kernel reads the avx512 variant's load-time packed layout (matmul_avx512.cc, int8_pack) and its quantized
// activations (int8_quantize_act): a model's packed weights and the matmul driver's activation buffer are the same
// whichever of the two runs.
//
// Why the packed slabs are TDPBSUD's B operand as they are: TDPBSUD takes each row of A as dwords of 4 bytes, and
// B's row k holds, for each output column n, the 4 bytes that meet A's dword k. A slab block
// stores, for each group g of 4 quant bytes (g = 0..7 over the block's 32), the 64-byte vector holding bytes
// 4g..4g+3 of weight rows 0-15 (one dword per row), then the same for rows 16-31. So the 8 vectors of rows 0-15,
// 128 bytes apart, are an 8-row x 64-byte B tile for output columns 0-15 and a block's 32 activation bytes (8
// dwords) the matching A row; the vectors at +64 are the B tile of columns 16-31. Q8_0 slabs hold the quants plus
// 128 (unsigned); the activation format carries -128 * sum(a) per block, so correction + A.B is the exact signed
// dot product. Q4_0 slabs hold nibbles: line d of a block is dword d of the rows, its low nibbles group d and its
// high nibbles group d + 4, expanded here into a buffer in the Q8_0 order; the raw nibble q times a, started from
// -8 * sum(a), is the exact dot product with the weights q - 8 (as the avx512 kernel computes it).
//
// Per block, each 16-row A tile and the two B tiles give two 16 x 16 int32 C tiles (a block's exact sums), stored
// and then scaled and added with AVX-512 by exactly the avx512 microkernel's operations in its order: sum + the
// correction, converted to f32, FMA'd with (weight scale x activation scale) into the group sum, groups of 8 blocks
// added to the total. Every output therefore has the bits the avx512 GEMV, GEMM and packed kernels give it, for
// every M (batch invariance, matmul_avx512.cc). Fewer than kAmxMinRows rows go to the avx512 kernels themselves.

// Rows at which AMX takes over: one 16-row A tile is the smallest operand TDPBSUD fills. Below it every tile
// instruction, and the per-block store and reload of C, would do a full tile's work for a fraction of the rows,
// while the VNNI microkernel's cost shrinks with the rows (and decode, M <= 3, is bound by memory anyway). Not
// measured: no AMX hardware was available to time it.
constexpr int64_t kAmxMinRows = 16;

// Tiles: A0, A1 = activation rows 0-15 and 16-31 of a 32-row group (one block, 32 bytes per row); B0, B1 = the
// block's weights for output columns 0-15 and 16-31; Cij = A_i . B_j.
constexpr int kTileA0 = 0, kTileA1 = 1, kTileB0 = 2, kTileB1 = 3, kTileC00 = 4, kTileC01 = 5, kTileC10 = 6,
              kTileC11 = 7;

constexpr int64_t kAmxSlabRows = 32;
static_assert(kPackedPanelRows == kAmxSlabRows, "a packed slab is 32 weight rows: the two B tiles of a block");
static_assert(kMatmulTileRows % kAmxSlabRows == 0, "tiles start on a slab");

// The avx512 kernels this one hands small M to and borrows the packing of, per weight type (set at registration).
struct AmxFallback {
  void (*tile)(const MatmulTile& t) = nullptr;
  void (*packed_tile)(const MatmulTile& t) = nullptr;
  void (*pack)(const uint8_t* w, int64_t N, int64_t K, int64_t panel_begin, int64_t panel_end, uint8_t* out) = nullptr;
  size_t (*packed_bytes)(int64_t N, int64_t K) = nullptr;
  size_t (*scratch_bytes)(int64_t K) = nullptr;
};
AmxFallback amx_fallback[2];
template <int Type>
inline const AmxFallback& amx_fallback_of() {
  return amx_fallback[Type == kQ8_0 ? 0 : 1];
}

// One quantized activation row (the avx512 format, duplicated from matmul_avx512.cc's ActRow): K signed bytes,
// K/32 f32 scales, K/32 int32 corrections (-128 * the block's sum).
struct AmxActRow {
  const int8_t* q;
  const float* d;
  const int32_t* correction;
  AmxActRow(const uint8_t* row, int64_t K)
      : q(reinterpret_cast<const int8_t*>(row)),
        d(reinterpret_cast<const float*>(row + K)),
        correction(reinterpret_cast<const int32_t*>(row + K) + K / 32) {}
};

// A configuration for a group of rows0 (1..16) activation rows, plus rows1 (0..16) more in the second A tile.
inline AmxTileConfig amx_config(int rows0, int rows1) {
  AmxTileConfig c{};
  c.palette_id = 1;
  auto set = [&](int tile, int rows, int colsb) {
    c.rows[tile] = static_cast<uint8_t>(rows);
    c.colsb[tile] = static_cast<uint16_t>(colsb);
  };
  set(kTileA0, rows0, 32);  // one block: 8 dwords
  set(kTileB0, 8, 64);      // 8 dwords of K x 16 columns
  set(kTileB1, 8, 64);
  set(kTileC00, rows0, 64);  // 16 int32 columns
  set(kTileC01, rows0, 64);
  if (rows1 > 0) {
    set(kTileA1, rows1, 32);
    set(kTileC10, rows1, 64);
    set(kTileC11, rows1, 64);
  }
  return c;
}

// A Q4_0 slab block's nibbles as bytes (0..15) in the Q8_0 slab order: line g, half h at 128 g + 64 h.
inline void amx_expand_q4_0_block(const uint8_t* block, uint8_t* out) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int d = 0; d < 4; ++d) {
    for (int h = 0; h < 2; ++h) {
      const __m512i x = _mm512_load_si512(block + 128 * d + 64 * h);
      _mm512_store_si512(out + 128 * d + 64 * h, _mm512_and_si512(x, low_nibbles));
      _mm512_store_si512(out + 128 * (d + 4) + 64 * h, _mm512_and_si512(_mm512_srli_epi16(x, 4), low_nibbles));
    }
  }
}

// Activation rows [m0, m0 + rows) x the 32 output columns of one slab (cols of them stored), all K/32 blocks.
// Groups = 1 (rows <= 16, tiles A0, C00, C01) or 2 (16 < rows <= 32, also A1, C10, C11), as configured.
template <class Tiles, int Type, int Groups>
void amx_row_group(const MatmulTile& t, int64_t m0, int rows, const uint8_t* slab, float* y, int64_t cols) {
  constexpr size_t kQuants = int8_slab_quant_bytes<Type>();
  const int64_t nb = t.K / 32;
  const uint8_t* act = t.act + m0 * t.act_stride;
  alignas(64) int32_t sums[32][32];      // row i: the block's sums of columns 0-15, then 16-31
  alignas(64) float group[32][32], total[32][32];
  alignas(64) uint8_t expanded[Type == kQ4_0 ? 1024 : 64];
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < 32; j += 16) {
      _mm512_store_ps(group[i] + j, _mm512_setzero_ps());
      _mm512_store_ps(total[i] + j, _mm512_setzero_ps());
    }
  }
  for (int64_t b = 0; b < nb; ++b, slab += int8_slab_block_bytes<Type>()) {
    const uint8_t* quants = slab;
    if (Type == kQ4_0) {
      amx_expand_q4_0_block(slab, expanded);
      quants = expanded;
    }
    Tiles::template load<kTileB0>(quants, 128);
    Tiles::template load<kTileB1>(quants + 64, 128);
    Tiles::template load<kTileA0>(act + 32 * b, static_cast<int64_t>(t.act_stride));
    Tiles::template zero<kTileC00>();
    Tiles::template zero<kTileC01>();
    Tiles::template dpbsud<kTileC00, kTileA0, kTileB0>();
    Tiles::template dpbsud<kTileC01, kTileA0, kTileB1>();
    Tiles::template store<kTileC00>(sums[0], 128);
    Tiles::template store<kTileC01>(sums[0] + 16, 128);
    if (Groups == 2) {
      Tiles::template load<kTileA1>(act + 16 * t.act_stride + 32 * b, static_cast<int64_t>(t.act_stride));
      Tiles::template zero<kTileC10>();
      Tiles::template zero<kTileC11>();
      Tiles::template dpbsud<kTileC10, kTileA1, kTileB0>();
      Tiles::template dpbsud<kTileC11, kTileA1, kTileB1>();
      Tiles::template store<kTileC10>(sums[16], 128);
      Tiles::template store<kTileC11>(sums[16] + 16, 128);
    }
    // The avx512 microkernel's scaling, operation for operation (see the top of this file).
    const __m512 dw[2] = {
        _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(slab + kQuants))),
        _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(slab + kQuants + 32)))};
    const bool group_complete = (b & 7) == 7 || b == nb - 1;
    for (int i = 0; i < rows; ++i) {
      const AmxActRow a(act + i * t.act_stride, t.K);
      const __m512i start = _mm512_set1_epi32(Type == kQ8_0 ? a.correction[b] : a.correction[b] / 16);
      const __m512 da = _mm512_set1_ps(a.d[b]);
      for (int h = 0; h < 2; ++h) {
        const __m512i sum = _mm512_add_epi32(_mm512_load_si512(sums[i] + 16 * h), start);
        __m512 g = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw[h], da),
                                   _mm512_load_ps(group[i] + 16 * h));
        if (group_complete) {
          _mm512_store_ps(total[i] + 16 * h, _mm512_add_ps(_mm512_load_ps(total[i] + 16 * h), g));
          g = _mm512_setzero_ps();
        }
        _mm512_store_ps(group[i] + 16 * h, g);
      }
    }
  }
  const __mmask16 mask0 = static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
  const __mmask16 mask1 = static_cast<__mmask16>(cols >= 32 ? 0xFFFF : cols > 16 ? (1u << (cols - 16)) - 1 : 0);
  for (int i = 0; i < rows; ++i) {
    _mm512_mask_storeu_ps(y + i * t.ldy, mask0, _mm512_load_ps(total[i]));
    if (mask1) _mm512_mask_storeu_ps(y + i * t.ldy + 16, mask1, _mm512_load_ps(total[i] + 16));
  }
}

// All t.M rows (>= kAmxMinRows) x output columns [c_begin, c_end), whose slabs start at `slabs`; y is column
// c_begin of row 0. Whole 32-row groups run under one configuration; the remaining rows (1..31) under a second one
// shaped to them, so no tile reads past the last activation row.
template <class Tiles, int Type>
void amx_gemm(const MatmulTile& t, const uint8_t* slabs, int64_t c_begin, int64_t c_end, float* y) {
  const size_t slab_bytes = static_cast<size_t>(t.K / 32) * int8_slab_block_bytes<Type>();
  const int64_t whole = t.M / 32 * 32;
  const int rest = static_cast<int>(t.M - whole);
  if (whole > 0) {
    Tiles::load_config(amx_config(16, 16));
    for (int64_t c0 = c_begin; c0 < c_end; c0 += kAmxSlabRows) {
      const uint8_t* slab = slabs + (c0 - c_begin) / kAmxSlabRows * slab_bytes;
      const int64_t cols = min64(c_end - c0, kAmxSlabRows);
      for (int64_t m0 = 0; m0 < whole; m0 += 32) {
        amx_row_group<Tiles, Type, 2>(t, m0, 32, slab, y + m0 * t.ldy + (c0 - c_begin), cols);
      }
    }
  }
  if (rest > 0) {
    Tiles::load_config(rest > 16 ? amx_config(16, rest - 16) : amx_config(rest, 0));
    for (int64_t c0 = c_begin; c0 < c_end; c0 += kAmxSlabRows) {
      const uint8_t* slab = slabs + (c0 - c_begin) / kAmxSlabRows * slab_bytes;
      const int64_t cols = min64(c_end - c0, kAmxSlabRows);
      float* out = y + whole * t.ldy + (c0 - c_begin);
      if (rest > 16) {
        amx_row_group<Tiles, Type, 2>(t, whole, rest, slab, out, cols);
      } else {
        amx_row_group<Tiles, Type, 1>(t, whole, rest, slab, out, cols);
      }
    }
  }
  Tiles::release();
}

// A tile of a packed matrix (t.w is the avx512 packed layout; [n0, n1) starts on a slab).
template <class Tiles, int Type>
void amx_packed_tile(const MatmulTile& t) {
  if (t.M < kAmxMinRows) return amx_fallback_of<Type>().packed_tile(t);
  const size_t slab_bytes = static_cast<size_t>(t.K / 32) * int8_slab_block_bytes<Type>();
  amx_gemm<Tiles, Type>(t, t.w + t.n0 / kAmxSlabRows * slab_bytes, t.n0, t.n1, t.y + t.n0);
}

// A tile of ggml rows: packed into this thread's scratch first, as a model packs its weights at load (the cost is
// shared by the M >= 16 rows, as the avx512 GEMM's per-call packing is).
template <class Tiles, int Type>
void amx_tile(const MatmulTile& t) {
  const AmxFallback& base = amx_fallback_of<Type>();
  if (t.M < kAmxMinRows) return base.tile(t);
  const int64_t rows = t.n1 - t.n0;
  base.pack(t.w + t.n0 * t.w_row_bytes, rows, t.K, 0, packed_panel_count(rows), t.scratch);
  amx_gemm<Tiles, Type>(t, t.scratch, t.n0, t.n1, t.y + t.n0);
}

// Scratch: the avx512 kernels' (small M), or one tile's slabs (ggml rows, M >= 16).
template <int Type>
size_t amx_scratch_bytes(int64_t K) {
  const AmxFallback& base = amx_fallback_of<Type>();
  const size_t small_m = base.scratch_bytes(K), packed_tile = base.packed_bytes(kMatmulTileRows, K);
  return small_m > packed_tile ? small_m : packed_tile;
}
