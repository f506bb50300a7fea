// Plain C++ matmul tiles. Float-weight types (F32, F16, BF16 and the K-quants) dequantize one weight row at a
// time and take float dot products. Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 follow the integer scheme every variant uses:
// activations are quantized to 8-bit blocks of 32 with one float scale (round to nearest even), each block's integer
// dot product is exact, and the float result is the sum over blocks of idot * (weight scale * activation scale)
// (Q4_1 and Q5_1 add the block's activation sum times its offset m times the activation scale).
#include <cmath>
#include <type_traits>

#include "kernels.h"

namespace conduit {

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Float weights

size_t float_scratch_bytes(int64_t K) { return static_cast<size_t>(K) * sizeof(float) + 64; }

template <int Type>
void tile_float(const MatmulTile& t) {
  float* w_row = reinterpret_cast<float*>(t.scratch);
  for (int64_t n = t.n0; n < t.n1; ++n) {
    dequantize_row_generic(Type, t.w + n * t.w_row_bytes, w_row, t.K);
    for (int64_t m = 0; m < t.M; ++m) {
      const float* x = t.x + m * t.K;
      float sum = 0.0f;
      for (int64_t k = 0; k < t.K; ++k) sum += x[k] * w_row[k];
      t.y[m * t.ldy + n] = sum;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// 8-bit weights with 8-bit activations

struct ActBlock {
  float d;
  int8_t qs[32];
};

size_t act_row_bytes(int64_t K) { return static_cast<size_t>(K / 32) * sizeof(ActBlock); }

void quantize_act(const float* x, int64_t K, uint8_t* out) {
  ActBlock* blocks = reinterpret_cast<ActBlock*>(out);
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::fabs(xb[i]) > amax ? std::fabs(xb[i]) : amax;
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    blocks[b].d = d;
    for (int i = 0; i < 32; ++i) blocks[b].qs[i] = static_cast<int8_t>(std::nearbyint(xb[i] * id));
  }
}

size_t no_scratch(int64_t) { return 64; }

void tile_q8_0(const MatmulTile& t) {
  const int64_t nb = t.K / 32;
  for (int64_t n = t.n0; n < t.n1; ++n) {
    const BlockQ8_0* w = reinterpret_cast<const BlockQ8_0*>(t.w + n * t.w_row_bytes);
    for (int64_t m = 0; m < t.M; ++m) {
      const ActBlock* a = reinterpret_cast<const ActBlock*>(t.act + m * t.act_stride);
      float sum = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t idot = 0;
        for (int i = 0; i < 32; ++i) idot += static_cast<int32_t>(w[b].qs[i]) * a[b].qs[i];
        sum += static_cast<float>(idot) * (fp16_to_fp32(w[b].d) * a[b].d);
      }
      t.y[m * t.ldy + n] = sum;
    }
  }
}

void tile_q4_0(const MatmulTile& t) {
  const int64_t nb = t.K / 32;
  for (int64_t n = t.n0; n < t.n1; ++n) {
    const BlockQ4_0* w = reinterpret_cast<const BlockQ4_0*>(t.w + n * t.w_row_bytes);
    for (int64_t m = 0; m < t.M; ++m) {
      const ActBlock* a = reinterpret_cast<const ActBlock*>(t.act + m * t.act_stride);
      float sum = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t idot = 0;
        for (int i = 0; i < 16; ++i) {
          idot += ((w[b].qs[i] & 0xF) - 8) * a[b].qs[i];
          idot += ((w[b].qs[i] >> 4) - 8) * a[b].qs[i + 16];
        }
        sum += static_cast<float>(idot) * (fp16_to_fp32(w[b].d) * a[b].d);
      }
      t.y[m * t.ldy + n] = sum;
    }
  }
}

// Q4_1 / Q5_1: value = q * d + m, so a block adds idot(q, a) * (d * da) + (sum of a) * (m * da). Q5_0: (q - 16) * d.
template <int Type>
void tile_q4_1_q5(const MatmulTile& t) {
  using Block = typename std::conditional<Type == kQ4_1, BlockQ4_1,
                                          typename std::conditional<Type == kQ5_0, BlockQ5_0, BlockQ5_1>::type>::type;
  const int64_t nb = t.K / 32;
  int q[32];
  for (int64_t n = t.n0; n < t.n1; ++n) {
    const Block* w = reinterpret_cast<const Block*>(t.w + n * t.w_row_bytes);
    for (int64_t m = 0; m < t.M; ++m) {
      const ActBlock* a = reinterpret_cast<const ActBlock*>(t.act + m * t.act_stride);
      float sum = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = reinterpret_cast<const uint8_t*>(w + b);
        if (Type == kQ4_1) {
          for (int i = 0; i < 16; ++i) {
            q[i] = blk[4 + i] & 0xF;
            q[i + 16] = blk[4 + i] >> 4;
          }
        } else {
          q5_levels(blk + (Type == kQ5_0 ? 2 : 4), blk + (Type == kQ5_0 ? 6 : 8), q);
        }
        int32_t idot = 0, asum = 0;
        for (int i = 0; i < 32; ++i) {
          idot += (Type == kQ5_0 ? q[i] - 16 : q[i]) * a[b].qs[i];
          asum += a[b].qs[i];
        }
        uint16_t dh, mh = 0;
        std::memcpy(&dh, blk, 2);
        if (Type != kQ5_0) std::memcpy(&mh, blk + 2, 2);
        if (Type == kQ5_0) {
          sum += static_cast<float>(idot) * (fp16_to_fp32(dh) * a[b].d);
        } else {
          sum += static_cast<float>(idot) * (fp16_to_fp32(dh) * a[b].d) +
                 static_cast<float>(asum) * (fp16_to_fp32(mh) * a[b].d);
        }
      }
      t.y[m * t.ldy + n] = sum;
    }
  }
}

template <int Type>
MatmulKernel float_kernel() {
  MatmulKernel k;
  k.scratch_bytes = float_scratch_bytes;
  k.tile = tile_float<Type>;
  return k;
}

MatmulKernel int8_kernel(void (*tile)(const MatmulTile&)) {
  MatmulKernel k;
  k.act_row_bytes = act_row_bytes;
  k.quantize_act = quantize_act;
  k.scratch_bytes = no_scratch;
  k.tile = tile;
  return k;
}

}  // namespace

void register_matmul_generic(KernelTable& t) {
  t.matmul[kF32] = float_kernel<kF32>();
  t.matmul[kF16] = float_kernel<kF16>();
  t.matmul[kBF16] = float_kernel<kBF16>();
  t.matmul[kQ4_K] = float_kernel<kQ4_K>();
  t.matmul[kQ5_K] = float_kernel<kQ5_K>();
  t.matmul[kQ6_K] = float_kernel<kQ6_K>();
  t.matmul[kQ8_0] = int8_kernel(tile_q8_0);
  t.matmul[kQ4_0] = int8_kernel(tile_q4_0);
  t.matmul[kQ4_1] = int8_kernel(tile_q4_1_q5<kQ4_1>);
  t.matmul[kQ5_0] = int8_kernel(tile_q4_1_q5<kQ5_0>);
  t.matmul[kQ5_1] = int8_kernel(tile_q4_1_q5<kQ5_1>);
  for (int type : {kF32, kF16, kBF16, kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K}) {
    t.names[std::string("matmul_") + type_name(type)] = "generic";
  }
}

}  // namespace conduit
