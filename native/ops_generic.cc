// Plain C++ versions of the row kernels (RMSNorm, residual add, SwiGLU, softmax, RoPE, KV store) and of row
// dequantization for every supported type. They are the reference the SIMD variants are tested against, so they
// favour the obvious loop over speed.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "sample_weigh.h"

namespace conduit {

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Row ops

int64_t argmax(const float* x, int64_t n) {
  int64_t best = -1;
  float best_value = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    if (v != v) return -1;
    if (v > best_value) {
      best_value = v;
      best = i;
    }
  }
  return best;
}

// sample_weigh.h's pass, one value at a time. Without fused multiply-add, as the header's own functions: on a target
// where FMA is baseline (aarch64) GCC would otherwise fuse what it inlines here.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
double sample_weigh(const float* x, int64_t n, double scale, double max, double floor, double* weights,
                    double* block_totals, double* bin_mass, int32_t* bin_count, int64_t* last) {
  const int64_t whole = n - n % sample::kWeighBlock;
  double total = 0.0;
  for (int64_t b = 0; b < whole; b += sample::kWeighBlock) {
    for (int64_t i = b; i < b + sample::kWeighBlock; ++i) weights[i] = sample::candidate_weight(x[i], scale, max, floor);
    total += sample::block_sum(weights + b);
    if (block_totals != nullptr) block_totals[b / sample::kWeighBlock] = total;
  }
  return sample::weigh_finish(x, n, whole, total, scale, max, floor, weights, block_totals, bin_mass, bin_count,
                              nullptr, last);
}
#pragma GCC pop_options

// kernels.h's scale_row, one value at a time.
void scale_row(const float* x, float* out, int64_t n, double factor) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<double>(x[i]) * factor);
}

void rmsnorm(const float* x, const float* weight, float* out, int64_t dim, float eps) {
  float sum_squares = 0.0f;
  for (int64_t i = 0; i < dim; ++i) sum_squares += x[i] * x[i];
  const float scale = 1.0f / std::sqrt(sum_squares / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) out[i] = x[i] * scale * weight[i];
}

void add(float* acc, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
}

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void geglu(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * g * (1.0f + 0.044715f * g * g))) * up[i];
  }
}

void softmax(float* x, int64_t n) {
  float max = -INFINITY;
  for (int64_t i = 0; i < n; ++i) max = x[i] > max ? x[i] : max;
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void rope(float* x, const RopeParams& p, const float* cos, const float* sin) {
  const int half = p.rope_dim / 2;
  for (int h = 0; h < p.num_heads; ++h) {
    float* head = x + static_cast<int64_t>(h) * p.head_dim;
    for (int i = 0; i < half; ++i) {
      const int a = p.neox ? i : 2 * i;
      const int b = p.neox ? i + half : 2 * i + 1;
      const float x0 = head[a], x1 = head[b];
      head[a] = x0 * cos[i] - x1 * sin[i];
      head[b] = x0 * sin[i] + x1 * cos[i];
    }
  }
}

void kv_store(const float* src, uint8_t* dst, int64_t n, bool f16) {
  if (!f16) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
    return;
  }
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = fp32_to_fp16(src[i]);
}

// ---------------------------------------------------------------------------------------------------------------
// Dequantization of one row of n elements (n a multiple of the type's block size).

void dequantize_f32(const uint8_t* src, float* dst, int64_t n) { std::memcpy(dst, src, static_cast<size_t>(n) * 4); }

void dequantize_f16(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    dst[i] = fp16_to_fp32(h);
  }
}

void dequantize_bf16(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t b;
    std::memcpy(&b, src + 2 * i, 2);
    dst[i] = bf16_to_fp32(b);
  }
}

void dequantize_q8_0(const uint8_t* src, float* dst, int64_t n) {
  const BlockQ8_0* blocks = reinterpret_cast<const BlockQ8_0*>(src);
  for (int64_t b = 0; b < n / kQK8_0; ++b) {
    const float d = fp16_to_fp32(blocks[b].d);
    for (int i = 0; i < kQK8_0; ++i) dst[b * kQK8_0 + i] = d * static_cast<float>(blocks[b].qs[i]);
  }
}

void dequantize_q4_0(const uint8_t* src, float* dst, int64_t n) {
  const BlockQ4_0* blocks = reinterpret_cast<const BlockQ4_0*>(src);
  for (int64_t b = 0; b < n / kQK4_0; ++b) {
    const float d = fp16_to_fp32(blocks[b].d);
    float* out = dst + b * kQK4_0;
    for (int i = 0; i < kQK4_0 / 2; ++i) {
      out[i] = d * static_cast<float>((blocks[b].qs[i] & 0xF) - 8);
      out[i + kQK4_0 / 2] = d * static_cast<float>((blocks[b].qs[i] >> 4) - 8);
    }
  }
}

