// AVX-512 matmul. Float weights use the shared kernel of matmul_float_simd.h. Q8_0 and Q4_0 use VNNI.
//
// Activations are quantized per block of 32 to int8 with one f32 scale (round to nearest even, as the generic
// kernel does). VPDPBUSD multiplies unsigned by signed bytes, so the weights are made unsigned by adding 128
// (an XOR of the sign bit); that adds 128 * sum(a) to each block's dot product, and -128 * sum(a) is stored
// with the activations so the integer accumulator starts from it and the inner loops pay nothing.
//
// Few rows (decode, the memory-bound case): a GEMV walks each weight row front to back, so the hardware
// prefetchers stream it, and takes each block's dot product with up to 3 activation rows (one VPDPBUSD each),
// producing bit for bit what the GEMM produces for the same row (batch invariance).
//
// Many rows (prefill, compute bound): weights are packed two panels of 16 rows at a time: for each block of 32
// columns, 8 vectors holding 4 consecutive bytes of each of the 16 rows (one 32-bit lane per row), then the 16
// row scales (576 bytes). VPDPBUSD of one such vector with a broadcast 4-byte group of an activation row
// advances 16 output columns by 4 multiply-adds each. The microkernel holds MR activation rows x 32 columns of
// int32 block sums and f32 totals in registers; per block it issues 8 x 2 x MR VPDPBUSD, then converts each
// block sum and adds it scaled by (weight scale x activation scale), in groups of 8 blocks as the GEMV does.
// Packing (a 16 x 8 transpose of 32-bit groups) is paid once per pair of panels and shared by every activation
// row.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "cpu.h"
#include "kernels.h"

namespace conduit {
namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include "simd_avx512.h"
#include "ops_simd.h"
#include "matmul_float_simd.h"

// ---------------------------------------------------------------------------------------------------------------
// Activation quantization: [K signed bytes][K/32 f32 scales][K/32 int32 corrections = -128 * sum of the block]

size_t int8_act_row_bytes(int64_t K) { return static_cast<size_t>(K) + static_cast<size_t>(K / 32) * 8; }

struct ActRow {
  const int8_t* q = nullptr;
  const float* d = nullptr;
  const int32_t* correction = nullptr;
  ActRow() = default;
  ActRow(const uint8_t* row, int64_t K)
      : q(reinterpret_cast<const int8_t*>(row)),
        d(reinterpret_cast<const float*>(row + K)),
        correction(reinterpret_cast<const int32_t*>(row + K) + K / 32) {}
};

void int8_quantize_act(const float* x, int64_t K, uint8_t* out) {
  float* scales = reinterpret_cast<float*>(out + K);
  int32_t* corrections = reinterpret_cast<int32_t*>(scales + K / 32);
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float d = amax / 127.0f;
    const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * b), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
    scales[b] = d;
    corrections[b] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

// The 32 quants of one weight block, plus 128 (unsigned).
inline __m256i block_quants_q8_0(const uint8_t* block) {
  return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2)),
                          _mm256_set1_epi8(static_cast<char>(0x80)));
}
inline __m256i block_quants_q4_0(const uint8_t* block) {
  // (q - 8) + 128 = q + 120 for the nibble q.
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(packed, mask), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  return _mm256_add_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(120));
}
template <int Type>
inline __m256i block_quants(const uint8_t* block) {
  return Type == kQ8_0 ? block_quants_q8_0(block) : block_quants_q4_0(block);
}
template <int Type>
constexpr size_t block_bytes() {
  return Type == kQ8_0 ? sizeof(BlockQ8_0) : sizeof(BlockQ4_0);
}
inline float block_scale(const uint8_t* block) {
  uint16_t d;
  std::memcpy(&d, block, 2);
  return _cvtsh_ss(d);
}

// ---------------------------------------------------------------------------------------------------------------
// GEMV: weight rows against MR (1..3) activation rows, each row read front to back so the hardware prefetchers
// stream it (interleaving 8 rows block by block measured 2-3x slower).
//
// Batch invariance: an output must not depend on how many rows share the matmul (a sequence decoded alone and
// in a batch of 16 must sample the same tokens), so the GEMV reproduces the GEMM's arithmetic exactly. Both sum
// an output in groups of 8 blocks: within a group, each block's exact integer dot product, converted, times
// (weight scale x activation scale), is added in block order from zero with one rounding per block (FMA); the
// group sums are then added to the total in order. (Groups make the GEMV's chains independent; one chain through
// all blocks bounded it by FMA latency.) The 8 blocks' 8-lane VPDPBUSD partial sums are reduced to their block
// totals at once (integer, so order-free).

