// Paged attention for AVX512: attention_simd.h over the Avx512 vector traits.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels.h"

namespace conduit {
namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include "simd_avx512.h"
#include "ops_simd.h"
#include "attention_simd.h"
#pragma GCC pop_options

}  // namespace

void register_attention_avx512(KernelTable& t) {
  t.attention_chunks = simd_attention_chunks<Avx512>;
  t.attention_merge = simd_attention_merge<Avx512>;
  t.names["attention"] = "avx512";
}

}  // namespace conduit
