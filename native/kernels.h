// The kernel table: one function pointer per kernel (and per weight type for matmul and dequantization), filled
// per variant. The generic table holds plain C++ versions of everything; a SIMD variant starts from the table
// below it and overrides what it implements, so every entry is always callable and `names` says which variant
// actually serves each kernel kind.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>

#include "common.h"

namespace conduit {

// ---------------------------------------------------------------------------------------------------------------
// Matmul y[M x N] = x[M x K] . W[N x K]^T, W stored row by row in a ggml type.
//
// The driver (matmul.cc) splits N into tiles that threads take one at a time; a tile kernel computes y[:, n0:n1)
// for all M rows. Integer kernels first quantize each activation row into a variant-private format
// (`act_row_bytes` > 0), once per matmul, shared by every tile and by every weight that reads the same input.
struct MatmulTile {
  const float* x;       // [M x K] activations (float kernels)
  const uint8_t* act;   // [M x act_row_bytes] quantized activations (integer kernels)
  size_t act_stride;
  int64_t M, K;
  const uint8_t* w;     // first byte of weight row 0
  size_t w_row_bytes;
  int64_t n0, n1;       // weight rows of this tile
  int64_t n_total;      // rows of the whole matrix (prefetching never runs past them)
  float* y;             // y[m * ldy + n]
  int64_t ldy;
  uint8_t* scratch;     // per-thread, scratch_bytes(K) long, 64-byte aligned
};

struct MatmulKernel {
  size_t (*act_row_bytes)(int64_t K) = nullptr;  // null: the tile reads float x
  void (*quantize_act)(const float* x, int64_t K, uint8_t* out) = nullptr;
  size_t (*scratch_bytes)(int64_t K) = nullptr;
  void (*tile)(const MatmulTile& t) = nullptr;
  // Optional load-time layout (null: none). A model repacks such weights once into packed_bytes(N, K) bytes
  // (pack fills the panels of kPackedPanelRows rows in [panel_begin, panel_end), so loading can be split over
  // threads), and packed_tile then reads t.w as that layout, producing the same bits as `tile` on the ggml rows.
  size_t (*packed_bytes)(int64_t N, int64_t K) = nullptr;
  void (*pack)(const uint8_t* w, int64_t N, int64_t K, int64_t panel_begin, int64_t panel_end, uint8_t* out) =
      nullptr;
  void (*packed_tile)(const MatmulTile& t) = nullptr;
};

// Packed layouts are panels of kPackedPanelRows rows (the last one padded), and tiles start on a panel
// (kMatmulTileRows is a multiple of it).
constexpr int64_t kPackedPanelRows = 32;
inline int64_t packed_panel_count(int64_t N) { return div_ceil(N, kPackedPanelRows); }

// The int8 packed slabs (Q8_0, Q4_0; matmul_avx512.cc describes them, matmul_amx_impl.h reads them too): per block
// of 32 columns, the quants of the slab's 32 rows (Q8_0: 8 groups of 4 bytes x 2 halves x 64 bytes; Q4_0: 4 nibble
// lines x 2 halves x 64 bytes), then the 32 rows' f16 scales.
template <int Type>
constexpr size_t int8_slab_quant_bytes() {
  return Type == kQ8_0 ? 2 * 8 * 64 : 2 * 4 * 64;
}
template <int Type>
constexpr size_t int8_slab_block_bytes() {
  return int8_slab_quant_bytes<Type>() + 32 * 2;
}

// Weight rows per tile: small enough that two threads balance on a 256-row matrix, large enough to amortise the
// hand-out (a decode tile of 768 columns is ~50 KB of Q8_0).
constexpr int64_t kMatmulTileRows = 64;

// ---------------------------------------------------------------------------------------------------------------
// Paged attention. K/V are read from the pool through the block table.
//
// The SIMD variants split each row's context into fixed chunks of kAttentionChunk positions (flash-decoding's
// split-K): a chunk gives, per query head, its running max, its sum of exponentials and its unnormalised P V, and a
// row's output folds its chunks in order 0, 1, 2 ... then normalises. The chunk boundaries depend on positions only,
// so a row gets the same bits whether its chunks were computed by one unit or spread over threads, alone or batched,
// prefill or decode. A chunk unit covers all KV heads, so it streams whole K and V rows.
// The generic variant keeps whole-context rows, one unit per (sequence, KV head, rows).
struct AttentionArgs {
  const float* q;          // [numTokens x numHeads*headDim], RoPE applied
  float* out;              // [numTokens x numHeads*headDim]
  const uint8_t* k_cache;  // this layer's K region: [numBlocks][blockSize][numKvHeads][headDim]
  const uint8_t* v_cache;
  bool kv_f16;
  int num_heads, num_kv_heads, head_dim, block_size;
  const int32_t* query_start_loc;  // [numSeqs + 1]
  const int32_t* seq_lens;         // [numSeqs]
  const int32_t* block_tables;     // [numSeqs x max_blocks_per_seq]
  int max_blocks_per_seq;
  float scale;
  // Sliding window (0: none): the row at position p attends to positions max(0, p - window + 1) .. p only.
  int window = 0;
};

// First position a row whose context is positions [0, context) attends to.
inline int attention_first_position(const AttentionArgs& a, int context) {
  return a.window > 0 && context > a.window ? context - a.window : 0;
}

// A unit covers at most this many rows of one sequence.
constexpr int kAttentionRowsPerUnit = 16;

// Positions per split-K chunk: chunk c of every row is positions [c * kAttentionChunk, (c + 1) * kAttentionChunk).
// Large enough that a chunk's K and V of all heads (64 KB each at 4 KV heads x 64 f16) stream as long runs, small
// enough that a decode row at a context of a few hundred gives every thread chunks.
constexpr int kAttentionChunk = 128;
inline int attention_chunks(int context) { return (context + kAttentionChunk - 1) / kAttentionChunk; }

// Scratch floats one attention unit needs: scores of every query head of a group over up to `context` positions
// (rows padded to a multiple of 16) and the 8-byte pool offset of each position.
inline size_t attention_score_stride(int context) { return (static_cast<size_t>(context) + 31) / 16 * 16; }
inline size_t attention_scratch_floats(int context, int head_dim, int group) {
  return static_cast<size_t>(group) * attention_score_stride(context) + 2 * static_cast<size_t>(context) +
         static_cast<size_t>(head_dim) + 16;
}

// One chunk's partial result for one row, all query heads: [numHeads x headDim] unnormalised P V, then the max
// score and the sum of exponentials of each head; padded to 16 floats.
inline size_t attention_partial_floats(int num_heads, int head_dim) {
  return (static_cast<size_t>(num_heads) * (head_dim + 2) + 15) / 16 * 16;
}

// Scratch floats of a chunked unit or a merge: scores of all heads over a chunk, the chunk's pool offsets, one
// partial, and the fold state (max and sum per head) of up to kAttentionRowsPerUnit rows.
inline size_t attention_chunk_scratch_floats(int num_heads, int head_dim) {
  return static_cast<size_t>(num_heads) * attention_score_stride(kAttentionChunk) + 2 * kAttentionChunk +
         attention_partial_floats(num_heads, head_dim) + 2 * static_cast<size_t>(kAttentionRowsPerUnit) * num_heads +
         16;
}

// ---------------------------------------------------------------------------------------------------------------
// LoRA (lora.h describes the storage and the batched driver). A matrix as the kernels read it: A [rank x in] and B
// transposed [rank x out] in one storage type, each row with its scale (1 unless q8). Bt is stored in blocks of
// kLoraBtBlock columns, each block holding its columns of every row k in turn (the last block padded with zeros):
// the up-projection of one matmul tile (kMatmulTileRows columns) then reads one contiguous run per adapter instead
// of one short piece per row. q8 keeps each column's k in groups of four within a block (rank rounded up to a
// multiple of 4, zeros after): the four bytes one 32-bit lane of an 8-bit dot product (VPDPBUSD) takes.
enum LoraDtype { kLoraF32 = 0, kLoraBF16 = 1, kLoraQ8 = 2, kLoraDtypeCount = 3 };
inline size_t lora_dtype_bytes(int dtype) { return dtype == kLoraF32 ? 4 : dtype == kLoraBF16 ? 2 : 1; }

struct LoraMatrixView {
  int dtype;
  int64_t rank, in, out;
  const uint8_t* a;   // rank rows of `in` elements
  const uint8_t* bt;  // rank rows of `out` elements (lora_bt_index)
  const float* a_scale;
  const float* bt_scale;
};

// Output columns per up-projection work item: items of one adapter's matrix split its outputs over threads.
constexpr int64_t kLoraUpChunk = 256;
constexpr int64_t kLoraBtBlock = 64;
static_assert(kLoraUpChunk % kLoraBtBlock == 0 && kLoraBtBlock % 16 == 0, "vectors and chunks stay within Bt blocks");
// Rows of Bt as stored: the rank, rounded up to a multiple of 4 for q8.
inline int64_t lora_bt_rows(int dtype, int64_t rank) { return dtype == kLoraQ8 ? div_ceil(rank, 4) * 4 : rank; }
// Index of element (k, o) of Bt in its blocked storage; a vector of up to 16 columns from a multiple of its width
// stays in one block.
inline int64_t lora_bt_index(int dtype, int64_t rank, int64_t k, int64_t o) {
  const int64_t block = (o / kLoraBtBlock) * lora_bt_rows(dtype, rank) * kLoraBtBlock;
  if (dtype == kLoraQ8) return block + (k & ~int64_t{3}) * kLoraBtBlock + (o % kLoraBtBlock) * 4 + (k & 3);
  return block + k * kLoraBtBlock + o % kLoraBtBlock;
}
// Elements of a blocked Bt of `rank` rows of `out` columns.
inline int64_t lora_bt_elements(int dtype, int64_t rank, int64_t out) {
  return div_ceil(out, kLoraBtBlock) * kLoraBtBlock * lora_bt_rows(dtype, rank);
}
// Scratch floats an up-projection item needs (a converted [rank x kLoraUpChunk] slice of Bt and rank factors).
inline size_t lora_up_scratch_floats(int64_t rank) { return static_cast<size_t>(rank) * (kLoraUpChunk + 1) + 16; }

// q8 multiplies 8-bit weights by 8-bit activations with exact 32-bit sums, as a Q8_0 matmul does: x in blocks of
// kLoraQ8Block elements, and the rank values B reads (bt_scale[k] * u[k]) in blocks of kLoraQ8Block too, each block
// with scale absmax / 127 and elements nearbyint(v * (127 / absmax)) (an all-zero block: scale 0, zeros).
constexpr int64_t kLoraQ8Block = 32;
// Quantizes n <= kLoraQ8Block values; returns the block's scale. The SIMD variants compute the same bits.
inline float lora_quantize_block(const float* v, int64_t n, int8_t* q) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(v[i]));
  const float inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
  return absmax / 127.0f;
}