constexpr int64_t kInt8GemvMaxRows = 3;

// Lane u of the result = sum of the 8 lanes of v[u].
inline __m256i reduce_lanes_i32(const __m256i* v) {
  const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i q0 = _mm256_hadd_epi32(h01, h23), q1 = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

// The scaled block dot products of 8 consecutive blocks (the last `live` of them may be fewer), for one weight row
// and one activation row; added into `total` as one group (see above).
template <int Type>
inline __m128 add_block_group(const uint8_t* group, const ActRow& a, int64_t b0, int live, __m128 total) {
  constexpr int bs = static_cast<int>(block_bytes<Type>());
  const __mmask8 mask = static_cast<__mmask8>((1u << live) - 1);
  __m256i sums[8];
  uint16_t halves[8] = {};
  for (int u = 0; u < 8; ++u) {
    sums[u] = _mm256_setzero_si256();
    if (u < live) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + 32 * (b0 + u)));
      sums[u] = _mm256_dpbusd_epi32(sums[u], block_quants<Type>(group + u * bs), q);
      std::memcpy(&halves[u], group + u * bs, 2);
    }
  }
  const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)));
  const __m256i corrections = _mm256_maskz_loadu_epi32(mask, a.correction + b0);
  alignas(32) float product[8], scale[8];
  _mm256_store_ps(product, _mm256_cvtepi32_ps(_mm256_add_epi32(reduce_lanes_i32(sums), corrections)));
  _mm256_store_ps(scale, _mm256_mul_ps(dw, _mm256_maskz_loadu_ps(mask, a.d + b0)));
  __m128 group_sum = _mm_setzero_ps();
  for (int u = 0; u < live; ++u) group_sum = _mm_fmadd_ss(_mm_load_ss(product + u), _mm_load_ss(scale + u), group_sum);
  return _mm_add_ss(total, group_sum);
}

// One weight row against MR activation rows.
template <int Type, int MR>
inline void int8_gemv_row(const uint8_t* w, const uint8_t* act, size_t act_stride, int64_t K, float* y, int64_t ldy) {
  constexpr int bs = static_cast<int>(block_bytes<Type>());
  const int64_t nb = K / 32;
  for (int i = 0; i < MR; ++i) {
    const ActRow a(act + i * act_stride, K);
    __m128 total = _mm_setzero_ps();
    int64_t b0 = 0;
    for (; b0 + 8 <= nb; b0 += 8) total = add_block_group<Type>(w + b0 * bs, a, b0, 8, total);
    if (b0 < nb) total = add_block_group<Type>(w + b0 * bs, a, b0, static_cast<int>(nb - b0), total);
    y[i * ldy] = _mm_cvtss_f32(total);
  }
}

template <int Type>
void int8_gemv(const MatmulTile& t) {
  for (int64_t n = t.n0; n < t.n1; ++n) {
    const uint8_t* w = t.w + n * t.w_row_bytes;
    switch (t.M) {
      case 3: int8_gemv_row<Type, 3>(w, t.act, t.act_stride, t.K, t.y + n, t.ldy); break;
      case 2: int8_gemv_row<Type, 2>(w, t.act, t.act_stride, t.K, t.y + n, t.ldy); break;
      default: int8_gemv_row<Type, 1>(w, t.act, t.act_stride, t.K, t.y + n, t.ldy); break;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// GEMM packing

constexpr int kPanelRows = 16;
constexpr size_t kPanelBlockBytes = 8 * 64 + 16 * 4;  // quants, scales

// The 16 f16 scales of a panel block in one gather (scalar conversions would occupy the FP pipes the
// microkernel needs, and 16 narrow stores read back as one vector stall on store forwarding); rows past the
// tile get scale 0. A panel may start past the tile (the second of a pair when the last pair has 16 rows or
// fewer): then no row is live and nothing is read.
template <int Type>
inline void pack_scales(const MatmulTile& t, int64_t r0, int64_t b, uint8_t* out) {
  const int64_t live = t.n1 - r0 < kPanelRows ? t.n1 - r0 : kPanelRows;
  const __mmask16 mask = static_cast<__mmask16>(live <= 0 ? 0 : live >= 16 ? 0xFFFF : (1u << live) - 1);
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(t.w_row_bytes)));
  const uint8_t* base = t.w + r0 * t.w_row_bytes + b * block_bytes<Type>();
  const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, rows, base, 1);
  _mm512_store_ps(out + 512, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words)));
}