void dequantize_q4_1(const uint8_t* src, float* dst, int64_t n) {
  const BlockQ4_1* blocks = reinterpret_cast<const BlockQ4_1*>(src);
  for (int64_t b = 0; b < n / kQK4_0; ++b) {
    const float d = fp16_to_fp32(blocks[b].d), m = fp16_to_fp32(blocks[b].m);
    float* out = dst + b * kQK4_0;
    for (int i = 0; i < kQK4_0 / 2; ++i) {
      // q * d is exact in f32 (4 x 11 significant bits): one rounding, as the fused form would give.
      out[i] = static_cast<float>(blocks[b].qs[i] & 0xF) * d + m;
      out[i + kQK4_0 / 2] = static_cast<float>(blocks[b].qs[i] >> 4) * d + m;
    }
  }
}

void dequantize_q5_0(const uint8_t* src, float* dst, int64_t n) {
  const BlockQ5_0* blocks = reinterpret_cast<const BlockQ5_0*>(src);
  int q[kQK4_0];
  for (int64_t b = 0; b < n / kQK4_0; ++b) {
    const float d = fp16_to_fp32(blocks[b].d);
    q5_levels(blocks[b].qh, blocks[b].qs, q);
    for (int i = 0; i < kQK4_0; ++i) dst[b * kQK4_0 + i] = d * static_cast<float>(q[i] - 16);
  }
}

void dequantize_q5_1(const uint8_t* src, float* dst, int64_t n) {
  const BlockQ5_1* blocks = reinterpret_cast<const BlockQ5_1*>(src);
  int q[kQK4_0];
  for (int64_t b = 0; b < n / kQK4_0; ++b) {
    const float d = fp16_to_fp32(blocks[b].d), m = fp16_to_fp32(blocks[b].m);
    q5_levels(blocks[b].qh, blocks[b].qs, q);
    for (int i = 0; i < kQK4_0; ++i) dst[b * kQK4_0 + i] = static_cast<float>(q[i]) * d + m;  // q * d exact
  }
}

// Q4_K and Q5_K: four groups of 64, the low nibbles of 32 bytes are sub-block 2g, the high nibbles sub-block 2g+1;
// Q5_K adds a fifth bit per element (bit s of qh[l] for element l of sub-block s), as 16 on the nibble.
template <class Block>
void dequantize_q4_q5_k(const uint8_t* src, float* dst, int64_t n) {
  const Block* blocks = reinterpret_cast<const Block*>(src);
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    const Block& blk = blocks[b];
    const uint8_t* qh = k4_high_bits(blk);
    const float d = fp16_to_fp32(blk.d), dmin = fp16_to_fp32(blk.dmin);
    float* out = dst + b * kQK_K;
    for (int g = 0; g < 4; ++g) {
      uint8_t sc_lo, m_lo, sc_hi, m_hi;
      q4k_scale_min(2 * g, blk.scales, &sc_lo, &m_lo);
      q4k_scale_min(2 * g + 1, blk.scales, &sc_hi, &m_hi);
      const float d_lo = d * sc_lo, min_lo = dmin * m_lo, d_hi = d * sc_hi, min_hi = dmin * m_hi;
      const uint8_t* q = blk.qs + 32 * g;
      for (int i = 0; i < 32; ++i) {
        const int h = qh ? qh[i] >> (2 * g) : 0;
        out[64 * g + i] = d_lo * static_cast<float>((q[i] & 0xF) | ((h & 1) << 4)) - min_lo;
        out[64 * g + 32 + i] = d_hi * static_cast<float>((q[i] >> 4) | ((h & 2) << 3)) - min_hi;
      }
    }
  }
}

