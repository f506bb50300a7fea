// BF16 weights through AVX512-BF16 dot products (VDPBF16PS), on CPUs that have them: registered over the avx512
// float kernel, which widens every weight to f32 and multiplies it with f32 activations by FMA.
//
// Activations are rounded to bf16 once per matmul (VCVTNE2PS2BF16: round to nearest even; denormal inputs become
// zero, NaN stays NaN, values that round past the largest finite bf16 become infinite), shared by every tile. One
// VDPBF16PS then adds 32 products of a weight row and an activation row into 16 f32 lanes: twice the multiply-adds
// of an f32 FMA at the same issue rate, with no widening of the weights. A product of two bf16 is exact in f32, so
// the only new error is the activations' rounding: at most 2^-8 of each value, about 2^-9 RMS. (The instruction also
// treats denormal inputs as zero and flushes denormal results: values below 1.2e-38, of no weight in a dot product.)
//
// Batch invariance (a sequence decoded alone and in a batch must sample the same tokens): an output's arithmetic
// does not depend on the number of rows. Each (activation row, weight row) pair has one accumulator that takes the
// K columns 32 at a time in order, one VDPBF16PS per step (the columns past K as zeros), and its 16 lanes are then
// added by the fixed tree of Avx512::reduce_add (reduce_add_lanes and reduce_add_lanes8 add in the same order).
// Register blocks of MR activation rows x 4 weight rows only decide which accumulators are live together, so
// decode (M = 1..3: one block of M rows) and prefill (M >= 4: blocks of 4 rows) run the same arithmetic.
//
// Weights are read as ggml rows or, in a model, from a copy made at load in which each group of 4 rows has its
// 32-column chunks interleaved (row 0's chunk 0, row 1's chunk 0, row 2's, row 3's, row 0's chunk 1, ...; 2 bytes
// per weight as before, the columns past K as zeros). The kernel loads the same values and combines them in the same
// order, so the copy gives the ggml rows' bits; but a tile's weights become one sequential stream, which the
// hardware prefetchers follow best: single-row decode streamed ~50 GB/s from the copy against ~25 GB/s from four
// row streams per thread, and prefill gained 5-15% (docs/benchmarks.md).
#include <immintrin.h>

#include <cstdlib>
#include <cstring>

#include "cpu.h"
#include "kernels.h"