// Packs block b of weight rows [r0, r0 + 16) (rows >= n1 as zeros) into `out`: 8 vectors, vector g holding
// quant bytes 4g..4g+3 of each of the 16 rows (plus 128), then the 16 scales.
template <int Type>
void pack_int8_panel_block(const MatmulTile& t, int64_t r0, int64_t b, uint8_t* out);

template <>
void pack_int8_panel_block<kQ8_0>(const MatmulTile& t, int64_t r0, int64_t b, uint8_t* out) {
  // z[i] = rows i and i + 8 (32 bytes each); two unpack stages transpose 4 x 4 groups within each 128-bit lane;
  // a two-source permute gathers the four lanes of each output group.
  auto quants = [&](int64_t row) {
    if (row >= t.n1) return _mm256_setzero_si256();
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.w + row * t.w_row_bytes + b * sizeof(BlockQ8_0) + 2));
  };
  __m512i z[8], t4[8], u[8];
  for (int i = 0; i < 8; ++i) z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(quants(r0 + i)), quants(r0 + i + 8), 1);
  for (int i = 0; i < 8; i += 2) {
    t4[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
    t4[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
  }
  for (int h = 0; h < 8; h += 4) {
    u[h + 0] = _mm512_unpacklo_epi64(t4[h + 0], t4[h + 2]);  // group 0 (lanes 1, 3: group 4)
    u[h + 1] = _mm512_unpackhi_epi64(t4[h + 0], t4[h + 2]);  // group 1 (5)
    u[h + 2] = _mm512_unpacklo_epi64(t4[h + 1], t4[h + 3]);  // group 2 (6)
    u[h + 3] = _mm512_unpackhi_epi64(t4[h + 1], t4[h + 3]);  // group 3 (7)
  }
  const __m512i even_lanes = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
  const __m512i odd_lanes = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int g = 0; g < 4; ++g) {
    const __m512i lo = _mm512_permutex2var_epi64(u[g], even_lanes, u[g + 4]);
    const __m512i hi = _mm512_permutex2var_epi64(u[g], odd_lanes, u[g + 4]);
    _mm512_store_si512(out + 64 * g, _mm512_xor_si512(lo, sign));
    _mm512_store_si512(out + 64 * (g + 4), _mm512_xor_si512(hi, sign));
  }
  pack_scales<kQ8_0>(t, r0, b, out);
}

// The nibble dwords of block b of rows [r0, r0 + 16) (rows >= n1 as zeros): 4 vectors, lane r = dword d of row r.
inline void q4_0_panel_dwords(const MatmulTile& t, int64_t r0, int64_t b, __m512i* td) {
  __m512i z[4];
  for (int i = 0; i < 4; ++i) {
    __m128i lanes[4];
    for (int l = 0; l < 4; ++l) {
      const int64_t row = r0 + i + 4 * l;
      const uint8_t* nibbles = t.w + row * t.w_row_bytes + b * sizeof(BlockQ4_0) + 2;
      lanes[l] = row < t.n1 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles)) : _mm_setzero_si128();
    }
    z[i] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(lanes[0]), lanes[1], 1),
                                                 lanes[2], 2), lanes[3], 3);
  }
  // z[i], lane l = row i + 4l; after the unpacks, lane l of td[d] holds dword d of rows 4l .. 4l + 3: rows in order.
  const __m512i a0 = _mm512_unpacklo_epi32(z[0], z[1]), a1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i a2 = _mm512_unpacklo_epi32(z[2], z[3]), a3 = _mm512_unpackhi_epi32(z[2], z[3]);
  td[0] = _mm512_unpacklo_epi64(a0, a2);
  td[1] = _mm512_unpackhi_epi64(a0, a2);
  td[2] = _mm512_unpacklo_epi64(a1, a3);
  td[3] = _mm512_unpackhi_epi64(a1, a3);
}