void dequantize_q6_k(const uint8_t* src, float* dst, int64_t n) {
  const BlockQ6_K* blocks = reinterpret_cast<const BlockQ6_K*>(src);
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    const BlockQ6_K& blk = blocks[b];
    const float d = fp16_to_fp32(blk.d);
    // Two halves of 128: element l + 32*k of a half takes 4 bits from ql (low or high nibble of byte l or l+32)
    // and 2 bits from qh[l] (bit pair k), and the scale of its 16-element sub-block.
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = blk.ql + 64 * half;
      const uint8_t* qh = blk.qh + 32 * half;
      const int8_t* sc = blk.scales + 8 * half;
      float* out = dst + b * kQK_K + 128 * half;
      for (int l = 0; l < 32; ++l) {
        const int s = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        out[l] = d * static_cast<float>(sc[s] * q1);
        out[l + 32] = d * static_cast<float>(sc[s + 2] * q2);
        out[l + 64] = d * static_cast<float>(sc[s + 4] * q3);
        out[l + 96] = d * static_cast<float>(sc[s + 6] * q4);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// LoRA: eight partial sums per dot product (element i in lane i mod 8), added in a fixed order at the end, so the
// result is the same whatever the batch or the thread; the up-projection adds k in ascending order per output.

template <int D>  // f32 and bf16; q8 below
inline float lora_element(const uint8_t* row, int64_t i) {
  if constexpr (D == kLoraF32) return reinterpret_cast<const float*>(row)[i];
  else return bf16_to_fp32(reinterpret_cast<const uint16_t*>(row)[i]);
}

template <int D>
void lora_down(const LoraMatrixView& m, const float* x, int64_t ldx, const int32_t* rows, int64_t n, float* u) {
  constexpr int kLanes = 8;
  const int64_t in = m.in;
  const int64_t body = in - in % kLanes;
  const size_t row_bytes = static_cast<size_t>(in) * lora_dtype_bytes(D);
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + static_cast<int64_t>(rows[r]) * ldx;
    for (int64_t k = 0; k < m.rank; ++k) {
      const uint8_t* a = m.a + k * row_bytes;
      float acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = 0; i < body; i += kLanes) {
        for (int j = 0; j < kLanes; ++j) acc[j] += lora_element<D>(a, i + j) * xr[i + j];
      }
      for (int64_t i = body; i < in; ++i) acc[i - body] += lora_element<D>(a, i) * xr[i];
      const float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      u[r * m.rank + k] = m.a_scale[k] * s;
    }
  }
}

template <int D>
void lora_up(const LoraMatrixView& m, const float* u, const int32_t* rows, int64_t n, float scale, float* y,
             int64_t ldy, int64_t o0, int64_t o1, float* scratch) {
  const int64_t width = o1 - o0;
  float* bt = scratch;
  float* factor = scratch + m.rank * kLoraUpChunk;
  for (int64_t k = 0; k < m.rank; ++k) {
    for (int64_t j = 0; j < width; ++j) bt[k * kLoraUpChunk + j] = lora_element<D>(m.bt, lora_bt_index(D, m.rank, k, o0 + j));
  }
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t k = 0; k < m.rank; ++k) factor[k] = m.bt_scale[k] * u[r * m.rank + k];
    float* yr = y + static_cast<int64_t>(rows[r]) * ldy + o0;
    for (int64_t j = 0; j < width; ++j) {
      float acc = bt[j] * factor[0];
      for (int64_t k = 1; k < m.rank; ++k) acc += bt[k * kLoraUpChunk + j] * factor[k];
      yr[j] += scale * acc;
    }
  }
}

// q8: 8-bit weights times 8-bit activations (kernels.h kLoraQ8Block), exact 32-bit sums per block, the blocks'
// scaled sums added in ascending order.
void lora_down_q8(const LoraMatrixView& m, const float* x, int64_t ldx, const int32_t* rows, int64_t n, float* u) {
  const int64_t in = m.in, blocks = div_ceil(in, kLoraQ8Block), stride = lora_u_stride(kLoraQ8, m.rank);
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs;
  xq.resize(static_cast<size_t>(in));
  xs.resize(static_cast<size_t>(blocks));
  const uint8_t* a = m.a;  // weights offset by 128 (lora.h)
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + static_cast<int64_t>(rows[r]) * ldx;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t i0 = b * kLoraQ8Block;
      xs[b] = lora_quantize_block(xr + i0, std::min(kLoraQ8Block, in - i0), xq.data() + i0);
    }
    for (int64_t k = 0; k < m.rank; ++k) {
      const uint8_t* ak = a + k * in;
      float acc = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t sum = 0;
        for (int64_t i = b * kLoraQ8Block; i < std::min(in, (b + 1) * kLoraQ8Block); ++i) sum += (int32_t{ak[i]} - 128) * xq[i];
        acc += xs[b] * static_cast<float>(sum);
      }
      u[r * stride + k] = m.a_scale[k] * acc;
    }
    lora_q8_prepare_row(m.bt_scale, m.rank, u + r * stride);
  }
}