// Floats per row of the down-projection's output u: its rank values, and for q8 after them what the
// up-projection reads of the row (lora_q8_prepare_row), so each up-projection call (one per matmul tile when
// fused) starts from it instead of quantizing again.
inline int64_t lora_u_stride(int dtype, int64_t rank) {
  return dtype == kLoraQ8 ? rank + div_ceil(rank, 4) + 2 * div_ceil(rank, kLoraQ8Block) : rank;
}
// After u[0, rank) of a row: bt_scale[k] * u[k] quantized per block of kLoraQ8Block k, as div_ceil(rank, 4)
// groups of four bytes (k ascending, zeros past the rank), then per block minus 128 times the sum of its values
// (int32: Bt is stored offset by 128) and its scale. Plain C++ for every variant: the same bits for all.
inline void lora_q8_prepare_row(const float* bt_scale, int64_t rank, float* u) {
  const int64_t groups = div_ceil(rank, 4), blocks = div_ceil(rank, kLoraQ8Block);
  float f[kLoraQ8Block];
  int8_t q[kLoraQ8Block];
  uint8_t* tail = reinterpret_cast<uint8_t*>(u + rank);  // bytes, copied in and out: no aliasing of floats
  std::memset(tail, 0, static_cast<size_t>(groups) * 4);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k0 = b * kLoraQ8Block, count = std::min(kLoraQ8Block, rank - k0);
    for (int64_t k = 0; k < count; ++k) f[k] = bt_scale[k0 + k] * u[k0 + k];
    const float scale = lora_quantize_block(f, count, q);
    std::memcpy(tail + k0, q, static_cast<size_t>(count));
    int32_t sum = 0;
    for (int64_t k = 0; k < count; ++k) sum += q[k];
    const int32_t offset = -128 * sum;
    std::memcpy(tail + (groups + b) * 4, &offset, 4);
    std::memcpy(tail + (groups + blocks + b) * 4, &scale, 4);
  }
}