template <>
void pack_int8_panel_block<kQ4_0>(const MatmulTile& t, int64_t r0, int64_t b, uint8_t* out) {
  // Dword d of a row's packed nibbles holds element 4d + j in the low nibble of byte j and element 16 + 4d + j in
  // its high nibble, so it yields output groups d and d + 4.
  __m512i td[4];
  q4_0_panel_dwords(t, r0, b, td);
  // (q - 8) + 128 = q + 120. Padding rows become 120 (q = 8, value 0) and carry scale 0 anyway.
  const __m512i mask = _mm512_set1_epi8(0x0F), offset = _mm512_set1_epi8(120);
  for (int d = 0; d < 4; ++d) {
    const __m512i lo = _mm512_and_si512(td[d], mask), hi = _mm512_and_si512(_mm512_srli_epi16(td[d], 4), mask);
    _mm512_store_si512(out + 64 * d, _mm512_add_epi8(lo, offset));
    _mm512_store_si512(out + 64 * (d + 4), _mm512_add_epi8(hi, offset));
  }
  pack_scales<kQ4_0>(t, r0, b, out);
}

// Software prefetch (into L2) of the weight rows the next pair of panels will pack, in the order they will be
// read: while block b of this pair is packed, block b of each of the next pair's 32 rows is requested, a whole
// pair's worth of work before it is needed. Packing reads 32 rows 34 bytes at a time, a pattern the hardware
// prefetchers do not follow; without this it waits on DRAM latency. (Prefetching the next rows in address order
// instead, spread over the microkernel too, measured slower: the lines packing needs first arrive last.) The
// next pair may start the next tile, which parallel_for_ranges makes this thread's next tile too.
struct RowPrefetcher {
  const uint8_t* first = nullptr;  // block 0 of the next pair's first row
  size_t row_bytes = 0, block_bytes = 0;
  int rows = 0;
  RowPrefetcher(const MatmulTile& t, int64_t first_row, size_t block_size) {
    const int64_t last_row = min64(t.n_total, first_row + 2 * kPanelRows);
    if (first_row >= last_row) return;
    first = t.w + first_row * t.w_row_bytes;
    row_bytes = t.w_row_bytes;
    block_bytes = block_size;
    rows = static_cast<int>(last_row - first_row);
  }
  inline void block(int64_t b) const {
    const uint8_t* p = first + b * block_bytes;
    for (int r = 0; r < rows; ++r, p += row_bytes) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  }
};

// ---------------------------------------------------------------------------------------------------------------
// GEMM microkernel: MR activation rows x 32 weight rows (panels p0, p1), all K/32 blocks.

// The microkernels' shared ends. A group of 8 blocks' sums joins the total after its 8th block (or the last
// block), exactly as the GEMV adds its groups: the batch-invariance rule.
template <int MR>
inline void add_group_if_complete(int64_t b, int64_t nb, __m512 (&total)[MR][2], __m512 (&group)[MR][2]) {
  if ((b & 7) != 7 && b != nb - 1) return;
  for (int i = 0; i < MR; ++i) {
    total[i][0] = _mm512_add_ps(total[i][0], group[i][0]);
    total[i][1] = _mm512_add_ps(total[i][1], group[i][1]);
    group[i][0] = group[i][1] = _mm512_setzero_ps();
  }
}

// MR rows of up to 32 output columns.
template <int MR>
inline void store_totals(const __m512 (&total)[MR][2], float* y, int64_t ldy, int64_t cols) {
  for (int i = 0; i < MR; ++i) {
    Avx512::store_partial(y + i * ldy, total[i][0], cols);
    if (cols > 16) Avx512::store_partial(y + i * ldy + 16, total[i][1], cols - 16);
  }
}