namespace conduit {
namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,avx2,fma,f16c")
#include "simd_avx512.h"

constexpr int64_t kChunk = 32;              // columns per VDPBF16PS
constexpr size_t kChunkBytes = kChunk * 2;  // one cache line of bf16
constexpr int kBlockRows = 4;               // MR of the many-row block (6 x 4 measured no faster)
constexpr int kGroupRows = 4;               // NR: weight rows per block, and the rows of a packed group
constexpr size_t kGroupChunkBytes = kGroupRows * kChunkBytes;
// Activation rows per pass over a tile's weights: their bf16 rows and the tile's 64 weight rows stay in L2 while
// every group meets them (K = 2048: 256 KB each; ~5% faster than one pass over all rows at M = 512).
constexpr int64_t kRowsPerPass = 64;

inline __m512bh as_bf16(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// ---------------------------------------------------------------------------------------------------------------
// Activations: ceil(K/32) chunks of 32 bf16, the columns past K zero (the last step needs no mask on this side).

size_t bf16_act_row_bytes(int64_t K) { return static_cast<size_t>(div_ceil(K, kChunk)) * kChunkBytes; }

void bf16_quantize_act(const float* x, int64_t K, uint8_t* out) {
  for (int64_t k = 0; k < K; k += kChunk) {
    const __m512 lo = Avx512::load_partial(x + k, K - k);
    const __m512 hi = k + 16 < K ? Avx512::load_partial(x + k + 16, K - k - 16) : _mm512_setzero_ps();
    const __m512bh both = _mm512_cvtne2ps_pbh(hi, lo);  // elements 0-15 from lo
    std::memcpy(out + 2 * k, &both, kChunkBytes);
  }
}

size_t bf16_scratch_bytes(int64_t) { return 0; }

// ---------------------------------------------------------------------------------------------------------------
// y[MR x NR] = act[MR rows] . w[NR rows]. Chunk c of weight row j starts at w[j] + c * stride: ggml rows (stride 64)
// end with a partial chunk when K is not a multiple of 32, read with a mask; packed groups (stride 256) hold it
// padded with zeros: the same values either way. Rows past `rows` and `cols` are computed and not stored.
template <int MR, int NR, bool Padded>
inline void bf16_dot_block(const uint8_t* act, size_t act_stride, const uint8_t* const* w, size_t stride, int64_t K,
                           float* y, int64_t ldy, int rows, int cols) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  const int64_t whole = Padded ? div_ceil(K, kChunk) : K / kChunk;
  size_t offset = 0;
  for (int64_t c = 0; c < whole; ++c, offset += stride) {
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = as_bf16(_mm512_loadu_si512(w[j] + offset));
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = as_bf16(_mm512_loadu_si512(act + i * act_stride + c * kChunkBytes));
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, wv[j]);
    }
  }
  if (!Padded && whole * kChunk < K) {
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - whole * kChunk)) - 1);
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = as_bf16(_mm512_maskz_loadu_epi16(mask, w[j] + offset));
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = as_bf16(_mm512_loadu_si512(act + i * act_stride + whole * kChunkBytes));
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, wv[j]);
    }
  }
  // The accumulators' sums, 16 or 8 at a time through the transposing reductions and the rest one by one: every sum
  // is added in reduce_add's order, so how they are grouped does not change a bit.
  constexpr int kSums = MR * NR;
  alignas(64) float sums[kSums + 16];
  const __m512* all = &acc[0][0];
  int s = 0;
  for (; s + 16 <= kSums; s += 16) _mm512_store_ps(sums + s, Avx512::reduce_add_lanes(all + s));
  for (; s + 8 <= kSums; s += 8) _mm512_store_ps(sums + s, Avx512::reduce_add_lanes8(all + s));
  for (; s < kSums; ++s) sums[s] = Avx512::reduce_add(all[s]);
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) y[i * ldy + j] = sums[i * NR + j];
  }
}

// Activation rows [m0, m1) against the kGroupRows weight rows from column n0 (`cols` of them real).
template <bool Padded>
inline void bf16_rows(const MatmulTile& t, int64_t m0, int64_t m1, const uint8_t* const* w, size_t stride,
                      int64_t n0, int cols) {
  int64_t m = m0;
  for (; m + kBlockRows <= m1; m += kBlockRows) {
    bf16_dot_block<kBlockRows, kGroupRows, Padded>(t.act + m * t.act_stride, t.act_stride, w, stride, t.K,
                                                   t.y + m * t.ldy + n0, t.ldy, kBlockRows, cols);
  }
  const uint8_t* act = t.act + m * t.act_stride;
  float* y = t.y + m * t.ldy + n0;
  switch (m1 - m) {
    case 3: bf16_dot_block<3, kGroupRows, Padded>(act, t.act_stride, w, stride, t.K, y, t.ldy, 3, cols); break;
    case 2: bf16_dot_block<2, kGroupRows, Padded>(act, t.act_stride, w, stride, t.K, y, t.ldy, 2, cols); break;
    case 1: bf16_dot_block<1, kGroupRows, Padded>(act, t.act_stride, w, stride, t.K, y, t.ldy, 1, cols); break;
    default: break;
  }
}