void lora_up_q8(const LoraMatrixView& m, const float* u, const int32_t* rows, int64_t n, float scale, float* y,
                int64_t ldy, int64_t o0, int64_t o1, float* scratch) {
  const int64_t rank = m.rank, stride = lora_u_stride(kLoraQ8, rank);
  const int64_t groups = div_ceil(rank, 4), blocks = div_ceil(rank, kLoraQ8Block);
  const uint8_t* bt = m.bt;  // weights offset by 128 (lora.h)
  for (int64_t r = 0; r < n; ++r) {
    // The row as its down-projection prepared it (lora_q8_prepare_row).
    const uint8_t* prepared = reinterpret_cast<const uint8_t*>(u + r * stride + rank);
    const int8_t* q = reinterpret_cast<const int8_t*>(prepared);
    float* yr = y + static_cast<int64_t>(rows[r]) * ldy;
    for (int64_t o = o0; o < o1; ++o) {
      float acc = yr[o];
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t sum, offset;
        float block_scale;
        std::memcpy(&offset, prepared + (groups + b) * 4, 4);
        std::memcpy(&block_scale, prepared + (groups + blocks + b) * 4, 4);
        sum = offset;
        for (int64_t k = b * kLoraQ8Block; k < std::min(groups * 4, (b + 1) * kLoraQ8Block); ++k) {
          sum += int32_t{bt[lora_bt_index(kLoraQ8, rank, k, o)]} * q[k];
        }
        acc += static_cast<float>(sum) * (scale * block_scale);
      }
      yr[o] = acc;
    }
  }
}

}  // namespace

void dequantize_row_generic(int type, const uint8_t* src, float* dst, int64_t n) {
  switch (type) {
    case kF32: return dequantize_f32(src, dst, n);
    case kF16: return dequantize_f16(src, dst, n);
    case kBF16: return dequantize_bf16(src, dst, n);
    case kQ8_0: return dequantize_q8_0(src, dst, n);
    case kQ4_0: return dequantize_q4_0(src, dst, n);
    case kQ4_1: return dequantize_q4_1(src, dst, n);
    case kQ5_0: return dequantize_q5_0(src, dst, n);
    case kQ5_1: return dequantize_q5_1(src, dst, n);
    case kQ4_K: return dequantize_q4_q5_k<BlockQ4_K>(src, dst, n);
    case kQ5_K: return dequantize_q4_q5_k<BlockQ5_K>(src, dst, n);
    case kQ6_K: return dequantize_q6_k(src, dst, n);
    default: break;
  }
}

void register_ops_generic(KernelTable& t) {
  t.lora_down[kLoraF32] = lora_down<kLoraF32>;
  t.lora_down[kLoraBF16] = lora_down<kLoraBF16>;
  t.lora_down[kLoraQ8] = lora_down_q8;
  t.lora_up[kLoraF32] = lora_up<kLoraF32>;
  t.lora_up[kLoraBF16] = lora_up<kLoraBF16>;
  t.lora_up[kLoraQ8] = lora_up_q8;
  for (const char* kind : {"lora_f32", "lora_bf16", "lora_q8"}) t.names[kind] = "generic";
  t.rmsnorm = rmsnorm;
  t.add = add;
  t.swiglu = swiglu;
  t.geglu = geglu;
  t.softmax = softmax;
  t.argmax = argmax;
  t.sample_weigh = sample_weigh;
  t.scale_row = scale_row;
  t.rope = rope;
  t.kv_store = kv_store;
  t.dequantize_row[kF32] = dequantize_f32;
  t.dequantize_row[kF16] = dequantize_f16;
  t.dequantize_row[kBF16] = dequantize_bf16;
  t.dequantize_row[kQ8_0] = dequantize_q8_0;
  t.dequantize_row[kQ4_0] = dequantize_q4_0;
  t.dequantize_row[kQ4_1] = dequantize_q4_1;
  t.dequantize_row[kQ5_0] = dequantize_q5_0;
  t.dequantize_row[kQ5_1] = dequantize_q5_1;
  t.dequantize_row[kQ4_K] = dequantize_q4_q5_k<BlockQ4_K>;
  t.dequantize_row[kQ5_K] = dequantize_q4_q5_k<BlockQ5_K>;
  t.dequantize_row[kQ6_K] = dequantize_q6_k;
  for (const char* kind : {"rmsnorm", "add", "swiglu", "geglu", "softmax", "argmax", "sample_weigh", "scale_row", "rope", "kv_store"}) {
    t.names[kind] = "generic";
  }
  for (int type : {kF32, kF16, kBF16, kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K}) {
    t.names[std::string("dequantize_") + type_name(type)] = "generic";
  }
}

}  // namespace conduit