template <int MR>
inline void int8_microkernel(const uint8_t* act, size_t act_stride, int64_t K, const uint8_t* p0, const uint8_t* p1,
                             float* y, int64_t ldy, int64_t cols) {
  const int64_t nb = K / 32;
  __m512 total[MR][2], group[MR][2];
  ActRow rows[MR];
  for (int i = 0; i < MR; ++i) {
    total[i][0] = total[i][1] = group[i][0] = group[i][1] = _mm512_setzero_ps();
    rows[i] = ActRow(act + i * act_stride, K);
  }
  for (int64_t b = 0; b < nb; ++b, p0 += kPanelBlockBytes, p1 += kPanelBlockBytes) {
    __m512i sum[MR][2];
    for (int i = 0; i < MR; ++i) sum[i][0] = sum[i][1] = _mm512_set1_epi32(rows[i].correction[b]);
    for (int g = 0; g < 8; ++g) {
      const __m512i w0 = _mm512_load_si512(p0 + 64 * g), w1 = _mm512_load_si512(p1 + 64 * g);
      for (int i = 0; i < MR; ++i) {
        int32_t group;
        std::memcpy(&group, rows[i].q + 32 * b + 4 * g, 4);
        const __m512i a = _mm512_set1_epi32(group);
        sum[i][0] = _mm512_dpbusd_epi32(sum[i][0], w0, a);
        sum[i][1] = _mm512_dpbusd_epi32(sum[i][1], w1, a);
      }
    }
    const __m512 d0 = _mm512_load_ps(p0 + 512), d1 = _mm512_load_ps(p1 + 512);
    for (int i = 0; i < MR; ++i) {
      const __m512 da = _mm512_set1_ps(rows[i].d[b]);
      group[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][0]), _mm512_mul_ps(d0, da), group[i][0]);
      group[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][1]), _mm512_mul_ps(d1, da), group[i][1]);
    }
    add_group_if_complete<MR>(b, nb, total, group);
  }
  store_totals<MR>(total, y, ldy, cols);
}

constexpr int kInt8MR = 4;

size_t int8_scratch_bytes(int64_t K) { return 2 * static_cast<size_t>(K / 32) * kPanelBlockBytes; }