// A tile of ggml rows. A group past the matrix's last row repeats that row (computed, not stored).
void bf16_tile(const MatmulTile& t) {
  for (int64_t m0 = 0; m0 < t.M; m0 += kRowsPerPass) {
    const int64_t m1 = min64(t.M, m0 + kRowsPerPass);
    for (int64_t n0 = t.n0; n0 < t.n1; n0 += kGroupRows) {
      const int cols = t.n1 - n0 < kGroupRows ? static_cast<int>(t.n1 - n0) : kGroupRows;
      const uint8_t* w[kGroupRows];
      for (int j = 0; j < kGroupRows; ++j) w[j] = t.w + (n0 + (j < cols ? j : cols - 1)) * t.w_row_bytes;
      bf16_rows<false>(t, m0, m1, w, kChunkBytes, n0, cols);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Load-time layout: slabs of kPackedPanelRows rows, each 8 groups of 4 rows, a group being its rows' chunks
// interleaved chunk by chunk (256 bytes per chunk). Columns past K and rows past N are zeros.

static_assert(kPackedPanelRows % kGroupRows == 0, "a slab is whole groups");
static_assert(kMatmulTileRows % kGroupRows == 0, "tiles start on a group");
constexpr int64_t kGroupsPerSlab = kPackedPanelRows / kGroupRows;

inline size_t packed_group_bytes(int64_t K) { return static_cast<size_t>(div_ceil(K, kChunk)) * kGroupChunkBytes; }

size_t bf16_packed_bytes(int64_t N, int64_t K) {
  return static_cast<size_t>(packed_panel_count(N) * kGroupsPerSlab) * packed_group_bytes(K);
}

void bf16_pack(const uint8_t* w, int64_t N, int64_t K, int64_t slab_begin, int64_t slab_end, uint8_t* out) {
  const size_t row_bytes = static_cast<size_t>(K) * 2;
  const int64_t chunks = div_ceil(K, kChunk);
  uint8_t* dst = out + slab_begin * kGroupsPerSlab * packed_group_bytes(K);
  for (int64_t r0 = slab_begin * kPackedPanelRows; r0 < slab_end * kPackedPanelRows; r0 += kGroupRows) {
    for (int64_t c = 0; c < chunks; ++c) {
      const size_t bytes = c + 1 < chunks ? kChunkBytes : row_bytes - c * kChunkBytes;
      for (int j = 0; j < kGroupRows; ++j, dst += kChunkBytes) {
        std::memset(dst, 0, kChunkBytes);
        if (r0 + j < N) std::memcpy(dst, w + (r0 + j) * row_bytes + c * kChunkBytes, bytes);
      }
    }
  }
}

// A tile of a packed matrix: t.w is the packed layout and [n0, n1) starts on a slab. The rows of a last, partial
// group are the copy's zeros (computed, not stored).
void bf16_packed_tile(const MatmulTile& t) {
  const size_t group_bytes = packed_group_bytes(t.K);
  for (int64_t m0 = 0; m0 < t.M; m0 += kRowsPerPass) {
    const int64_t m1 = min64(t.M, m0 + kRowsPerPass);
    for (int64_t n0 = t.n0; n0 < t.n1; n0 += kGroupRows) {
      const int cols = t.n1 - n0 < kGroupRows ? static_cast<int>(t.n1 - n0) : kGroupRows;
      const uint8_t* group = t.w + (n0 / kGroupRows) * group_bytes;
      const uint8_t* w[kGroupRows];
      for (int j = 0; j < kGroupRows; ++j) w[j] = group + j * kChunkBytes;
      bf16_rows<true>(t, m0, m1, w, kGroupChunkBytes, n0, cols);
    }
  }
}

#pragma GCC pop_options

// CONDUIT_BF16_DOT=0 keeps the f32 kernel: f32 activations, as on CPUs without AVX512-BF16 (and the baseline the
// kernel benchmark compares with; the table is built once per process).
bool bf16_dot_enabled() {
  const char* v = std::getenv("CONDUIT_BF16_DOT");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

}  // namespace

void register_matmul_avx512_bf16(KernelTable& t) {
  if (!cpu_features().avx512bf16 || !bf16_dot_enabled()) return;
  MatmulKernel k;
  k.act_row_bytes = bf16_act_row_bytes;
  k.quantize_act = bf16_quantize_act;
  k.scratch_bytes = bf16_scratch_bytes;
  k.tile = bf16_tile;
  k.packed_bytes = bf16_packed_bytes;
  k.pack = bf16_pack;
  k.packed_tile = bf16_packed_tile;
  t.matmul[kBF16] = k;
  t.names["matmul_bf16"] = "avx512_bf16";
}

}  // namespace conduit
