// Row kernels for AVX2: the templates of ops_simd.h instantiated over the Avx2 vector traits.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace conduit {
namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "simd_avx2.h"
#include "ops_simd.h"
#include "lora_simd.h"
#include "lora_q8_avx2.h"
#pragma GCC pop_options

}  // namespace

// Registration runs on every CPU, so it stays outside the target region.
void register_ops_avx2(KernelTable& t) {
  t.lora_down[kLoraF32] = simd_lora_down<Avx2, kLoraF32>;
  t.lora_down[kLoraBF16] = simd_lora_down<Avx2, kLoraBF16>;
  t.lora_up[kLoraF32] = simd_lora_up<Avx2, kLoraF32>;
  t.lora_up[kLoraBF16] = simd_lora_up<Avx2, kLoraBF16>;
  t.lora_down[kLoraQ8] = avx2_lora_down_q8;
  t.lora_up[kLoraQ8] = avx2_lora_up_q8;
  for (const char* kind : {"lora_f32", "lora_bf16", "lora_q8"}) t.names[kind] = "avx2";
  t.rmsnorm = simd_rmsnorm<Avx2>;
  t.add = simd_add<Avx2>;
  t.swiglu = simd_swiglu<Avx2>;
  t.geglu = simd_geglu<Avx2>;
  t.softmax = simd_softmax<Avx2>;
  t.argmax = simd_argmax<Avx2>;
  t.rope = simd_rope<Avx2>;
  t.kv_store = simd_kv_store<Avx2>;
  t.dequantize_row[kF16] = simd_dequantize_f16<Avx2>;
  t.dequantize_row[kBF16] = simd_dequantize_bf16<Avx2>;
  t.dequantize_row[kQ8_0] = simd_dequantize_q8_0<Avx2>;
  t.dequantize_row[kQ4_0] = simd_dequantize_q4_0<Avx2>;
  t.dequantize_row[kQ4_K] = simd_dequantize_q4_q5_k<Avx2, BlockQ4_K>;
  t.dequantize_row[kQ5_K] = simd_dequantize_q4_q5_k<Avx2, BlockQ5_K>;
  t.dequantize_row[kQ6_K] = simd_dequantize_q6_k<Avx2>;
  for (const char* kind : {"rmsnorm", "add", "swiglu", "geglu", "softmax", "argmax", "rope", "kv_store", "dequantize_f16",
                           "dequantize_bf16", "dequantize_q8_0", "dequantize_q4_0", "dequantize_q4_k",
                           "dequantize_q5_k", "dequantize_q6_k"}) {
    t.names[kind] = "avx2";
  }
}

}  // namespace conduit