template <int Type>
void int8_gemm(const MatmulTile& t) {
  const int64_t nb = t.K / 32;
  const size_t panel_bytes = static_cast<size_t>(nb) * kPanelBlockBytes;
  uint8_t* p0 = t.scratch;
  uint8_t* p1 = p0 + panel_bytes;
  for (int64_t c0 = t.n0; c0 < t.n1; c0 += 2 * kPanelRows) {
    const RowPrefetcher prefetch(t, c0 + 2 * kPanelRows, block_bytes<Type>());
    for (int64_t b = 0; b < nb; ++b) {
      prefetch.block(b);
      pack_int8_panel_block<Type>(t, c0, b, p0 + b * kPanelBlockBytes);
      pack_int8_panel_block<Type>(t, c0 + kPanelRows, b, p1 + b * kPanelBlockBytes);
    }
    const int64_t cols = t.n1 - c0 < 2 * kPanelRows ? t.n1 - c0 : 2 * kPanelRows;
    int64_t m = 0;
    for (; m + kInt8MR <= t.M; m += kInt8MR) {
      int8_microkernel<kInt8MR>(t.act + m * t.act_stride, t.act_stride, t.K, p0, p1, t.y + m * t.ldy + c0, t.ldy, cols);
    }
    const uint8_t* act = t.act + m * t.act_stride;
    float* y = t.y + m * t.ldy + c0;
    switch (t.M - m) {
      case 3: int8_microkernel<3>(act, t.act_stride, t.K, p0, p1, y, t.ldy, cols); break;
      case 2: int8_microkernel<2>(act, t.act_stride, t.K, p0, p1, y, t.ldy, cols); break;
      case 1: int8_microkernel<1>(act, t.act_stride, t.K, p0, p1, y, t.ldy, cols); break;
      default: break;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Load-time packed layout (Q8_0; Q4_0 below): the GEMM's panels, built once when a model loads, so every matmul of
// the model (decode included) runs the microkernel with no per-call packing. A slab holds 32 weight rows (the
// microkernel's two panels) and, for each block in order: the 8 groups of 4 bytes, each as the vector of rows 0-15
// (as the GEMM packs it) followed by the vector of rows 16-31, then the 32 rows' scales in f16 (1088 bytes, 17
// cache lines). The microkernel thus reads every cache line in address order: one sequential stream, and slabs are
// contiguous, so a thread's contiguous share of tiles is one stream too. (The order matters to the hardware
// prefetchers: the same bytes with each block's two panels one after the other, read alternately, streamed at half
// the rate on one thread, and separate scale arrays or two panel streams were slower than the ggml rows.) In f16
// the scales keep the layout exactly as large as the ggml rows (34 bytes per row and block): decode streams no
// extra bytes; VCVTPH2PS gives the f32 the GEMM's packing computes. Rows past the matrix (the last slab) are zeros.
//
// Compared with the GEMV on ggml rows, decode issues several times fewer instructions per weight byte (~55 per
// 1088-byte slab block in the M = 1 loop, against roughly 10 per 34-byte block and row): one VPDPBUSD advances 16
// outputs (not 8 lanes of one output that then need a horizontal reduction), and the per-block scaling is one
// vector FMA for 16 outputs instead of a scalar FMA each. It also reads the weights in the order the hardware
// prefetchers follow best (see above). The arithmetic is the microkernel's, so the results are the bits of the
// GEMV and the GEMM on the same weights.

// Q4_0 slabs keep the nibbles: per block, 4 lines, line d holding dword d of rows 0-15 then of rows 16-31 (one
// 32-bit lane per row, as the GEMM's Q4_0 packing transposes them), whose low nibbles are group d and high nibbles
// group d + 4, then the f16 scales: 576 bytes, the ggml size again. The kernel takes q * a for the raw nibble q
// and starts from -8 * sum(a) (a sixteenth of the stored correction, -128 * sum(a)) instead of adding 120 to every
// byte: the same integer as the GEMM's (q - 8 + 128) * a - 128 * sum(a).

static_assert(kPackedPanelRows == 2 * kPanelRows, "a packed panel is the microkernel's pair of GEMM panels");
static_assert(kMatmulTileRows % kPackedPanelRows == 0, "tiles must start on a slab");

template <int Type>
size_t int8_packed_bytes(int64_t N, int64_t K) {
  return static_cast<size_t>(packed_panel_count(N)) * static_cast<size_t>(K / 32) * int8_slab_block_bytes<Type>();
}

template <int Type>
void int8_pack(const uint8_t* w, int64_t N, int64_t K, int64_t slab_begin, int64_t slab_end, uint8_t* out) {
  MatmulTile t{};
  t.w = w;
  t.w_row_bytes = row_bytes(Type, K);
  t.K = K;
  t.n1 = t.n_total = N;
  const int64_t nb = K / 32;
  constexpr size_t kBlock = int8_slab_block_bytes<Type>(), kQuants = int8_slab_quant_bytes<Type>();
  alignas(64) uint8_t panel[kPanelBlockBytes];
  for (int64_t slab = slab_begin; slab < slab_end; ++slab) {
    uint8_t* dst = out + slab * nb * kBlock;
    for (int64_t b = 0; b < nb; ++b, dst += kBlock) {
      for (int h = 0; h < 2; ++h) {
        const int64_t r0 = slab * kPackedPanelRows + h * kPanelRows;
        if (r0 >= N) {  // rows past the matrix: zero quants, zero scales
          for (size_t g = 0; g < kQuants / 128; ++g) std::memset(dst + 128 * g + 64 * h, 0, 64);
          std::memset(dst + kQuants + 32 * h, 0, 32);
          continue;
        }
        if (Type == kQ8_0) {
          pack_int8_panel_block<kQ8_0>(t, r0, b, panel);
          for (int g = 0; g < 8; ++g) std::memcpy(dst + 128 * g + 64 * h, panel + 64 * g, 64);
        } else {
          __m512i td[4];
          q4_0_panel_dwords(t, r0, b, td);
          for (int d = 0; d < 4; ++d) _mm512_store_si512(dst + 128 * d + 64 * h, td[d]);
          pack_scales<kQ4_0>(t, r0, b, panel);
        }
        // The f32 scales came from f16: converting back is exact.
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + kQuants + 32 * h),
                           _mm512_cvtps_ph(_mm512_load_ps(panel + 512), _MM_FROUND_TO_NEAREST_INT));
      }
    }
  }
}

// The microkernel on a slab. With one or two activation rows, the 2 x MR VPDPBUSD chains per block cannot hide
// the instruction's latency, so the 8 groups alternate between two sets of accumulators, added at the end of the
// block (integers: the sum's bits do not depend on the order). With one or two rows (decode) it also requests the
// lines of the first whole block 8 KiB or more ahead into L2 where decode_prefetch_ahead() says so (cpu.h): on a
// Xeon that made a Q8_0 110M model's decode step 16-37% shorter than the hardware prefetchers alone (quiet, one or
// two threads). Past the slab that is the next slab, which the same thread reads next; past the matrix, a harmless
// request.
template <int Type, int MR>
inline void packed_microkernel(const uint8_t* act, size_t act_stride, int64_t K, const uint8_t* slab, float* y,
                               int64_t ldy, int64_t cols) {
  constexpr int kSets = MR <= 2 ? 2 : 1;
  constexpr size_t kQuants = int8_slab_quant_bytes<Type>();
  const int64_t nb = K / 32;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 total[MR][2], group[MR][2];
  ActRow rows[MR];
  for (int i = 0; i < MR; ++i) {
    total[i][0] = total[i][1] = group[i][0] = group[i][1] = _mm512_setzero_ps();
    rows[i] = ActRow(act + i * act_stride, K);
  }
  constexpr size_t kBlockBytes = int8_slab_block_bytes<Type>();
  constexpr size_t kAhead = (8192 + kBlockBytes - 1) / kBlockBytes * kBlockBytes;
  const bool prefetch = MR <= 2 && decode_prefetch_ahead();
  for (int64_t b = 0; b < nb; ++b, slab += kBlockBytes) {
    if (prefetch) {
      const char* ahead = reinterpret_cast<const char*>(slab) + kAhead;
      for (size_t off = 0; off < kBlockBytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T1);
    }
    __m512i sum[kSets][MR][2];
    for (int i = 0; i < MR; ++i) {
      const int32_t start = Type == kQ8_0 ? rows[i].correction[b] : rows[i].correction[b] / 16;
      sum[0][i][0] = sum[0][i][1] = _mm512_set1_epi32(start);
      if (kSets == 2) sum[kSets - 1][i][0] = sum[kSets - 1][i][1] = _mm512_setzero_si512();
    }
    __m512i w[8][2];
    if (Type == kQ8_0) {
      for (int g = 0; g < 8; ++g) {
        w[g][0] = _mm512_load_si512(slab + 128 * g);
        w[g][1] = _mm512_load_si512(slab + 128 * g + 64);
      }
    } else {
      for (int d = 0; d < 4; ++d) {
        for (int h = 0; h < 2; ++h) {
          const __m512i x = _mm512_load_si512(slab + 128 * d + 64 * h);
          w[d][h] = _mm512_and_si512(x, low_nibbles);
          w[d + 4][h] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low_nibbles);
        }
      }
    }
    for (int g = 0; g < 8; ++g) {
      for (int i = 0; i < MR; ++i) {
        int32_t quads;
        std::memcpy(&quads, rows[i].q + 32 * b + 4 * g, 4);
        const __m512i a = _mm512_set1_epi32(quads);
        sum[g % kSets][i][0] = _mm512_dpbusd_epi32(sum[g % kSets][i][0], w[g][0], a);
        sum[g % kSets][i][1] = _mm512_dpbusd_epi32(sum[g % kSets][i][1], w[g][1], a);
      }
    }
    if (kSets == 2) {
      for (int i = 0; i < MR; ++i) {
        sum[0][i][0] = _mm512_add_epi32(sum[0][i][0], sum[kSets - 1][i][0]);
        sum[0][i][1] = _mm512_add_epi32(sum[0][i][1], sum[kSets - 1][i][1]);
      }
    }
    const __m512 d0 = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(slab + kQuants)));
    const __m512 d1 = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(slab + kQuants + 32)));
    for (int i = 0; i < MR; ++i) {
      const __m512 da = _mm512_set1_ps(rows[i].d[b]);
      group[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[0][i][0]), _mm512_mul_ps(d0, da), group[i][0]);
      group[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[0][i][1]), _mm512_mul_ps(d1, da), group[i][1]);
    }
    add_group_if_complete<MR>(b, nb, total, group);
  }
  store_totals<MR>(total, y, ldy, cols);
}