// ---------------------------------------------------------------------------------------------------------------
struct RopeParams {
  int num_heads, head_dim, rope_dim;
  bool neox;  // pairs (i, i + rope_dim/2); otherwise (2i, 2i+1)
};

struct KernelTable {
  MatmulKernel matmul[31];  // indexed by GgmlType
  void (*dequantize_row[31])(const uint8_t* src, float* dst, int64_t n) = {};

  void (*rmsnorm)(const float* x, const float* weight, float* out, int64_t dim, float eps) = nullptr;
  void (*add)(float* acc, const float* x, int64_t n) = nullptr;  // acc += x
  void (*swiglu)(const float* gate, const float* up, float* out, int64_t n) = nullptr;  // silu(gate) * up
  // gelu_tanh(gate) * up (Gemma's GeGLU), gelu_tanh(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
  void (*geglu)(const float* gate, const float* up, float* out, int64_t n) = nullptr;
  void (*softmax)(float* x, int64_t n) = nullptr;  // in place
  // The index of the first largest of n values (the greedy token of a logits row), or -1 when a value is NaN or
  // none is above -inf: the caller reports those rows its own way.
  int64_t (*argmax)(const float* x, int64_t n) = nullptr;
  // The sampler's weighing pass over a logits row (sample_weigh.h): with v = x[i] read at scale (the float nearest
  // x[i] * scale), weights[i] = exp(v - max) for the candidates (v >= floor, above -inf), 0 for the others; returns
  // their total (by blocks of 8 ids, sample_weigh.h) and sets *last to the last id with a weight other than 0.
  // block_totals (or null): the running total after each block. bin_mass / bin_count (or null, both; kMassBins
  // each): zeroed, then each candidate's weight and count added into its top_p bin. Bit for bit the same in every
  // variant.
  double (*sample_weigh)(const float* x, int64_t n, double scale, double max, double floor, double* weights,
                         double* block_totals, double* bin_mass, int32_t* bin_count, int64_t* last) = nullptr;
  // out[i] = x[i] * factor as JavaScript stores it into a Float32Array: the product in double, then the float
  // nearest it (the sampler's copy of a row scaled by 1/temperature). out may be x. Bit for bit in every variant.
  void (*scale_row)(const float* x, float* out, int64_t n, double factor) = nullptr;
  // Rotates one token's heads in place; cos/sin hold rope_dim/2 values for this token's position.
  void (*rope)(float* x, const RopeParams& p, const float* cos, const float* sin) = nullptr;
  // Writes one token's K and V rows (num_kv_heads*head_dim floats each) into pool slots.
  void (*kv_store)(const float* src, uint8_t* dst, int64_t n, bool f16) = nullptr;
  // Whole-context rows (generic): one KV head's query heads for rows [row_begin, row_end) of a sequence.
  void (*attention)(const AttentionArgs& a, int seq, int kv_head, int row_begin, int row_end, float* scratch) =
      nullptr;
  // Split-K (null where not implemented; the driver then uses `attention`). With partials null: every chunk of
  // rows [row_begin, row_end), folded in order into their outputs, which are then normalised. Otherwise: chunk
  // `chunk` only, each row that reaches it writing its partial to partials + (r - row_begin) * partial_row_stride
  // + chunk * attention_partial_floats().
  void (*attention_chunks)(const AttentionArgs& a, int seq, int row_begin, int row_end, int chunk, float* partials,
                           size_t partial_row_stride, float* scratch) = nullptr;
  // Folds row `row`'s partials (chunk c at partials + c * attention_partial_floats()) in order and writes its
  // normalised output: the same arithmetic as the fold in attention_chunks.
  void (*attention_merge)(const AttentionArgs& a, int seq, int row, const float* partials, float* scratch) = nullptr;