// A tile of a packed matrix: t.w is the packed layout, [n0, n1) starts on a slab.
template <int Type>
void int8_packed_tile(const MatmulTile& t) {
  const size_t slab_bytes = static_cast<size_t>(t.K / 32) * int8_slab_block_bytes<Type>();
  for (int64_t c0 = t.n0; c0 < t.n1; c0 += kPackedPanelRows) {
    const uint8_t* slab = t.w + (c0 / kPackedPanelRows) * slab_bytes;
    const int64_t cols = t.n1 - c0 < kPackedPanelRows ? t.n1 - c0 : kPackedPanelRows;
    int64_t m = 0;
    for (; m + kInt8MR <= t.M; m += kInt8MR) {
      packed_microkernel<Type, kInt8MR>(t.act + m * t.act_stride, t.act_stride, t.K, slab, t.y + m * t.ldy + c0,
                                        t.ldy, cols);
    }
    const uint8_t* act = t.act + m * t.act_stride;
    float* y = t.y + m * t.ldy + c0;
    switch (t.M - m) {
      case 3: packed_microkernel<Type, 3>(act, t.act_stride, t.K, slab, y, t.ldy, cols); break;
      case 2: packed_microkernel<Type, 2>(act, t.act_stride, t.K, slab, y, t.ldy, cols); break;
      case 1: packed_microkernel<Type, 1>(act, t.act_stride, t.K, slab, y, t.ldy, cols); break;
      default: break;
    }
  }
}

template <int Type>
void int8_tile(const MatmulTile& t) {
  if (t.M <= kInt8GemvMaxRows) {
    int8_gemv<Type>(t);
  } else {
    int8_gemm<Type>(t);
  }
}

// Q4_K / Q5_K / Q6_K: VPMADDUBSW pair sums times the sub-block scales, accumulated by AVX512-VNNI's VPDPWSSD.
#define KQ_DOT16(acc, pairs, scales) _mm256_dpwssd_epi32((acc), (pairs), (scales))
#include "matmul_kquant_simd.h"
#undef KQ_DOT16
#include "matmul_kquant_packed_avx512.h"

#pragma GCC pop_options

// The kernel-table helpers below run while the tables are built, on any CPU: outside the target region, so the
// compiler cannot use AVX-512 instructions to fill them in.
template <int Type>
MatmulKernel kq_kernel() {
  MatmulKernel k;
  k.act_row_bytes = kq_act_row_bytes;
  k.quantize_act = kq_quantize_act;
  k.scratch_bytes = kq_scratch_bytes;
  k.tile = kq_tile<Type>;
  return k;
}

// The K-quants also have the load-time packed layout (matmul_kquant_packed_avx512.h).
template <int Type>
MatmulKernel kq_packed_kernel() {
  MatmulKernel k = kq_kernel<Type>();
  k.packed_bytes = kq_packed_bytes<Type>;
  k.pack = kq_pack<Type>;
  k.packed_tile = kq_packed_tile<Type>;
  return k;
}

template <int Type>
MatmulKernel float_kernel() {
  MatmulKernel k;
  k.scratch_bytes = float_scratch_bytes;
  k.tile = float_tile<Avx512, Type, 4, 4>;
  return k;
}

template <int Type>
MatmulKernel int8_kernel() {
  MatmulKernel k;
  k.act_row_bytes = int8_act_row_bytes;
  k.quantize_act = int8_quantize_act;
  k.scratch_bytes = int8_scratch_bytes;
  k.tile = int8_tile<Type>;
  k.packed_bytes = int8_packed_bytes<Type>;
  k.pack = int8_pack<Type>;
  k.packed_tile = int8_packed_tile<Type>;
  return k;
}

}  // namespace

void register_matmul_avx512(KernelTable& t) {
  t.matmul[kF32] = float_kernel<kF32>();
  t.matmul[kF16] = float_kernel<kF16>();
  t.matmul[kBF16] = float_kernel<kBF16>();
  t.matmul[kQ8_0] = int8_kernel<kQ8_0>();
  t.matmul[kQ4_0] = int8_kernel<kQ4_0>();
  for (int type : {kF32, kF16, kBF16}) t.names[std::string("matmul_") + type_name(type)] = "avx512";
  if (kquant_dot_enabled()) {
    t.matmul[kQ4_K] = kq_packed_kernel<kQ4_K>();
    t.matmul[kQ5_K] = kq_packed_kernel<kQ5_K>();
    t.matmul[kQ6_K] = kq_packed_kernel<kQ6_K>();
    t.names["matmul_q4_k"] = "avx512_vnni";
    t.names["matmul_q5_k"] = "avx512_vnni";
    t.names["matmul_q6_k"] = "avx512_vnni";
  } else {
    t.matmul[kQ4_K] = float_kernel<kQ4_K>();
    t.matmul[kQ5_K] = float_kernel<kQ5_K>();
    t.matmul[kQ6_K] = float_kernel<kQ6_K>();
    t.names["matmul_q4_k"] = "avx512";
    t.names["matmul_q5_k"] = "avx512";
    t.names["matmul_q6_k"] = "avx512";
  }
  t.names["matmul_q8_0"] = "avx512_vnni";
  t.names["matmul_q4_0"] = "avx512_vnni";
  register_matmul_avx512_bf16(t);
}

}  // namespace conduit