  // LoRA, per storage type (LoraDtype), u's rows lora_u_stride apart. Down: u[r * stride + k] = a_scale[k] * (A[k] .
  // x[rows[r] * ldx ...]) for the n rows listed, every k; each dot product in the variant's fixed order whatever n.
  // Up: for o in [o0, o1) (at most kLoraUpChunk, o0 a multiple of kLoraBtBlock), y[rows[r] * ldy + o] += scale *
  // sum_k Bt[k][o] * (bt_scale[k] * u[r * stride + k]), k ascending. q8 quantizes x and bt_scale[k] * u[k] as
  // kLoraQ8Block says (the latter in its down-projection: lora_q8_prepare_row).
  void (*lora_down[kLoraDtypeCount])(const LoraMatrixView& m, const float* x, int64_t ldx, const int32_t* rows,
                                     int64_t n, float* u) = {};
  void (*lora_up[kLoraDtypeCount])(const LoraMatrixView& m, const float* u, const int32_t* rows, int64_t n,
                                   float scale, float* y, int64_t ldy, int64_t o0, int64_t o1, float* scratch) = {};

  // Kernel kind -> variant serving it, e.g. "matmul_q8_0" -> "avx512".
  std::map<std::string, std::string> names;
};

// Whether the SIMD variants multiply Q4_K / Q6_K weights with 8-bit activations (integer dot products, the
// default) rather than decoding them to f32; CONDUIT_KQUANT_DOT=0 keeps the f32 kernel (the baseline the kernel
// benchmark compares with; read when a table is built, once per process). Defined in compute.cc.
bool kquant_dot_enabled();

// The plain C++ dequantization of one row (n a multiple of the type's block size), usable by any variant's code.
void dequantize_row_generic(int type, const uint8_t* src, float* dst, int64_t n);

// Registration per kernel family and variant; each overrides the entries it implements and records their names.
void register_ops_generic(KernelTable& t);
void register_matmul_generic(KernelTable& t);
void register_attention_generic(KernelTable& t);
void register_ops_avx2(KernelTable& t);
void register_matmul_avx2(KernelTable& t);
void register_attention_avx2(KernelTable& t);
void register_ops_avx512(KernelTable& t);
void register_matmul_avx512(KernelTable& t);
// BF16 through VDPBF16PS where the CPU has AVX512-BF16 (called by register_matmul_avx512).
void register_matmul_avx512_bf16(KernelTable& t);
void register_attention_avx512(KernelTable& t);
// Both start from the avx512 table, whose Q8_0/Q4_0 kernels they keep for few rows and reuse the packed layout of.
void register_matmul_amx(KernelTable& t);
void register_matmul_amx_model(KernelTable& t);

// The table for a variant (built once, cached). The caller must have checked that the CPU supports it.
const KernelTable& kernel_table(Variant v);

}  // namespace conduit
